"""Model families: what a checkpoint is, and which component each on-disk tensor belongs to.

Everything here works on on-disk names (per-expert 2-D tensors), never on the fused 3-D
layout transformers builds at load time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from quantkit.checkpoint.config import ModelConfig
from quantkit.checkpoint.names import LAYER

COMPONENTS = (
    "routed_experts",
    "shared_experts",
    "attention",
    "indexer",
    "dense_mlp",
    "router",
    "embeddings",
    "lm_head",
    "norms",
    "mtp",
    "other",
)



@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    moe: bool
    attention: str  # "mla" or "gqa"
    has_indexer: bool = False
    has_mtp: bool = False


FAMILIES = (
    Family("glm_moe_dsa", ("glm_moe_dsa",), moe=True, attention="mla", has_indexer=True, has_mtp=True),
    Family("deepseek_v3", ("deepseek_v3", "kimi_k2", "deepseek_v32"), moe=True, attention="mla", has_mtp=True),
    Family("qwen3_moe", ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe"), moe=True, attention="gqa"),
    Family("dense", ("llama", "qwen2", "qwen3", "mistral", "gemma", "phi3"), moe=False, attention="gqa"),
)


def detect_family(config: ModelConfig) -> Family:
    model_type = config.model_type
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    attention = "mla" if config.declares("kv_lora_rank") else "gqa"
    return Family(model_type or "unknown", (model_type,), moe=config.is_moe, attention=attention)


def layer_index(name: str) -> int | None:
    m = LAYER.match(name)
    return int(m.group(1)) if m else None


def is_mtp(name: str, config: ModelConfig) -> bool:
    """Multi-token-prediction layers sit after the decoder layers: index >= num_hidden_layers."""
    index = layer_index(name)
    layers = config.num_hidden_layers
    return index is not None and layers is not None and index >= layers


def component(name: str, config: ModelConfig) -> str:
    if is_mtp(name, config):
        return "mtp"
    if ".mlp.experts." in name or ".block_sparse_moe.experts." in name:
        return "routed_experts"
    if ".shared_expert" in name:
        return "shared_experts"
    if ".self_attn.indexer." in name:
        return "indexer"
    module = name.rpartition(".")[0]
    if module.endswith("norm"):
        return "norms"
    if ".self_attn." in name:
        return "attention"
    if re.search(r"\.(mlp|block_sparse_moe)\.gate\.", name):
        return "router"
    if ".mlp." in name:
        return "dense_mlp"
    if "embed_tokens" in name:
        return "embeddings"
    if name.startswith("lm_head"):
        return "lm_head"
    return "other"


def is_linear_weight(name: str, ndim: int) -> bool:
    """What the recipe target ``Linear`` means on disk: a 2-D ``.weight`` that is not an
    embedding table or a norm (the same reading llm-compressor's model_free_ptq applies)."""
    module, _, param = name.rpartition(".")
    return param == "weight" and ndim == 2 and not module.endswith("norm") and "embed_tokens" not in module


# What real block-FP8 releases keep in BF16: embeddings, lm_head, norms, the router and its
# bias, the indexer's head weights, the MTP projection and head. Every other Linear is FP8.
_RELEASE_KEEPS_BF16 = ("embed_tokens", "lm_head", "norm", ".mlp.gate.", "indexer.weights_proj", "eh_proj",
                       "shared_head.head")


def release_stores_fp8(name: str, ndim: int) -> bool:
    """Whether a block-FP8 release (DeepSeek-V3, GLM 5.x, Kimi K2 base) stores this tensor as FP8."""
    return name.endswith(".weight") and ndim == 2 and not any(part in name for part in _RELEASE_KEEPS_BF16)


def mtp_extra_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The tensors a DeepSeek-V3-style MTP layer holds besides a decoder layer's (local names)."""
    hidden, vocab = config.size("hidden_size"), config.size("vocab_size")
    return {
        "embed_tokens.weight": (vocab, hidden),
        "enorm.weight": (hidden,),
        "hnorm.weight": (hidden,),
        "eh_proj.weight": (hidden, 2 * hidden),
        "shared_head.norm.weight": (hidden,),
        "shared_head.head.weight": (vocab, hidden),
    }
