"""Third adversarial pass: each finding planted as found, and the outcome it asked for.

Every file quantkit writes goes through one writer (a temporary name in the folder, then a rename), pictures
included: a link planted at an output's path is replaced, never written through.
"""

from __future__ import annotations

import pytest
from helpers import OUTSIDE, one_line_error, plant_link, quantkit, release_config, suite, write_run, write_seeded

from quantkit.checkpoint.reader import open_checkpoint
from quantkit.convert import convert
from quantkit.errors import QuantkitError





def replaced_by_a_picture(path, target) -> bool:
    return target.read_bytes() == OUTSIDE and not path.is_symlink() and path.read_bytes()[:4] == b"\x89PNG"


def test_plan_deploys_chart_is_not_written_through_a_link(synthetic, tmp_path):
    chart = tmp_path / "plan-memory.png"
    target = plant_link(chart, tmp_path)
    result = quantkit("plan", synthetic["glm_moe_dsa"], "--recipe", "glm5-int4-experts-g32", "--deploy",
                      "--gpu-mem-gib", 1, "--chart", chart)
    assert result.exit_code == 0, result.output
    assert replaced_by_a_picture(chart, target)


def test_a_chart_path_matplotlib_cannot_write_is_one_line(synthetic, tmp_path):
    result = quantkit("plan", synthetic["glm_moe_dsa"], "--recipe", "glm5-int4-experts-g32", "--deploy",
                      "--gpu-mem", 1, "--chart", tmp_path / "chart.txt")
    one_line_error(result, "a chart is written as .png", code=None)
    assert "internal error" not in result.output and not (tmp_path / "chart.txt").exists()


def test_the_gates_charts_are_not_written_through_a_link(tmp_path):
    a = write_run(tmp_path / "a", {"arc_easy": [1, 0] * 200}, model="base")
    b = write_run(tmp_path / "b", {"arc_easy": [1, 1] * 200}, model="cand")
    target = plant_link(tmp_path / "report" / "forest.png", tmp_path)
    result = quantkit("gate", a, b, "--suite", suite(tmp_path, ["arc_easy"]), "--report", tmp_path / "report")
    assert result.exit_code == 0, result.output
    assert replaced_by_a_picture(tmp_path / "report" / "forest.png", target)


def test_calibrate_kv_in_place_never_writes_its_plot_through_a_link_in_the_model(synthetic, tmp_path):
    import torch

    from quantkit.kv.calibrate import calibrate_kv

    out = tmp_path / "int4"
    convert(synthetic["llama"], out, "dense-w4a16-g128", device="cpu")
    tokenizer = out / "tokenizer_config.json"
    before = tokenizer.read_bytes()
    (out / "kv_scales.png").symlink_to(tokenizer.name)  # inside the model, pointing at its tokenizer
    calibrate_kv(out, in_place=True, batches=[torch.randint(0, 512, (1, 16)) for _ in range(2)], device="cpu")
    assert tokenizer.read_bytes() == before
    assert not (out / "kv_scales.png").is_symlink() and (out / "kv_scales.png").read_bytes()[:4] == b"\x89PNG"
    assert open_checkpoint(out).config.quantization_config["kv_cache_scheme"]


# --- Outputs never land in a model folder a command reads ------------------------------------------


def test_budget_never_writes_into_the_source(synthetic, tmp_path):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(synthetic["llama"], src)
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    for out in (src / "config.json", src / "sub" / "recipe.yaml"):
        result = quantkit("budget", src, "--recipe", "dense-w4a16-g128", "--budget", "0.9", "--out", out)
        one_line_error(result, "--out must not be the model folder or inside it", code=None)
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before


