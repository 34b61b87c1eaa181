"""The tensors a model's checkpoint holds, from its config.json alone: names, shapes, dtypes.

``plan`` sizes a conversion before any weight is downloaded. transformers can build the model on
the meta device and list its state dict, but importing it costs seconds; for the families quantkit
targets the layout is a few lines of arithmetic, written here from transformers 5.17's modeling
files (glm_moe_dsa/modeling_glm_moe_dsa.py, deepseek_v3/modeling_deepseek_v3.py,
llama/modeling_llama.py). tests/test_layout.py holds every result equal to the meta model's state
dict. A config this module does not cover (another model type, a flag that adds tensors, a key it
would have to default) returns None, and plan builds the meta model instead.
"""

from __future__ import annotations

from quantkit.checkpoint.config import ModelConfig

Shape = tuple[int, ...]
# Keys whose transformers default this module would otherwise have to know: absent -> not laid out here.
_MLA_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
             "num_attention_heads", "n_routed_experts", "n_shared_experts", "kv_lora_rank", "q_lora_rank",
             "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "tie_word_embeddings", "attention_bias")
_GQA_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "tie_word_embeddings", "attention_bias", "mlp_bias")
_DSA_KEYS = ("index_head_dim", "index_n_heads")


def model_tensors(config: ModelConfig, dtype: str) -> dict[str, tuple[str, Shape]] | None:
    """``{name: (dtype code, shape)}`` as transformers' meta model of ``config`` lists them (routed
    experts already per expert, as releases store them), or None when not covered here."""
    model_type = config.model_type
    if model_type in ("glm_moe_dsa", "deepseek_v3"):
        keys = _MLA_KEYS + (_DSA_KEYS if model_type == "glm_moe_dsa" else ())
        if not all(map(config.declares, keys)) or config.attention_bias:
            return None
        if model_type == "glm_moe_dsa" and config.q_lora_rank is None:
            return None  # the indexer's wq_b reads the query latent: transformers itself cannot build this
        if not config.declares("mlp_layer_types") and not config.declares("first_k_dense_replace"):
            return None
        return _mla_moe(config, dtype, indexer=model_type == "glm_moe_dsa")
    if model_type in ("llama", "mistral"):
        if not all(map(config.declares, _GQA_KEYS)) or config.attention_bias or config.mlp_bias:
            return None
        return _dense_gqa(config, dtype)
    return None


def _mlp(prefix: str, hidden: int, inter: int, dtype: str) -> dict[str, tuple[str, Shape]]:
    return {f"{prefix}.gate_proj.weight": (dtype, (inter, hidden)),
            f"{prefix}.up_proj.weight": (dtype, (inter, hidden)),
            f"{prefix}.down_proj.weight": (dtype, (hidden, inter))}


def _ends(config: ModelConfig, dtype: str, layers: dict) -> dict[str, tuple[str, Shape]]:
    hidden, vocab = config.size("hidden_size"), config.size("vocab_size")
    # the meta model lists lm_head even when tied to the embeddings
    return {"model.embed_tokens.weight": (dtype, (vocab, hidden)), **layers,
            "model.norm.weight": (dtype, (hidden,)), "lm_head.weight": (dtype, (vocab, hidden))}


