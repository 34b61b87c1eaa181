"""Against the peer: llm-compressor's model_free_ptq on the same input and scheme.

llm-compressor divides by the scale in the weight's dtype (bf16) on CPU and in fp32 on CUDA.
quantkit uses the fp32 rule everywhere. On CPU the peer's packed words must therefore equal
our packing of the bf16-division rule exactly, its scales must equal ours exactly, and our
words must equal the fp32 rule — every difference between the two is explained, none is noise.
"""

import json

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import quantize
from safetensors.torch import load_file

from quantkit.checkpoint.reader import open_checkpoint
from quantkit.convert import convert
from quantkit.examples.synthetic import build_synthetic
from quantkit.formats import int4
from quantkit.checkpoint.describe import config_mismatches
from quantkit.formats.recipe import load_recipe

EXPERTS = r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"


def load_all(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def run_peer(src, dst, fp8: bool, dequantize_only=None):
    from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer
    from llmcompressor import model_free_ptq

    recipe = load_recipe("glm5-int4-experts-g32")
    fp8_modules = [n.removesuffix(".weight_scale_inv") for n in open_checkpoint(src).tensors if n.endswith("_scale_inv")]
    converter = FP8BlockDequantizer(targets=dequantize_only or fp8_modules) if fp8 else None
    model_free_ptq(src, dst, config=recipe.config.to_compressed_tensors(), device="cpu", converter=converter)


@pytest.fixture(scope="module")
def peer_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("peer")
    runs = {}
    for encoding in ("bf16", "fp8"):
        src = build_synthetic("glm_moe_dsa", root / f"src-{encoding}", seed=4, fp8=encoding == "fp8")
        convert(src, root / f"ours-{encoding}", "glm5-int4-experts-g32", device="cpu")
        run_peer(src, root / f"peer-{encoding}", fp8=encoding == "fp8")
        runs[encoding] = (src, load_all(root / f"ours-{encoding}"), load_all(root / f"peer-{encoding}"), root)
    return runs


@pytest.mark.parametrize("encoding", ["bf16", "fp8"])
def test_packed_experts_match_the_peer_under_the_rounding_rule(peer_runs, encoding):
    src, ours, peer, _ = peer_runs[encoding]
    from quantkit.modeling import dequantized_state_dict

    source = dequantized_state_dict(src)  # FP8 path: bf16(fp32(w) * scale_inv)
    experts = [n.removesuffix(".weight_packed") for n in ours if ".experts." in n and n.endswith("weight_packed")]
    assert len(experts) == 3 * 8 * 3  # MoE layers 1, 2 and the MTP layer 3; 8 experts; gate/up/down
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
    differing = total = 0
    for m in experts:
        assert torch.equal(ours[f"{m}.weight_scale"], peer[f"{m}.weight_scale"]), m
        assert torch.equal(ours[f"{m}.weight_shape"], peer[f"{m}.weight_shape"]), m
        w, scale = source[f"{m}.weight"], ours[f"{m}.weight_scale"]
        fp32_rule = int4.pack_int4(quantize(w.float(), scale.float(), None, args, dtype=torch.int8))
        bf16_rule = int4.pack_int4(quantize(w, scale, None, args, dtype=torch.int8))
        assert torch.equal(ours[f"{m}.weight_packed"], fp32_rule), m
        assert torch.equal(peer[f"{m}.weight_packed"], bf16_rule), m
        differing += int((ours[f"{m}.weight_packed"] != peer[f"{m}.weight_packed"]).sum())
        total += ours[f"{m}.weight_packed"].numel()
    print(f"{encoding}: {differing / total:.2%} of packed words differ from the peer's CPU bf16 division")


def test_everything_not_targeted_equals_the_peer(peer_runs):
    _, ours, peer, _ = peer_runs["fp8"]
    plain = [n for n in ours if "weight_packed" not in n and "weight_scale" not in n and "weight_shape" not in n]
    for name in plain:
        assert torch.equal(ours[name], peer[name]), name


def test_our_config_describes_every_quantized_tensor_and_the_peers_does_not(peer_runs, tmp_path):
    _, _, _, root = peer_runs["fp8"]
    assert config_mismatches(open_checkpoint(root / "ours-fp8")) == []
    # Dequantizing only what it quantizes, the peer leaves the FP8 attention weights as they
    # were, and its quantization_config (INT4 experts only) does not describe them.
    src = root / "src-fp8"
    run_peer(src, tmp_path / "peer-raw", fp8=True, dequantize_only=[EXPERTS])
    mismatches = config_mismatches(open_checkpoint(tmp_path / "peer-raw"))
    assert any("self_attn.o_proj" in m.tensor and "no quantization_config group" in m.problem for m in mismatches)
    config = json.loads((root / "ours-fp8" / "config.json").read_text())
    assert config["quantization_config"]["format"] == "pack-quantized"
