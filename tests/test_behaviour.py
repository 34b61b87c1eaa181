"""The gate sees what accuracy hides: answers that grew longer, generations that run away, the engine's own
noise, and long context. Statistics on planted records first, then planted candidates on the real SmolLM2
answering real GSM8K items, an A/A pair of the hf engine, and the needle task."""

import json
import random
import sys
from pathlib import Path

import pytest
from helpers import evaldata, suite, write_generations, write_run

from quantkit.evaluation.generation import LOOP_SHARE, generation_stats, repeated_share, runaway
from quantkit.evaluation.run_dir import SampleRecord
from quantkit.release.behaviour import length_check, runaway_check
from quantkit.release.gate import CannotCompare, gate
from quantkit.release.stats import bootstrap_interval

DATA = evaldata("gsm8k")
STANDIN = Path(__file__).resolve().parent / "standin" / "sglang_standin.py"


def test_a_loop_covers_the_answer_and_an_ordinary_answer_has_none():
    assert repeated_share([7] * 40) == 1.0
    assert repeated_share([1, 2, 3] * 10) == 1.0
    assert repeated_share(list(range(50)) + [1, 2, 3, 4] * 10) == pytest.approx(40 / 90)
    assert repeated_share([1, 2, 1, 2, 5, 6, 7, 8]) == 0.0  # two copies are not a loop
    assert repeated_share(list(range(200))) == 0.0 and repeated_share([]) == 0.0
    stuck = generation_stats([5, 9] * 128, 256)
    assert stuck.hit_limit and stuck.looped and runaway(stuck.hit_limit, stuck.repetition)
    short = generation_stats(list(range(30)), 256)
    assert not short.hit_limit and not short.looped and not runaway(False, 0.0)
    assert runaway(False, LOOP_SHARE) and not runaway(False, LOOP_SHARE - 0.01)


def records(tokens, limit=None, loops=()):
    return {f"t-{i}": SampleRecord(item_id=f"t-{i}", prompt_hash=f"h{i}", correct=1, generated_tokens=n,
                                   hit_limit=limit is not None and n >= limit, repetition=0.9 if i in loops else 0.0)
            for i, n in enumerate(tokens)}


def test_length_ratio_interval_and_verdict():
    rng = random.Random(3)
    base = [rng.randrange(40, 200) for _ in range(64)]
    ids = sorted(records(base))
    same = length_check("t", ids, records(base), records(base), 0.05, 0.95, 2000)
    assert (same.estimate, same.low, same.high, same.median_ratio, same.passed) == (1.0, 1.0, 1.0, 1.0, True)
    longer = length_check("t", ids, records(base), records([int(n * 1.5) for n in base]), 0.05, 0.95, 2000)
    assert longer.estimate == pytest.approx(1.5, abs=0.01) and longer.low > 1.45 and not longer.passed
    # 3 % longer with item noise: the interval reaches below the 5 % limit, so it is not shown to be longer
    noisy = [max(1, int(n * 1.03 + rng.gauss(0, 15))) for n in base]
    slight = length_check("t", ids, records(base), records(noisy), 0.05, 0.95, 2000)
    assert slight.low < 1.05 < slight.high and slight.passed


def test_the_bootstrap_interval_covers_the_true_ratio_near_its_nominal_rate():
    rng = random.Random(11)
    hits, trials = 0, 150
    for t in range(trials):  # true mean ratio 1.2: candidate = 1.2 x baseline x noise of mean 1
        base = [rng.uniform(20, 200) for _ in range(80)]
        ratios = [(1.2 * b * rng.uniform(0.8, 1.2)) / b for b in base]
        lo, hi = bootstrap_interval(ratios, 0.9, 400, str(t))
        hits += lo <= 1.2 <= hi
    assert 0.82 <= hits / trials <= 0.97


def test_runaway_rate_against_the_baseline():
    ids = sorted(records([50] * 40))
    same = runaway_check("t", ids, records([50] * 40), records([50] * 40), 1.0, 1.96)
    assert (same.estimate, same.passed) == (0.0, True)
    looping = runaway_check("t", ids, records([50] * 40), records([50] * 30 + [256] * 10, limit=256), 1.0, 1.96)
    assert looping.candidate == 25.0 and looping.low > 1.0 and not looping.passed
    loops = runaway_check("t", ids, records([50] * 40), records([50] * 40, loops=range(8)), 1.0, 1.96)
    assert loops.estimate == 20.0 and not loops.passed




