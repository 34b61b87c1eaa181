"""Per-task progress in items for lm-eval runs.

lm-eval hands a model all of a task's requests at once and reports requests, not items. This
wrapper passes them on one slice of items at a time and reports after each slice, which gives
items/s and an ETA per task; results and the request cache are unchanged by the slicing.
"""

from __future__ import annotations

from collections.abc import Callable

from lm_eval.api.model import LM

from quantkit.evaluation.lm_wrapper import DelegatingLM

REQUESTS_PER_SLICE = 256


class TaskProgress(DelegatingLM):
    def __init__(self, inner: LM, task: str, on_progress: Callable[[str, int, int], None] | None):
        super().__init__(inner)
        self.task, self.on_progress = task, on_progress

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return self._sliced("loglikelihood", requests)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        return self._sliced("loglikelihood_rolling", requests)

    def generate_until(self, requests, disable_tqdm: bool = False):
        return self._sliced("generate_until", requests)

    def _sliced(self, method: str, requests: list) -> list:
        items: dict[object, list[int]] = {}
        for i, request in enumerate(requests):
            items.setdefault(request.doc_id, []).append(i)
        results: list = [None] * len(requests)
        done = 0
        self._report(done, len(items))
        batch: list[int] = []
        for n, indices in enumerate(items.values(), 1):
            batch += indices
            if len(batch) >= REQUESTS_PER_SLICE or n == len(items):
                answers = getattr(self.inner, method)([requests[i] for i in batch], disable_tqdm=True)
                for i, answer in zip(batch, answers, strict=True):
                    results[i] = answer
                batch, done = [], n
                self._report(done, len(items))
        return results

    def _report(self, done: int, total: int) -> None:
        if self.on_progress is not None:
            self.on_progress(self.task, done, total)
