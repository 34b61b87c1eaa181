"""checkpoint/layout.py lists exactly what transformers' meta model of a config holds, in the same order."""

import json

import pytest

from quantkit.checkpoint.config import ModelConfig
from quantkit.checkpoint.layout import model_tensors
from quantkit.examples.synthetic import tiny_config
from quantkit.plan import meta_model_tensors, virtual_checkpoint

# GLM-5-shaped (the dimensions FORMATS.md and benchmarks/convert_speed.py use), DeepSeek-V3's published
# config.json dimensions, and a SmolLM2-135M-shaped Llama; every key the layout reads given explicitly,
# as a release's config.json gives it.
GLM5 = dict(vocab_size=154880, hidden_size=6144, intermediate_size=12288, moe_intermediate_size=2048,
            num_hidden_layers=78, num_attention_heads=64, num_key_value_heads=64, n_shared_experts=1,
            n_routed_experts=256, num_experts_per_tok=8, kv_lora_rank=512, q_lora_rank=2048,
            qk_rope_head_dim=64, v_head_dim=256, qk_nope_head_dim=192, first_k_dense_replace=3,
            index_head_dim=128, index_n_heads=32, index_topk=2048, tie_word_embeddings=False, attention_bias=False)
DEEPSEEK_V3 = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                   num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
                   n_routed_experts=256, num_experts_per_tok=8, kv_lora_rank=512, q_lora_rank=1536,
                   qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, first_k_dense_replace=3,
                   n_group=8, topk_group=4, tie_word_embeddings=False, attention_bias=False)
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True, attention_bias=False,
               mlp_bias=False)


def tiny(family, **overrides):
    return dict(tiny_config(family, **overrides), tie_word_embeddings=overrides.get("tie_word_embeddings", False),
                attention_bias=False, **({"mlp_bias": False} if family == "llama" else {}))


CONFIGS = {
    "glm5-shaped": ("glm_moe_dsa", GLM5),
    "deepseek-v3": ("deepseek_v3", DEEPSEEK_V3),
    "smollm2-shaped": ("llama", SMOLLM2),
    "glm tiny": ("glm_moe_dsa", tiny("glm_moe_dsa")),
    "glm explicit mlp_layer_types": ("glm_moe_dsa", tiny("glm_moe_dsa", mlp_layer_types=["sparse", "dense", "sparse"])),
    "glm indexer pattern": ("glm_moe_dsa", tiny("glm_moe_dsa", num_hidden_layers=4, index_topk_pattern="FSSF")),
    "glm indexer every 2nd": ("glm_moe_dsa", tiny("glm_moe_dsa", num_hidden_layers=5, index_topk_freq=2,
                                                  index_skip_topk_offset=1)),
    "deepseek tiny": ("deepseek_v3", tiny("deepseek_v3")),
    "deepseek all dense": ("deepseek_v3", tiny("deepseek_v3", first_k_dense_replace=5)),
    "deepseek two shared": ("deepseek_v3", tiny("deepseek_v3", n_shared_experts=2, q_lora_rank=None)),
    "llama tiny": ("llama", tiny("llama")),
    "llama tied, one kv head, head_dim": ("llama", tiny("llama", tie_word_embeddings=True, num_key_value_heads=1,
                                                       head_dim=32)),
    "mistral": ("mistral", tiny("llama", num_key_value_heads=2)),
}


@pytest.mark.parametrize("dtype", ["BF16", "F32"])
@pytest.mark.parametrize("case", list(CONFIGS))
def test_layout_equals_the_meta_model(case, dtype):
    model_type, config = CONFIGS[case]
    config = ModelConfig.read(dict(config, model_type=model_type))
    ours = model_tensors(config, dtype)
    assert ours is not None, "this config is meant to be covered"
    assert list(ours.items()) == list(meta_model_tensors(config, dtype).items())


@pytest.mark.parametrize("model_type, change", [
    ("glm_moe_dsa", {"attention_bias": True}),  # adds biases the layout does not list
    ("glm_moe_dsa", {"index_head_dim": None}),  # a key it would have to default
    ("glm_moe_dsa", {"q_lora_rank": None}),  # no query latent for the indexer: not a buildable GLM 5
    ("llama", {"mlp_bias": True}),
    ("qwen2", {}),  # a model type it does not lay out
])
def test_configs_it_does_not_cover_go_to_the_meta_model(model_type, change):
    family = "llama" if model_type in ("llama", "qwen2") else model_type
    config = dict(tiny(family), model_type=model_type, **change)
    config = {k: v for k, v in config.items() if v is not None or k == "q_lora_rank"}
    assert model_tensors(ModelConfig.read(config), "BF16") is None


def test_plan_from_config_alone_lists_the_mtp_layer_and_fp8_scales(tmp_path):
    config = dict(GLM5, model_type="glm_moe_dsa", num_nextn_predict_layers=1, dtype="bfloat16",
                  quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = virtual_checkpoint(tmp_path).tensors
    mtp = "model.layers.78."
    assert tensors[mtp + "eh_proj.weight"].dtype == "BF16" and tensors[mtp + "eh_proj.weight"].shape == (6144, 12288)
    expert = tensors[mtp + "mlp.experts.255.down_proj.weight"]
    assert expert.dtype == "F8_E4M3" and expert.shape == (6144, 2048)
    assert tensors[mtp + "mlp.experts.255.down_proj.weight_scale_inv"].shape == (48, 16)
    assert sum(n.endswith("experts.0.gate_proj.weight") for n in tensors) == 78 - 3 + 1
