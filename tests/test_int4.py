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


# --- asymmetric groups (zero points) -----------------------------------------------------------------------------


def asym_args(group_size: int) -> QuantizationArgs:
    return QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=group_size)


def asym_weights(seed: int, dtype, group_size: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(260, 512, generator=g) * 0.02  # 260 rows: the packed zero points need a padded last word
    w[0, :128] = 0  # all-zero groups: scale eps, zero point 0 (compressed-tensors' 0/0)
    w[1, 5] = 0.5
    w[2, :group_size] = torch.rand(group_size, generator=g) + 0.1  # all positive: the range still holds 0
    w[3, :group_size] = -torch.rand(group_size, generator=g) - 0.1
    return w.to(dtype)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_asymmetric_qparams_values_and_dequantization_equal_compressed_tensors(group_size, dtype, seed):
    w = asym_weights(seed, dtype, group_size)
    q, scale, zero = int4.quantize_int4_asym(w, group_size)
    groups = w.reshape(w.shape[0], -1, group_size)
    ct_scale, ct_zero = calculate_qparams(groups.amin(-1), groups.amax(-1), asym_args(group_size))
    assert torch.equal(scale, ct_scale) and torch.equal(zero, ct_zero)
    assert torch.equal(q, quantize(w.float(), scale.float(), ct_zero, asym_args(group_size), dtype=torch.int8))
    assert torch.equal(int4.dequantize_int4(q, scale, group_size, zero), dequantize(q, scale, ct_zero,
                                                                                    asym_args(group_size)))


def test_zero_points_pack_along_the_output_dimension_as_pack_to_int32():
    zero = torch.randint(-8, 8, (260, 16), dtype=torch.int8, generator=torch.Generator().manual_seed(5))
    packed = int4.pack_zero_point(zero)
    assert packed.shape == (33, 16) and packed.dtype == torch.int32
    assert torch.equal(packed, pack_to_int32(zero, 4, packed_dim=0))
    assert torch.equal(int4.unpack_zero_point(packed, 260), zero)


def test_an_asymmetric_conversion_is_what_compressed_tensors_compressor_writes(synthetic, tmp_path):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file

    from quantkit.checkpoint.reader import open_checkpoint
    from quantkit.convert import convert
    from quantkit.modeling import dequantized_state_dict
    from quantkit.verify import verify

    result = convert(synthetic["glm_moe_dsa"], tmp_path / "asym", "glm5-int4-experts-asym-g32", device="cpu")
    out = {k: v for f in sorted((tmp_path / "asym").glob("*.safetensors")) for k, v in load_file(f).items()}
    source = dequantized_state_dict(synthetic["glm_moe_dsa"])
    scheme = QuantizationScheme(targets=["Linear"], weights=asym_args(32))
    module = "model.layers.1.mlp.experts.3.down_proj"
    w = source[f"{module}.weight"]
    groups = w.reshape(w.shape[0], -1, 32)
    scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), asym_args(32))
    theirs = PackedQuantizationCompressor.compress({"weight": w.float(), "weight_scale": scale.float(),
                                                     "weight_zero_point": zero}, scheme)
    assert torch.equal(out[f"{module}.weight_packed"], theirs["weight_packed"])
    assert torch.equal(out[f"{module}.weight_zero_point"], theirs["weight_zero_point"])
    assert torch.equal(out[f"{module}.weight_scale"], scale)
    assert result.tensors_by_group == {"routed_experts": 72}
    assert sum(n.endswith("weight_zero_point") for n in out) == 72
    config = open_checkpoint(tmp_path / "asym").config.quantization_config["config_groups"]["routed_experts"]
    assert config["weights"] == {**asym_args(32).model_dump(mode="json"), "observer": config["weights"]["observer"]}
    for engine in ("sglang", "vllm"):
        report = verify(tmp_path / "asym", source=synthetic["glm_moe_dsa"], engine=engine)
        assert report.passed, report.findings
        assert any("weight_zero_point" in r for r in report.remarks)
