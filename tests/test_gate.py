"""gate: the paired interval covers the truth at its nominal rate; identical runs pass; a 3-point drop fails."""

import json
import random
import shutil

import pytest
from typer.testing import CliRunner

from helpers import BILLION_LAUGHS, one_line_error, plant_link, quantkit, replaced_by_a_picture, suite, write_generations, write_run
from quantkit.cli import app
from quantkit.release.gate import CannotCompare, gate
from quantkit.release.stats import paired_binary_interval








def paired(n, p_base, flip_down, flip_up, rng):
    """Baseline correct with p_base; the candidate loses an item with flip_down, gains one with flip_up."""
    base, cand = [], []
    for _ in range(n):
        b = rng.random() < p_base
        c = (not (rng.random() < flip_down)) if b else (rng.random() < flip_up)
        base.append(int(b))
        cand.append(int(c))
    return base, cand


def test_interval_coverage_is_near_nominal():
    rng = random.Random(7)
    n, p, down, up = 800, 0.6, 0.10, 0.12  # true delta = 100 * (0.4 * 0.12 - 0.6 * 0.10) = -1.2 points
    true = 100 * ((1 - p) * up - p * down)
    z, hits, trials = 1.959964, 0, 600
    for _ in range(trials):
        b, c = paired(n, p, down, up, rng)
        _, lo, hi = paired_binary_interval(b, c, z)
        hits += lo <= true <= hi
    assert 0.92 <= hits / trials <= 0.98


def test_identical_runs_pass_and_a_three_point_drop_fails(tmp_path):
    rng = random.Random(1)
    base = [int(rng.random() < 0.6) for _ in range(3000)]
    s = suite(tmp_path, ["arc_easy"], margin=1.0, correction="none")
    a = write_run(tmp_path / "a", {"arc_easy": base}, model="base")
    same = write_run(tmp_path / "same", {"arc_easy": base}, model="cand")
    report = gate(a, same, suite=s)
    assert report.passed and report.tasks[0].delta == 0 and -0.2 < report.tasks[0].low < 0  # nothing flipped: narrow,
    # yet not of zero width (the Wald interval claimed [0, 0] here, whatever n)
    worse = base[:]
    ones = [i for i, v in enumerate(worse) if v]
    for i in rng.sample(ones, 90):  # 90 of 3000 items: a 3-point drop
        worse[i] = 0
    bad = write_run(tmp_path / "bad", {"arc_easy": worse}, model="cand")
    report = gate(a, bad, suite=s, report_dir=tmp_path / "report")
    t = report.tasks[0]
    assert not report.passed and t.delta == pytest.approx(-3.0) and t.high < 0
    assert report.candidate_checksums == {"model-00001-of-00001.safetensors": "cand" * 8}
    assert {p.split("/")[-1] for p in report.report_files} == {"verdict.json", "report.md", "report.html", "forest.png"}
    assert "FAIL" in (tmp_path / "report" / "report.md").read_text()


def test_power_statement_and_continuous_signals(tmp_path):
    rng = random.Random(3)
    b, c = paired(1000, 0.55, 0.15, 0.18, rng)
    logp = {"arc_easy": [[rng.gauss(-1, 0.3), -2.0, -2.5, -3.0] for _ in b]}
    logp_c = {"arc_easy": [[x[0] + rng.gauss(0, 0.05), *x[1:]] for x in logp["arc_easy"]]}
    s = suite(tmp_path, ["arc_easy"], decide_by="[accuracy, loglik]")
    report = gate(write_run(tmp_path / "a", {"arc_easy": b}, logprobs=logp), write_run(tmp_path / "b", {"arc_easy": c}, logprobs=logp_c), suite=s)
    t = report.tasks[0]
    names = {sig.name for sig in t.signals}
    assert {"delta loglik of the correct answer", "choice flip rate", "KL(baseline || candidate) of choices"} <= names
    # the power statement uses the verdict's own interval (Tango's at an even split of the flips): at large n close to
    # the normal approximation z * sqrt(discordance / n), and 1 point needs about z^2 * discordance / 0.01^2 items
    z = 1.959964  # one task: no correction
    assert t.certifiable_margin == pytest.approx(z * 100 * (t.flip_rate / 100 / t.n) ** 0.5, rel=0.05)
    assert t.items_for_margin == pytest.approx(z * z * (t.flip_rate / 100) * 1e4, rel=0.05)
    assert t.items_for_margin > t.n  # 1,000 items cannot certify 1 point at ~17 % discordance
    assert "cannot certify a 1-point margin with 1,000 items" in t.note
    assert t.decided_by == ["accuracy", "loglik"]


