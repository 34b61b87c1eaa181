"""INT4 quantization and packing equal compressed-tensors' own functions, bit for bit."""

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
from compressed_tensors.quantization.utils.helpers import calculate_qparams

from quantkit.formats import int4, shapes


def args(group_size: int) -> QuantizationArgs:
    return QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)


def weights(out=256, inn=512, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inn, generator=g) * 0.02
    w[0, :128] = 0  # an all-zero group: its scale must become eps, not 0
    w[1, 5] = 0.5  # an outlier
    return w.to(dtype)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_scales_equal_compressed_tensors_calculate_qparams(group_size, dtype):
    w = weights(dtype=dtype)
    _, scale = int4.quantize_int4(w, group_size)
    groups = w.reshape(w.shape[0], -1, group_size)
    ct_scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args(group_size))
    assert scale.dtype == dtype
    assert torch.equal(scale, ct_scale)
    assert scale[0, 0] == torch.finfo(dtype).eps


@pytest.mark.parametrize("group_size", [32, 128])
def test_quantized_values_equal_compressed_tensors_quantize_in_fp32(group_size):
    # The one rounding rule: fp32 division, round half to even, clamp to [-8, 7].
    w = weights()
    q, scale = int4.quantize_int4(w, group_size)
    expected = quantize(w.float(), scale.float(), None, args(group_size), dtype=torch.int8)
    assert torch.equal(q, expected)
    assert q.min() >= -8 and q.max() <= 7


def test_round_half_to_even_on_exact_ties():
    # absmax 7.5 -> scale 1.0; 2.5 and -0.5 are exact ties.
    w = torch.tensor([[7.5, 2.5, -0.5, 3.5, 0.0, 0.0, 0.0, 0.0]], dtype=torch.bfloat16)
    q, scale = int4.quantize_int4(w, 8)
    assert scale.item() == 1.0
    assert q[0, :4].tolist() == [8 - 1, 2, 0, 4]  # 7.5 -> 8 clamps to 7


def test_pack_equals_pack_to_int32_and_unpacks():
    q = torch.randint(-8, 8, (64, 256), dtype=torch.int8, generator=torch.Generator().manual_seed(3))
    packed = int4.pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (64, 32)
    assert torch.equal(packed, pack_to_int32(q, 4))
    assert torch.equal(int4.unpack_int4(packed, q.shape), q)
    assert torch.equal(unpack_from_int32(packed, 4, torch.Size(q.shape)), q)


def test_nibble_order_is_lowest_first():
    q = torch.tensor([[-8, -7, -6, -5, -4, -3, -2, -1]], dtype=torch.int8)  # stored as 0..7
    assert int4.pack_int4(q).item() == 0x76543210


@pytest.mark.parametrize("group_size", [32, 128])
def test_dequantize_equals_compressed_tensors(group_size):
    w = weights()
    q, scale = int4.quantize_int4(w, group_size)
    assert torch.equal(int4.dequantize_int4(q, scale, group_size), dequantize(q, scale, None, args(group_size)))


def test_group_size_check():
    assert shapes.check_group_size(512, 128) is None
    assert "does not divide" in shapes.check_group_size(96, 64)
