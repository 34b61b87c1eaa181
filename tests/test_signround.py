"""SignRound (AutoRound) recipes: streamed layer by layer, equal to llm-compressor's own oneshot to the bit where
oneshot does what the recipe says, resumable after a kill, asymmetric with AutoRound's own zero points, and on MoE
experts tuned inside their layer."""

import json
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from conftest import tree_bytes
from helpers import (
    add_word_tokenizer,
    first_layers,
    held_out_batches,
    mlp_output_errors,
    perplexity,
    signround_recipe,
    stop_after_first_layer,
)
from safetensors.torch import load_file

from quantkit.calibration_data import DEFAULT_DATA, calibration_batches, model_tokenizer
from quantkit.convert import convert
from quantkit.convert.calibrated.walk import WORK_DIR
from quantkit.examples.synthetic import build_synthetic
from quantkit.formats import int4
from quantkit.formats.recipe import load_recipe
from quantkit.packaged import recipes_dir

SHIPPED = "dense-mlp-w4a16-signround-g32"



@contextmanager
def autoround_told_what_the_recipe_leaves_unquantized():
    """llm-compressor 0.14's AutoRoundModifier names only targeted Linears as unquantized to AutoRound, which then
    rounds every other Linear of the block (an MLP recipe's attention) to INT4 while it tunes, and oneshot saves those
    rounded, as FP32. The peer here gets every Linear its own targets and ignore leave out, so that it runs the
    recipe as written."""
    from compressed_tensors.utils import match_named_modules
    from llmcompressor.modifiers.autoround import AutoRoundModifier

    def unquantized(self, layer):
        targeted = {name for name, _ in match_named_modules(layer, self.resolved_targets, self.ignore)}
        return sorted(n for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear) and n not in targeted)

    original = AutoRoundModifier.get_unquantized_layer_names
    AutoRoundModifier.get_unquantized_layer_names = unquantized
    try:
        yield
    finally:
        AutoRoundModifier.get_unquantized_layer_names = original


def same_bf16_kernels():
    """BF16 matrix products off oneDNN: on a CPU with AMX or AVX-512 BF16, oneDNN's kernels round by shape, and
    quantkit and the peer shape the same products differently (seen 2026-12-07: layer 3 of 8 differed); without it
    both take the path a CPU without native BF16 takes, where equal arithmetic gives equal bits."""
    return torch.backends.mkldnn.flags(enabled=False)


def peer_oneshot(model_dir: Path, recipe: Path, out: Path) -> dict[str, torch.Tensor]:
    """llm-compressor's oneshot with the same recipe and token sequences, saved compressed; its tensors. Its
    attention is the source's, to the bit (what the recipe says and quantkit writes)."""
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM

    rec = load_recipe(recipe)
    cal = rec.calibration
    rows = [json.loads(line)["input_ids"] for line in Path(cal.dataset).read_text().splitlines()]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    source = {n: p.detach().clone() for n, p in model.named_parameters() if "self_attn" in n}
    with autoround_told_what_the_recipe_leaves_unquantized():
        oneshot(model=model, dataset=Dataset.from_dict({"input_ids": rows,
                                                        "attention_mask": [[1] * cal.seq_len] * len(rows)}),
                recipe=str(recipe), num_calibration_samples=cal.samples, max_seq_length=cal.seq_len,
                shuffle_calibration_samples=False, batch_size=1, pipeline="sequential")
    tuned = dict(model.named_parameters())
    assert all(torch.equal(tuned[n].to(w.dtype), w) for n, w in source.items())
    model.save_pretrained(out, save_compressed=True)
    return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.fixture(scope="module")
def llama(synthetic, tmp_path_factory):
    """The synthetic Llama in BF16 with a tokenizer (llm-compressor's oneshot needs one)."""
    root = tmp_path_factory.mktemp("signround")
    model = build_synthetic("llama", root / "bf16", seed=1, fp8=False, num_hidden_layers=3)
    return add_word_tokenizer(model)


