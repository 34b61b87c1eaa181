"""INT4 symmetric group quantization and compressed-tensors ``pack-quantized`` packing.

One rounding rule on every device (CPU and CUDA give the same bits):
  per group: scale = dtype(absmax(w) / 7.5), a zero scale becomes the dtype's eps;
  q = clamp(round_half_even(fp32(w) / fp32(scale)), -8, 7).
This is compressed-tensors' rule computed in fp32, which is what llm-compressor does on CUDA;
on CPU llm-compressor divides in bf16 and differs in ~10 % of words (see docs/formats.md).

Packing stores q + 8 as nibbles along the input dimension, lowest nibble first: column 8k + j
sits in bits [4j, 4j + 4) of int32 word k. On a little-endian host that is two nibbles per
byte and four bytes per word, so packing is a byte view, not a loop (tests prove it equal to
compressed-tensors' ``pack_to_int32``).
"""

from __future__ import annotations

import sys

import torch

QMIN, QMAX = -8, 7

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError("quantkit's INT4 packing assumes a little-endian host")


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (q int8 [out, in], scale [out, in/group_size] in w's dtype)."""
    out, inn = w.shape
    groups = w.reshape(out, inn // group_size, group_size)
    absmax = groups.abs().amax(dim=-1)
    scale = (absmax.to(torch.float32) / 7.5).to(w.dtype)
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(w.dtype).eps, dtype=w.dtype, device=w.device), scale)
    # in place on one fp32 copy: the division, rounding and clamp cost one allocation, not four
    q = groups.to(torch.float32, copy=True).div_(scale.to(torch.float32).unsqueeze(-1)).round_().clamp_(QMIN, QMAX)
    return q.to(torch.int8).reshape(out, inn), scale


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7], shape [out, in] -> int32 [out, in / 8]."""
    u = (q + 8).to(torch.uint8)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous().view(torch.int32)


def unpack_int4(packed: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """int32 [out, in / 8] -> int8 [out, in] in [-8, 7]."""
    b = packed.contiguous().view(torch.uint8)
    u = torch.stack((b & 0xF, b >> 4), dim=-1).reshape(shape[0], -1)[:, : shape[1]]
    return u.to(torch.int8) - 8


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """q * scale in the scale's dtype, as compressed-tensors' dequantize computes it."""
    out, inn = q.shape
    w = q.reshape(out, inn // group_size, group_size).to(scale.dtype) * scale.unsqueeze(-1)
    return w.reshape(out, inn)


def fake_quantize_int4(w: torch.Tensor, group_size: int) -> torch.Tensor:
    q, scale = quantize_int4(w, group_size)
    return dequantize_int4(q, scale, group_size)
