"""FP8 weights with a scale per output row and FP8 activations per token (llm-compressor's FP8_DYNAMIC preset): the
prefill pool's format for a BF16 source. quantkit writes what llm-compressor's oneshot writes, bit for bit, from a
BF16 source; from a block-FP8 source it decodes first; it reads its own output back as compressed-tensors does."""

import json

import pytest
import torch
from safetensors.torch import load_file

from quantkit.checkpoint.reader import TensorReader, open_checkpoint
from quantkit.convert import convert
from quantkit.examples.synthetic import build_synthetic
from quantkit.formats.fp8_channel import dequantize_fp8_channel, quantize_fp8_channel
from quantkit.modeling import read_weight

RECIPE = "dense-fp8-dynamic"


def tensors(folder):
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype:
        return False
    if a.dtype == torch.float8_e4m3fn:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_synthetic("llama", tmp_path_factory.mktemp("fp8dyn") / "bf16", seed=1, fp8=False, num_hidden_layers=2)


def test_equal_to_llm_compressors_oneshot_with_the_fp8_dynamic_preset(llama, tmp_path):
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    result = convert(llama, tmp_path / "ours", RECIPE, device="cpu")
    assert result.tensors_by_kind["fp8_channel"] == 14  # 7 Linears a layer, lm_head left alone
    net = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.bfloat16)
    oneshot(model=net, recipe=QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"]))
    net.save_pretrained(tmp_path / "peer", save_compressed=True)
    mine, theirs = tensors(tmp_path / "ours"), tensors(tmp_path / "peer")
    assert set(mine) == set(theirs)
    assert [k for k in theirs if not same(mine[k], theirs[k])] == []
    ours = json.loads((tmp_path / "ours" / "config.json").read_text())["quantization_config"]
    peer = json.loads((tmp_path / "peer" / "config.json").read_text())["quantization_config"]
    group = ours["config_groups"]["fp8_dynamic"]
    for field in ("num_bits", "type", "strategy", "symmetric", "dynamic"):
        assert group["weights"][field] == peer["config_groups"]["group_0"]["weights"][field]
        assert group["input_activations"][field] == peer["config_groups"]["group_0"]["input_activations"][field]
    assert ours["format"] == peer["format"] == "float-quantized"


def test_the_preset_form_of_a_recipe_converts_to_the_same_bytes(llama, tmp_path):
    preset = tmp_path / "preset.yaml"
    preset.write_text("quant_stage:\n  quant_modifiers:\n    QuantizationModifier:\n      ignore: [lm_head]\n"
                      "      targets: [Linear]\n      scheme: FP8_DYNAMIC\n")
    convert(llama, tmp_path / "built-in", RECIPE, device="cpu")
    convert(llama, tmp_path / "preset", preset, device="cpu")
    assert tensors(tmp_path / "preset").keys() == tensors(tmp_path / "built-in").keys()
    assert all(same(a, tensors(tmp_path / "built-in")[k]) for k, a in tensors(tmp_path / "preset").items())


def test_a_block_fp8_source_is_decoded_then_quantized_per_row(tmp_path):
    src = build_synthetic("llama", tmp_path / "fp8", seed=2, fp8=True, num_hidden_layers=1)
    convert(src, tmp_path / "out", RECIPE, device="cpu")
    ckpt, out = open_checkpoint(src), tensors(tmp_path / "out")
    with TensorReader(ckpt) as reader:
        for name in ("model.layers.0.mlp.down_proj", "model.layers.0.self_attn.q_proj"):
            want_q, want_scale = quantize_fp8_channel(read_weight(ckpt, reader, name))
            assert same(out[f"{name}.weight"], want_q) and same(out[f"{name}.weight_scale"], want_scale)
    from quantkit.verify import verify

    # quantized again, not copied: its error against the source is FP8's rounding, which verify bounds
    assert verify(tmp_path / "out", source=src, engine="sglang", smoke=False).passed


def test_read_back_as_compressed_tensors_dequantizes_it(llama, tmp_path):
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    convert(llama, tmp_path / "out", RECIPE, device="cpu")
    args = QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True)
    ckpt, out = open_checkpoint(tmp_path / "out"), tensors(tmp_path / "out")
    name = "model.layers.1.mlp.gate_proj"
    with TensorReader(ckpt) as reader:
        ours = read_weight(ckpt, reader, name)
    theirs = dequantize(out[f"{name}.weight"], out[f"{name}.weight_scale"], args=args, dtype=torch.bfloat16)
    assert same(ours, theirs)