def test_cannot_compare(tmp_path):
    s = suite(tmp_path, ["arc_easy"])
    a = write_run(tmp_path / "a", {"arc_easy": [1, 0, 1]})
    other_engine = write_run(tmp_path / "b", {"arc_easy": [1, 0, 1]}, engine="sglang")
    with pytest.raises(CannotCompare, match="engine.name"):
        gate(a, other_engine, suite=s)
    fewer = write_run(tmp_path / "c", {"arc_easy": [1, 0]})
    with pytest.raises(CannotCompare, match="different items"):
        gate(a, fewer, suite=s)
    r = CliRunner().invoke(app, ["gate", str(a), str(other_engine), "--suite", str(s)])
    assert r.exit_code == 2 and "engine.name" in r.output
    missing = CliRunner().invoke(app, ["gate", str(a), str(tmp_path / "nope"), "--suite", str(s)])
    assert missing.exit_code == 2 and "no run.json" in missing.output


def test_cli_exit_codes(tmp_path):
    rng = random.Random(5)
    base = [int(rng.random() < 0.6) for _ in range(2000)]
    s = suite(tmp_path, ["arc_easy"])
    a = write_run(tmp_path / "a", {"arc_easy": base})
    ok = CliRunner().invoke(app, ["gate", str(a), str(write_run(tmp_path / "b", {"arc_easy": base})), "--suite", str(s)])
    assert ok.exit_code == 0 and "PASS" in ok.output
    drop = [0 if (v and i % 10 == 0) else v for i, v in enumerate(base)]
    bad = CliRunner().invoke(app, ["gate", str(a), str(write_run(tmp_path / "c", {"arc_easy": drop})), "--suite", str(s), "--json"])
    assert bad.exit_code == 1 and json.loads(bad.stdout)["passed"] is False


def test_without_a_suite_the_tasks_both_runs_hold_are_gated_and_named(tmp_path):
    rng = random.Random(3)
    arc = [int(rng.random() < 0.6) for _ in range(400)]
    gsm = [int(rng.random() < 0.3) for _ in range(50)]
    a = write_run(tmp_path / "a", {"arc_easy": arc, "gsm8k": gsm})
    b = write_run(tmp_path / "b", {"arc_easy": arc})  # the candidate was evaluated on ARC-Easy alone
    report = gate(a, b, margin=3.0)
    assert [(t.task, t.margin) for t in report.tasks] == [("arc_easy", 3.0)] and report.passed
    assert report.correction == "bonferroni over 1 tasks"
    assert report.gated == "no suite named: gated the 1 task(s) both runs hold (arc_easy) under the release suite's rules"
    both = write_run(tmp_path / "d", {"arc_easy": arc, "arc_challenge": arc[:100]})
    assert [t.margin for t in gate(both, both).tasks] == [1.0, 1.0]  # the release suite's where --margin is not given
    r = CliRunner().invoke(app, ["gate", str(a), str(b), "--margin", "3"])
    assert r.exit_code == 0 and "No suite named: gated the 1 task(s) both runs hold (arc_easy)" in r.output
    other = write_run(tmp_path / "c", {"mmlu": [1, 0, 1]})
    r = CliRunner().invoke(app, ["gate", str(a), str(other), "--margin", "3"])
    assert r.exit_code == 2 and "the runs share no task (baseline: arc_easy, gsm8k; candidate: mmlu)" in r.output
    # a suite is a demand: every task it names must be in both runs
    with pytest.raises(CannotCompare, match="task gsm8k is not in this run"):
        gate(a, b, suite=suite(tmp_path, ["arc_easy", "gsm8k"]))