def test_eval_never_writes_its_run_into_the_model(synthetic, tmp_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(synthetic["llama"], model)
    before = sorted(p.name for p in model.rglob("*"))
    for out in (model, model / "runs"):
        result = quantkit("eval", model, "--tasks", "arc_easy", "--limit", 2, "--out", out)
        one_line_error(result, "RUN_DIR must not be the model folder or inside it", code=None)
    assert sorted(p.name for p in model.rglob("*")) == before


def test_budget_refuses_a_seq_len_beyond_the_models_context(synthetic, tmp_path):
    result = quantkit("budget", synthetic["llama"], "--recipe", "dense-w4a16-g128", "--budget", "0.9",
                      "--out", tmp_path / "r.yaml", "--seq-len", 257)
    one_line_error(result, "--seq-len 257 exceeds the model's context (256)", code=None)
    assert not (tmp_path / "r.yaml").exists()




# --- Statistics that cannot be talked into a wrong answer -------------------------------------------


@pytest.mark.parametrize("looks", ["[0.9999, 1.0]", "[0.5, 1.0]"])
def test_a_run_of_every_item_is_the_last_look_and_decides(tmp_path, looks):
    """Looks that round to one item count are one look: [0.9999, 1.0] on 500 items said UNDECIDED (exit 3) with
    every item evaluated, where [0.5, 1.0] said FAIL on the same data."""
    import random


    from quantkit.release.gate import gate

    rng = random.Random(7)
    population = 500
    base = [int(rng.random() < 0.6) for _ in range(population)]
    worse = [v if rng.random() > 0.15 else 0 for v in base]
    (tmp_path / "suite.yaml").write_text(f"sequential: {{looks: {looks}}}\ntasks:\n  arc_easy: {{margin: 2}}\n")
    a = write_seeded(tmp_path / "a", "arc_easy", base, population)
    report = gate(a, write_seeded(tmp_path / "b", "arc_easy", worse, population, 1.0), suite=tmp_path / "suite.yaml")
    assert report.decision == "fail" and report.sequential.look == report.sequential.looks == 2
    if looks == "[0.9999, 1.0]":  # both looks are 500 items: one test, spending what both spend
        assert report.sequential.alpha == pytest.approx(0.025, rel=1e-6)


def test_differences_that_cancel_in_every_cluster_leave_the_interval_as_it_is():
    """A design effect of 0 raised ZeroDivisionError in the gate (exit 1, the code for "a task fails")."""
    from quantkit.evaluation.run_dir import SampleRecord
    from quantkit.release.gate import _task_verdict
    from quantkit.release.suite import Suite, TaskSpec
    from quantkit.release.stats import design_effect, z_of

    clusters = [str(i // 2) for i in range(400)]
    differences = [1, -1] * 200  # a gain and a loss in every cluster
    assert design_effect(differences, clusters) == 1.0
    ids = [str(i) for i in range(400)]
    b = {i: SampleRecord(item_id=i, prompt_hash=i, correct=int(int(i) % 2 == 1)) for i in ids}
    c = {i: SampleRecord(item_id=i, prompt_hash=i, correct=int(int(i) % 2 == 0)) for i in ids}
    verdict = _task_verdict("mmlu", ids, b, c, 2.0, z_of(0.025), Suite(tasks={"mmlu": TaskSpec(margin=2.0)}), clusters)
    assert verdict.design_effect == 1.0 and verdict.delta == 0


# --- What quantkit writes into YAML from a name is inert -------------------------------------------


def test_a_newline_in_the_source_folders_name_adds_no_key_to_budgets_recipe(synthetic, tmp_path):
    import json
    import shutil

    import torch
    import yaml

    from quantkit.budget import budget

    src = tmp_path / "src\nquantkit_calibration: {samples: 1}\nx"
    shutil.copytree(synthetic["llama"], src)
    data = tmp_path / "tokens.jsonl"
    data.write_text("".join(json.dumps({"input_ids": torch.randint(2, 512, (32,)).tolist()}) + "\n" for _ in range(2)))
    budget(src, recipe="dense-w4a16-g128", size="0.9", out=tmp_path / "r.yaml", data=data, samples=2, seq_len=32,
           device="cpu")
    text = (tmp_path / "r.yaml").read_text()
    assert set(yaml.safe_load(text)) == {"quant_stage"} and "src\\nquantkit_calibration" in text.splitlines()[0]


# --- A recipe means what it says, or is refused ----------------------------------------------------

INT4_GROUP = """quant_stage:
  quant_modifiers:
    QuantizationModifier:
      ignore: ["lm_head"]
      config_groups:
        g:
          targets: ["Linear"]
          weights: {{num_bits: 4, type: int, symmetric: {sym}, strategy: {strategy}, group_size: {gs}{more}}}
{fmt}"""


def recipe(tmp_path, sym="true", strategy="group", gs="32", more="", fmt=""):
    path = tmp_path / "r.yaml"
    path.write_text(INT4_GROUP.format(sym=sym, strategy=strategy, gs=gs, more=more, fmt=fmt))
    return path


@pytest.mark.parametrize("kwargs, says", [
    (dict(more=", observer: mse"), "weights.observer 'mse' is not applied"),
    (dict(more=", scale_dtype: float16"), "weights.scale_dtype 'torch.float16' is not applied"),
    (dict(more=", dynamic: true"), "weights.dynamic True is not applied"),
    (dict(fmt="          format: nvfp4-pack-quantized\n"), "format 'nvfp4-pack-quantized': 4-bit int weights are "
                                                            "written pack-quantized"),
    (dict(sym="false", strategy="channel", gs="-1"), "asymmetric INT4 is written group-wise only"),
    (dict(gs='"32"'), "group_size '32' is not an integer"),
    (dict(gs="1e400"), "group_size '1e400' is not an integer"),
])
def test_a_recipe_argument_quantkit_does_not_apply_is_refused_naming_it(synthetic, tmp_path, kwargs, says):
    result = quantkit("convert", synthetic["llama"], tmp_path / "out", "--recipe", recipe(tmp_path, **kwargs))
    one_line_error(result, says, code=None)
    assert "internal error" not in result.output and not (tmp_path / "out").exists()


def test_a_group_without_a_format_is_written_in_the_one_its_weights_have(synthetic, tmp_path):
    import json

    from quantkit.verify import verify

    convert(synthetic["llama"], tmp_path / "out", recipe(tmp_path), device="cpu")
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert config["format"] == config["config_groups"]["g"]["format"] == "pack-quantized"
    assert verify(tmp_path / "out", source=synthetic["llama"]).passed


@pytest.mark.parametrize("where", ["group", "top"])
def test_verify_refuses_a_config_naming_another_format_than_the_tensors_have(synthetic, tmp_path, where):
    """config.json edited to say nvfp4-pack-quantized over INT4 tensors: an engine would read them as FP4."""
    import json

    from quantkit.verify import verify

    convert(synthetic["llama"], tmp_path / "out", recipe(tmp_path), device="cpu")
    path = tmp_path / "out" / "config.json"
    config = json.loads(path.read_text())
    q = config["quantization_config"]
    if where == "group":
        q["config_groups"]["g"]["format"] = "nvfp4-pack-quantized"
    else:
        q["format"], q["config_groups"]["g"]["format"] = "nvfp4-pack-quantized", None
    path.write_text(json.dumps(config))
    report = verify(tmp_path / "out", smoke=False)
    assert not report.passed
    assert any("names format 'nvfp4-pack-quantized'; the tensor is stored pack-quantized" in f.message
               for f in report.findings)


def test_a_recipe_whose_aliases_expand_without_bound_is_refused_at_once(synthetic, tmp_path):
    """31 levels of {a: *prev, b: *prev}: 62 alias uses, under the use cap, and two billion nodes expanded; convert
    walked them at 100 % CPU (killed at 60 s)."""
    import time

    levels = ["l0: &l0 [x]"] + [f"l{i}: &l{i} {{a: *l{i - 1}, b: *l{i - 1}}}" for i in range(1, 32)]
    text = "unused:\n" + "".join(f"  {line}\n" for line in levels) + INT4_GROUP.format(
        sym="true", strategy="group", gs="32", more="", fmt="")
    (tmp_path / "bomb.yaml").write_text(text)
    started = time.perf_counter()
    result = quantkit("convert", synthetic["llama"], tmp_path / "out", "--recipe", tmp_path / "bomb.yaml")
    one_line_error(result, "nodes with its aliases expanded", code=None)
    assert time.perf_counter() - started < 10 and not (tmp_path / "out").exists()


# --- Calibration rows --------------------------------------------------------------------------------


@pytest.mark.parametrize("row, says", [
    ('{"input_ids": ' + "[" * 100_000 + "]" * 100_000 + "}", "line 1: nested deeper than JSON is read here"),
    ('{"input_ids": [' + "9" * 5000 + "]}", "line 1: invalid JSON"),
])
def test_calibration_rows_json_cannot_read_are_one_line_naming_the_file(synthetic, tmp_path, row, says):
    (tmp_path / "rows.jsonl").write_text(row + "\n")
    result = quantkit("calibrate-kv", synthetic["llama"], "--out", tmp_path / "out", "--data", tmp_path / "rows.jsonl",
                      "--seq-len", 64)
    line = one_line_error(result, says, code=None)
    assert "rows.jsonl" in line and "internal error" not in result.output


# --- plan from config.json alone --------------------------------------------------------------------


def glm_config_only(synthetic, tmp_path, **fields):
    import json

    config = json.loads((synthetic["glm_moe_dsa"] / "config.json").read_text())
    config.pop("indexer_types", None)
    config.update(fields)
    folder = tmp_path / "config-only"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder, config


def test_plan_reads_glm5s_index_topk_pattern_with_its_mtp_layer(synthetic, tmp_path):
    from quantkit.plan import plan

    n = 3
    folder, _ = glm_config_only(synthetic, tmp_path, num_hidden_layers=n, index_topk_pattern="FFF")
    assert plan(folder).total_params == plan(synthetic["glm_moe_dsa"]).total_params  # every layer "full" there too
    (tmp_path / "b").mkdir()
    shared, _ = glm_config_only(synthetic, tmp_path / "b", num_hidden_layers=n, index_topk_pattern="FSF")
    assert plan(shared).total_params < plan(folder).total_params  # a shared layer holds no indexer weights


@pytest.mark.parametrize("fields, says", [
    (dict(index_topk_freq="x"), "index_topk_freq = 'x': expected an integer"),
    (dict(index_skip_topk_offset=[1]), "index_skip_topk_offset = [1]: expected an integer"),
    (dict(index_topk_pattern="FX"), "index_topk_pattern: expected a string of F and S"),
    (dict(index_topk_pattern="FF"), "index_topk_pattern has 2 entries for num_hidden_layers = 3"),
])
def test_plan_refuses_indexer_fields_it_cannot_read_in_one_line(synthetic, tmp_path, fields, says):
    folder, _ = glm_config_only(synthetic, tmp_path, **fields)
    one_line_error(quantkit("plan", folder), says, code=None)


# --- Resume ------------------------------------------------------------------------------------------


def test_release_resume_after_the_source_was_replaced_runs_every_stage_again(synthetic, tmp_path):
    """It reported every stage "done earlier" and would have published the old conversion."""
    import shutil


    from quantkit.examples.synthetic import build_synthetic
    from quantkit.release import ReleaseStopped, release

    source = tmp_path / "source"
    shutil.copytree(synthetic["llama"], source)
    config = release_config(tmp_path, source)
    with pytest.raises(ReleaseStopped, match="stage eval-baseline"):  # no data: the chain stops after verify
        release(config)
    shutil.rmtree(source)
    build_synthetic("llama", source, seed=9, fp8=False, num_hidden_layers=3)  # another model at the same path
    seen = []
    with pytest.raises(ReleaseStopped, match="stage eval-baseline"):
        release(config, resume=True, on_stage=seen.append)
    assert [(r.stage, r.status) for r in seen] == [("plan", "ran"), ("convert", "ran"), ("calibrate-kv", "skipped"),
                                                   ("verify", "ran")]
    assert open_checkpoint(tmp_path / "release-work" / "model").config.num_hidden_layers == 3


# --- budget carries its base recipe through ---------------------------------------------------------

BASE = """quant_stage:
  quant_modifiers:
    QuantizationModifier:
      ignore: ["lm_head"]
      kv_cache_scheme: {num_bits: 8, type: float, symmetric: true, strategy: tensor, dynamic: false}
      config_groups:
        mlp:
          targets: ["re:.*mlp\\\\.(gate|up|down)_proj$"]
          weights: {num_bits: 4, type: int, symmetric: false, strategy: group, group_size: 32}
        attention:
          targets: ["re:.*self_attn\\\\.(q|k|v|o)_proj$"]
          weights: {num_bits: 8, type: float, symmetric: true, strategy: block, block_structure: [128, 128]}
          input_activations: {num_bits: 8, type: float, symmetric: true, strategy: group, group_size: 128,
                              dynamic: true}
"""


@pytest.fixture
def budget_inputs(synthetic, tmp_path):
    import json

    import torch

    (tmp_path / "base.yaml").write_text(BASE)
    data = tmp_path / "tokens.jsonl"
    gen = torch.Generator().manual_seed(0)
    data.write_text("".join(json.dumps({"input_ids": torch.randint(2, 512, (32,), generator=gen).tolist()}) + "\n"
                            for _ in range(2)))
    return synthetic["llama"], tmp_path / "base.yaml", data


def test_budget_keeps_the_base_recipes_sign_convention_fp8_groups_and_kv_scheme(budget_inputs, tmp_path):
    """From an asymmetric base it measured and wrote symmetric INT4, dropped the kv_cache_scheme, and left the base's
    FP8 layers BF16."""
    from quantkit.budget import budget
    from quantkit.formats.recipe import load_recipe

    src, base, data = budget_inputs
    roomy = budget(src, recipe=str(base), size="0.9", out=tmp_path / "r.yaml", data=data, samples=2, seq_len=32,
                   device="cpu")
    result = budget(src, recipe=str(base), size=str(int(roomy.smallest_bytes * 1.01)), out=tmp_path / "r.yaml",
                    data=data, samples=2, seq_len=32, device="cpu")  # room for INT4 MLPs only
    written = load_recipe(tmp_path / "r.yaml").config
    int4 = [s for s in written.config_groups.values() if s.weights.num_bits == 4]
    assert int4 and all(not s.weights.symmetric for s in int4)
    assert written.kv_cache_scheme is not None and written.kv_cache_scheme.num_bits == 8
    kept = written.config_groups["base_attention"]
    assert kept.weights.block_structure == [128, 128] and kept.targets == [r"re:.*self_attn\.(q|k|v|o)_proj$"]
    out = convert(src, tmp_path / "mixed", tmp_path / "r.yaml", device="cpu")
    assert out.output_bytes == result.predicted_bytes <= result.budget_bytes
    assert out.tensors_by_kind.get("fp8_quantize", 0) >= 8  # the attention of both layers, as the base had it


def test_budget_never_writes_a_recipe_over_its_budget(budget_inputs, tmp_path, monkeypatch):
    """It wrote a recipe predicted at 1,722,400 bytes for a budget of 1,659,297, its comment saying it fits, exit 0.
    Here the per-option size estimate is made low, so that no choice the greedy step allows converts within it."""
    import quantkit.budget as b

    src, base, data = budget_inputs
    real = b.option_bytes
    monkeypatch.setattr(b, "option_bytes", lambda *args: None if real(*args) is None else int(real(*args) * 0.8))
    first = b.budget(src, recipe=str(base), size="0.9", out=tmp_path / "r.yaml", data=data, samples=2, seq_len=32,
                     device="cpu")
    with pytest.raises(QuantkitError, match="nothing written"):
        b.budget(src, recipe=str(base), size=str(first.smallest_bytes), out=tmp_path / "tight.yaml", data=data,
                 samples=2, seq_len=32, device="cpu")
    assert not (tmp_path / "tight.yaml").exists()