def test_a_zero_row_gets_the_epsilon_scale_and_round_trips():
    w = torch.randn(4, 64, dtype=torch.bfloat16)
    w[2] = 0
    q, scale = quantize_fp8_channel(w)
    assert scale[2].item() == torch.finfo(torch.bfloat16).eps and not q.view(torch.uint8)[2].any()
    assert torch.allclose(dequantize_fp8_channel(q, scale, torch.float32), w.float(), rtol=0.07, atol=1e-6)


def test_verify_passes_it_and_refuses_a_scale_the_engines_would_not_load(llama, tmp_path):
    """Both engines load a channel scale into an [out, 1] parameter and assert the shape (SGLang 0.5.23
    srt/layers/parameter.py copy_with_check; vLLM 0.33.0 model_executor/parameter.py): a 1-D scale fails there."""
    from safetensors.torch import save_file

    from quantkit.verify import verify

    out = tmp_path / "out"
    convert(llama, out, RECIPE, device="cpu")
    for engine in ("sglang", "vllm"):
        assert verify(out, source=llama, engine=engine, smoke=False).passed
    shard = next(out.glob("*.safetensors"))
    stored = load_file(shard)
    name = "model.layers.0.mlp.down_proj.weight_scale"
    stored[name] = stored[name].reshape(-1)
    save_file(stored, shard, {"format": "pt"})
    report = verify(out, engine="sglang", smoke=False)
    assert not report.passed
    assert any(f.tensor == name and "expected [256, 1]" in f.message for f in report.findings)


def test_the_in_process_engine_quantizes_each_tokens_input_as_the_engine_does(llama, tmp_path):
    """SGLang 0.5.23's per-token kernel (jit/csrc/gemm/per_token_quant_fp8.cuh:41-64): absmax / 448 in FP32, times the
    reciprocal, clamped, cast; a zero token stays zero. The hf engine applies it to the input of every Linear the
    scheme quantizes per token (all 14 here; lm_head is left alone), so its logits move."""
    from quantkit.evaluation.activations import activation_hooks, fake_quantize_per_token
    from quantkit.modeling import load_model

    x = (torch.randn(3, 5, 64) * torch.linspace(0.01, 30, 64)).to(torch.bfloat16)
    x[1, 2] = 0
    scale = x.float().abs().amax(-1, keepdim=True) / 448
    want = ((x.float() * torch.where(scale == 0, 0, 1 / scale)).clamp(-448, 448).to(torch.float8_e4m3fn).float()
            * scale).to(torch.bfloat16)
    assert torch.equal(fake_quantize_per_token(x), want) and not fake_quantize_per_token(x)[1, 2].any()

    out = tmp_path / "out"
    convert(llama, out, RECIPE, device="cpu")
    model = load_model(out, torch.float32)
    ids = torch.randint(2, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with activation_hooks(model, open_checkpoint(out)) as hooked:
            emulated = model(input_ids=ids).logits
        again = model(input_ids=ids).logits
    assert hooked == 14
    assert not torch.equal(plain, emulated) and torch.equal(plain, again)  # the hooks go with the context
    with activation_hooks(load_model(llama), open_checkpoint(llama)) as none:
        assert none == 0  # a checkpoint without the scheme is not touched