def test_weights_equal_llm_compressor_oneshot_autoround(llama, tmp_path):
    recipe = signround_recipe(tmp_path)
    result = convert(llama, tmp_path / "ours", recipe, device="cpu")
    assert result.calibrated.weights_by_method == {"signround": 9}
    assert [r["method"] for r in result.calibrated.layers] == ["signround"] * 3
    assert all(r["loss"] > 0 and "tune" in r["phases"] for r in result.calibrated.layers)
    mine = {k: v for f in sorted((tmp_path / "ours").glob("*.safetensors")) for k, v in load_file(f).items()}
    theirs = peer_oneshot(llama, recipe, tmp_path / "peer")
    quantized = [n for n in mine if n.endswith(("weight_packed", "weight_scale"))]
    assert len(quantized) == 18
    for name in quantized:
        assert torch.equal(mine[name], theirs[name]), name
    rtn = convert(llama, tmp_path / "rtn", "dense-mlp-w4a16-g32", device="cpu")
    assert rtn.output_bytes == result.output_bytes  # the same format: SignRound changes values, not layout
    manifest = json.loads((tmp_path / "ours" / "quantkit-manifest.json").read_text())
    assert {r["method"] for r in manifest["calibrated_modules"].values()} == {"signround"}


def test_a_kill_between_layers_then_resume_gives_the_same_bytes(llama, tmp_path):
    """A resume's fault gives other bytes on every try. Tried twice: on an AVX-512 host with AMX (2026-12-08), 5 of
    some 120 fresh processes in one half hour tuned the same layers to other bits (the best step's loss 1e-4 off at
    the first layer, the last layer's weights half different), none of some 300 after it; the cause was not found
    (neither the hash seed alone, nor oneDNN's ISA, a busy CPU or auto-round's BF16 check gave those bits).
    docs/int4-methods.md says so."""
    recipe = signround_recipe(tmp_path, iters=8)
    convert(llama, tmp_path / "reference", recipe, device="cpu")
    want = tree_bytes(tmp_path / "reference")
    got = _killed_after_a_layer_then_resumed(llama, recipe, tmp_path / "dst")
    if got != want:
        got = _killed_after_a_layer_then_resumed(llama, recipe, tmp_path / "dst-again")
    assert got == want


