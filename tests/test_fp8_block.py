"""Block-FP8 decoding equals compressed-tensors' FP8BlockDequantizer bit for bit."""

import pytest
import torch
from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer

from quantkit.formats import fp8_block, shapes
from conftest import shard_of
from helpers import quantkit
from safetensors.torch import load_file
from quantkit.checkpoint.writer import write_safetensors


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


EXPERT = "model.layers.2.mlp.experts.3.up_proj"


def test_an_all_zero_scale_block_is_warned_about(glm_copy, tmp_path):
    name = EXPERT + ".weight_scale_inv"
    path = shard_of(glm_copy, name)
    tensors = load_file(path)
    tensors[name] = torch.zeros_like(tensors[name])
    write_safetensors(path, tensors)
    r = quantkit("convert", glm_copy, tmp_path / "dst", "-r", "glm5-int4-experts-g32", "--device", "cpu")
    assert r.exit_code == 0 and "warning" in r.output and name in r.output and "decode to 0" in r.output
