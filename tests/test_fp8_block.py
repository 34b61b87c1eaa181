"""Block-FP8 decoding equals compressed-tensors' FP8BlockDequantizer bit for bit."""

import pytest
import torch
from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer

from quantkit.formats import fp8_block, shapes


@pytest.mark.parametrize("shape", [(256, 512), (160, 256), (300, 200)])  # full and partial edge blocks
def test_dequantize_equals_fp8_block_dequantizer(shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.05
    q, scale_inv = fp8_block.quantize_fp8_block(w)
    assert scale_inv.shape == shapes.expected_scale_shape(shape, (128, 128))
    ours = fp8_block.dequantize_fp8_block(q, scale_inv)
    theirs = FP8BlockDequantizer(targets=["Linear"]).process({"m.weight": q, "m.weight_scale_inv": scale_inv})
    assert torch.equal(ours, theirs["m.weight"])


def test_scale_inv_is_a_multiplier():
    q = torch.full((128, 128), 2.0).to(torch.float8_e4m3fn)
    w = fp8_block.dequantize_fp8_block(q, torch.tensor([[0.25]]), dtype=torch.float32)
    assert torch.all(w == 0.5)


def test_encode_decode_error_is_small():
    w = torch.randn(256, 256) * 0.02
    q, s = fp8_block.quantize_fp8_block(w)
    back = fp8_block.dequantize_fp8_block(q, s, dtype=torch.float32)
    assert ((back - w).norm() / w.norm()) < 0.05
