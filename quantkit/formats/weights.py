"""The one decoder: a stored Linear weight, in whatever encoding, back to its values.

Every reader of weights goes through ``decode_weight``: conversion (before re-quantizing),
``verify`` (error against the source), KV calibration and the strict model loader. Each encoding's
arithmetic lives with its format (``fp8_block``, ``int4``), each proven equal to compressed-tensors.
"""

from __future__ import annotations

import torch

from quantkit.formats import fp8_block, fp8_channel, int4

ENCODINGS = ("fp8_block", "fp8_channel", "int4_packed", "float")


def decode_weight(encoding: str, parts: tuple[torch.Tensor, ...], dtype: torch.dtype,
                  block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """The weight in ``dtype`` from its stored ``parts``:

    - ``fp8_block``: (fp8 weight, scale) with the scale per ``block``: bf16(fp32(w) * scale), one rounding;
    - ``fp8_channel``: (fp8 weight, scale [out, 1]): w in the scale's dtype times the scale, then ``dtype``;
    - ``int4_packed``: (int32 packed, scale, [out, in][, packed zero point]): (q - zero point) * scale in the
      scale's dtype, then ``dtype``;
    - ``float``: (weight,) cast to ``dtype``.
    """
    if encoding == "fp8_block":
        weight, scale = parts
        return fp8_block.dequantize_fp8_block(weight, scale, block, dtype)
    if encoding == "fp8_channel":
        weight, scale = parts
        return fp8_channel.dequantize_fp8_channel(weight, scale, dtype)
    if encoding == "int4_packed":
        packed, scale, shape, *zero = parts
        out_features, in_features = (int(d) for d in shape)
        q = int4.unpack_int4(packed, (out_features, in_features))
        zp = int4.unpack_zero_point(zero[0], out_features) if zero else None
        return int4.dequantize_int4(q, scale, in_features // scale.shape[1], zp).to(dtype)
    if encoding == "float":
        (weight,) = parts
        return weight.to(dtype=dtype)
    raise ValueError(f"unknown weight encoding {encoding!r} (known: {', '.join(ENCODINGS)})")