def _killed_after_a_layer_then_resumed(llama: Path, recipe: Path, dst: Path) -> dict[str, bytes]:
    args = [sys.executable, "-m", "quantkit", "convert", str(llama), str(dst), "-r", str(recipe), "--device", "cpu",
            "--json"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if json.loads((dst / "quantkit-manifest.json").read_text())["calibrated_layers"]:
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.01)
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the conversion ended before it could be killed"
    assert any(dst.glob(f"{WORK_DIR}/q-input-*.safetensors"))  # what the next layer's tuning starts from
    done = subprocess.run(args + ["--resume"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    layers = json.loads(done.stdout)["calibrated"]["layers"]
    assert layers[0]["reused"] and not layers[-1]["reused"]
    return tree_bytes(dst)


def test_asymmetric_groups_keep_autorounds_own_zero_points(llama, tmp_path, monkeypatch):
    """symmetric: false tunes a zero point per group with the rounding. The weights quantkit writes dequantize to
    AutoRound's own tuned weights, with oneshot's scales. oneshot itself (llm-compressor 0.14) hands compressed-tensors
    only AutoRound's scales: its zero points stay 0 and a group whose AutoRound zero point is not 8 is clamped at one
    end. The day the peer keeps them, its output should equal quantkit's, and this test says so."""
    import quantkit.convert.calibrated.signround as signround

    tuned = {}
    real = signround.autoround_libraries

    def recording():
        wrapper_block, quantize = real()

        def spy(x, scale, zero_point, args, dtype):  # x: AutoRound's tuned (quantized-dequantized) weight
            tuned[len(tuned)] = x.clone()
            return quantize(x=x, scale=scale, zero_point=zero_point, args=args, dtype=dtype)
        return wrapper_block, spy

    monkeypatch.setattr(signround, "autoround_libraries", recording)
    recipe = signround_recipe(tmp_path, base="dense-mlp-w4a16-signround-asym-g32")
    result = convert(llama, tmp_path / "ours", recipe, device="cpu")
    assert result.calibrated.weights_by_method == {"signround": 9}
    mine = {k: v for f in sorted((tmp_path / "ours").glob("*.safetensors")) for k, v in load_file(f).items()}
    theirs = peer_oneshot(llama, recipe, tmp_path / "peer")
    modules = sorted(n.removesuffix(".weight_packed") for n in mine if n.endswith(".weight_packed"))
    assert len(modules) == len(tuned) == 9

    # one of AutoRound's tuned weights, up to the scale's BF16 rounding and, on a CPU with native BF16, AutoRound's own
    # BF16 rounding of its product (seen on an AMX host: 5,939 of 131,072 elements past 2^-8, e.g. -0.036530 against
    # -0.036377); the peer's clamped groups are whole steps off
    def autorounds(weight: torch.Tensor) -> bool:
        return any(w.shape == weight.shape and torch.allclose(weight, w.float(), rtol=2**-7, atol=0)
                   for w in tuned.values())

    for module in modules:
        assert torch.equal(mine[f"{module}.weight_scale"], theirs[f"{module}.weight_scale"]), module
        assert autorounds(_dequantized(mine, module)), module
        assert not int4.unpack_zero_point(theirs[f"{module}.weight_zero_point"], 1 << 16).any()  # all 0
        assert not autorounds(_dequantized(theirs, module)), module  # clamped where AutoRound's zero point is not 8
    rtn = convert(llama, tmp_path / "rtn", "dense-mlp-w4a16-asym-g32", device="cpu")
    assert rtn.output_bytes == result.output_bytes
    written = json.loads((tmp_path / "ours" / "config.json").read_text())["quantization_config"]
    assert written == json.loads((tmp_path / "rtn" / "config.json").read_text())["quantization_config"]


def _dequantized(tensors: dict, module: str) -> torch.Tensor:
    out, inn = tensors[f"{module}.weight_shape"].tolist()
    scale = tensors[f"{module}.weight_scale"].float()
    zero = int4.unpack_zero_point(tensors[f"{module}.weight_zero_point"], out)
    return int4.dequantize_int4(int4.unpack_int4(tensors[f"{module}.weight_packed"], (out, inn)), scale,
                                inn // scale.shape[1], zero)


@pytest.fixture(scope="module")
def glm5(tmp_path_factory):
    """The synthetic GLM-5 in BF16 (a dense layer, two MoE layers of 8 routed experts, an MTP layer) with a
    tokenizer."""
    root = tmp_path_factory.mktemp("signround-moe")
    return add_word_tokenizer(build_synthetic("glm_moe_dsa", root / "bf16", seed=1, fp8=False))


@contextmanager
def autoround_without_layer_index_rules():
    """auto-round's own ignore rules for glm_moe_dsa name the first dense layers' MLPs by index (``layers.0.mlp``);
    llm-compressor hands AutoRound each decoder layer as ``model.layers.0``, so the rule leaves every layer's experts
    unquantized in oneshot too. The peer here runs without such rules, as quantkit does."""
    import re

    from auto_round.compressors import base

    real = base.get_predefined_ignore_layers
    base.get_predefined_ignore_layers = lambda model: [n for n in real(model) if not re.search(r"layers\.\d", n)]
    try:
        yield
    finally:
        base.get_predefined_ignore_layers = real


def moe_peer(model: Path, recipe: Path) -> dict[str, torch.Tensor]:
    """oneshot (which linearizes MoE experts itself) with the same recipe and tokens; each tuned expert weight packed
    with compressed-tensors' quantize, as llm-compressor compresses it."""
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM

    cal = load_recipe(recipe).calibration
    rows = [json.loads(line)["input_ids"] for line in Path(cal.dataset).read_text().splitlines()]
    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    data = Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * cal.seq_len] * len(rows)})
    with autoround_told_what_the_recipe_leaves_unquantized(), autoround_without_layer_index_rules():
        oneshot(model=net, dataset=data, recipe=str(recipe), num_calibration_samples=cal.samples,
                max_seq_length=cal.seq_len, shuffle_calibration_samples=False, batch_size=1, pipeline="sequential")
    out = {}
    for name, module in net.named_modules():
        if ".experts." in name and hasattr(module, "weight_scale"):
            q = quantize(x=module.weight.detach(), scale=module.weight_scale.detach(), zero_point=None,
                         args=module.quantization_scheme.weights, dtype=torch.int8)
            out[f"{name}.weight_packed"] = int4.pack_int4(q)
            out[f"{name}.weight_scale"] = module.weight_scale.detach().to(torch.bfloat16)
    return out


