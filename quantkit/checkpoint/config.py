"""What a checkpoint's config.json says, in one place: ``ModelConfig`` (model dtype, sizes, FP8 block, MoE or not,
its quantization_config).

``check_config`` runs once when a checkpoint is opened (``checkpoint.read_config`` builds the ``ModelConfig``), so
every reader may trust the fields it reads. It also bounds what a config may ask for: a
config claiming a million layers or experts would otherwise make ``plan`` and ``verify`` build
structures for ever; real models are orders of magnitude below these limits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationError

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


def check_config(config: dict, path: Path | None) -> None:
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


def _check_layer_lists(config: dict, path: Path | None) -> None:
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


class ModelConfig(BaseModel):
    """config.json as every reader in quantkit sees it, built once by ``ModelConfig.read`` after ``check_config``
    vetted it: the fields quantkit reads, typed, and every other field kept as written. ``raw`` gives the file's
    object back unchanged, key order too, so what quantkit writes from it differs only where it means to."""

    model_config = ConfigDict(extra="allow", frozen=True, protected_namespaces=())

    model_type: str = ""
    architectures: list[str] | None = None
    dtype: str | None = None
    torch_dtype: str | None = None
    # bounded by LIMITS
    num_hidden_layers: int | None = None
    num_nextn_predict_layers: int | None = None
    hidden_size: int | None = None
    intermediate_size: int | None = None
    moe_intermediate_size: int | None = None
    vocab_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    n_routed_experts: int | None = None
    n_shared_experts: int | None = None
    first_k_dense_replace: int | None = None
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None
    index_head_dim: int | None = None
    index_n_heads: int | None = None
    index_topk_freq: int | None = None
    index_skip_topk_offset: int | None = None
    max_position_embeddings: int | None = None
    # checked against num_hidden_layers by _check_layer_lists
    index_topk_pattern: str | None = None
    mlp_layer_types: list[str] | None = None
    indexer_types: list[str] | None = None
    index_topk: int | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    quantization_config: dict | None = None

    _raw: dict = PrivateAttr(default_factory=dict)
    _path: Path | None = PrivateAttr(default=None)

    @classmethod
    def read(cls, raw: dict, path: Path | None = None) -> ModelConfig:
        """RAW (config.json's object, at PATH) checked and typed, or a one-line error naming the field."""
        check_config(raw, path)
        try:
            config = cls.model_validate(raw)
        except ValidationError as exc:
            raise QuantkitError(field_error(exc), path) from exc
        config._raw, config._path = raw, path
        return config

    @property
    def raw(self) -> dict:
        """The JSON object as config.json holds it (a copy)."""
        return dict(self._raw)

    @property
    def path(self) -> Path | None:
        return self._path

    def declares(self, key: str) -> bool:
        """Whether config.json has KEY at all (transformers' configs fill absent keys with defaults)."""
        return key in self._raw

    def with_quantization(self, quantization_config: dict) -> ModelConfig:
        """This model's config with another quantization_config (convert's output, KV scales added), every other key
        as read."""
        return ModelConfig.read({**self._raw, "quantization_config": quantization_config}, self._path)

    def to_json(self) -> bytes:
        """config.json's bytes: the keys in the order read (no sort: config_groups keep the recipe's order, which
        first-match readers rely on)."""
        return (json.dumps(self._raw, indent=2) + "\n").encode()

    def size(self, key: str) -> int:
        """Integer field KEY, where quantkit cannot do without it, or a one-line error naming it."""
        value = getattr(self, key, None)
        if not isinstance(value, int) or isinstance(value, bool):
            raise QuantkitError(f"{key} = {value!r}: an integer is needed to size this model", self._path)
        return value

    @property
    def num_experts(self) -> int | None:
        """Routed experts per MoE layer, or None for a dense model (three spellings across families)."""
        return next((self._raw[k] for k in MOE_KEYS if self._raw.get(k)), None)

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def max_context(self) -> int | None:
        return self.max_position_embeddings

    @property
    def layers(self) -> int:
        return self.num_hidden_layers or 0

    @property
    def dtype_code(self) -> str:
        """safetensors code of the dtype a dequantized weight takes (the model's own; BF16 by default)."""
        name = str(self.dtype or self.torch_dtype or "bfloat16").removeprefix("torch.")
        return _DTYPE_CODES.get(name, "BF16")

    @property
    def quantization(self) -> Quantization:
        return Quantization(self.quantization_config or {}, self._path)

    @property
    def fp8_block(self) -> tuple[int, int]:
        """The FP8 block of a release (``weight_block_size``) or of a compressed-tensors block group."""
        q = self.quantization
        for group in (q.raw.get("config_groups") or {}).values():
            weights = (group or {}).get("weights") or {}
            if weights.get("strategy") == "block" and weights.get("block_structure"):
                return tuple(weights["block_structure"])
        if q.fp8_release:
            return tuple(q.raw.get("weight_block_size") or (128, 128))
        return (128, 128)

    def check_context(self, seq_len: int, what: str) -> None:
        """A calibration sequence fits the model's context: longer ones would run positions the model never saw,
        and calibrate on them."""
        if self.max_context is not None and seq_len > self.max_context:
            raise QuantkitError(f"{what} {seq_len} exceeds the model's context ({self.max_context})", self._path)