def _lines(run, task="arc_easy"):
    return [json.loads(line) for line in (run / "samples" / f"{task}.jsonl").read_text().splitlines()]


def _rewrite(run, rows, task="arc_easy"):
    (run / "samples" / f"{task}.jsonl").write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def test_duplicated_ids_cannot_turn_failures_into_a_pass(tmp_path):
    """200 items, the candidate fails the first 100; repeating those ids as correct once collapsed to a pass."""
    s = suite(tmp_path, ["arc_easy"], margin=1.0, correction="none")
    base = write_run(tmp_path / "a", {"arc_easy": [1] * 200})
    cand = write_run(tmp_path / "b", {"arc_easy": [0] * 100 + [1] * 100})
    rows = _lines(cand)
    _rewrite(cand, rows + [dict(r, correct=1) for r in rows[:100]])
    with pytest.raises(CannotCompare, match="item arc_easy-0 appears twice"):
        gate(base, cand, suite=s)


@pytest.mark.parametrize("damage, message", [
    (lambda rows: [dict(rows[0], correct=500)] + rows[1:], "correct: Input should be less than or equal to 1"),
    (lambda rows: [dict(rows[0], correct=True)] + rows[1:], "correct: Input should be a valid integer"),
    (lambda rows: [dict(rows[0], choice_logprobs=[-1.0, -2.0], gold=5)] + rows[1:], "gold 5 is out of range"),
    (lambda rows: [dict(rows[0], choice_logprobs=[])] + rows[1:], "choice_logprobs"),
    (lambda rows: ["[1, 2, 3]"] + rows[1:], "line 1: invalid sample"),
    (lambda rows: [{k: v for k, v in rows[0].items() if k != "correct"}] + rows[1:], "correct: Field required"),
    (lambda rows: [dict(rows[0], extra="x")] + rows[1:], "extra: Extra inputs are not permitted"),
    (lambda rows: [dict(rows[0], item_id="arc_easy-999")] + rows[1:], "arc_easy-0 is missing or foreign"),
    (lambda rows: [], "scored no items"),
])
def test_run_files_are_validated_strictly(tmp_path, damage, message):
    s = suite(tmp_path, ["arc_easy"])
    base = write_run(tmp_path / "a", {"arc_easy": [1, 0, 1]})
    cand = write_run(tmp_path / "b", {"arc_easy": [1, 0, 1]})
    _rewrite(cand, damage(_lines(cand)))
    with pytest.raises(CannotCompare, match=message):
        gate(base, cand, suite=s)
    r = CliRunner().invoke(app, ["gate", str(base), str(cand), "--suite", str(s)])
    one_line_error(r, "arc_easy.jsonl", code=2)




