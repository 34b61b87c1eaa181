"""Fourth adversarial pass (the items of it done so far): each finding planted as found, and the outcome it asked for."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import OUTSIDE, one_line_error, plant_link, quantkit, suite, write_generations, write_run

from quantkit.errors import QuantkitError
from quantkit.release.gate import gate

# --- What a verdict decides -------------------------------------------------------------------------------------


def test_a_generative_task_decided_by_loglik_alone_fails_instead_of_passing(tmp_path):
    base = write_generations(tmp_path / "b", [20] * 50)
    cand = write_generations(tmp_path / "c", [20] * 50, correct=[0] * 50, model="n")  # -100 points, no choices
    report = gate(base, cand, suite=suite(tmp_path, ["gsm8k"], margin=1.0, decide_by="[loglik]"))
    assert not report.passed and report.tasks[0].delta == -100
    assert "decide_by loglik, but the task has no choice log-likelihoods" in report.tasks[0].note


# --- Files a user writes ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["suite", "recipe", "release config"])
def test_a_key_named_twice_is_refused_naming_the_file_and_key(synthetic, tmp_path, kind):
    if kind == "suite":
        path = tmp_path / "s.yaml"
        path.write_text("tasks:\n  arc_easy: {margin: 1}\nalpha: 0.05\ntasks:\n  gsm8k: {margin: 50}\n")
        result = quantkit("gate", tmp_path, tmp_path, "--suite", path)
    elif kind == "recipe":
        path = tmp_path / "r.yaml"
        path.write_text("quant_stage:\n  quant_modifiers: {}\nquant_stage:\n  quant_modifiers: {}\n")
        result = quantkit("convert", synthetic["llama"], tmp_path / "out", "-r", path)
    else:
        path = tmp_path / "release.yaml"
        path.write_text("source: a\nrecipe: b\npublish: null\nrecipe: c\n")
        result = quantkit("release", path)
    line = one_line_error(result, str(path), code=None)
    key = "tasks" if kind == "suite" else "quant_stage" if kind == "recipe" else "recipe"
    assert f"invalid YAML at line {3 if kind == 'recipe' else 4}: duplicate key '{key}'" in line


def test_a_merge_key_may_still_be_overridden(tmp_path):
    from quantkit.yaml_file import load_yaml

    path = tmp_path / "m.yaml"
    path.write_text("base: &b {margin: 1, cluster: null}\ntasks:\n  arc_easy:\n    <<: *b\n    margin: 3\n")
    assert load_yaml(path, "suite")["tasks"]["arc_easy"] == {"margin": 3, "cluster": None}


def test_gate_never_writes_its_report_into_a_model_folder(synthetic, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(synthetic["llama"], model)
    before = sorted(p.name for p in model.rglob("*"))
    base = write_run(tmp_path / "b", {"arc_easy": [1, 0] * 50}, model=str(model))
    cand = write_run(tmp_path / "c", {"arc_easy": [1, 0] * 50}, model="n")
    for out in (model, model / "gate"):
        one_line_error(quantkit("gate", base, cand, "--report", out), "--report must not be the model folder or inside it", code=None)
    assert sorted(p.name for p in model.rglob("*")) == before


def test_the_demo_writes_nothing_through_links_planted_in_its_workdir(smollm2_bf16, tmp_path):
    from quantkit.examples.demo import demo

    work = tmp_path / "work"
    suite_target = plant_link(work / "suite.yaml", tmp_path)
    (tmp_path / "elsewhere").mkdir()
    (work / "data").mkdir()
    (work / "data" / "arc_easy").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(QuantkitError, match="is a link: refused"):
        demo(work, arc_items=4, gsm8k_items=1, source_model=smollm2_bf16)
    assert list((tmp_path / "elsewhere").iterdir()) == [] and suite_target.read_bytes() == OUTSIDE

    (work / "data" / "arc_easy").unlink()  # the folder link gone, the file link is replaced, never written through
    (work / "data" / "gsm8k").mkdir()
    ok = (work / "data" / "gsm8k" / "test.jsonl")
    plant_link(ok, tmp_path / "elsewhere")
    from quantkit.examples import demo as demo_module

    demo_module._slice(demo_module.DATA / "gsm8k" / "test.jsonl", work, "data/gsm8k/test.jsonl", 2)
    assert not ok.is_symlink() and len(ok.read_text().splitlines()) == 2
    assert (tmp_path / "elsewhere" / "outside.txt").read_bytes() == OUTSIDE


def test_a_block_fp8_source_is_written_again_for_another_model(smollm2_bf16, tmp_path):
    from quantkit.examples.smollm2 import block_fp8_release
    from quantkit.checkpoint.reader import open_checkpoint

    out = block_fp8_release(smollm2_bf16, tmp_path / "fp8")
    first = open_checkpoint(out).fingerprint()
    assert block_fp8_release(smollm2_bf16, out) == out and open_checkpoint(out).fingerprint() == first  # resumed
    other = tmp_path / "other"
    shutil.copytree(smollm2_bf16, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(dict(config, rms_norm_eps=1e-6)))  # another model, same headers
    block_fp8_release(other, out)
    assert json.loads((out / "config.json").read_text())["rms_norm_eps"] == 1e-6
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(QuantkitError, match="holds files this demo did not write"):
        block_fp8_release(smollm2_bf16, foreign)
    assert (foreign / "notes.txt").read_text() == "mine"


# --- What verify checks ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [float("nan"), 0.0, -1.0, float("inf")])
def test_verify_refuses_a_kv_scale_that_is_not_finite_and_positive(synthetic, tmp_path, value):
    import torch
    from safetensors.torch import load_file, save_file

    from quantkit.verify import verify

    model = tmp_path / "model"
    shutil.copytree(synthetic["llama"], model)
    shard = sorted(model.glob("*.safetensors"))[0]
    tensors = load_file(shard)
    tensors["model.layers.0.self_attn.k_proj.k_scale"] = torch.tensor(value)
    save_file(tensors, shard, metadata={"format": "pt"})
    index = model / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"]["model.layers.0.self_attn.k_proj.k_scale"] = shard.name
        index.write_text(json.dumps(data))
    report = verify(model, smoke=False)
    found = [f for f in report.findings if f.rule == "KV-cache scales are finite and above zero"]
    assert len(found) == 1 and found[0].tensor == "model.layers.0.self_attn.k_proj.k_scale", report.findings


# --- One line, not a traceback ----------------------------------------------------------------------------------


@pytest.mark.parametrize("margin", ["inf", "101"])
def test_gate_margins_beyond_100_points_are_one_line(tmp_path, margin):
    base = write_run(tmp_path / "b", {"arc_easy": [1, 0] * 50})
    cand = write_run(tmp_path / "c", {"arc_easy": [1, 0] * 50}, model="n")
    one_line_error(quantkit("gate", base, cand, "--margin", margin), "the margin is a loss in accuracy points, from 0 to 100", code=None)


def test_plan_with_infinite_gpu_memory_is_one_line(synthetic):
    one_line_error(quantkit("plan", synthetic["llama"], "--gpu-mem-gib", "inf"), "--gpu-mem-gib must be a GPU's memory", code=None)


@pytest.mark.parametrize("extra, says", [(lambda: "[" * 100_000 + "]" * 100_000, "maximum recursion depth"),
                                         (lambda: "9" * 5000, "Exceeds the limit (4300 digits)")])
def test_a_config_json_python_cannot_parse_is_one_line_naming_it(synthetic, tmp_path, extra, says):
    model = tmp_path / "model"
    shutil.copytree(synthetic["llama"], model)
    text = (model / "config.json").read_text().rstrip().removesuffix("}")
    (model / "config.json").write_text(text + ', "x": ' + extra() + "}")
    for command in (("inspect", model), ("plan", model)):
        line = one_line_error(quantkit(*command), says, code=None)
        assert "config.json: invalid JSON" in line
    checked = quantkit("verify", model)  # verify reports it as a finding, as it does any unreadable checkpoint
    assert checked.exit_code == 1 and "readable checkpoint: invalid JSON: " + says in checked.output
