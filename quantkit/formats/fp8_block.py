"""Block-FP8 (DeepSeek-V3 style) weights: decoding to the model dtype, and encoding.

``weight_scale_inv`` is, despite its name, a multiplier: w = fp8 * scale_inv per 128x128 block,
edge blocks partial. Decoding computes in fp32 and rounds once to the model dtype, exactly as
compressed-tensors' FP8BlockDequantizer does (a test holds the two equal bit for bit).
"""

from __future__ import annotations

import torch

from quantkit.formats.shapes import expected_scale_shape

FP8_MAX = 448.0  # largest finite float8_e4m3fn
# config.json's quantization_config of a DeepSeek-V3 / GLM 5.x block-FP8 release.
RELEASE_QUANTIZATION_CONFIG = {
    "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic",
}


def _expand(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """Each block's scale repeated over the block, cut to ``shape`` (a broadcast view copied once: on CUDA,
    ``repeat_interleave`` copies its count to the device, which a CUDA graph cannot capture)."""
    rows, cols = scale.shape
    full = scale[:, None, :, None].expand(rows, block[0], cols, block[1]).reshape(rows * block[0], cols * block[1])
    return full[: shape[0], : shape[1]]


def dequantize_fp8_block(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128), dtype=torch.bfloat16
) -> torch.Tensor:
    out, inn = weight.shape
    shape = (out, inn)
    w = weight.to(torch.float32, copy=True)  # mutated below: never alias the caller's tensor
    scale = scale_inv.to(torch.float32)
    if out % block[0] == 0 and inn % block[1] == 0:
        # whole blocks: broadcast in place over a block view, no expanded scale tensor
        w.view(out // block[0], block[0], inn // block[1], block[1]).mul_(scale[:, None, :, None])
        return w.to(dtype)
    return (w * _expand(scale, shape, block)).to(dtype)


def quantize_fp8_block(weight: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest block FP8: scale_inv = absmax(block) / 448 (fp32), a zero block gets 1.0."""
    out, inn = weight.shape
    rows, cols = expected_scale_shape((out, inn), block)
    w = weight.to(torch.float32)
    padded = torch.nn.functional.pad(w, (0, cols * block[1] - inn, 0, rows * block[0] - out))
    absmax = padded.reshape(rows, block[0], cols, block[1]).abs().amax(dim=(1, 3))
    scale_inv = torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax))
    q = (w / _expand(scale_inv, (out, inn), block)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale_inv
