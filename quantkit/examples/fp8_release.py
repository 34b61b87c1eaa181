"""A block-FP8 release as DeepSeek-V3 and GLM-5 ship theirs, made from BF16 weights: the examples' sources and the
benchmarks' inputs."""

from __future__ import annotations

import torch

from quantkit.checkpoint.families import release_stores_fp8
from quantkit.formats.fp8_block import quantize_fp8_block


def release_encoding(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """One tensor as a block-FP8 release stores it: FP8 + ``weight_scale_inv`` where such releases
    quantize (families.release_stores_fp8), unchanged elsewhere."""
    if not release_stores_fp8(name, tensor.ndim):
        return {name: tensor}
    q, scale_inv = quantize_fp8_block(tensor)
    return {name: q, name.removesuffix(".weight") + ".weight_scale_inv": scale_inv}