@pytest.mark.parametrize("family", ["glm_moe_dsa", "deepseek_v3"])
def test_moe_experts_are_tuned_inside_their_layer_as_oneshot_tunes_them(glm5, tmp_path, family):
    """Each routed expert becomes Linears by llm-compressor's own linearize and is tuned with its layer. At one step
    the packed experts equal oneshot's (with the two peer fixes above): AutoRound keeps the best of its steps, here
    the rounding it starts from, so this holds the names, targets, scales and layout equal, not the tuning (at 4
    steps 36 of the 48 differ: docs/int4-methods.md). The MTP layer's experts, which the calibration forward does not
    reach, stay round-to-nearest."""
    model = glm5 if family == "glm_moe_dsa" else add_word_tokenizer(
        build_synthetic(family, tmp_path / "bf16", seed=1, fp8=False))
    prefix = {"glm_moe_dsa": "glm5", "deepseek_v3": "deepseek-v3"}[family]
    recipe = signround_recipe(tmp_path, base=f"{prefix}-int4-experts-signround-g32", iters=1)
    result = convert(model, tmp_path / "ours", recipe, device="cpu")
    assert result.calibrated.weights_by_method == {"signround": 2 * 8 * 3, "rtn": 8 * 3}
    assert [layer["layer"] for layer in result.calibrated.layers] == [1, 2]
    mine = {k: v for f in sorted((tmp_path / "ours").glob("*.safetensors")) for k, v in load_file(f).items()}
    theirs = moe_peer(model, recipe)
    assert len(theirs) == 2 * 2 * 8 * 3
    different = [n for n in theirs if not torch.equal(mine[n], theirs[n])]
    assert not different, different[:5]
    rtn = convert(model, tmp_path / "rtn", f"{prefix}-int4-experts-g32", device="cpu")
    assert rtn.output_bytes == result.output_bytes


def test_tuned_experts_move_the_models_output_less_than_round_to_nearest(glm5, tmp_path):
    """What the tuning is for, on tokens it did not see: the whole model's next-token distribution moves less from
    the source's with the tuned experts than with round-to-nearest's."""
    from quantkit.modeling import load_model

    recipe = signround_recipe(tmp_path, samples=8, base="glm5-int4-experts-signround-g32", iters=40)
    tuned = convert(glm5, tmp_path / "tuned", recipe, device="cpu")
    assert tuned.calibrated.weights_by_method["signround"] == 48
    convert(glm5, tmp_path / "rtn", "glm5-int4-experts-g32", device="cpu")
    held_out = torch.randint(2, 512, (4, 64), generator=torch.Generator().manual_seed(7))

    def log_probs(model: Path) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(load_model(model, dtype=torch.float32)(input_ids=held_out).logits, -1)

    source = log_probs(glm5)
    kl = {name: float((source.exp() * (source - log_probs(tmp_path / name))).sum(-1).mean())
          for name in ("tuned", "rtn")}
    assert kl["tuned"] < kl["rtn"], kl


