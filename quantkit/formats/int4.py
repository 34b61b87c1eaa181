"""INT4 group quantization (symmetric, or asymmetric with zero points) and compressed-tensors ``pack-quantized``
packing.

One rounding rule on every device (CPU and CUDA give the same bits):
  per group: scale = dtype(absmax(w) / 7.5), a zero scale becomes the dtype's eps;
  q = clamp(round_half_even(fp32(w) / fp32(scale)), -8, 7).
This is compressed-tensors' rule computed in fp32, which is what llm-compressor does on CUDA;
on CPU llm-compressor divides in bf16 and differs in ~10 % of words (see docs/formats.md).

Packing stores q + 8 as nibbles along the input dimension, lowest nibble first: column 8k + j
sits in bits [4j, 4j + 4) of int32 word k. On a little-endian host that is two nibbles per
byte and four bytes per word, so packing is a byte view, not a loop (tests prove it equal to
compressed-tensors' ``pack_to_int32``).

Asymmetric (compressed-tensors' rule for ``symmetric: false``, its observer's arithmetic in the weight's dtype):
  per group: lo = min(min(w), 0), hi = max(max(w), 0); scale = dtype((hi - lo) / 15), a zero scale the dtype's eps;
  zp = clamp(round_half_even(dtype(-8 - dtype(lo / scale))), -8, 7) as int8 (0 for an all-zero group);
  q = clamp(round_half_even(fp32(w) / fp32(scale) + zp), -8, 7); w' = (q - zp) * scale.
The zero points are packed like the weights but along the output dimension (``pack_to_int32(zp, 4, packed_dim=0)``):
``weight_zero_point`` is int32 [ceil(out / 8), in / group_size], rows past ``out`` padded with the nibble 0.
"""

from __future__ import annotations

import sys

import torch

QMIN, QMAX = -8, 7

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError("quantkit's INT4 packing assumes a little-endian host")


def _eps(w: torch.Tensor) -> torch.Tensor:
    """The dtype's eps, a zero scale's replacement, made on the device (a copy from the host could not be captured
    in a CUDA graph)."""
    return torch.full((), torch.finfo(w.dtype).eps, dtype=w.dtype, device=w.device)


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (q int8 [out, in], scale [out, in/group_size] in w's dtype)."""
    out, inn = w.shape
    groups = w.reshape(out, inn // group_size, group_size)
    absmax = groups.abs().amax(dim=-1)
    scale = (absmax.to(torch.float32) / 7.5).to(w.dtype)
    scale = torch.where(scale == 0, _eps(w), scale)
    # in place on one fp32 copy: the division, rounding and clamp cost one allocation, not four
    q = groups.to(torch.float32, copy=True).div_(scale.to(torch.float32).unsqueeze(-1)).round_().clamp_(QMIN, QMAX)
    return q.to(torch.int8).reshape(out, inn), scale


def quantize_int4_asym(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (q int8 [out, in], scale [out, in/group_size] in w's dtype, zero point int8 [out, in/group_size])."""
    out, inn = w.shape
    groups = w.reshape(out, inn // group_size, group_size)
    zero = torch.zeros((), dtype=w.dtype, device=w.device)
    lo, hi = torch.minimum(groups.amin(dim=-1), zero), torch.maximum(groups.amax(dim=-1), zero)
    scale = (hi - lo) / (QMAX - QMIN)  # each step rounded to w's dtype, as compressed-tensors' observer computes it
    empty = scale == 0  # an all-zero group: compressed-tensors' zero point is its 0 / 0, which becomes 0
    zp = torch.where(empty, 0, (QMIN - lo / torch.where(empty, 1, scale)).clamp(QMIN, QMAX).round()).to(torch.int8)
    scale = torch.where(empty, _eps(w), scale)
    q = groups.to(torch.float32, copy=True).div_(scale.to(torch.float32).unsqueeze(-1))
    q = q.add_(zp.to(torch.float32).unsqueeze(-1)).round_().clamp_(QMIN, QMAX)
    return q.to(torch.int8).reshape(out, inn), scale, zp


def pack_zero_point(zp: torch.Tensor) -> torch.Tensor:
    """int8 zero points [out, groups] -> int32 [ceil(out / 8), groups], packed along the output dimension."""
    out = zp.shape[0]
    padded = torch.nn.functional.pad(zp.t(), (0, -out % 8), value=QMIN)  # QMIN packs to the nibble 0
    return pack_int4(padded).t().contiguous()


def unpack_zero_point(packed: torch.Tensor, out: int) -> torch.Tensor:
    """int32 [ceil(out / 8), groups] -> int8 zero points [out, groups]."""
    groups = packed.shape[1]
    return unpack_int4(packed.t().contiguous(), (groups, packed.shape[0] * 8))[:, :out].t().contiguous()


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7], shape [out, in] -> int32 [out, in / 8]."""
    u = (q + 8).to(torch.uint8)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous().view(torch.int32)


def unpack_int4(packed: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """int32 [out, in / 8] -> int8 [out, in] in [-8, 7]."""
    b = packed.contiguous().view(torch.uint8)
    u = torch.stack((b & 0xF, b >> 4), dim=-1).reshape(shape[0], -1)[:, : shape[1]]
    return u.to(torch.int8) - 8


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, group_size: int,
                    zero_point: torch.Tensor | None = None) -> torch.Tensor:
    """(q - zero point) * scale in the scale's dtype, as compressed-tensors' dequantize computes it."""
    out, inn = q.shape
    w = q.reshape(out, inn // group_size, group_size).to(scale.dtype)
    if zero_point is not None:
        w = w - zero_point.to(scale.dtype).unsqueeze(-1)
    return (w * scale.unsqueeze(-1)).reshape(out, inn)


def fake_quantize_int4(w: torch.Tensor, group_size: int, symmetric: bool = True) -> torch.Tensor:
    """``w`` as it comes back from its INT4 form: symmetric, or with a zero point per group."""
    if not symmetric:
        q, scale, zero_point = quantize_int4_asym(w, group_size)
        return dequantize_int4(q, scale, group_size, zero_point)
    q, scale = quantize_int4(w, group_size)
    return dequantize_int4(q, scale, group_size)
