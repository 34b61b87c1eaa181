"""GPTQ: llm-compressor's own algorithm, streamed one decoder layer at a time.

The weights equal llm-compressor oneshot(GPTQModifier)'s to the bit on the real SmolLM2; on
synthetic GLM-5 and DeepSeek-V3 checkpoints GPTQ lowers every MoE layer's output error on
held-out tokens below round-to-nearest's; an expert the router never picks is handled as the
recipe says and recorded; a run killed after any layer resumes to the same bytes; the output
has the RTN recipe's format exactly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import first_layers, revise_in_place, stop_after_first_layer
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from quantkit.checkpoint.manifest import load_manifest
from quantkit.checkpoint.reader import open_checkpoint
from quantkit.convert import DifferentRun, calibration_batches, convert
from quantkit.convert.calibrated.walk import LEGACY_WORK_DIR, WORK_DIR
from quantkit.errors import QuantkitError
from quantkit.examples.synthetic import build_synthetic
from quantkit.formats.recipe import load_recipe
from quantkit.layerwise import layer_output_errors
from quantkit.packaged import recipes_dir
from tests.conftest import tree_bytes

RTN_FOR = {"glm_moe_dsa": "glm5-int4-experts-g32", "deepseek_v3": "deepseek-v3-int4-experts-g32"}
GPTQ_FOR = {"glm_moe_dsa": "glm5-int4-experts-gptq-g32", "deepseek_v3": "deepseek-v3-int4-experts-gptq-g32"}
UNROUTED = ("model.layers.1.mlp.gate.e_score_correction_bias", 5)  # the router bias that keeps expert 5 away


def small_recipe(tmp: Path, base: str, name: str, **calibration) -> Path:
    """A built-in GPTQ recipe with its quantkit_calibration replaced (samples, seq_len, dataset, experts...)."""
    text = (recipes_dir() / f"{base}.yaml").read_text()
    head, _, rest = text.partition("quantkit_calibration:\n")
    body = rest[rest.index("quant_stage:"):]
    lines = "".join(f"  {k}: {v}\n" for k, v in calibration.items())
    path = tmp / f"{name}.yaml"
    path.write_text(f"{head}quantkit_calibration:\n{lines}{body}")
    return path


def token_file(path: Path, rows: int, length: int, seed: int, vocab: int = 512) -> Path:
    gen = torch.Generator().manual_seed(seed)
    path.write_text("".join(json.dumps({"input_ids": torch.randint(2, vocab, (length,), generator=gen).tolist()}) + "\n"
                            for _ in range(rows)))
    return path


def load_all(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


# --- equality with the peer ------------------------------------------------------------------

LAYERS = 8  # of SmolLM2's 30, for the equality with oneshot


@pytest.mark.slow
def test_weights_equal_llm_compressor_oneshot_on_smollm2(smollm2_bf16, tmp_path):
    """The real model's first 8 layers (of 30: each layer is quantized from the outputs of the ones before it, as in
    the whole model) and real calibration text, to the bit."""
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM

    smollm2_bf16 = first_layers(smollm2_bf16, tmp_path / "smollm2-8", LAYERS)
    samples, seq_len = 16, 128
    recipe = small_recipe(tmp_path, "dense-mlp-w4a16-gptq-g32", "r", samples=samples, seq_len=seq_len)
    # in BF16, as oneshot computes the model it loads in BF16 (auto computes in FP32 on a CPU slow at BF16)
    ours = convert(smollm2_bf16, tmp_path / "ours", recipe, device="cpu", dtype="bf16")
    assert ours.calibrated.weights_by_method == {"gptq": 3 * LAYERS} and ours.calibrated.computed_in == "bfloat16"

    batches = calibration_batches(open_checkpoint(smollm2_bf16), load_recipe(recipe), None)
    # llm-compressor's LengthAwareSampler visits equal-length samples in torch.argsort(descending=True)'s
    # order, which is not the identity; lay the dataset out so that it visits ours (the Hessians are
    # fp32 sums, so the order of the samples shows in the last bits)
    order = torch.argsort(torch.tensor([seq_len] * samples), descending=True).tolist()
    rows = [None] * samples
    for k, j in enumerate(order):
        rows[j] = batches[k][0].tolist()
    model = AutoModelForCausalLM.from_pretrained(smollm2_bf16, dtype=torch.bfloat16)
    oneshot(model=model, dataset=Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * seq_len] * samples}),
            recipe=str(recipe), num_calibration_samples=samples, max_seq_length=seq_len,
            shuffle_calibration_samples=False, batch_size=1, pipeline="sequential")
    model.save_pretrained(tmp_path / "peer", save_compressed=True)

    mine, theirs = load_all(tmp_path / "ours"), load_all(tmp_path / "peer")
    assert set(mine) == set(theirs)
    packed = [n for n in mine if n.endswith("weight_packed")]
    assert len(packed) == 3 * LAYERS
    for name in mine:
        assert torch.equal(mine[name], theirs[name]), name


@pytest.mark.parametrize("actorder", [None, "static", "weight"])
@pytest.mark.parametrize("hessian", ["positive definite, one dead column", "not positive definite"])
def test_weights_sharing_a_hessian_quantize_as_llm_compressors_quantize_weight_given_a_copy_each(actorder, hessian):
    """quantize_sharing_hessian (a GPU node's path for experts: all) orders and factorizes the one Hessian once;
    llm-compressor's quantize_weight, given a copy per weight, gives the same weights, losses and fallbacks to the
    bit (on a CPU, where both factorize item by item)."""
    from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight

    from quantkit.convert.calibrated.gptq_shared_hessian import quantize_sharing_hessian
    from quantkit.formats import int4
    from quantkit.formats.quant_config import QuantizationArgs

    gen = torch.Generator().manual_seed(0)
    ws = torch.randn(5, 48, 256, generator=gen)
    if hessian == "not positive definite":
        h = -torch.eye(256)
    else:
        x = torch.randn(512, 256, generator=gen) * torch.linspace(0.1, 3, 256)
        h = x.t() @ x / 512
        h[:, 7] = h[7, :] = 0  # an input channel the calibration never moved
    scale = torch.stack([int4.quantize_int4(w, 32)[1] for w in ws])
    zp = torch.zeros_like(scale, dtype=torch.int8)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32,
                            actorder=actorder).to_compressed_tensors()
    want = quantize_weight(ws.clone(), h.expand(5, -1, -1).clone(), scale, zp, None, args, blocksize=64, percdamp=0.01)
    got = quantize_sharing_hessian(ws.clone(), h, scale, zp, args, blocksize=64, percdamp=0.01)
    for name, w, g in zip(("weights", "losses", "fallbacks"), want, got):
        assert torch.equal(w, g), name
    assert bool(got[2].all()) == (hessian == "not positive definite")


# --- MoE: synthetic GLM-5 and DeepSeek-V3 ------------------------------------------------------

@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory):
    """Per family: a block-FP8 source whose layer-1 router never picks expert 5, converted with RTN, GPTQ
    (experts: all) and GPTQ (experts: routed); plus held-out tokens."""
    runs = {}
    for family in RTN_FOR:
        root = tmp_path_factory.mktemp(family)
        src = build_synthetic(family, root / "src", seed=3)
        name, expert = UNROUTED
        shard = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][name]
        tensors = load_file(src / shard)
        tensors[name][expert] = -1e4
        save_file(tensors, src / shard, {"format": "pt"})
        data = token_file(root / "calibration.jsonl", 96, 64, seed=0)
        runs[family] = {"src": src, "root": root, "rtn": root / "rtn"}
        convert(src, root / "rtn", RTN_FOR[family], device="cpu")
        for mode in ("all", "routed"):
            recipe = small_recipe(root, GPTQ_FOR[family], mode, dataset=data, samples=96, seq_len=64, experts=mode,
                                  min_expert_tokens=16)
            runs[family][mode] = root / mode
            runs[family][f"{mode}-result"] = convert(src, root / mode, recipe, device="cpu")
            runs[family][f"{mode}-recipe"] = recipe
    return runs


@pytest.mark.parametrize("mode,limit", [("routed", 2_000_000), ("all", 1_470_000)])
def test_experts_worked_in_groups_that_fit_a_budget_give_the_same_bytes(moe_runs, tmp_path, monkeypatch, mode, limit):
    """A GPU memory budget too small for every expert's Hessians at once splits each MoE layer's experts into groups,
    each summed from the layer's kept inputs, quantized and freed before the next: the same Hessians, in the same
    order, so the same bytes as all experts at once. (On a CPU a budget only sizes the groups: what the walk holds
    there is not counted.)"""
    from quantkit.convert.calibrated import memory

    run = moe_runs["glm_moe_dsa"]
    monkeypatch.setattr(memory.Budget, "of", classmethod(lambda cls, device, spec=None: cls(device, limit)))
    layers = []
    convert(run["src"], tmp_path / "grouped", run[f"{mode}-recipe"], device="cpu",
            on_layer=lambda report, n: layers.append(report))
    assert [r.expert_groups for r in layers] == [3, 3]  # 8 experts: 3 + 3 + 2
    assert tree_bytes(tmp_path / "grouped") == tree_bytes(run[mode])


@pytest.mark.slow
@pytest.mark.parametrize("family", list(RTN_FOR))
def test_gptq_lowers_every_moe_layers_held_out_error_below_rtn(moe_runs, family):
    run = moe_runs[family]
    gen = torch.Generator().manual_seed(99)  # not the calibration tokens
    held_out = [torch.randint(2, 512, (1, 64), generator=gen) for _ in range(8)]
    source = open_checkpoint(run["src"])
    rtn = layer_output_errors(source, open_checkpoint(run["rtn"]), held_out)
    gptq = layer_output_errors(source, open_checkpoint(run["all"]), held_out)
    assert rtn[0] == gptq[0] == 0.0  # layer 0 is dense: nothing targeted
    for layer in range(1, len(rtn)):
        assert gptq[layer] < 0.9 * rtn[layer], (layer, gptq, rtn)


@pytest.mark.parametrize("family", list(RTN_FOR))
def test_an_expert_no_token_reaches_is_handled_as_configured_and_recorded(moe_runs, family):
    run = moe_runs[family]
    expert = f"model.layers.1.mlp.experts.{UNROUTED[1]}"
    routed = load_manifest(run["routed"]).calibrated_modules
    everyone = load_manifest(run["all"]).calibrated_modules
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert routed[f"{expert}.{proj}"].method == "rtn"
        assert routed[f"{expert}.{proj}"].tokens == 0
        assert "0 routed token(s) < min_expert_tokens 16" in routed[f"{expert}.{proj}"].reason
        assert everyone[f"{expert}.{proj}"].method == "gptq"  # every token went through it for the Hessian
        assert everyone[f"{expert}.{proj}"].tokens == 0  # ... and the record still says none was routed to it
    # the RTN fallback is exactly what the RTN recipe writes for that expert
    rtn, fell_back = load_all(run["rtn"]), load_all(run["routed"])
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert torch.equal(rtn[f"{expert}.{proj}.weight_packed"], fell_back[f"{expert}.{proj}.weight_packed"])
    result = run["routed-result"].calibrated
    assert result.expert_tokens[expert] == 0
    assert sum(result.expert_tokens.values()) > 0
    # the MTP layer's experts are outside the forward: RTN, and said so
    assert all(".layers.3." in m for m in result.rtn_outside_calibration) and result.rtn_outside_calibration


@pytest.mark.parametrize("family", list(RTN_FOR))
def test_output_has_the_rtn_recipes_format_exactly(moe_runs, family):
    from quantkit.verify import verify

    run = moe_runs[family]
    rtn, gptq = run["rtn"], run["all"]
    assert not (gptq / WORK_DIR).exists()
    assert json.loads((rtn / "config.json").read_text()) == json.loads((gptq / "config.json").read_text())
    assert json.loads((rtn / "model.safetensors.index.json").read_text()) == \
        json.loads((gptq / "model.safetensors.index.json").read_text())
    a, b = load_all(rtn), load_all(gptq)
    changed = 0
    for name in a:
        assert (a[name].dtype, a[name].shape) == (b[name].dtype, b[name].shape), name
        if name.endswith(("weight_scale", "weight_shape")) or not name.endswith("weight_packed"):
            assert torch.equal(a[name], b[name]), name  # GPTQ keeps RTN's scales; untargeted tensors are RTN's
        else:
            changed += not torch.equal(a[name], b[name])
    assert changed > 0
    report = verify(gptq, source=run["src"], smoke=False)
    assert report.passed, report.findings


def test_resume_after_a_kill_at_any_layer_redoes_no_finished_layer_and_gives_the_same_bytes(moe_runs, tmp_path):
    run = moe_runs["glm_moe_dsa"]
    recipe = run["all-recipe"]
    dst = tmp_path / "out"
    stop_after_first_layer(run["src"], dst, recipe)
    assert (dst / WORK_DIR / "layer-00001.safetensors").is_file()
    assert not list(dst.glob("model-*.safetensors"))  # no shard before every layer is quantized
    seen = []
    convert(run["src"], dst, recipe, device="cpu", resume=True, on_layer=lambda r, n: seen.append((r.layer, r.reused)))
    assert seen == [(1, True), (2, False)]
    assert tree_bytes(dst) | {"quantkit-manifest.json": b""} == tree_bytes(run["all"]) | {"quantkit-manifest.json": b""}
    ours, theirs = load_manifest(dst), load_manifest(run["all"])
    assert ours.shards == theirs.shards and ours.calibrated_modules == theirs.calibrated_modules


def test_resume_refuses_finished_layers_whose_source_changed_in_place(moe_runs, tmp_path):
    """Layer 1's finished GPTQ came through layer 0: a revision written over layer 0 (same headers) must not be
    resumed into, nor one over layer 1 itself; an untouched source resumes."""
    run = moe_runs["glm_moe_dsa"]
    src = tmp_path / "src"
    shutil.copytree(run["src"], src)
    for part in ("layers.0.", "layers.1."):
        dst = tmp_path / part
        stop_after_first_layer(src, dst, run["all-recipe"])
        assert revise_in_place(src, tensors=part)
        with pytest.raises(DifferentRun, match="decoder layer 1 or one before it"):
            convert(src, dst, run["all-recipe"], device="cpu", resume=True)


def test_a_run_an_older_quantkit_started_resumes_with_its_finished_layers(moe_runs, tmp_path):
    """Before the calibrated walk had one driver, its manifest named the finished layers gptq_layers and
    gptq_modules (for SignRound too) and kept their files in DST/.quantkit-gptq: such a run still resumes."""
    run = moe_runs["glm_moe_dsa"]
    dst = tmp_path / "out"
    stop_after_first_layer(run["src"], dst, run["all-recipe"])
    (dst / WORK_DIR).rename(dst / LEGACY_WORK_DIR)
    manifest = (dst / "quantkit-manifest.json").read_text()
    assert '"calibrated_layers"' in manifest
    (dst / "quantkit-manifest.json").write_text(manifest.replace('"calibrated_layers"', '"gptq_layers"')
                                                .replace('"calibrated_modules"', '"gptq_modules"'))
    seen = []
    convert(run["src"], dst, run["all-recipe"], device="cpu", resume=True,
            on_layer=lambda r, n: seen.append((r.layer, r.reused)))
    assert seen == [(1, True), (2, False)]
    assert not (dst / LEGACY_WORK_DIR).exists() and not (dst / WORK_DIR).exists()
    assert tree_bytes(dst) | {"quantkit-manifest.json": b""} == tree_bytes(run["all"]) | {"quantkit-manifest.json": b""}
    assert load_manifest(dst).calibrated_modules == load_manifest(run["all"]).calibrated_modules


def test_a_layer_file_that_cannot_be_written_stops_the_run_and_is_not_recorded(moe_runs, tmp_path, monkeypatch):
    """A layer's file is written while the next layer is computed; its failure still stops the run, and only the
    layers whose files are whole are in the manifest (a resume redoes the rest)."""
    from quantkit.convert.calibrated import walk

    run, real = moe_runs["glm_moe_dsa"], walk.write_safetensors

    def disk_full_at_layer_2(path, tensors, metadata=None):
        if path.name == "layer-00002.safetensors":
            raise OSError(28, "No space left on device", str(path))
        return real(path, tensors, metadata)

    monkeypatch.setattr(walk, "write_safetensors", disk_full_at_layer_2)
    dst = tmp_path / "out"
    with pytest.raises(OSError, match="No space left"):
        convert(run["src"], dst, run["all-recipe"], device="cpu")
    assert list(load_manifest(dst).calibrated_layers) == ["1"]
    assert sorted(p.name for p in (dst / WORK_DIR).iterdir()) == ["layer-00001.safetensors"]


def test_a_different_calibration_is_a_different_run(moe_runs, tmp_path):
    run = moe_runs["glm_moe_dsa"]
    dst = tmp_path / "out"
    shutil.copytree(run["all"], dst)
    other = token_file(tmp_path / "other.jsonl", 96, 64, seed=5)
    with pytest.raises(QuantkitError, match="calibration data"):
        convert(run["src"], dst, run["all-recipe"], device="cpu", resume=True, calibration_data=other)


def test_the_walks_dtype_changes_the_arithmetic_not_the_format_and_a_resume_keeps_it(synthetic, tmp_path):
    """--dtype: the layers' forwards compute in it; the weights GPTQ starts from and the scales stay the model's, so
    the output has the same tensors, dtypes and shapes, and a weight GPTQ never saw (RTN) the same bytes."""
    src = synthetic["llama"]
    data = token_file(tmp_path / "calibration.jsonl", 8, 64, seed=0)
    recipe = small_recipe(tmp_path, "dense-mlp-w4a16-gptq-g32", "r", dataset=data, samples=8, seq_len=64)
    runs = {d: convert(src, tmp_path / d, recipe, device="cpu", dtype=d) for d in ("bf16", "fp32")}
    assert runs["fp32"].calibrated.computed_in == "float32" and runs["bf16"].calibrated.computed_in == "bfloat16"
    assert load_manifest(tmp_path / "fp32").computed_in == "float32"
    assert load_manifest(tmp_path / "bf16").computed_in is None  # the model's own, as every older manifest
    bf16, fp32 = load_all(tmp_path / "bf16"), load_all(tmp_path / "fp32")
    assert {k: (v.dtype, v.shape) for k, v in bf16.items()} == {k: (v.dtype, v.shape) for k, v in fp32.items()}
    first = "model.layers.0.mlp.gate_proj"  # its Hessian comes from the embeddings alone: equal in both
    assert torch.equal(bf16[f"{first}.weight_scale"], fp32[f"{first}.weight_scale"])
    last = "model.layers.1.mlp.down_proj"
    assert not torch.equal(bf16[f"{last}.weight_packed"], fp32[f"{last}.weight_packed"])  # the arithmetic did change
    with pytest.raises(QuantkitError, match="compute dtype"):
        convert(src, tmp_path / "fp32", recipe, device="cpu", dtype="bf16", resume=True)
    # auto resumed takes what the run started in, whatever a probe would pick now
    again = convert(src, tmp_path / "fp32", recipe, device="cpu", resume=True)
    assert again.shards_written == 0 and again.calibrated.computed_in == "float32"


def test_signround_tunes_in_the_models_dtype_only(synthetic, tmp_path):
    with pytest.raises(QuantkitError, match="SignRound tunes in the model's dtype"):
        convert(synthetic["llama"], tmp_path / "out", "dense-mlp-w4a16-signround-g32", device="cpu", dtype="fp32")
    assert not (tmp_path / "out").exists()


def test_layer_files_carry_each_weights_record(moe_runs, tmp_path):
    run = moe_runs["deepseek_v3"]
    first = stop_after_first_layer(run["src"], tmp_path / "out", run["routed-recipe"])
    with safe_open(str(tmp_path / "out" / WORK_DIR / "layer-00001.safetensors"), framework="pt") as f:
        records = json.loads(f.metadata()["quantkit_calibrated"])
    assert len(records) == 8 * 3 and first.weights == 24
    assert {r["method"] for r in records.values()} == {"gptq", "rtn"}


# --- bad input ---------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "calibration,message",
    [
        ({"dataset": "missing.jsonl"}, "calibration data not found"),
        ({"dataset": "empty.jsonl"}, "calibration data is empty"),
        ({"dataset": "short.jsonl", "samples": 64, "seq_len": 64}, "too short"),
        ({"dataset": "big-ids.jsonl", "samples": 2, "seq_len": 64}, "outside the model's vocabulary"),
        ({"dataset": "short.jsonl", "seq_len": 100000}, "exceeds the model's context"),
    ],
)
def test_bad_calibration_data_is_one_line_naming_the_file_and_writes_nothing(synthetic, tmp_path, calibration, message):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    token_file(tmp_path / "short.jsonl", 3, 64, seed=1)
    token_file(tmp_path / "big-ids.jsonl", 4, 64, seed=1, vocab=100000)
    recipe = small_recipe(tmp_path, "glm5-int4-experts-gptq-g32", "bad", **calibration)
    with pytest.raises(QuantkitError, match=message) as info:
        convert(synthetic["glm_moe_dsa"], tmp_path / "out", recipe, device="cpu")
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()


def test_nan_activations_stop_at_the_layer_naming_it(tmp_path):
    src = build_synthetic("llama", tmp_path / "src", seed=2)
    name = "model.layers.1.post_attention_layernorm.weight"
    shard = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(src / shard)
    tensors[name] = torch.full_like(tensors[name], 3e38)  # finite, but the layer's activations overflow
    save_file(tensors, src / shard, {"format": "pt"})
    data = token_file(tmp_path / "cal.jsonl", 4, 64, seed=0)
    recipe = small_recipe(tmp_path, "dense-mlp-w4a16-gptq-g32", "r", dataset=data, samples=4, seq_len=64)
    with pytest.raises(QuantkitError, match="NaN or Inf activations after decoder layer 1") as info:
        convert(src, tmp_path / "out", recipe, device="cpu")
    assert str(src) in str(info.value) and "model.layers.1" in str(info.value)
    assert not list((tmp_path / "out").glob("model-*.safetensors"))


def test_calibration_data_on_an_rtn_recipe_is_refused(synthetic, tmp_path):
    with pytest.raises(QuantkitError, match="for GPTQ and SignRound recipes"):
        convert(synthetic["llama"], tmp_path / "out", "dense-w4a16-g128", device="cpu",
                calibration_data=token_file(tmp_path / "c.jsonl", 2, 8, 0))


def test_convert_json_is_pure_json_on_stdout_in_a_fresh_process(synthetic, tmp_path):
    """llm-compressor logs to the stdout of the moment it is imported; quantkit's --json stdout stays JSON."""
    import subprocess
    import sys

    data = token_file(tmp_path / "cal.jsonl", 4, 64, seed=0)
    recipe = small_recipe(tmp_path, "dense-mlp-w4a16-gptq-g32", "r", dataset=data, samples=4, seq_len=64)
    run = subprocess.run([sys.executable, "-m", "quantkit", "convert", str(synthetic["llama"]), str(tmp_path / "out"),
                          "-r", str(recipe), "--device", "cpu", "--json"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["calibrated"]["weights_by_method"] == {"gptq": 6}
    assert [layer["layer"] for layer in result["calibrated"]["layers"]] == [0, 1]
    assert all(layer["loss"] > 0 for layer in result["calibrated"]["layers"])


def test_kill_9_during_gptq_then_resume_is_byte_identical(moe_runs, tmp_path):
    """SIGKILL once the first GPTQ layer is recorded, and again during the shard pass; the resumed
    output equals the uninterrupted run's."""
    import signal
    import subprocess
    import sys
    import time

    run = moe_runs["glm_moe_dsa"]
    dst = tmp_path / "out"
    args = [sys.executable, "-m", "quantkit", "convert", str(run["src"]), str(dst), "-r", str(run["all-recipe"]),
            "--device", "cpu", "--max-shard-size", "1MB", "--json"]

    def manifest_says(test) -> bool:
        try:
            return test(json.loads((dst / "quantkit-manifest.json").read_text()))
        except (OSError, ValueError):
            return False

    for condition in (lambda m: len(m["calibrated_layers"]) >= 1, lambda m: len(m["shards"]) >= 1):
        proc = subprocess.Popen(args + (["--resume"] if dst.exists() else []), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        start = time.monotonic()
        while proc.poll() is None and time.monotonic() - start < 120 and not manifest_says(condition):
            time.sleep(0.002)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait()
    subprocess.run(args + ["--resume"], check=True, capture_output=True)
    reference = tmp_path / "reference"
    convert(run["src"], reference, run["all-recipe"], device="cpu", max_shard_size="1MB")
    assert tree_bytes(dst) | {"quantkit-manifest.json": b""} == tree_bytes(reference) | {"quantkit-manifest.json": b""}
    assert load_manifest(dst).calibrated_modules == load_manifest(reference).calibrated_modules
    assert not (dst / WORK_DIR).exists()


def test_without_llm_compressor_a_gptq_recipe_stops_before_writing(synthetic, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "llmcompressor.modifiers.gptq.gptq_quantize", None)  # import raises ImportError
    recipe = small_recipe(tmp_path, "dense-mlp-w4a16-gptq-g32", "r", samples=2, seq_len=8)
    with pytest.raises(QuantkitError, match=r"pip install 'quantkit\[gptq\]'"):
        convert(synthetic["llama"], tmp_path / "out", recipe, device="cpu")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("importer", ["quantkit.convert.calibrated.gptq:llmcompressor_gptq"])
def test_importing_llm_compressor_through_quantkit_leaves_its_own_gptq_usable(importer):
    """quantkit imports llm-compressor with its log off and stdout on stderr; llm-compressor 0.14 then skips
    registering its METRIC level, which its CompressionLogger logs at after every module, so its own oneshot in
    the same process failed ("Level 'METRIC' does not exist"). Nothing of its import reaches stdout."""
    import subprocess
    import sys

    module, function = importer.split(":")
    code = (f"from {module} import {function}; {function}()\n"
            "import torch\n"
            "from llmcompressor.utils.metric_logging import CompressionLogger\n"
            "with CompressionLogger(torch.nn.Linear(2, 2)):\n"
            "    pass\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout == ""
