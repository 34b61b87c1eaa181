"""The request cache of an evaluation run: answers already computed, so a re-run resumes.

lm-eval's own cache (``use_cache``) is a SqliteDict of pickles, and a run directory is shared
(a baseline reused by another release, a copy from a colleague): unpickling a poisoned copy
runs arbitrary code. quantkit keeps its cache as JSON lines instead, one answer per line keyed
by lm-eval's request hash (``hash_args``: sha256 of the method and its JSON arguments), and
validates every value read back: a log-likelihood is ``[float, bool]``, a generation a string.
Answers are appended as the model produces them, so a crash loses nothing already done.

Every answer is bound to what produced it: each line carries the run's ``binding`` (a digest of the
model's file checksums and the engine and its settings, ``evaluation.cache_binding``). A request
alone does not say which model answered it, so a cache copied from another model's run would
otherwise score that model's answers as this one's; a cache holding any answer of another binding,
or an unbound one, is refused whole.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from lm_eval.api.model import LM, hash_args

from quantkit.errors import QuantkitError
from quantkit.evaluation.lm_wrapper import DelegatingLM

METHODS = ("loglikelihood", "loglikelihood_rolling", "generate_until")


def _valid(attr: str, value):
    """The answer as the model returns it, or None when ``value`` is not a well-formed answer of ``attr``."""
    if attr == "loglikelihood":
        if (isinstance(value, list) and len(value) == 2 and isinstance(value[0], (int, float))
                and not isinstance(value[0], bool) and math.isfinite(value[0]) and isinstance(value[1], bool)):
            return (float(value[0]), value[1])
        return None
    if attr == "loglikelihood_rolling":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        return float(value) if ok else None
    return value if isinstance(value, str) else None


class RequestCache:
    """``RUN_DIR/cache/requests.jsonl`` of one binding; also lm-eval's cache hook (``add_partial``)."""

    def __init__(self, path: Path, binding: str):
        self.path = Path(path)
        self.binding = binding
        self.answers: dict[str, object] = {}
        if self.path.is_symlink():
            raise QuantkitError("the request cache is a link: refused", self.path)
        if self.path.is_file():
            self._load()

    def _load(self) -> None:
        lines = self.path.read_bytes().splitlines()  # decoded line by line: a kill may cut the last one mid-character
        foreign = unbound = 0
        for n, line in enumerate(lines, 1):
            try:
                row = json.loads(line.decode("utf-8"))
                key, attr = row["key"], row["attr"]
                answer = _valid(attr, row["answer"]) if attr in METHODS else None
                if not (isinstance(key, str) and len(key) == 64) or answer is None:
                    raise ValueError("not an answer")
            except (ValueError, KeyError, TypeError) as exc:
                if n == len(lines):  # the last line of a run killed mid-write: recompute it
                    continue
                raise QuantkitError(f"line {n}: not a cached answer ({exc}); delete the cache to start over",
                                    self.path) from exc
            binding = row.get("binding")
            if binding != self.binding:
                foreign += binding is not None
                unbound += binding is None
                continue
            self.answers[key] = answer
        if foreign or unbound:
            what = (f"{foreign} answer(s) of another model or engine setup" if foreign else "") + \
                   (" and " if foreign and unbound else "") + \
                   (f"{unbound} answer(s) bound to no model (an older quantkit's)" if unbound else "")
            raise QuantkitError(f"holds {what}: refused, they would be scored as this model's; delete "
                                f"{self.path.parent} or evaluate into another --out", self.path)

    def get(self, attr: str, args) -> object | None:
        return self.answers.get(hash_args(attr, args))

    def add_partial(self, attr: str, req, res) -> None:
        key = hash_args(attr, req)
        value = list(res) if isinstance(res, tuple) else res  # as JSON stores it
        if key in self.answers or _valid(attr, value) is None:
            return
        self.answers[key] = res
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
        with os.fdopen(fd, "a") as f:
            f.write(json.dumps({"key": key, "attr": attr, "answer": value, "binding": self.binding}) + "\n")


class CachedLM(DelegatingLM):
    """Answers from the cache where it has them; the inner model answers the rest and fills it."""

    def __init__(self, inner: LM, cache: RequestCache):
        super().__init__(inner)
        self.cache = cache
        inner.set_cache_hook(cache)

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return self._answer("loglikelihood", requests, disable_tqdm)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        return self._answer("loglikelihood_rolling", requests, disable_tqdm)

    def generate_until(self, requests, disable_tqdm: bool = False):
        return self._answer("generate_until", requests, disable_tqdm)

    def _answer(self, attr: str, requests: list, disable_tqdm: bool) -> list:
        # Sampled generations are not repeatable: never answered from the cache.
        sampled = attr == "generate_until" and any(r.args[1].get("do_sample", False) for r in requests)
        results = [None if sampled else self.cache.get(attr, r.args) for r in requests]
        missing = [i for i, r in enumerate(results) if r is None]
        if missing:
            answers = getattr(self.inner, attr)([requests[i] for i in missing], disable_tqdm=disable_tqdm)
            for i, answer in zip(missing, answers, strict=True):
                results[i] = answer
                if not sampled:
                    self.cache.add_partial(attr, requests[i].args, answer)
        return results
