"""The evaluation run directory: what ``eval`` writes and ``gate``, ``release`` and the card read.

RUN_DIR holds ``run.json`` (a ``RunRecord``: the provenance), ``samples/<task>.jsonl`` (one
``SampleRecord`` per item) and ``results.json`` (scores). Run directories are shared between
people and releases (a reused baseline), so everything read back is validated strictly: unknown
fields, out-of-range values, duplicated or foreign item ids are refused with the file and line
named, never silently collapsed (a duplicated id once let a failing candidate pass).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from quantkit.checkpoint.writer import write_bytes_atomic
from quantkit.errors import CannotCompare, QuantkitError, field_error
from quantkit.evaluation.probe import ProbeRecord

RUN_NAME = "run.json"
RESULTS_NAME = "results.json"
REPEAT_DIR = "repeat-2"  # RUN_DIR/repeat-2: the second run of ``--repeat 2`` (gate's default noise run)
MAX_SAMPLE_FILE_BYTES = 1 << 30
ORDER_SEED = 20140923  # the one seeded order of a task's items (sequential gating evaluates its prefixes)


def seeded_order(population: int) -> list[int]:
    """A task's items in the fixed seeded order: a look at a fraction of the items is a prefix of it."""
    import numpy as np

    return np.random.default_rng(ORDER_SEED).permutation(population).tolist()


Order = Literal["file", "seeded"]  # the items in the data file's order, or in seeded_order(population)

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TaskIdentity(_Strict):
    config_sha256: str | None = None  # the task's YAML + data sha256; None for lm-eval's own tasks
    num_fewshot: int = 0
    limit: int | None = None
    items: int | None = None  # items scored: the first `limit` of the data (in `order`), or all of it
    order: Order = "file"  # seeded: the items in seeded_order(population)
    population: int | None = None  # items in the task's data
    cluster_key: str | None = None  # the data field each record's cluster is (MMLU: subject)

    def item_ids(self, task: str, scored: int) -> set[str]:
        """The item ids a run of this task holds: the first ``items`` in its order."""
        count = self.items if self.items is not None else scored
        if self.order == "seeded" and self.population is not None:
            return {f"{task}-{i}" for i in seeded_order(self.population)[:count]}
        return {f"{task}-{i}" for i in range(count)}


class EngineRecord(_Strict):
    name: str
    version: str
    args: dict = Field(default_factory=dict)


class RunRecord(_Strict):
    model: str
    model_checksums: dict[str, str]  # every file that ships with the model -> sha256
    # the evaluated checkpoint as a conversion's manifest names its source (Checkpoint.fingerprint): what binds a
    # baseline run to the model a candidate was converted from; None for runs before quantkit recorded it
    model_fingerprint: str | None = None
    model_family: dict | None = None
    lm_eval_version: str | None = None
    tasks: dict[str, TaskIdentity]
    chat_template_sha256: str | None = None
    chat_template_applied: bool = False
    seeds: dict[str, int] = Field(default_factory=dict)
    engine: EngineRecord
    server: dict | None = None
    probe: ProbeRecord | None = None  # a server engine's answers after boot, against quantkit's decoding (probe.py)


class SampleRecord(_Strict):
    item_id: str
    prompt_hash: str
    correct: int = Field(ge=0, le=1)
    gold: int | None = Field(default=None, ge=0)
    choice_logprobs: list[float] | None = None
    response: str | None = None
    # generative tasks (evaluation/generation.py): the answer as generated, its length in tokens, whether it
    # ran into the length limit, and the share of it one back-to-back repeat covers
    generation: str | None = None
    generated_tokens: int | None = Field(default=None, ge=0)
    hit_limit: bool | None = None
    repetition: float | None = Field(default=None, ge=0, le=1)
    cluster: str | None = None  # the task's cluster key's value for this item (MMLU: its subject)

    @field_validator("choice_logprobs")
    @classmethod
    def _finite(cls, values):
        if values is not None and (not values or not all(math.isfinite(v) for v in values)):
            raise ValueError("must be a non-empty list of finite numbers")
        return values

    @model_validator(mode="after")
    def _gold_in_range(self):
        if self.gold is not None and self.choice_logprobs is not None and self.gold >= len(self.choice_logprobs):
            raise ValueError(f"gold {self.gold} is out of range for {len(self.choice_logprobs)} choices")
        return self


class TaskScore(_Strict):
    score: float
    stderr: float
    n: int


def read_run_record(run_dir: Path) -> RunRecord:
    path = run_dir / RUN_NAME
    if not path.is_file():
        raise CannotCompare("not a run directory (no run.json)", run_dir)
    try:
        return RunRecord.model_validate_json(path.read_bytes())
    except ValidationError as exc:
        raise CannotCompare(f"invalid run record: {field_error(exc)}", path) from exc


def read_samples(run_dir: Path, task: str, identity: TaskIdentity) -> dict[str, SampleRecord]:
    """One task's records by item id; ids must be unique and exactly the run's items (TaskIdentity.item_ids)."""
    path = run_dir / "samples" / f"{task}.jsonl"
    if not path.is_file():
        raise CannotCompare(f"task {task} has no samples file", path)
    if path.stat().st_size > MAX_SAMPLE_FILE_BYTES:
        raise CannotCompare("samples file over 1 GiB", path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise CannotCompare(f"not UTF-8 text ({exc.reason} at byte {exc.start})", path) from exc
    rows: dict[str, SampleRecord] = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = SampleRecord.model_validate_json(line)
        except ValidationError as exc:
            raise CannotCompare(f"line {n}: invalid sample ({field_error(exc)})", path) from exc
        if row.item_id in rows:
            raise CannotCompare(f"line {n}: item {row.item_id} appears twice", path)
        rows[row.item_id] = row
    if not rows:
        raise CannotCompare(f"task {task} scored no items", path)
    expected = identity.item_ids(task, len(rows))
    if set(rows) != expected:
        odd = sorted(set(rows) ^ expected)[0]
        which = "seeded-order" if identity.order == "seeded" else "task's"
        raise CannotCompare(f"the items are not the {which} first {len(expected)} ({odd} is missing or foreign)", path)
    return rows


def write_samples(run_dir: Path, task: str, records: list[SampleRecord]) -> None:
    text = "".join(r.model_dump_json(exclude_none=True) + "\n" for r in records)
    write_bytes_atomic(run_dir / "samples" / f"{task}.jsonl", text.encode())


def write_run_record(run_dir: Path, record: RunRecord) -> None:
    write_bytes_atomic(run_dir / RUN_NAME, (record.model_dump_json(indent=2) + "\n").encode())


def write_scores(run_dir: Path, scores: dict[str, TaskScore]) -> None:
    data = {task: s.model_dump() for task, s in scores.items()}
    write_bytes_atomic(run_dir / RESULTS_NAME, (json.dumps(data, indent=2) + "\n").encode())


def read_scores(run_dir: Path) -> dict[str, TaskScore]:
    path = run_dir / RESULTS_NAME
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        return {task: TaskScore.model_validate(s) for task, s in data.items()}
    except (OSError, ValueError) as exc:
        raise QuantkitError(f"unreadable scores ({str(exc).splitlines()[0]})", path) from exc
