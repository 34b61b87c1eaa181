"""Sequential gating end to end: eval in the seeded order at a share of the items, a later look resuming the
earlier one from its request cache, and release evaluating the candidate one look at a time until the gate decides."""

import json
import shutil

import pytest
from helpers import add_word_tokenizer

from quantkit.evaluation import evaluate
from quantkit.evaluation.run_dir import seeded_order
from quantkit.examples.synthetic import build_synthetic
from quantkit.examples.demo import DATA
from quantkit.release import release
from quantkit.release.gate import gate


@pytest.fixture(scope="module")
def setup(llama_pair, tmp_path_factory):
    """conftest's word-level Llama and its INT4 conversion (read only here), and 120 ARC-Easy items."""
    base, cand = llama_pair
    root = tmp_path_factory.mktemp("sequential")
    data = root / "data" / "arc_easy"
    data.mkdir(parents=True)
    (data / "test.jsonl").write_text("".join((DATA / "arc_easy" / "test.jsonl").read_text().splitlines(True)[:120]))
    return base, cand, root / "data"


def run(model, out, data, **kw):
    return evaluate(model, tasks=["arc_easy"], data_dir=data, out=out, batch_size=16, device="cpu", **kw)


def test_a_look_is_a_seeded_prefix_and_the_next_look_extends_it(setup, tmp_path):
    base, cand, data = setup
    run(base, tmp_path / "baseline", data)
    first = run(cand, tmp_path / "cand", data, order="seeded", fraction=0.25)
    assert first.scores["arc_easy"]["n"] == 30
    ids = [json.loads(line)["item_id"] for line in (tmp_path / "cand" / "samples" / "arc_easy.jsonl").read_text().split()]
    assert sorted(ids) == sorted(f"arc_easy-{i}" for i in seeded_order(120)[:30])
    cached = len((tmp_path / "cand" / "cache" / "requests.jsonl").read_text().splitlines())
    second = run(cand, tmp_path / "cand", data, order="seeded", fraction=0.5)  # resumes: the first 30 from the cache
    assert second.scores["arc_easy"]["n"] == 60
    assert len((tmp_path / "cand" / "cache" / "requests.jsonl").read_text().splitlines()) < 2 * cached + 1
    (tmp_path / "suite.yaml").write_text("sequential: {looks: [0.25, 0.5, 1.0]}\ntasks:\n  arc_easy: {margin: 100}\n")
    report = gate(tmp_path / "baseline", tmp_path / "cand", suite=tmp_path / "suite.yaml")
    assert report.sequential.look == 2 and report.decision == "pass" and report.tasks[0].n == 60


def test_release_evaluates_the_candidate_one_look_at_a_time(setup, tmp_path):
    base, _, data = setup
    (tmp_path / "suite.yaml").write_text("sequential: {looks: [0.25, 0.5, 1.0]}\ntasks:\n  arc_easy: {margin: 100}\n")
    config = {"source": str(base), "recipe": "dense-w4a16-g128", "convert": {"device": "cpu"},
              "verify": {"smoke": False}, "eval": {"tasks": ["arc_easy"], "data_dir": str(data), "device": "cpu"},
              "suite": "suite.yaml", "publish": {"repo": "file://published"}}
    (tmp_path / "release.yaml").write_text(json.dumps(config))
    result = release(tmp_path / "release.yaml")
    stages = {r.stage: r.summary for r in result.stages}
    assert stages["eval-candidate"].startswith("look 1 of 3 (25% of the items, pass)")
    verdict = json.loads((tmp_path / "release-work" / "gate" / "verdict.json").read_text())
    assert verdict["sequential"]["look"] == 1 and verdict["passed"]
    assert "not evaluated" in (tmp_path / "release-work" / "gate" / "report.md").read_text()


def test_a_task_the_suite_does_not_gate_is_evaluated_whole_at_the_first_look(setup, tmp_path):
    """Generation runs to a batch's longest answer: a task evaluated at every look pays for a runaway answer in each
    of its small batches (the demo's GSM8K, three 256-token runs instead of one). Ungated, it needs no looks."""
    _, _, data = setup
    base = add_word_tokenizer(build_synthetic("llama", tmp_path / "base", seed=1, fp8=False,
                                              max_position_embeddings=1024))  # GSM8K's prompts are long
    gsm8k = tmp_path / "data" / "gsm8k"
    gsm8k.mkdir(parents=True)
    (gsm8k / "test.jsonl").write_text("".join((DATA / "gsm8k" / "test.jsonl").read_text().splitlines(True)[:4]))
    shutil.copytree(data / "arc_easy", tmp_path / "data" / "arc_easy")
    (tmp_path / "suite.yaml").write_text("sequential: {looks: [0.25, 0.5, 1.0]}\ntasks:\n  arc_easy: {margin: 100}\n")
    config = {"source": str(base), "recipe": "dense-w4a16-g128", "convert": {"device": "cpu"},
              "verify": {"smoke": False}, "suite": "suite.yaml", "publish": {"repo": "file://published"},
              "eval": {"tasks": ["arc_easy", "gsm8k"], "data_dir": str(tmp_path / "data"), "device": "cpu"}}
    (tmp_path / "release.yaml").write_text(json.dumps(config))
    result = release(tmp_path / "release.yaml")
    assert {r.stage: r.summary for r in result.stages}["eval-candidate"].startswith("look 1 of 3")
    scores = json.loads((tmp_path / "release-work" / "runs" / "candidate" / "results.json").read_text())
    assert scores["arc_easy"]["n"] == 30 and scores["gsm8k"]["n"] == 4
