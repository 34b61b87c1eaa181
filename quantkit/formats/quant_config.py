"""compressed-tensors' quantization config models, readable without importing compressed-tensors.

``import compressed_tensors`` imports torch, transformers and accelerate (4-6 s, 500 MB), while
``plan``, ``verify`` and recipe checks only read a few fields of a YAML or JSON mapping. These
models parse exactly what compressed-tensors 0.19's ``QuantizationArgs``, ``QuantizationScheme`` and
``QuantizationConfig`` parse (same defaults, the same inferred ``strategy`` and ``zp_dtype``, the
same refusals) and dump the same JSON: tests/test_quant_config.py holds both libraries' results
equal over every built-in recipe and a grid of hand-written and generated inputs. The output's
config.json is these models' dump too (``convert.dst.output_quantization_config``), held equal to compressed-tensors'
own dump of the same config by the same tests.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, field_serializer, field_validator, model_validator

FORMATS = ("dense", "sparse-bitmask", "sparse-24-bitmask", "int-quantized", "float-quantized",
           "naive-quantized", "pack-quantized", "marlin-24", "mixed-precision", "nvfp4-pack-quantized",
           "mxfp4-pack-quantized", "mxfp8-quantized")
STATUSES = ("initialized", "calibration", "frozen", "compressed", "decompressed")


def match_name(name: str, target: str) -> bool:
    """compressed-tensors' ``utils.match.match_name`` (no fused mapping): ``re:`` is ``re.match``, else equality."""
    return bool(name_matcher(target)(name))


def name_matcher(target: str) -> Callable[[str], object]:
    """``match_name(name, target)`` as a function of ``name`` alone, the regex compiled once; its result is
    truthy exactly when ``match_name`` is true."""
    if target.startswith("re:"):
        return re.compile(target.removeprefix("re:")).match
    return target.__eq__


def any_matcher(targets: list[str]) -> Callable[[str], object]:
    """Whether ``match_name(name, t)`` for any of ``targets``, as one function of ``name``: a plan asks it of every
    module of a 700 GB checkpoint (some 60,000), mostly of one target."""
    matchers = [name_matcher(t) for t in targets]
    if len(matchers) == 1:
        return matchers[0]
    return lambda name: any(m(name) for m in matchers)


class QuantizationArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_bits: int = 8
    type: Literal["int", "float"] = "int"
    symmetric: bool = True
    group_size: int | None = None
    strategy: Literal["tensor", "channel", "group", "block", "token", "tensor_group", "attn_head"] | None = None
    block_structure: list[int] | None = None
    dynamic: Literal["local"] | bool = False
    actorder: Literal["weight", "static", "group", "dynamic"] | None = None
    scale_dtype: str | None = None
    zp_dtype: str | None = None
    observer: str | None = None
    observer_kwargs: dict[str, Any] = Field(default_factory=dict)

    @field_validator("type", "strategy", mode="before")
    @classmethod
    def _lower(cls, value):
        return value.lower() if isinstance(value, str) else value

    @field_validator("dynamic", mode="before")
    @classmethod
    def _dynamic(cls, value):
        if isinstance(value, str) and value.lower() != "local":
            raise ValueError(f"dynamic {value!r}: true, false or 'local'")
        return value.lower() if isinstance(value, str) else value

    @field_validator("group_size", mode="before")
    @classmethod
    def _group(cls, value):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ValueError(f"group_size {value!r} is not an integer")
        if value is not None and value < -1:
            raise ValueError(f"Invalid group size {value}. Use group_size > 0 for strategy='group' and "
                             "group_size = -1 for 'channel'")
        return value

    @field_validator("block_structure", mode="before")
    @classmethod
    def _block(cls, value):
        if value is None:
            return value
        error = ValueError(f"Invalid block_structure '{value}'. Must be a list of positive ints [rows, cols].")
        if isinstance(value, str):
            try:
                value = [int(x) for x in value.split("x")]
            except ValueError:
                raise error from None
        if (isinstance(value, (list, tuple)) and len(value) == 2
                and all(isinstance(v, int) for v in value) and all(v > 0 for v in value)):
            return list(value)
        raise error

    @field_validator("actorder", mode="before")
    @classmethod
    def _actorder(cls, value):
        if isinstance(value, bool):
            if value:
                raise ValueError("actorder=True previously mapped to ActivationOrdering.GROUP, which has been removed")
            return None
        if isinstance(value, str) and value.lower() in ("group", "dynamic"):
            raise ValueError(f"actorder='{value}' has been removed")
        return value

    @field_validator("scale_dtype", "zp_dtype", mode="before")
    @classmethod
    def _dtype(cls, value):
        if isinstance(value, str) and not value.startswith("torch."):
            return f"torch.{value}"
        return value

    @model_validator(mode="after")
    def _infer(self):
        strategy, group_size = self.strategy, self.group_size
        if strategy is None:
            if group_size is None:
                strategy = "tensor"
            elif group_size > 0:
                strategy = "group"
            elif group_size == -1:
                strategy = "channel"
            else:
                raise ValueError(f"Invalid group size {group_size}")
        if strategy == "token" and not self.dynamic:
            raise ValueError("Cannot perform static token quantization, please use `dynamic=True`")
        if strategy in ("group", "tensor_group") and (group_size is None or group_size <= 0):
            raise ValueError(f"strategy {strategy} requires group_size to be set to a positive value")
        if group_size is not None and group_size > 0 and strategy not in ("group", "tensor_group"):
            raise ValueError("group_size requires strategy to be set to 'group'")
        if (strategy == "block") != (self.block_structure is not None):
            raise ValueError("block strategy and block_structure go together")
        if self.dynamic:
            if strategy not in ("token", "tensor", "tensor_group", "group"):
                raise ValueError("dynamic quantization needs token, tensor, tensor_group or group strategy")
            if self.dynamic == "local" and strategy != "tensor_group":
                raise ValueError("local is only supported for strategy tensor_group")
        if self.zp_dtype is None:
            self.zp_dtype = zero_point_dtype(self.type, self.num_bits)
        self.strategy = strategy
        return self

    def to_compressed_tensors(self):
        """compressed-tensors' own ``QuantizationArgs`` of the same JSON (what llm-compressor's functions take)."""
        from compressed_tensors.quantization import QuantizationArgs as Theirs

        return Theirs.model_validate(self.model_dump(mode="json"))

    @field_serializer("zp_dtype")
    def _zero_point(self, dtype: str | None) -> str | None:
        # written only where there is a zero point, as compressed-tensors does
        return None if self.symmetric else dtype


