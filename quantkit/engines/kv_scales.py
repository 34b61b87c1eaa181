"""What the serving engines do with a checkpoint's FP8 KV-cache scales, read in their own source.

Two questions, both answered per engine from the wheels PyPI serves (SGLang 0.5.23, vLLM 0.33.0):

- Does the loader put the tensor on a parameter? That is a name rule like any other weight's and lives
  with them in ``quantkit/engines/loaders.py``. quantkit writes the ModelOpt layout
  ``model.layers.N.self_attn.k_proj.k_scale`` / ``v_proj.v_scale``, which every traced loader takes.
- Once loaded, does the attention backend use it? The FP8 KV write path must divide by the scale and
  the read path multiply by it. ``BACKENDS`` records, per backend and attention type, what its source
  does: ``used`` (both), ``unused`` (neither: the cache is a plain cast, as with scale 1.0) or
  ``mismatched`` (the cache is written by a plain cast but read back multiplied by the loaded scale,
  so any scale other than 1.0 distorts attention scores).
"""

from __future__ import annotations

from dataclasses import dataclass

from quantkit.checkpoint.config import ModelConfig
from quantkit.checkpoint.names import KV_SCALE
from quantkit.engines.versions import SGLANG_VERSION, VLLM_VERSION

_POOL = "sglang/srt/mem_cache/memory_pool.py"
_ATT = "sglang/srt/layers/attention"


# 0.5.23's CompressedTensorsConfig gives the attention a KV-cache method (compressed_tensors.py:212-225, 1267); an
# H200 running 0.5.17 logged "Found .k_scale in the checkpoint ... .k_scale is not loaded" and served with 1.0
OLDER_SGLANG = ("SGLang 0.5.17 (the newest for torch 2.11) drops them and serves FP8 KV with scale 1.0: its "
                "compressed-tensors config gives the attention no KV-cache method")


def scale_names(layer: int) -> tuple[str, str]:
    """The k_scale and v_scale names quantkit writes for a decoder layer."""
    return f"model.layers.{layer}.self_attn.k_proj.k_scale", f"model.layers.{layer}.self_attn.v_proj.v_scale"


def is_kv_scale(name: str) -> bool:
    return bool(KV_SCALE.match(name))


@dataclass(frozen=True)
class BackendUse:
    engine: str
    version: str
    attention: str  # gqa | mla | dsa (MLA with a sparse-attention indexer)
    backend: str  # the engine's --attention-backend value
    use: str  # used | unused | mismatched
    how: str
    source: str


BACKENDS = (
    BackendUse("sglang", SGLANG_VERSION, "gqa", "fa3", "used",
               "writes K / k_scale and V / v_scale into the FP8 cache and passes both as descales to the kernel",
               f"{_POOL}:2897-2928; {_ATT}/flashattention_backend.py:1426-1434, 1536-1548"),
    BackendUse("sglang", SGLANG_VERSION, "gqa", "triton", "used",
               "writes K / k_scale and V / v_scale; reads with k_scale and v_scale as descales",
               f"{_ATT}/triton_backend.py:1734-1742, 1835-1836"),
    BackendUse("sglang", SGLANG_VERSION, "mla", "triton", "used",
               "divides the latent by k_scale before the MLA pool's write and multiplies the scores by k_scale",
               f"{_ATT}/triton_backend.py:1721-1733, 2325-2330 (write), 1835-1836, 2368-2369 (read)"),
    BackendUse("sglang", SGLANG_VERSION, "mla", "fa3", "unused",
               "the MLA pool's write is a plain cast and descales are passed only for head_dim <= 256 (MLA's latent "
               "is 576)",
               f"{_POOL}:4970-4971, 5014-5024; {_ATT}/flashattention_backend.py:1426-1434"),
    BackendUse("sglang", SGLANG_VERSION, "mla", "flashinfer", "unused",
               "writes through the MLA pool's plain cast and never reads k_scale",
               f"{_ATT}/flashinfer_mla_backend.py:720-733 (no reference to k_scale); {_POOL}:5014-5024"),
    BackendUse("sglang", SGLANG_VERSION, "mla", "flashmla", "mismatched",
               "writes through the MLA pool's plain cast but passes k_scale as the FP8 descale of q and k",
               f"{_ATT}/flashmla_backend.py:445-464; {_POOL}:4970-4971"),
    BackendUse("sglang", SGLANG_VERSION, "mla", "trtllm_mla", "mismatched",
               "decode casts the latent to FP8 without a scale but multiplies the scores by k_scale",
               f"sglang/kernels/ops/attention/utils.py:145-154; {_ATT}/trtllm_mla_backend.py:955-974, 1261-1263"),
    BackendUse("sglang", SGLANG_VERSION, "dsa", "dsa", "unused",
               "the FP8 cache of a sparse-attention model stores one FP32 scale per 128 values, computed when "
               "written; no checkpoint scale enters that write (its trtllm decode path still multiplies the "
               "scores by a loaded k_scale, dsa_backend.py:3952-3958: not traced further)",
               f"{_POOL}:4786-4790, 5002-5012; {_ATT}/dsa_backend.py:3952-3958"),
)


def backends(engine: str, attention: str) -> list[BackendUse]:
    return [b for b in BACKENDS if b.engine == engine and b.attention == attention]


def attention_kind(family) -> str:
    return "dsa" if family.has_indexer else family.attention


def scale_backend(attention: str) -> BackendUse | None:
    """The SGLang backend whose FP8 KV path uses calibrated scales for this attention type, if any."""
    return next((b for b in backends("sglang", attention) if b.use == "used"), None)


def engine_usage(config: ModelConfig) -> dict[str, str]:
    """Per engine, one line: where its loader puts the scales quantkit writes and which attention backends
    use them, for a model with this config."""
    from quantkit.checkpoint.families import detect_family
    from quantkit.engines.loaders import loader_rules

    family = detect_family(config)
    kind = attention_kind(family)
    usage = {}
    for engine, version in (("sglang", SGLANG_VERSION), ("vllm", VLLM_VERSION)):
        rules = loader_rules(engine, config.model_type)
        if rules is None:
            usage[f"{engine} {version}"] = (f"loader of model_type {config.model_type!r} not traced in its "
                                            "source: unknown")
            continue
        rule, parameter = rules.place(scale_names(0)[0], config)
        if parameter is None:
            why = rule.note if rule is not None else "no parameter takes this name"
            usage[f"{engine} {version}"] = f"not loaded, FP8 KV served with scale 1.0: {why} ({rules.engine} source: " \
                                           f"{rule.source if rule is not None else rules.on_unknown})"
            continue
        loaded = f"loaded into {parameter.replace('.0.', '.N.').replace('k_scale', 'k|v_scale')}"
        traced = backends(engine, kind)
        if not traced:
            usage[f"{engine} {version}"] = f"{loaded}; which attention backends use them: not traced"
            continue
        by_use = {u: [b.backend for b in traced if b.use == u] for u in ("used", "unused", "mismatched")}
        parts = [f"used by {', '.join(by_use['used'])}" if by_use["used"] else "used by no traced backend"]
        if by_use["unused"]:
            parts.append(f"unused by {', '.join(by_use['unused'])}")
        if by_use["mismatched"]:
            parts.append(f"{', '.join(by_use['mismatched'])} write the cache unscaled but read it scaled: serve "
                         "those with scale 1.0, not with these scales")
        if engine == "sglang":
            parts.append(OLDER_SGLANG)
        usage[f"{engine} {version}"] = f"{loaded}; " + "; ".join(parts)
    return usage