def test_experts_tuned_in_groups_that_fit_a_budget(glm5, tmp_path, monkeypatch):
    """A budget too small for every expert's tuning state at once tunes each MoE layer's experts in groups, each
    against the layer's full-precision output with the other experts held: the model still moves less than with
    round-to-nearest, about as little as with all experts in one group, and the groups are reported."""
    from quantkit.convert.calibrated import memory
    from quantkit.modeling import load_model

    recipe = signround_recipe(tmp_path, samples=8, base="glm5-int4-experts-signround-g32", iters=40)
    whole = convert(glm5, tmp_path / "whole", recipe, device="cpu")
    monkeypatch.setattr(memory.Budget, "of", classmethod(lambda cls, device, spec=None: cls(device, 8 * 2**20)))
    layers = []
    grouped = convert(glm5, tmp_path / "grouped", recipe, device="cpu", on_layer=lambda r, n: layers.append(r))
    assert [r.expert_groups for r in layers] == [4, 4]  # 8 experts, 2 a group
    assert grouped.calibrated.weights_by_method == whole.calibrated.weights_by_method == {"signround": 48,
                                                                                                "rtn": 24}
    convert(glm5, tmp_path / "rtn", "glm5-int4-experts-g32", device="cpu")
    held_out = torch.randint(2, 512, (4, 64), generator=torch.Generator().manual_seed(7))

    def log_probs(model: Path) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(load_model(model, dtype=torch.float32)(input_ids=held_out).logits, -1)

    source = log_probs(glm5)
    kl = {name: float((source.exp() * (source - log_probs(tmp_path / name))).sum(-1).mean())
          for name in ("whole", "grouped", "rtn")}
    assert kl["grouped"] < kl["rtn"], kl
    assert kl["grouped"] < 1.1 * kl["whole"], kl


def test_a_moe_run_stopped_after_a_layer_resumes_to_the_same_bytes(glm5, tmp_path):
    """GLM-5's layers hand the next one their DSA top-k indices too: the saved quantized outputs hold them. With the
    shipped recipes' ``experts: routed`` (each expert computes only the tokens the router sends it)."""
    recipe = signround_recipe(tmp_path, base="glm5-int4-experts-signround-g32", iters=4)
    recipe.write_text(recipe.read_text().replace("quant_stage:", "  experts: routed\nquant_stage:", 1))
    assert load_recipe(recipe).calibration.experts == "routed"
    reference = convert(glm5, tmp_path / "reference", recipe, device="cpu")
    assert reference.calibrated.weights_by_method["signround"] == 48
    dst = tmp_path / "dst"
    stop_after_first_layer(glm5, dst, recipe)
    saved = load_file(str(dst / WORK_DIR / "q-input-00001.safetensors"))
    assert any(n.startswith("q_input.prev_topk_indices.") for n in saved)
    seen = []
    convert(glm5, dst, recipe, device="cpu", resume=True, on_layer=lambda r, n: seen.append((r.layer, r.reused)))
    assert seen == [(1, True), (2, False)]
    assert tree_bytes(dst) == tree_bytes(tmp_path / "reference")


def test_recipe_settings_are_the_modifiers(tmp_path):
    from llmcompressor.modifiers.autoround import AutoRoundModifier

    rec = load_recipe("dense-mlp-w4a16-signround-g32")
    theirs = AutoRoundModifier(iters=200, batch_size=8, enable_torch_compile=False)
    assert (rec.calibrated.iters, rec.calibrated.batch_size, rec.calibrated.lr) == (theirs.iters, theirs.batch_size,
                                                                                      theirs.lr)
    assert rec.algorithm == "signround" and rec.calibration.samples == 64
    bare = tmp_path / "bare.yaml"
    bare.write_text("quant_stage:\n  quant_modifiers:\n    AutoRoundModifier:\n      scheme: W4A16\n      "
                    "targets: [Linear]\n")
    default = load_recipe(bare).calibrated
    peer = AutoRoundModifier(scheme="W4A16", targets=["Linear"])
    assert (default.iters, default.batch_size, default.lr, default.enable_torch_compile) == (
        peer.iters, peer.batch_size, peer.lr, peer.enable_torch_compile)


