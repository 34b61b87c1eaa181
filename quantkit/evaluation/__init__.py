"""``eval``: run the release benchmarks on a model and keep every item's outcome.

lm-eval runs the tasks through its Python API. With ``--data-dir`` (the hub's schema, as in shared/evaldata) each task
is an lm-eval task YAML that reads the local JSONL files (tasks.py); without it lm-eval's own hub-backed tasks run. The
engines are in engines.py: the in-process ``hf`` engine loads the model with quantkit's strict loader (so INT4 MoE
experts are really there) and can emulate an FP8 KV cache with the checkpoint's calibrated scales.

RUN_DIR keeps ``run.json`` (provenance), ``samples/<task>.jsonl`` (per item: id, prompt hash, correct, choice
log-likelihoods, gold), ``results.json`` (scores with stderr) and a request cache of JSON lines (never pickles:
request_cache.py), so a re-run with the same RUN_DIR resumes (runner.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from pydantic import ValidationError

from quantkit.checkpoint.writer import folder_lock, refuse_inside, work_folder, write_error
from quantkit.errors import QuantkitError, field_error
from quantkit.evaluation.engines import ENGINES, engine_settings
from quantkit.evaluation.eval_run import EvalRun
from quantkit.evaluation.identity import cache_binding, finished_run, model_checksums
from quantkit.evaluation.run_dir import REPEAT_DIR, Order, RunRecord
from quantkit.evaluation.runner import evaluate_into
from quantkit.evaluation.tasks import TASKS, task_configs, task_spec
from quantkit.settings import EvalSettings

__all__ = ["REPEAT_DIR", "EvalResult", "RunRecord", "cache_binding", "engine_settings", "evaluate", "finished_run",
           "model_checksums", "task_spec"]


@dataclass
class EvalResult:
    model: str
    run_dir: str
    engine: str
    scores: dict[str, dict[str, float]]  # task -> {"score", "stderr", "n"}
    seconds: float


def evaluate(
    model: str | os.PathLike,
    *,
    settings: EvalSettings | None = None,
    out: str | os.PathLike | None = None,
    order: str = "file",
    fraction: float | dict[str, float] | None = None,
    on_progress: Callable[[str, int, int], None] | None = None,
    on_launch: Callable[[list[str]], None] | None = None,
    **options,
) -> EvalResult:
    """Score MODEL on the tasks with one engine and keep every item's outcome in RUN_DIR (``out``).

    The engine's settings are an ``EvalSettings`` (quantkit/settings.py: engine, tasks, data_dir, limit,
    kv_cache_dtype, batch_size, tp, ep, url, engine_cmd, mem_fraction, health_timeout, device, dtype, repeat), given
    whole as ``settings`` or field by field as keywords (which override ``settings``).

    ``hf`` runs the model in-process on ``device``, computing in ``dtype`` (compute_dtype.py); ``sglang`` starts a
    server from ``engine_cmd`` for the run and stops it after; ``openai`` talks to a running server at ``url``. For
    the server engines MODEL is still the local checkpoint: its tokenizer splits context from continuation, its
    checksums go into the provenance. ``batch_size`` is requests per forward pass (hf) or in flight (servers).
    ``engine_cmd`` is executable configuration: it runs as given, and ``on_launch(argv)`` is told first.
    ``repeat=2`` runs everything again into RUN_DIR/repeat-2 with a request cache of its own: the engine's
    run-to-run noise, which ``gate`` uses as its floor. RUN_DIR is locked while the run writes into it.
    ``order="seeded"`` evaluates each task's items in a fixed seeded order and ``fraction`` the first share of them
    (a look of a sequential gate: a later, larger look answers the earlier items from the request cache); a mapping
    gives each task its own share, a task it does not name all of its items.
    """
    from quantkit.calibration_data import model_tokenizer

    started = time.perf_counter()
    s = _settings(settings, options)
    _check(s, order, fraction)
    path = Path(model)
    run_dir = Path(out) if out else Path("runs") / path.name
    refuse_inside(path, run_dir, "RUN_DIR")
    run = EvalRun(path, s, s.tasks or list(TASKS), cast(Order, order), fraction, on_progress, on_launch)
    ENGINES[s.engine].check(run)
    run.tokenizer = model_tokenizer(path)
    run.configs = task_configs(run.tasks, s.data_dir, path, run.tokenizer, run.order)  # refused before RUN_DIR exists
    if run_dir.exists() and not run_dir.is_dir():
        raise QuantkitError("RUN_DIR exists and is not a folder", run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise write_error(run_dir, exc) from exc
    with folder_lock(run_dir):
        scores = evaluate_into(run, run_dir, attempt=1)
        if s.repeat == 2:  # a fresh request cache: the engine answers everything again
            again = work_folder(run_dir, REPEAT_DIR)
            with folder_lock(again):
                evaluate_into(run, again, attempt=2)
    return EvalResult(str(path), str(run_dir), s.engine, {t: v.model_dump() for t, v in scores.items()},
                      time.perf_counter() - started)


def _settings(settings: EvalSettings | None, options: dict) -> EvalSettings:
    base = (settings or EvalSettings()).model_dump(include=set(EvalSettings.model_fields))
    paths = {k: os.fspath(v) for k, v in options.items() if isinstance(v, os.PathLike)}  # data_dir as a Path
    try:
        return EvalSettings.model_validate({**base, **options, **paths})
    except ValidationError as exc:
        raise QuantkitError(f"eval settings: {field_error(exc)}") from exc


def _check(s: EvalSettings, order: str, fraction: float | dict[str, float] | None) -> None:
    if s.engine not in ENGINES:
        raise QuantkitError(f"unknown engine {s.engine!r} (known: {', '.join(ENGINES)})")
    for task in s.tasks or []:
        task_spec(task)
    from quantkit.compute_dtype import check_dtype

    check_dtype(s.dtype)
    if s.kv_cache_dtype not in ("auto", "fp8_e4m3"):
        raise QuantkitError("--kv-cache-dtype must be auto or fp8_e4m3")
    if order not in ("file", "seeded"):
        raise QuantkitError(f"--order must be file or seeded, not {order!r}")
    shares = list(fraction.values()) if isinstance(fraction, dict) else [] if fraction is None else [fraction]
    if shares and not (all(0 < f <= 1 for f in shares) and order == "seeded" and s.limit is None):
        raise QuantkitError("--fraction takes a share of the items in (0, 1], with --order seeded and no --limit")
