"""Gate suites: which tasks gate a release, each with its margin (and the cluster its variance is clustered by), and
the rules the gate decides by. Built-in suites live in eval/suites/; a suite file is the same YAML."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, field_validator

from quantkit.errors import CannotCompare, QuantkitError, field_error
from quantkit.evaluation.run_dir import RunRecord
from quantkit.packaged import suite_path
from quantkit.settings import Section

DEFAULT_SUITE = "release"


class TaskEntry(Section):
    """A task as a suite file lists it: its own margin or the file's default."""

    margin: float | None = Field(default=None, ge=0, le=100)
    cluster: str | None = None  # the run's cluster key (MMLU: subject): its items' variance is clustered


class TaskSpec(Section):
    """A gated task, resolved: the margin in accuracy points its delta's interval must clear."""

    margin: float = Field(ge=0, le=100)
    cluster: str | None = None


class Sequential(Section):
    """Looks at growing shares of the candidate's items, in the seeded order (eval --order seeded --fraction)."""

    looks: list[float] = Field(default_factory=lambda: [0.25, 0.5, 1.0], min_length=1)
    spending: Literal["obrien-fleming", "pocock"] = "obrien-fleming"

    @field_validator("looks")
    @classmethod
    def _increasing_to_one(cls, looks):
        if any(not 0 < t <= 1 for t in looks) or looks != sorted(set(looks)) or looks[-1] != 1:
            raise ValueError("looks are increasing shares of the items in (0, 1], the last 1")
        return looks


class _SuiteRules(Section):
    """How a suite decides, the same in the file and in the resolved suite."""

    alpha: float = Field(default=0.05, gt=0, lt=1)
    correction: Literal["bonferroni", "none"] = "bonferroni"
    decide_by: list[Literal["accuracy", "loglik"]] = Field(default_factory=lambda: ["accuracy"],  # type: ignore[arg-type]
                                                           min_length=1)
    loglik_margin: float = Field(default=0.1, ge=0)  # nats: the correct answer's log-likelihood may drop this much
    # Provenance fields the candidate may change besides its weights, because they ship with it
    # (the decode pool's FP8 KV cache: engine.args.kv_cache_dtype). Printed with every verdict.
    may_differ: list[str] = Field(default_factory=list)
    # Behaviour of generative tasks (release/behaviour.py): the candidate's answers may be this much longer
    # (ratio - 1) and run away (hit the length limit or loop) on this many more points of items.
    length_limit: float = Field(default=0.05, ge=0)
    runaway_margin: float = Field(default=1.0, ge=0, le=100)
    bootstrap_rounds: int = Field(default=2000, ge=100, le=100_000)
    sequential: Sequential | None = None  # decide at the first look that certifies or refutes (release/stats.py)


class Suite(_SuiteRules):
    """A suite, resolved: which tasks gate a release, each with its TaskSpec; the file it was read from (None: none
    was named, and the gate takes the tasks both runs hold under the built-in suite's rules); the margin that
    overrode every task's, if one did. The verdict records both, so that publish can gate again."""

    tasks: dict[str, TaskSpec]
    path: str | None = None
    margin: float | None = None


class _SuiteFile(_SuiteRules):
    """A suite as written: per-task margins optional, a default margin for the rest."""

    tasks: dict[str, TaskEntry | None] = Field(min_length=1)
    margin: float = Field(default=1.0, ge=0, le=100)


def load_suite(path: str | os.PathLike | None, margin: float | None = None) -> Suite:
    """A suite file, or a built-in suite by name (``release``, ``small-model``); ``margin`` overrides every task's."""
    from quantkit.yaml_file import load_yaml

    named = path is not None
    if margin is not None and not 0 <= margin <= 100:  # points of accuracy; also refuses NaN and infinity
        raise QuantkitError(f"the margin is a loss in accuracy points, from 0 to 100, not {margin:g}")
    path = suite_path(path or DEFAULT_SUITE)
    doc = load_yaml(path, "suite")
    try:
        spec = _SuiteFile.model_validate(doc if doc is not None else {})
    except ValidationError as exc:
        raise QuantkitError(f"invalid suite: {field_error(exc)}", path) from exc
    from quantkit.evaluation import task_spec

    for name in spec.tasks:
        try:
            task_spec(name)
        except QuantkitError as exc:
            raise QuantkitError(f"invalid suite: {exc.message}", path) from exc
    tasks = {name: TaskSpec(margin=margin if margin is not None else (t.margin if t and t.margin is not None
                                                                      else spec.margin),
                            cluster=t.cluster if t else None)
             for name, t in spec.tasks.items()}
    return Suite(tasks=tasks, path=str(Path(path).resolve()) if named else None, margin=margin,
                 **spec.model_dump(exclude={"tasks", "margin"}))


def shared_tasks(spec: Suite, base: RunRecord, cand: RunRecord, candidate) -> tuple[Suite, str]:
    """No suite named: the built-in suite's rules over the tasks both runs hold, each at the suite's margin for it (a
    task the suite does not list: its default margin) unless the suite's ``margin`` overrides them. Evaluating a few
    tasks and gating them is the everyday use; a suite file says which tasks must be there."""
    shared = [t for t in base.tasks if t in cand.tasks]
    if not shared:
        raise CannotCompare(f"the runs share no task (baseline: {', '.join(base.tasks) or 'none'}; candidate: "
                            f"{', '.join(cand.tasks) or 'none'})", Path(candidate) / "run.json")
    default = TaskSpec(margin=spec.margin if spec.margin is not None else _SuiteFile.model_fields["margin"].default)
    tasks = {t: spec.tasks.get(t, default) for t in shared}
    note = (f"no suite named: gated the {len(tasks)} task(s) both runs hold ({', '.join(tasks)}) under the "
            f"{DEFAULT_SUITE} suite's rules")
    return spec.model_copy(update={"tasks": tasks}), note
