"""``inspect``: what a checkpoint holds, from config.json and safetensors headers only.

No tensor data is read, so a 700 GB checkpoint inspects in the time it takes to read a few
hundred kilobytes of headers.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from quantkit.checkpoint.families import COMPONENTS, component, detect_family, is_mtp, layer_index
from quantkit.checkpoint.reader import Checkpoint, TensorInfo, open_checkpoint

_SCALE_PARAMS = ("weight_scale_inv", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")


@dataclass
class ComponentSummary:
    params: int = 0
    bytes: int = 0
    encodings: dict[str, int] = field(default_factory=dict)  # encoding -> parameters stored that way


@dataclass
class InspectReport:
    path: str
    model_type: str
    family: str
    architectures: list[str]
    quantization: str
    num_hidden_layers: int
    mtp_layers: int
    total_params: int
    total_bytes: int
    shards: list[dict]
    components: dict[str, ComponentSummary]


def inspect_checkpoint(path: str | os.PathLike) -> InspectReport:
    ckpt = open_checkpoint(path)
    config = ckpt.config
    components = {name: ComponentSummary() for name in COMPONENTS}
    for info in ckpt.tensors.values():
        summary = components[component(info.name, config)]
        summary.bytes += info.nbytes
        params, encoding = tensor_params(info, ckpt)
        if params:
            summary.params += params
            summary.encodings[encoding] = summary.encodings.get(encoding, 0) + params
    mtp = {layer_index(n) for n in ckpt.tensors if is_mtp(n, config)}
    return InspectReport(
        path=str(ckpt.root),
        model_type=config.model_type or "unknown",
        family=detect_family(config).name,
        architectures=list(config.architectures or []),
        quantization=config.quantization.describe(),
        num_hidden_layers=config.layers,
        mtp_layers=len(mtp),
        total_params=sum(c.params for c in components.values()),
        total_bytes=ckpt.total_bytes,
        shards=[{"name": s.name, "bytes": s.size, "tensors": len(s.tensors)} for s in ckpt.shards],
        components={k: v for k, v in components.items() if v.bytes},
    )


def tensor_params(info: TensorInfo, ckpt: Checkpoint) -> tuple[int, str]:
    """(parameters a tensor stores, their encoding); scales and shapes store none."""
    module, _, param = info.name.rpartition(".")
    count = param_count(info)
    if param in _SCALE_PARAMS:
        return count, ""
    if param == "weight_packed":
        scale = ckpt.tensors.get(f"{module}.weight_scale")
        in_features = info.shape[1] * 8
        group = in_features // scale.shape[1] if scale is not None and len(scale.shape) == 2 else in_features
        return count, f"int4 g{group}"
    if info.dtype in ("F8_E4M3", "F8_E5M2"):
        has_block_scale = f"{module}.weight_scale_inv" in ckpt.tensors or f"{module}.weight_scale" in ckpt.tensors
        return count, "fp8 block" if has_block_scale else "fp8"
    return count, info.dtype.lower()


def param_count(info: TensorInfo) -> int:
    """The parameters a tensor stores: eight per packed INT4 word, none in scales and shapes."""
    param = info.name.rpartition(".")[2]
    if param in _SCALE_PARAMS:
        return 0
    if param == "weight_packed":
        return info.shape[0] * info.shape[1] * 8
    return math.prod(info.shape)
