"""What a checkpoint's config.json says, in one place: model dtype, FP8 block size, MoE or not.

``check_config`` runs once when a checkpoint is opened (``checkpoint.read_config``), so the
readers below may trust the fields they read. It also bounds what a config may ask for: a
config claiming a million layers or experts would otherwise make ``plan`` and ``verify`` build
structures for ever; real models are orders of magnitude below these limits.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from quantkit.errors import QuantkitError, field_error

FLOAT_CODES = ("BF16", "F16", "F32")
MOE_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")
LIMITS = {"num_hidden_layers": 1024, "num_nextn_predict_layers": 16, "hidden_size": 1 << 17,
          "intermediate_size": 1 << 20, "moe_intermediate_size": 1 << 20, "vocab_size": 1 << 23,
          "num_attention_heads": 4096, "num_key_value_heads": 4096, **{k: 8192 for k in MOE_KEYS},
          # the attention and MoE dimensions checkpoint/layout.py sizes tensors from
          "n_shared_experts": 8192, "first_k_dense_replace": 1024, "head_dim": 1 << 16, "kv_lora_rank": 1 << 17,
          "q_lora_rank": 1 << 17, "qk_rope_head_dim": 1 << 16, "qk_nope_head_dim": 1 << 16, "v_head_dim": 1 << 16,
          "index_head_dim": 1 << 16, "index_n_heads": 4096, "index_topk_freq": 1024, "index_skip_topk_offset": 1024,
          "max_position_embeddings": 1 << 24}  # the context eval's needle tasks and calibration lengths check against
_DTYPE_CODES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
# One entry per decoder layer, read by checkpoint/layout.py (transformers' glm_moe_dsa and deepseek_v3 configs).
LAYER_LISTS = {"mlp_layer_types": ("dense", "sparse"), "indexer_types": ("full", "shared")}


def check_config(config: dict, path: Path) -> None:
    """Refuse, naming the field, what quantkit would misread or could not bound."""
    for key, limit in LIMITS.items():
        value = config.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= limit:
            raise QuantkitError(f"{key} = {value!r}: expected an integer from 0 to {limit:,}", path)
    _check_layer_lists(config, path)
    qc = config.get("quantization_config")
    if qc is None:
        return
    if not isinstance(qc, dict):
        raise QuantkitError(f"quantization_config is a {type(qc).__name__}, not an object", path)
    if qc.get("quant_method") == "fp8":
        block = qc.get("weight_block_size", [128, 128])
        if (not isinstance(block, list) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and 0 < b <= 1 << 16 for b in block)):
            raise QuantkitError(f"quantization_config.weight_block_size = {block!r}: expected two positive "
                                f"integers", path)
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise QuantkitError(f"quantization_config.fmt = {fmt!r}: only e4m3 block-FP8 releases are supported", path)


def check_context(config: dict, seq_len: int, what: str, path: Path) -> None:
    """A calibration sequence fits the model's context (``max_position_embeddings``): longer ones would run positions
    the model never saw, and calibrate on them."""
    limit = config.get("max_position_embeddings")
    if limit is not None and seq_len > limit:
        raise QuantkitError(f"{what} {seq_len} exceeds the model's context ({limit})", path)


def _check_layer_lists(config: dict, path: Path) -> None:
    layers = config.get("num_hidden_layers")
    pattern = config.get("index_topk_pattern")  # GLM-5's short form of indexer_types: one F(ull) or S(hared) a layer
    if pattern is not None:
        if not isinstance(pattern, str) or set(pattern) - {"F", "S"}:
            raise QuantkitError("index_topk_pattern: expected a string of F and S, one per layer", path)
        if layers is not None and len(pattern) != layers:
            raise QuantkitError(f"index_topk_pattern has {len(pattern)} entries for num_hidden_layers = {layers}",
                                path)
    for key, allowed in LAYER_LISTS.items():
        value = config.get(key)
        if value is None:
            continue
        if not isinstance(value, list) or any(v not in allowed for v in value):
            raise QuantkitError(f"{key}: expected a list of {' or '.join(map(repr, allowed))}", path)
        if layers is not None and len(value) != layers:
            raise QuantkitError(f"{key} has {len(value)} entries for num_hidden_layers = {layers}", path)


def model_dtype_code(config: dict) -> str:
    """safetensors code of the dtype a dequantized weight takes (the model's own; BF16 by default)."""
    name = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16").removeprefix("torch.")
    return _DTYPE_CODES.get(name, "BF16")


@dataclass(frozen=True)
class Quantization:
    """config.json's quantization_config, as every reader in quantkit sees it: a block-FP8 release's
    (``quant_method: fp8``, vetted by check_config) or compressed-tensors' (parsed by formats/quant_config.py)."""

    raw: dict
    path: Path | None = None  # config.json, named in errors

    @property
    def method(self) -> str | None:
        return self.raw.get("quant_method")

    @property
    def fp8_release(self) -> bool:
        return self.method == "fp8"

    @property
    def format(self) -> str | None:
        return self.raw.get("format")

    @property
    def kv_cache_scheme(self) -> dict:
        return self.raw.get("kv_cache_scheme") or {}

    def group_formats(self) -> set[str | None]:
        """The format of each config group (a group without one has the config's)."""
        return {(g or {}).get("format") or self.format for g in (self.raw.get("config_groups") or {}).values()}

    def compressed(self):
        """compressed-tensors' QuantizationConfig (formats/quant_config.py), or None for another method."""
        from pydantic import ValidationError

        from quantkit.formats.quant_config import QuantizationConfig

        if self.method != "compressed-tensors":
            return None
        try:
            return QuantizationConfig.model_validate(self.raw)
        except ValidationError as exc:
            raise QuantkitError(f"invalid quantization_config: {field_error(exc)}", self.path) from exc

    def describe(self) -> str:
        if not self.method:
            return "none"
        if self.fp8_release:
            return f"fp8 block {self.raw.get('weight_block_size')}"
        return f"{self.method} ({self.format or '?'})"


def quantization(config: dict, path: Path | None = None) -> Quantization:
    return Quantization(config.get("quantization_config") or {}, path)


def fp8_block_size(config: dict) -> tuple[int, int]:
    """The FP8 block of a release (``weight_block_size``) or of a compressed-tensors block group."""
    q = quantization(config)
    for group in (q.raw.get("config_groups") or {}).values():
        weights = (group or {}).get("weights") or {}
        if weights.get("strategy") == "block" and weights.get("block_structure"):
            return tuple(weights["block_structure"])
    if q.fp8_release:
        return tuple(q.raw.get("weight_block_size") or (128, 128))
    return (128, 128)


def num_experts(config: dict) -> int | None:
    """Routed experts per MoE layer, or None for a dense model."""
    return next((config[k] for k in MOE_KEYS if config.get(k)), None)


def is_moe(config: dict) -> bool:
    return num_experts(config) is not None
