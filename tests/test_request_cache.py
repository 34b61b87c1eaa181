"""The request cache of a run directory: JSON data only, checked on reading, a torn last line recomputed."""

import json

import pytest
from lm_eval.api.model import hash_args

from quantkit.errors import QuantkitError
from quantkit.evaluation.request_cache import RequestCache
import shutil
from quantkit.evaluation import RunRecord, cache_binding
from helpers import evaluate_small

ARGS = ("Question: 2+2?\nAnswer:", " 4")
BINDING = "b" * 64


def line(attr, args, answer):
    return json.dumps({"key": hash_args(attr, args), "attr": attr, "answer": answer, "binding": BINDING})


def test_answers_round_trip_as_json(tmp_path):
    cache = RequestCache(tmp_path / "requests.jsonl", BINDING)
    cache.add_partial("loglikelihood", ARGS, (-1.5, True))
    cache.add_partial("generate_until", ("Q", {"until": ["\n"]}), "4")
    again = RequestCache(tmp_path / "requests.jsonl", BINDING)
    assert again.get("loglikelihood", ARGS) == (-1.5, True)
    assert again.get("generate_until", ("Q", {"until": ["\n"]})) == "4"


def test_a_torn_last_line_is_recomputed_and_any_other_bad_line_refused(tmp_path):
    path = tmp_path / "requests.jsonl"
    good = line("loglikelihood", ARGS, [-1.5, True])
    path.write_bytes((good + "\n").encode() + b'{"key": "ab\xe2\x82')  # killed mid-write, mid-character
    assert RequestCache(path, BINDING).get("loglikelihood", ARGS) == (-1.5, True)
    for bad in ('{"key": "x", "attr": "loglikelihood", "answer": [-1.0, true]}',  # not a request hash
                line("loglikelihood", ARGS, ["__import__('os')", True]),  # not a number
                line("loglikelihood", ARGS, [float("nan"), True]),
                line("shell", ARGS, "rm -rf /")):  # not a method
        path.write_text(bad + "\n" + good + "\n")
        with pytest.raises(QuantkitError, match="line 1: not a cached answer"):
            RequestCache(path, BINDING)


def test_a_linked_cache_is_refused(tmp_path):
    (tmp_path / "elsewhere.jsonl").write_text("")
    (tmp_path / "requests.jsonl").symlink_to(tmp_path / "elsewhere.jsonl")
    with pytest.raises(QuantkitError, match="is a link"):
        RequestCache(tmp_path / "requests.jsonl", BINDING)


def test_a_candidate_evaluated_into_a_folder_seeded_with_the_baselines_cache_is_refused(llama_pair, tmp_path):
    base, cand = llama_pair
    evaluate_small(base, tmp_path / "baseline")
    seeded = tmp_path / "candidate"
    (seeded / "cache").mkdir(parents=True)
    shutil.copy(tmp_path / "baseline" / "cache" / "requests.jsonl", seeded / "cache")  # no run.json: nothing else binds it
    with pytest.raises(QuantkitError, match=r"requests.jsonl: holds \d+ answer\(s\) of another model or engine setup"):
        evaluate_small(cand, seeded)
    assert not (seeded / "run.json").exists() and not (seeded / "results.json").exists()

    # the same model again resumes from its own cache
    again = evaluate_small(base, tmp_path / "baseline")
    assert again.scores["arc_easy"]["n"] == 4


def test_unbound_answers_and_a_copied_first_pass_are_refused(tmp_path):
    record = RunRecord(model="m", model_checksums={"a": "0" * 64}, tasks={}, engine={"name": "hf", "version": "1"})
    first, second = cache_binding(record, 1), cache_binding(record, 2)
    assert first != second  # the repeat that measures engine noise cannot be a copy of the first pass
    path = tmp_path / "requests.jsonl"
    RequestCache(path, first).add_partial("loglikelihood", ("Q", " A"), (-1.0, True))
    assert RequestCache(path, first).get("loglikelihood", ("Q", " A")) == (-1.0, True)
    with pytest.raises(QuantkitError, match="1 answer.s. of another model or engine setup"):
        RequestCache(path, second)
    row = json.loads(path.read_text())
    del row["binding"]  # what a cache written before binding looks like
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(QuantkitError, match="bound to no model"):
        RequestCache(path, first)
    other = dict(record.model_dump(), model_checksums={"a": "1" * 64})
    assert cache_binding(RunRecord(**other), 1) != first
