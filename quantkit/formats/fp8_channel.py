"""Per-channel FP8 weights: llm-compressor's ``FP8_DYNAMIC`` preset (static FP8 e4m3 weights with one scale per output
row, the activations quantized to FP8 per token by the engine at run time).

compressed-tensors 0.19 computes it in the weight's own dtype: the row's absolute maximum over 448 (the largest
e4m3 value), a zero scale replaced by the dtype's epsilon (``calculate_qparams``), then the weight divided by its
scale, clamped to +-448 and cast to e4m3 (``_quantize``); the scale is stored in the weight's dtype.
``tests/test_fp8_channel.py`` holds this equal to llm-compressor's oneshot with the preset, bit for bit.
"""

from __future__ import annotations

import torch

from quantkit.formats.fp8_block import FP8_MAX


def quantize_fp8_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, scale [rows, 1] in the weight's dtype) of a 2-D float weight."""
    absmax = weight.abs().amax(dim=1, keepdim=True)
    scale = absmax / torch.tensor(FP8_MAX, dtype=weight.dtype, device=weight.device)
    scale = torch.where(scale == 0, torch.finfo(weight.dtype).eps, scale).to(weight.dtype)
    q = (weight / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8_channel(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """compressed-tensors' ``_dequantize``: the e4m3 values in the scale's dtype, times the scale."""
    return (weight.to(scale.dtype) * scale).to(dtype)
