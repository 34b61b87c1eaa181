"""The request cache of a run directory: JSON data only, checked on reading, a torn last line recomputed."""

import json

import pytest
from lm_eval.api.model import hash_args

from quantkit.errors import QuantkitError
from quantkit.evaluation.request_cache import RequestCache

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