def test_gate_fails_longer_answers_and_reports_both_checks(tmp_path):
    base = [random.Random(i).randrange(60, 160) for i in range(50)]
    a = write_generations(tmp_path / "a", base)
    b = write_generations(tmp_path / "b", [int(n * 1.5) for n in base])
    # 50 items certify no more than ~7 points even when nothing flips: the margin is 10
    report = gate(a, b, suite=suite(tmp_path, ["gsm8k"], margin=10), report_dir=tmp_path / "report")
    assert not report.passed and all(t.passed for t in report.tasks)
    length, runaways = report.behaviour
    assert (length.check, length.passed, runaways.check, runaways.passed) == ("output length", False, "runaway generations", True)
    md = (tmp_path / "report" / "report.md").read_text()
    assert "| gsm8k | output length | 50 |" in md and "FAIL" in md
    assert (tmp_path / "report" / "lengths.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "report" / "verdict.json").read_text())["behaviour"][0]["estimate"] == length.estimate
    assert gate(a, a, suite=suite(tmp_path, ["gsm8k"], margin=10)).passed


def test_the_suite_sets_the_limits(tmp_path):
    base = [100] * 400  # enough items that accuracy certifies 5 points: the length limit decides
    a, b = write_generations(tmp_path / "a", base), write_generations(tmp_path / "b", [130] * 400)
    assert not gate(a, b, suite=suite(tmp_path, ["gsm8k"], margin=5)).passed
    assert gate(a, b, suite=suite(tmp_path, ["gsm8k"], margin=5, length_limit=0.5)).passed


def test_generation_records_in_one_run_only_cannot_be_compared(tmp_path):
    a = write_generations(tmp_path / "a", [100] * 10)
    b = write_run(tmp_path / "b", {"gsm8k": [1] * 10})
    with pytest.raises(CannotCompare, match="b: task gsm8k: item gsm8k-0 has no generation record"):
        gate(a, b, suite=suite(tmp_path, ["gsm8k"]))


def test_one_record_without_its_generation_fields_refuses_instead_of_switching_the_checks_off(tmp_path):
    """Both runs missing one record's fields used to skip the length and runaway checks without a word."""
    runs = []
    for name, tokens in (("a", [100] * 10), ("b", [300] * 10)):  # b answers three times longer: a failing candidate
        folder = write_generations(tmp_path / name, tokens)
        rows = (folder / "samples" / "gsm8k.jsonl").read_text().splitlines()
        rows[3] = json.dumps({k: v for k, v in json.loads(rows[3]).items() if k != "repetition"})
        (folder / "samples" / "gsm8k.jsonl").write_text("\n".join(rows) + "\n")
        runs.append(folder)
    with pytest.raises(CannotCompare, match="task gsm8k: item gsm8k-3 has no generation record"):
        gate(*runs, suite=suite(tmp_path, ["gsm8k"], margin=5))
    plain = [write_run(tmp_path / f"plain-{n}", {"gsm8k": [1] * 10}) for n in "ab"]  # a generative task without any
    with pytest.raises(CannotCompare, match="has no generation record"):
        gate(*plain, suite=suite(tmp_path, ["gsm8k"], margin=5))


def test_noise_floor_labels_a_candidate_within_or_beyond_the_engines_own_flips(tmp_path):
    rng = random.Random(5)
    base = [int(rng.random() < 0.6) for _ in range(200)]
    flip = lambda values, idx: [1 - v if i in idx else v for i, v in enumerate(values)]  # noqa: E731
    a = write_generations(tmp_path / "a", [80] * 200, base)
    aa = write_generations(tmp_path / "a" / "repeat-2", [80] * 200, flip(base, set(range(0, 200, 10))))  # 10 % flips
    near = write_generations(tmp_path / "near", [80] * 200, flip(base, set(range(0, 200, 20))))  # 5 % flips
    wrong = write_generations(tmp_path / "wrong", [80] * 200, [0 if i % 4 == 0 else v for i, v in enumerate(base)])
    s = suite(tmp_path, ["gsm8k"], margin=1)
    report = gate(a, near, suite=s)  # BASELINE/repeat-2 is found by itself
    assert report.noise_run == str(aa) and report.noise[0].flip_rate == 10.0
    assert report.tasks[0].engine_noise == "indistinguishable from engine noise"
    assert report.tasks[0].regression is False  # failing or not, its flips are within the engine's own
    bad = gate(a, wrong, suite=s)
    assert not bad.passed and bad.tasks[0].engine_noise == "beyond engine noise" and bad.tasks[0].regression is True
    assert "a regression" in __import__("quantkit.release.report", fromlist=["markdown"]).markdown(bad)
    plain = gate(a, near, suite=s, noise=write_generations(tmp_path / "aa2", [80] * 200, base, batch_size=4))
    assert plain.noise[0].flip_rate == 0.0 and plain.tasks[0].engine_noise == "beyond engine noise"


def test_a_noise_run_of_another_model_or_setup_is_refused(tmp_path):
    a = write_generations(tmp_path / "a", [80] * 20)
    other = write_generations(tmp_path / "other", [80] * 20, model="x")
    with pytest.raises(CannotCompare, match="not of the baseline's model"):
        gate(a, a, suite=suite(tmp_path, ["gsm8k"]), noise=other)
    engine = write_generations(tmp_path / "engine", [80] * 20)
    meta = json.loads((engine / "run.json").read_text())
    meta["engine"]["version"] = "2"
    (engine / "run.json").write_text(json.dumps(meta))
    with pytest.raises(CannotCompare, match="differs from the baseline's in more than engine.args.batch_size"):
        gate(a, a, suite=suite(tmp_path, ["gsm8k"]), noise=engine)


# ---- the real SmolLM2 on real GSM8K items ----------------------------------------------------------------

def standin(answers: Path) -> str:
    """The stand-in's command; its mode comes from STANDIN_MODE, so the planted candidates share the baseline's
    server command (the command is part of a run's setup, and the gate compares runs of one setup)."""
    import shlex

    return shlex.join([sys.executable, str(STANDIN), "--standin-answers", str(answers)])


@pytest.mark.slow
def test_planted_candidates_on_smollm2_gsm8k(smollm2_bf16, tmp_path, monkeypatch):
    """Served by the SGLang stand-in from the real SmolLM2's greedy answers (generated once, kept in a file the
    servers share): the model as it is (twice), the same answers with unrelated text appended (x1.5), and the same
    answers except one prompt in two looping to the limit."""
    from transformers import AutoTokenizer

    from quantkit.evaluation import evaluate

    tokenizer = AutoTokenizer.from_pretrained(smollm2_bf16)
    runs = {}
    for name, mode in (("base", "model"), ("again", "model"), ("filler", "filler"), ("loop", "loop")):
        monkeypatch.setenv("STANDIN_MODE", mode)
        runs[name] = evaluate(smollm2_bf16, engine="sglang", tasks=["gsm8k"], data_dir=DATA, limit=12,
                              out=tmp_path / name, engine_cmd=standin(tmp_path / "answers.jsonl"),
                              batch_size=4).run_dir
    base = [json.loads(x) for x in (tmp_path / "base" / "samples" / "gsm8k.jsonl").read_text().splitlines()]
    assert all(r["generated_tokens"] == len(tokenizer(r["generation"], add_special_tokens=False)["input_ids"]) for r in base)
    s = suite(tmp_path, ["gsm8k"], margin=50)  # accuracy is not what these candidates break
    same = gate(runs["base"], runs["again"], suite=s, noise=runs["again"])
    assert same.passed and [c.passed for c in same.behaviour] == [True, True]
    assert same.tasks[0].engine_noise == "indistinguishable from engine noise"
    filler = gate(runs["base"], runs["filler"], suite=s)
    length, runaways = filler.behaviour
    assert not filler.passed and not length.passed and length.low > 1.05 and runaways.passed
    loop = gate(runs["base"], runs["loop"], suite=s)
    assert not loop.passed and loop.behaviour[1].candidate > loop.behaviour[1].baseline and not loop.behaviour[1].passed


@pytest.mark.slow
def test_aa_on_the_hf_engine_with_two_batch_sizes(smollm2_bf16, tmp_path):
    """The in-process engine at batch 1 and batch 8: the floor is measured and reported, and a candidate equal
    to the baseline is called indistinguishable from engine noise."""
    from quantkit.evaluation import evaluate
    from quantkit.release.report import markdown

    one = evaluate(smollm2_bf16, engine="hf", tasks=["gsm8k"], data_dir=DATA, limit=12, out=tmp_path / "bs1",
                   batch_size=1).run_dir
    eight = evaluate(smollm2_bf16, engine="hf", tasks=["gsm8k"], data_dir=DATA, limit=12, out=tmp_path / "bs8",
                     batch_size=8).run_dir
    report = gate(one, one, suite=suite(tmp_path, ["gsm8k"], margin=50), noise=eight)
    floor = report.noise[0]
    assert floor.n == 12 and 0 <= floor.flip_rate <= 100
    assert report.passed and report.tasks[0].engine_noise == "indistinguishable from engine noise"
    assert f"the baseline's model flips {floor.flip_rate:.1f} % of items against itself" in markdown(report)
    assert floor.changed_answers is not None  # batch 1 and 8 pad differently: measured 4 of 12 answers changed
    (tmp_path / "floor.json").write_text(json.dumps(floor.model_dump()))  # the figure docs/gate.md records


@pytest.mark.slow
def test_needle_task_is_a_real_measurement_on_smollm2(smollm2_bf16, tmp_path):
    """Far above chance (1/4) at 1K tokens, lower at 4K; built offline from bundled text, the same items each time."""
    from quantkit.evaluation import evaluate
    from quantkit.evaluation.long_context import KEYS, needle_jsonl

    scores = {}
    for task in ("needle_1k", "needle_4k"):
        result = evaluate(smollm2_bf16, engine="hf", tasks=[task], limit=8, out=tmp_path / task, batch_size=4)
        scores[task] = result.scores[task]["score"]
    assert scores["needle_1k"] >= 2 * 100 / KEYS and scores["needle_4k"] < scores["needle_1k"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_bf16)
    assert needle_jsonl("needle_1k", tok) == needle_jsonl("needle_1k", tok)
    item = json.loads(needle_jsonl("needle_1k", tok).splitlines()[0])
    assert 900 < len(tok(item["context"])["input_ids"]) <= 1024 and f"The access code of {item['name']} is {item['code']}." in item["context"]