def test_run_records_and_suites_are_validated(tmp_path):
    s = suite(tmp_path, ["arc_easy"])
    base = write_run(tmp_path / "a", {"arc_easy": [1, 0, 1]})
    cand = write_run(tmp_path / "b", {"arc_easy": [1, 0, 1]})
    for run in (base, cand):  # the task's data has 4 items: runs that scored 3 are incomplete
        meta = json.loads((run / "run.json").read_text())
        meta["tasks"]["arc_easy"]["items"] = 4
        (run / "run.json").write_text(json.dumps(meta))
    with pytest.raises(CannotCompare, match="not the task's first 4"):
        gate(base, cand, suite=s)
    (cand / "run.json").write_text("{not json")
    with pytest.raises(CannotCompare, match="run.json: invalid run record"):
        gate(base, cand, suite=s)
    for text, message in [("tasks: [arc_easy]\n", "tasks: Input should be a valid dictionary"),
                          ("alpha: 5\ntasks: {arc_easy: {}}\n", "alpha: Input should be less than 1"),
                          ("tasks: {arc_easy: {margin: -1}}\n", "margin: Input should be greater than or equal to 0"),
                          (BILLION_LAUGHS, "alias")]:
        bad = tmp_path / "bad-suite.yaml"
        bad.write_text(text)
        r = CliRunner().invoke(app, ["gate", str(base), str(base), "--suite", str(bad)])
        assert r.exit_code == 2 and message in r.output and "bad-suite.yaml" in r.output, r.output
    (tmp_path / "report-file").write_text("")
    good = write_run(tmp_path / "c", {"arc_easy": [1, 0, 1]})
    r = CliRunner().invoke(app, ["gate", str(good), str(good), "--suite", str(s), "--report", str(tmp_path / "report-file")])
    assert r.exit_code == 2 and "report folder is a file" in r.output


def test_a_samples_file_that_is_not_utf8_cannot_be_compared(tmp_path):
    s = suite(tmp_path, ["arc_easy"])
    base = write_run(tmp_path / "a", {"arc_easy": [1, 0, 1]})
    cand = write_run(tmp_path / "b", {"arc_easy": [1, 0, 1]})
    path = cand / "samples" / "arc_easy.jsonl"
    path.write_bytes(path.read_bytes().replace(b'"h0"', b'"h\xff"'))
    r = CliRunner().invoke(app, ["gate", str(base), str(cand), "--suite", str(s)])
    one_line_error(r, "arc_easy.jsonl: not UTF-8 text", code=2)


def test_a_generative_task_decided_by_loglik_alone_fails_instead_of_passing(tmp_path):
    base = write_generations(tmp_path / "b", [20] * 50)
    cand = write_generations(tmp_path / "c", [20] * 50, correct=[0] * 50, model="n")  # -100 points, no choices
    report = gate(base, cand, suite=suite(tmp_path, ["gsm8k"], margin=1.0, decide_by="[loglik]"))
    assert not report.passed and report.tasks[0].delta == -100
    assert "decide_by loglik, but the task has no choice log-likelihoods" in report.tasks[0].note


def test_gate_never_writes_its_report_into_a_model_folder(synthetic, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(synthetic["llama"], model)
    before = sorted(p.name for p in model.rglob("*"))
    base = write_run(tmp_path / "b", {"arc_easy": [1, 0] * 50}, model=str(model))
    cand = write_run(tmp_path / "c", {"arc_easy": [1, 0] * 50}, model="n")
    for out in (model, model / "gate"):
        one_line_error(quantkit("gate", base, cand, "--report", out), "--report must not be the model folder or inside it", code=None)
    assert sorted(p.name for p in model.rglob("*")) == before


@pytest.mark.parametrize("margin", ["inf", "101"])
def test_gate_margins_beyond_100_points_are_one_line(tmp_path, margin):
    base = write_run(tmp_path / "b", {"arc_easy": [1, 0] * 50})
    cand = write_run(tmp_path / "c", {"arc_easy": [1, 0] * 50}, model="n")
    one_line_error(quantkit("gate", base, cand, "--margin", margin), "the margin is a loss in accuracy points, from 0 to 100", code=None)


def test_the_gates_charts_are_not_written_through_a_link(tmp_path):
    a = write_run(tmp_path / "a", {"arc_easy": [1, 0] * 200}, model="base")
    b = write_run(tmp_path / "b", {"arc_easy": [1, 1] * 200}, model="cand")
    target = plant_link(tmp_path / "report" / "forest.png", tmp_path)
    result = quantkit("gate", a, b, "--suite", suite(tmp_path, ["arc_easy"]), "--report", tmp_path / "report")
    assert result.exit_code == 0, result.output
    assert replaced_by_a_picture(tmp_path / "report" / "forest.png", target)