def zero_point_dtype(kind: str, num_bits: int) -> str:
    """compressed-tensors' ``QuantizationArgs.pytorch_dtype`` for the zero point, as torch names it."""
    if kind == "float":
        if num_bits in (4, 8):  # FP4's zero point is stored as FP8 as well
            return "torch.float8_e4m3fn"
        raise ValueError("Only num_bits in (8) are supported")
    return "torch.int8" if num_bits <= 8 else "torch.int16" if num_bits <= 16 else "torch.int32"


class QuantizationScheme(BaseModel):
    model_config = ConfigDict(extra="forbid")

    targets: list[str]
    weights: QuantizationArgs | None = None
    input_activations: QuantizationArgs | None = None
    output_activations: QuantizationArgs | None = None
    format: Literal[FORMATS] | None = None  # type: ignore[valid-type]

    @model_validator(mode="after")
    def _check(self):
        inputs, outputs = self.input_activations, self.output_activations
        if inputs is not None:
            if inputs.strategy not in ("token", "tensor", "group", "tensor_group", "attn_head"):
                raise ValueError(f"Using {inputs.strategy} strategy is not supported for activation quantization")
            if inputs.actorder is not None:
                raise ValueError("Cannot apply actorder to input activations")
        if outputs is not None and outputs.actorder is not None:
            raise ValueError("Cannot apply actorder to output activations")
        if self.format == "mixed-precision":
            raise ValueError("mixed-precision cannot be set as a format for a QuantizationScheme")
        return self


class QuantizationConfig(BaseModel):
    """The ``quantization_config`` mapping (unknown keys such as ``version`` are ignored, as there)."""

    config_groups: dict[str, QuantizationScheme]
    quant_method: str = "compressed-tensors"
    kv_cache_scheme: QuantizationArgs | None = None
    format: str = "fakequant"
    quantization_status: Literal[STATUSES] = "initialized"  # type: ignore[valid-type]
    global_compression_ratio: float | None = None
    ignore: list[str] | None = Field(default_factory=list)

    def to_compressed_tensors(self):
        """compressed-tensors' own ``QuantizationConfig`` of the same JSON (for llm-compressor and the writer)."""
        from compressed_tensors.quantization import QuantizationConfig as Theirs

        return Theirs.model_validate(self.model_dump(mode="json"))

    @field_validator("config_groups", mode="before")
    @classmethod
    def _presets(cls, groups):
        # compressed-tensors accepts `{preset name: [targets]}` and expands it.
        if isinstance(groups, dict):
            return {name: preset_scheme(name, value) if isinstance(value, list) else value
                    for name, value in groups.items()}
        return groups


# The presets quantkit writes, as compressed-tensors 0.19's quant_scheme.py defines them (a test holds
# them equal); any other preset name is expanded by compressed-tensors itself.
_WEIGHT_ONLY_INT = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True,
                    "dynamic": False}
PRESETS = {
    "W4A16": {"weights": _WEIGHT_ONLY_INT},
    "W4A16_ASYM": {"weights": dict(_WEIGHT_ONLY_INT, symmetric=False)},
    "W8A16": {"weights": dict(_WEIGHT_ONLY_INT, num_bits=8)},
}


def preset_scheme(name: str, targets: list[str]) -> QuantizationScheme:
    """compressed-tensors' ``preset_name_to_scheme``."""
    preset = PRESETS.get(name.upper())
    if preset is not None:
        return QuantizationScheme.model_validate({"targets": targets, **preset})
    from compressed_tensors.quantization import preset_name_to_scheme

    return QuantizationScheme.model_validate(preset_name_to_scheme(name, targets).model_dump(mode="json"))