def _mla_moe(config: ModelConfig, dtype: str, indexer: bool) -> dict[str, tuple[str, Shape]]:
    hidden, heads = config.size("hidden_size"), config.size("num_attention_heads")
    q_lora, kv_lora = config.q_lora_rank, config.size("kv_lora_rank")
    rope, nope, v_dim = config.size("qk_rope_head_dim"), config.size("qk_nope_head_dim"), config.size("v_head_dim")
    experts, n = config.size("n_routed_experts"), config.size("num_hidden_layers")
    moe_inter = config.size("moe_intermediate_size")
    sparse = config.mlp_layer_types or _first_dense(config, n)
    full_indexer = _indexer_types(config, n) if indexer else [False] * n
    # glm_moe_dsa keeps the router's correction bias in fp32 (an explicit buffer dtype); deepseek_v3 does not
    bias_dtype = "F32" if indexer else dtype
    layers: dict[str, tuple[str, Shape]] = {}
    for i in range(n):
        p = f"model.layers.{i}"
        attn: dict[str, tuple[str, Shape]] = {}
        if q_lora is None:
            attn["q_proj.weight"] = (dtype, (heads * (nope + rope), hidden))
        else:
            attn["q_a_proj.weight"] = (dtype, (q_lora, hidden))
            attn["q_a_layernorm.weight"] = (dtype, (q_lora,))
            attn["q_b_proj.weight"] = (dtype, (heads * (nope + rope), q_lora))
        attn["kv_a_proj_with_mqa.weight"] = (dtype, (kv_lora + rope, hidden))
        attn["kv_a_layernorm.weight"] = (dtype, (kv_lora,))
        attn["kv_b_proj.weight"] = (dtype, (heads * (nope + v_dim), kv_lora))
        attn["o_proj.weight"] = (dtype, (hidden, heads * v_dim))
        if full_indexer[i]:
            ih, idim = config.size("index_n_heads"), config.size("index_head_dim")
            attn["indexer.wq_b.weight"] = (dtype, (ih * idim, config.size("q_lora_rank")))
            attn["indexer.wk.weight"] = (dtype, (idim, hidden))
            attn["indexer.k_norm.weight"] = (dtype, (idim,))
            attn["indexer.k_norm.bias"] = (dtype, (idim,))
            attn["indexer.weights_proj.weight"] = (dtype, (ih, hidden))
        layers.update({f"{p}.self_attn.{k}": v for k, v in attn.items()})
        if sparse[i] == "sparse":
            # transformers fuses the experts into gate_up_proj and down_proj; split per expert in that order
            for e in range(experts):
                layers[f"{p}.mlp.experts.{e}.gate_proj.weight"] = (dtype, (moe_inter, hidden))
                layers[f"{p}.mlp.experts.{e}.up_proj.weight"] = (dtype, (moe_inter, hidden))
            for e in range(experts):
                layers[f"{p}.mlp.experts.{e}.down_proj.weight"] = (dtype, (hidden, moe_inter))
            layers[f"{p}.mlp.gate.weight"] = (dtype, (experts, hidden))
            layers[f"{p}.mlp.gate.e_score_correction_bias"] = (bias_dtype, (experts,))
            layers.update(_mlp(f"{p}.mlp.shared_experts", hidden, moe_inter * config.size("n_shared_experts"), dtype))
        else:
            layers.update(_mlp(f"{p}.mlp", hidden, config.size("intermediate_size"), dtype))
        layers[f"{p}.input_layernorm.weight"] = (dtype, (hidden,))
        layers[f"{p}.post_attention_layernorm.weight"] = (dtype, (hidden,))
    return _ends(config, dtype, layers)


def _first_dense(config: ModelConfig, n: int) -> list[str]:
    dense = min(config.size("first_k_dense_replace"), n)
    return ["dense"] * dense + ["sparse"] * (n - dense)


def _indexer_types(config: ModelConfig, n: int) -> list[bool]:
    """Which layers run their own DSA indexer (configuration_glm_moe_dsa.py ``__post_init__``)."""
    types = config.indexer_types
    if types is None:
        pattern = config.index_topk_pattern
        if pattern is not None:
            types = [{"F": "full", "S": "shared"}[c] for c in pattern]  # checked by check_config
        else:
            freq = max(config.index_topk_freq or 1, 1)
            offset = 2 if config.index_skip_topk_offset is None else config.index_skip_topk_offset
            types = ["full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(n)]
    return [t != "shared" for t in types]


def _dense_gqa(config: ModelConfig, dtype: str) -> dict[str, tuple[str, Shape]]:
    hidden, heads = config.size("hidden_size"), config.size("num_attention_heads")
    kv = config.size("num_key_value_heads")
    head_dim = config.head_dim or hidden // heads
    layers: dict[str, tuple[str, Shape]] = {}
    for i in range(config.size("num_hidden_layers")):
        p = f"model.layers.{i}"
        layers[f"{p}.self_attn.q_proj.weight"] = (dtype, (heads * head_dim, hidden))
        layers[f"{p}.self_attn.k_proj.weight"] = (dtype, (kv * head_dim, hidden))
        layers[f"{p}.self_attn.v_proj.weight"] = (dtype, (kv * head_dim, hidden))
        layers[f"{p}.self_attn.o_proj.weight"] = (dtype, (hidden, heads * head_dim))
        layers.update(_mlp(f"{p}.mlp", hidden, config.size("intermediate_size"), dtype))
        layers[f"{p}.input_layernorm.weight"] = (dtype, (hidden,))
        layers[f"{p}.post_attention_layernorm.weight"] = (dtype, (hidden,))
    return _ends(config, dtype, layers)