@pytest.mark.slow
def test_weights_equal_llm_compressor_oneshot_on_smollm2(smollm2_bf16, tmp_path):
    """The real model's first 8 layers of 30, each tuned on the outputs of the ones before it as in the whole model
    (a few tuning steps on a few sequences keep it to a minute on a CPU)."""
    recipe = signround_recipe(tmp_path, samples=4, seq_len=64, iters=2, batch_size=2)
    model = first_layers(smollm2_bf16, tmp_path / "smollm2", 8)
    with same_bf16_kernels():
        convert(model, tmp_path / "ours", recipe, device="cpu")
        theirs = peer_oneshot(model, recipe, tmp_path / "peer")
    mine = {k: v for f in sorted((tmp_path / "ours").glob("*.safetensors")) for k, v in load_file(f).items()}
    quantized = [n for n in mine if n.endswith(("weight_packed", "weight_scale"))]
    assert len(quantized) == 2 * 3 * 8
    different = [n for n in quantized if not torch.equal(mine[n], theirs[n])]
    assert not different, different[:5]


def test_autoround_leaves_alone_what_the_recipe_does_not_quantize(llama, tmp_path, monkeypatch):
    """llm-compressor 0.14 tells AutoRound only of targeted Linears without a scheme, so AutoRound rounded an MLP
    recipe's attention to INT4 while it tuned the MLP against it (SmolLM2, 2 layers, 200 steps: held-out KL 0.0088,
    0.0048 once told; docs/int4-methods.md). quantkit marks only the recipe's targets: auto-round's wrapper tunes
    those and leaves every other Linear of the block as it is."""
    import auto_round.wrapper

    wrapped = []
    real = auto_round.wrapper.wrapper_block

    def recording(block, *args, **kwargs):
        tuned, untouched = real(block, *args, **kwargs)
        wrapped.append((set(tuned), set(untouched)))
        return tuned, untouched

    monkeypatch.setattr(auto_round.wrapper, "wrapper_block", recording)
    convert(llama, tmp_path / "ours", signround_recipe(tmp_path, iters=1), device="cpu")
    attention = {f"self_attn.{p}_proj" for p in "qkvo"}
    mlp = {f"mlp.{p}_proj" for p in ("gate", "up", "down")}
    assert wrapped == [(mlp, attention)] * 3


def users_oneshot(model: Path, recipe: Path, rows: list[list[int]], out: Path, device: str) -> None:
    """llm-compressor's oneshot as its users run it: the model on DEVICE, the recipe file as written, these token
    sequences in this order; saved compressed."""
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).to(device)
    data = Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]})
    oneshot(model=net, dataset=data, recipe=str(recipe), num_calibration_samples=len(rows), max_seq_length=len(rows[0]),
            shuffle_calibration_samples=False, batch_size=1, pipeline="sequential")
    net.save_pretrained(out, save_compressed=True)
    model_tokenizer(model).save_pretrained(out)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on a GPU machine)")
def test_the_shipped_recipe_on_a_gpu_is_as_good_as_llm_compressors_oneshot(smollm2_bf16, tmp_path):
    """What users run: the shipped recipe at its own settings (200 steps per layer, 64 x 256 tokens) on all 30 layers
    of the real SmolLM2 on a GPU, beside llm-compressor's oneshot with the same recipe file and tokens. Scored on
    held-out GSM8K test text by transformers' own loading: perplexity within 1 % of oneshot's (the code before
    81bbc26 measured 7.40 against oneshot's 6.42), and per layer the MLP's output error no worse than oneshot's by
    more than oneshot's own run-to-run spread (measured: oneshot again on the first 4 layers with the calibration
    sequences in reverse order, which changes the batches AutoRound draws). On the GPU machine:
    ``. engines/sglang-gpu-env.sh .gpu/sglang.tar.xz && . engines/llmcompressor-gpu-env.sh``."""
    cal = load_recipe(SHIPPED).calibration
    rows = [b[0].tolist() for b in calibration_batches(DEFAULT_DATA, cal.text_field, cal.samples, cal.seq_len, 1,
                                                       lambda: model_tokenizer(smollm2_bf16), None, require_all=True)]
    ours = convert(smollm2_bf16, tmp_path / "ours", SHIPPED, device="cuda")
    assert ours.calibrated.weights_by_method == {"signround": 90} and ours.devices == ["cuda:0"]
    assert ours.calibrated.settings["iters"] == 200
    recipe = recipes_dir() / f"{SHIPPED}.yaml"
    users_oneshot(smollm2_bf16, recipe, rows, tmp_path / "oneshot", "cuda")
    users_oneshot(first_layers(smollm2_bf16, tmp_path / "cut", 4), recipe, rows[::-1], tmp_path / "again", "cuda")
    convert(smollm2_bf16, tmp_path / "rtn", "dense-mlp-w4a16-g32", device="cuda")
    held_out = held_out_batches(smollm2_bf16)
    ppl = {name: perplexity(smollm2_bf16 if name == "source" else tmp_path / name, held_out, "cuda")
           for name in ("source", "rtn", "oneshot", "ours")}
    errors = {name: mlp_output_errors(smollm2_bf16, tmp_path / name, held_out, "cuda") for name in ("ours", "oneshot")}
    again = mlp_output_errors(tmp_path / "cut", tmp_path / "again", held_out, "cuda")
    spread = max(abs(a - b) / a for a, b in zip(errors["oneshot"], again, strict=False))  # the cut's 4 layers
    print(f"held-out perplexity: {ppl}; RTN damage removed: quantkit "
          f"{(ppl['rtn'] - ppl['ours']) / (ppl['rtn'] - ppl['source']):.0%}, oneshot "
          f"{(ppl['rtn'] - ppl['oneshot']) / (ppl['rtn'] - ppl['source']):.0%}; oneshot's spread {spread:.2%}")
    for i, (mine, theirs) in enumerate(zip(errors["ours"], errors["oneshot"], strict=True)):
        print(f"layer {i}: MLP output error quantkit {mine:.5f}, oneshot {theirs:.5f}")
    assert ppl["ours"] <= 1.01 * ppl["oneshot"]
    worse = [i for i, (mine, theirs) in enumerate(zip(errors["ours"], errors["oneshot"], strict=True))
             if mine > theirs * (1 + spread)]
    assert not worse, f"layers {worse}: MLP output error above oneshot's beyond its run-to-run spread ({spread:.2%})"


def test_a_group_out_of_memory_is_tuned_again_in_halves_with_its_memory_given_back(glm5, tmp_path, monkeypatch):
    """The plan's estimate can be short: the group is tuned again in halves, and by then nothing of the failed
    attempt is still held (its tensors go back to the cache, and the cache to the device, before the halves)."""
    import weakref

    from quantkit.convert.calibrated.signround import _ExpertGroups

    tune_group = _ExpertGroups._tune_group
    held: list = []
    sizes: list[int] = []

    def short_of_memory(self, group, parts, reference):
        sizes.append(len(group))
        assert all(ref() is None for ref in held), "the failed group's tensors are still held"
        if len(group) == 8:
            state = torch.ones(1024)  # what a failing tuning step holds when it runs out
            held.append(weakref.ref(state))
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.47 GiB.")
        return tune_group(self, group, parts, reference)

    monkeypatch.setattr(_ExpertGroups, "_tune_group", short_of_memory)
    layers = []
    result = convert(glm5, tmp_path / "sr", signround_recipe(tmp_path, base="glm5-int4-experts-signround-g32"),
                     device="cpu", on_layer=lambda r, n: layers.append(r))
    assert sizes == [8, 4, 4] * 2 and [r.expert_groups for r in layers] == [2, 2]
    assert result.calibrated.weights_by_method == {"signround": 48, "rtn": 24}
