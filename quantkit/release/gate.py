"""``gate``: may the candidate ship? A paired non-inferiority test on the same items.

Two evaluation runs of the same items (baseline and candidate) are compared per task: the delta
of accuracy with a confidence interval from the per-item differences (paired, so the items'
own difficulty cancels), a non-inferiority verdict (the interval's lower bound above -margin),
a Bonferroni correction for testing several tasks at once, and continuous paired signals from
the same runs (change of the correct answer's log-likelihood, flip rate, KL divergence of the
choice distributions) with a power statement.

A run directory holds ``run.json`` (provenance) and ``samples/<task>.jsonl``, one line per item:
``{"item_id", "prompt_hash", "correct": 0|1, "choice_logprobs": [...] (optional), "gold": int (optional)}``.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Literal, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from quantkit.errors import CannotCompare, QuantkitError, field_error
from quantkit.evaluation import REPEAT_DIR
from quantkit.evaluation.run_dir import RunRecord, SampleRecord, read_run_record, read_samples
from quantkit.packaged import suite_path
from quantkit.release.behaviour import (
    BehaviourCheck,
    NoiseFloor,
    is_generative,
    length_check,
    missing_generation,
    noise_floor,
    read_noise_run,
    runaway_check,
)
from quantkit.release.provenance import provenance_differences
from quantkit.release.stats import (
    argmax,
    certifiable_margin,
    choice_kl,
    design_effect,
    items_for_margin,
    look_alphas,
    paired_binary_interval,
    t_interval,
    z_of,
    z_tail,
)

DEFAULT_SUITE = "release"

__all__ = ["CannotCompare", "GateReport", "Suite", "TaskVerdict", "gate", "load_samples", "load_suite"]


Decision = Literal["pass", "fail", "continue"]  # continue: undecided at a sequential look before the last

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TaskSpec(_Strict):
    margin: float | None = Field(default=None, ge=0, le=100)
    cluster: str | None = None  # the run's cluster key (MMLU: subject): its items' variance is clustered


class Sequential(_Strict):
    """Looks at growing shares of the candidate's items, in the seeded order (eval --order seeded --fraction)."""

    looks: list[float] = Field(default_factory=lambda: [0.25, 0.5, 1.0], min_length=1)
    spending: Literal["obrien-fleming", "pocock"] = "obrien-fleming"

    @field_validator("looks")
    @classmethod
    def _increasing_to_one(cls, looks):
        if any(not 0 < t <= 1 for t in looks) or looks != sorted(set(looks)) or looks[-1] != 1:
            raise ValueError("looks are increasing shares of the items in (0, 1], the last 1")
        return looks


class _SuiteRules(_Strict):
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
    """A suite: which tasks gate a release, each with its margin in accuracy points."""

    tasks: dict[str, float]  # task -> margin in accuracy points
    clusters: dict[str, str] = Field(default_factory=dict)  # task -> the cluster key its variance is clustered by


class _SuiteFile(_SuiteRules):
    """A suite as written: per-task margins optional, a default margin for the rest."""

    tasks: dict[str, TaskSpec | None] = Field(min_length=1)
    margin: float = Field(default=1.0, ge=0, le=100)


class Signal(_Strict):
    name: str
    estimate: float
    low: float | None = None  # None: a point estimate without an interval
    high: float | None = None
    unit: str


class TaskVerdict(_Strict):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # verdict.json is strict JSON

    task: str
    n: int
    baseline: float  # accuracy, percent
    candidate: float
    delta: float  # points
    low: float
    high: float
    margin: float
    passed: bool
    flip_rate: float  # share of items whose correctness changed
    certifiable_margin: float  # points this n can certify at the observed discordance (true delta 0)
    items_for_margin: int  # items needed to certify the margin at that discordance
    signals: list[Signal] = Field(default_factory=list)
    decided_by: list[str] = Field(default_factory=list)
    # with an A/A run: whether the candidate's flip rate is within the engine's own (noise floor)
    engine_noise: Literal["indistinguishable from engine noise", "beyond engine noise"] | None = None
    regression: bool | None = None  # a failing task whose flips exceed the noise floor
    design_effect: float = 1.0  # clustered items: the interval is widened by its square root
    clusters: int | None = None
    decision: Decision = "fail"  # continue: undecided at a sequential look before the last
    note: str | None = None  # why this n cannot certify the margin, when it cannot


class SequentialLook(_Strict):
    look: int  # 1-based
    looks: int
    fraction: float  # share of the items the candidate was evaluated on
    items: int  # candidate items evaluated, over every task
    population: int  # items the tasks hold
    alpha: float  # one-sided alpha this look tests at, per task


class GateReport(_Strict):
    """The verdict (verdict.json): what publish and the model card trust."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    baseline: str
    candidate: str
    passed: bool
    confidence: float  # per task, after the correction
    correction: str
    tasks: list[TaskVerdict]
    candidate_checksums: dict[str, str]  # every file the candidate ships with -> sha256
    allowed_differences: list[str] = Field(default_factory=list)  # by the suite's may_differ
    behaviour: list[BehaviourCheck] = Field(default_factory=list)  # generative tasks: length, runaways
    noise_run: str | None = None  # the A/A run of the baseline's model
    gated: str | None = None  # with no suite named: which tasks were gated, and why those
    noise: list[NoiseFloor] = Field(default_factory=list)
    report_files: list[str] = Field(default_factory=list)
    decision: Decision = "fail"
    sequential: SequentialLook | None = None


def load_suite(path: str | os.PathLike | None, margin: float | None = None) -> Suite:
    """A suite file, or a built-in suite by name (``release``, ``small-model``); ``margin`` overrides every task's."""
    from quantkit.yaml_file import load_yaml

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
    tasks = {name: float(margin if margin is not None else (t.margin if t and t.margin is not None else spec.margin))
             for name, t in spec.tasks.items()}
    clusters = {name: t.cluster for name, t in spec.tasks.items() if t and t.cluster}
    return Suite(tasks=tasks, clusters=clusters, **spec.model_dump(exclude={"tasks", "margin"}))


def load_samples(run_dir: Path, record: RunRecord, task: str) -> dict[str, SampleRecord]:
    """One task's records of a run, strictly validated against the run's item count."""
    if task not in record.tasks:
        raise CannotCompare(f"task {task} is not in this run", run_dir / "run.json")
    return read_samples(run_dir, task, record.tasks[task])


def gate(
    baseline: str | os.PathLike,
    candidate: str | os.PathLike,
    *,
    suite: str | os.PathLike | None = None,
    margin: float | None = None,
    report_dir: str | os.PathLike | None = None,
    noise: str | os.PathLike | None = None,
) -> GateReport:
    """Compare CANDIDATE's run with BASELINE's per the suite; write the report files when ``report_dir`` is given.

    ``noise``: a second run of the baseline's model (A/A) giving the engine's own flip rate; without it,
    BASELINE/repeat-2 is used when ``eval --repeat 2`` wrote one. Raises CannotCompare (no verdict either
    way) when the runs or the suite cannot be read, or the runs differ in more than the model and what the
    suite's ``may_differ`` allows.
    """
    try:
        spec = load_suite(suite, margin)
    except CannotCompare:
        raise
    except QuantkitError as exc:
        raise CannotCompare(exc.message, exc.file, exc.tensor) from exc
    base_record, cand_record = read_run_record(Path(baseline)), read_run_record(Path(candidate))
    spec, gated = _shared_tasks(spec, margin, base_record, cand_record, candidate) if suite is None else (spec, None)
    _require_tasks(spec, (base_record, baseline), (cand_record, candidate))
    allowed = _allowed_differences(spec, base_record, cand_record, candidate)
    k = len(spec.tasks)
    alpha = spec.alpha / k if spec.correction == "bonferroni" else spec.alpha  # two-sided, per task
    look = _look(spec, base_record, cand_record, alpha / 2, candidate) if spec.sequential else None
    z = z_of(look.alpha if look else alpha / 2)
    if noise is None and (Path(baseline) / REPEAT_DIR / "run.json").is_file():
        noise = Path(baseline) / REPEAT_DIR
    noise_record = read_noise_run(Path(noise), base_record) if noise is not None else None
    verdicts, behaviour, floors = [], [], []
    for task, task_margin in spec.tasks.items():
        b, c = load_samples(Path(baseline), base_record, task), load_samples(Path(candidate), cand_record, task)
        ids = _paired_items(task, b, c, candidate, subset=spec.sequential is not None)
        clusters = _clusters(task, spec, base_record, ids, b, baseline)
        verdict = _task_verdict(task, ids, b, c, task_margin, z, spec, clusters)
        verdict.decision = _decision(verdict, look)
        verdict.passed = verdict.decision == "pass"
        behaviour += _behaviour_checks(task, ids, [(baseline, b), (candidate, c)], spec, z)
        if noise is not None and noise_record is not None:
            again = load_samples(Path(noise), noise_record, task)
            _paired_items(task, b, again, noise)
            floor = noise_floor(task, ids, b, again)
            floors.append(floor)
            within = verdict.flip_rate <= floor.flip_rate
            verdict.engine_noise = "indistinguishable from engine noise" if within else "beyond engine noise"
            verdict.regression = verdict.decision == "fail" and not within
        verdicts.append(verdict)
    decision = _overall(verdicts, behaviour, look)
    report = GateReport(
        baseline=str(baseline),
        candidate=str(candidate),
        passed=decision == "pass",
        confidence=1 - 2 * z_tail(z),
        correction=f"{spec.correction} over {k} tasks" if spec.correction == "bonferroni" else "none",
        tasks=verdicts,
        candidate_checksums=dict(cand_record.model_checksums or {}),
        allowed_differences=allowed,
        behaviour=behaviour,
        noise_run=str(noise) if noise is not None else None,
        gated=gated,
        noise=floors,
        decision=decision,
        sequential=look,
    )
    if report_dir is not None:
        from quantkit.release.report import write_gate_report

        if Path(report_dir).exists() and not Path(report_dir).is_dir():
            raise CannotCompare("the report folder is a file", Path(report_dir))
        report.report_files = [str(p) for p in write_gate_report(report, Path(report_dir))]
    return report


def _require_tasks(spec: Suite, *runs: tuple[RunRecord, str | os.PathLike]) -> None:
    for record, run in runs:
        missing = [t for t in spec.tasks if t not in record.tasks]
        if missing:
            raise CannotCompare(f"task {missing[0]} is not in this run (the suite gates {', '.join(spec.tasks)})",
                                Path(run) / "run.json")


def _shared_tasks(spec: Suite, margin: float | None, base: RunRecord, cand: RunRecord, candidate) -> tuple[Suite, str]:
    """No suite named: the built-in suite's rules over the tasks both runs hold, each at the suite's margin for it (a
    task the suite does not list: its default margin) unless ``margin`` is given. Evaluating a few tasks and gating
    them is the everyday use; a suite file says which tasks must be there."""
    shared = [t for t in base.tasks if t in cand.tasks]
    if not shared:
        raise CannotCompare(f"the runs share no task (baseline: {', '.join(base.tasks) or 'none'}; candidate: "
                            f"{', '.join(cand.tasks) or 'none'})", Path(candidate) / "run.json")
    default = margin if margin is not None else _SuiteFile.model_fields["margin"].default
    tasks = {t: spec.tasks.get(t, default) for t in shared}
    clusters = {t: key for t, key in spec.clusters.items() if t in tasks}
    note = (f"no suite named: gated the {len(tasks)} task(s) both runs hold ({', '.join(tasks)}) under the "
            f"{DEFAULT_SUITE} suite's rules")
    return spec.model_copy(update={"tasks": tasks, "clusters": clusters}), note


_LOOK_FIELD = re.compile(r"^tasks\.[^.]+\.(limit|items|order)$")  # what a sequential look changes in a run


def _allowed_differences(spec: Suite, base: RunRecord, cand: RunRecord, candidate) -> list[str]:
    """The provenance differences of the two runs that the suite's ``may_differ`` allows; any other (a sequential
    look's item count aside) refuses the comparison."""
    found = [d for d in provenance_differences(base.model_dump(), cand.model_dump())
             if not d.startswith("tasks.") or d.split(".")[1].split(":")[0] in spec.tasks]  # a task not gated: unread
    allowed = [d for d in found if d.split(":", 1)[0] in spec.may_differ]
    looked = [d for d in found if spec.sequential and _LOOK_FIELD.match(d.split(":", 1)[0])]
    diffs = [d for d in found if d not in allowed and d not in looked]
    if diffs:
        raise CannotCompare(f"runs differ in more than the model: {'; '.join(diffs[:5])}", candidate)
    return allowed


def _behaviour_checks(task: str, ids: list[str], runs: list[tuple], spec: Suite, z: float) -> list[BehaviourCheck]:
    """Length and runaway checks, which decide generative tasks: a record without their fields would switch them off,
    so it is refused. ``runs``: (run folder, records) of the baseline and of the candidate."""
    (_, b), (_, c) = runs
    if not is_generative(task, b, c):
        return []
    for run, rows in runs:
        if (item := missing_generation(rows)) is not None:
            raise CannotCompare(f"task {task}: item {item} has no generation record (tokens, limit, "
                                "repetition), which the behaviour checks need; re-run eval for this run", run)
    return [length_check(task, ids, b, c, spec.length_limit, 1 - 2 * z_tail(z), spec.bootstrap_rounds),
            runaway_check(task, ids, b, c, spec.runaway_margin, z)]


def _look(spec: Suite, base: RunRecord, cand: RunRecord, alpha_one_sided: float, candidate) -> SequentialLook:
    """Which look of the suite's plan the candidate's run is, and the alpha that look spends: every task's items are
    the seeded-order prefix at one and the same look (eval --order seeded --fraction t). Looks that round to one item
    count for a task are one look there, the last of them, spending what they spend together: a run of every item is
    always the last look, which decides."""
    plan = spec.sequential
    assert plan is not None  # called for sequential suites only
    sizes: dict[str, list[int]] = {}
    for task in spec.tasks:
        b, c = base.tasks.get(task), cand.tasks.get(task)
        if b is None or c is None or c.population is None or c.items is None:
            raise CannotCompare(f"task {task}: a sequential gate needs both runs to hold it with its item count",
                                candidate)
        if c.order != "seeded":
            raise CannotCompare(f"task {task}: the candidate's items are in the file's order; a sequential gate looks "
                                "at seeded-order prefixes (eval --order seeded --fraction)", candidate)
        sizes[task] = [math.ceil(t * c.population) for t in plan.looks]
        if c.items not in sizes[task]:
            raise CannotCompare(f"task {task}: {c.items} items is none of the looks {sizes[task]} of the suite's plan",
                                candidate)
    counts = {task: cast(int, cand.tasks[task].items) for task in spec.tasks}
    index = max((i for i in range(len(plan.looks)) if all(sizes[t][i] == counts[t] for t in spec.tasks)), default=None)
    if index is None:
        raise CannotCompare("the tasks were evaluated at different looks; evaluate them at one --fraction", candidate)
    alphas = look_alphas(alpha_one_sided, plan.looks, plan.spending)
    # a task spends from the first look past the last one at which it held fewer items; min: none over-spends
    alpha = min(sum(alphas[next(i for i in range(index + 1) if sizes[t][i] == counts[t]):index + 1])
                for t in spec.tasks)
    items = sum(counts.values())
    population = sum(cast(int, cand.tasks[t].population) for t in spec.tasks)
    return SequentialLook(look=index + 1, looks=len(plan.looks), fraction=plan.looks[index], items=items,
                          population=population, alpha=alpha)


def _decision(verdict: TaskVerdict, look: SequentialLook | None) -> Decision:
    """Pass when the interval's low end clears -margin; at a look before the last, fail only when its high end is
    below -margin (inferiority shown), else continue to the next look."""
    if verdict.passed:
        return "pass"
    if look is None or look.look == look.looks or verdict.high < -verdict.margin:
        return "fail"
    return "continue"


def _overall(verdicts: list[TaskVerdict], behaviour: list[BehaviourCheck], look: SequentialLook | None) -> str:
    if any(v.decision == "fail" for v in verdicts):
        return "fail"
    if any(v.decision == "continue" for v in verdicts):
        return "continue"
    if not all(check.passed for check in behaviour):
        return "continue" if look is not None and look.look < look.looks else "fail"
    return "pass"


def _clusters(task: str, spec: Suite, record: RunRecord, ids: list[str], b: dict[str, SampleRecord],
              baseline) -> list[str] | None:
    """Each item's cluster, when the suite clusters the task: the runs must carry the key the suite names."""
    key = spec.clusters.get(task)
    if key is None:
        return None
    if record.tasks[task].cluster_key != key:
        raise CannotCompare(f"task {task}: the suite clusters by {key!r}, the run's records carry "
                            f"{record.tasks[task].cluster_key!r}; re-run eval", baseline)
    missing = next((i for i in ids if b[i].cluster is None), None)
    if missing is not None:
        raise CannotCompare(f"task {task}: item {missing} has no cluster; re-run eval", baseline)
    return [str(b[i].cluster) for i in ids]


def _paired_items(task: str, b: dict[str, SampleRecord], c: dict[str, SampleRecord], other,
                  subset: bool = False) -> list[str]:
    """The items both runs scored, each prompted the same way (``subset``: the candidate's, all of them in the
    baseline, which may hold more: a sequential look)."""
    if (set(c) - set(b)) if subset else (set(b) != set(c)):
        raise CannotCompare(f"task {task}: the runs scored different items ({len(set(b) ^ set(c))} differ)", other)
    ids = sorted(c)
    for i in ids:
        if b[i].prompt_hash != c[i].prompt_hash:
            raise CannotCompare(f"task {task}: item {i} was prompted differently", other)
    return ids


def _task_verdict(task, ids, b, c, margin, z, spec: Suite, clusters: list[str] | None = None) -> TaskVerdict:
    decide_by = spec.decide_by
    alpha = 2 * z_tail(z)
    n = len(ids)
    acc_b = [b[i].correct for i in ids]
    acc_c = [c[i].correct for i in ids]
    effect = design_effect([y - x for x, y in zip(acc_b, acc_c, strict=False)], clusters) if clusters else 1.0
    delta, low, high = paired_binary_interval(acc_b, acc_c, z, effect)
    discordant = sum(x != y for x, y in zip(acc_b, acc_c, strict=False)) / n
    certifiable = math.sqrt(effect) * certifiable_margin(n, discordant, z)
    needed = items_for_margin(margin / math.sqrt(effect), discordant, z)
    note = (f"cannot certify a {margin:g}-point margin with {n:,} items: at this discordance the interval alone "
            f"reaches -{certifiable:.2f} (about {needed:,} items would)") if certifiable >= margin else None
    signals = []
    loglik_ok = True
    with_choices = [i for i in ids if b[i].choice_logprobs and b[i].gold is not None and c[i].choice_logprobs]
    for i in with_choices:
        if len(b[i].choice_logprobs) != len(c[i].choice_logprobs) or b[i].gold != c[i].gold:
            raise CannotCompare(f"task {task}: item {i} has other choices or another gold answer in the two runs")
    if with_choices:
        d_ll = [c[i].choice_logprobs[c[i].gold] - b[i].choice_logprobs[b[i].gold] for i in with_choices]
        m, lo, hi = t_interval(d_ll, alpha)
        signals.append(Signal(name="delta loglik of the correct answer", estimate=m, low=lo, high=hi, unit="nats"))
        loglik_ok = lo > -spec.loglik_margin
        flips = sum(argmax(b[i].choice_logprobs) != argmax(c[i].choice_logprobs) for i in with_choices)
        signals.append(Signal(name="choice flip rate", estimate=100 * flips / len(with_choices), unit="%"))
        kls = [choice_kl(b[i].choice_logprobs, c[i].choice_logprobs) for i in with_choices]
        m, lo, hi = t_interval(kls, alpha)
        signals.append(Signal(name="KL(baseline || candidate) of choices", estimate=m, low=lo, high=hi, unit="nats"))
    passed = True
    if "accuracy" in decide_by:
        passed &= low > -margin
    if "loglik" in decide_by and with_choices:
        passed &= loglik_ok
    return TaskVerdict(
        task=task, n=n, baseline=100 * sum(acc_b) / n, candidate=100 * sum(acc_c) / n, delta=delta, low=low,
        high=high, margin=margin, passed=passed, flip_rate=100 * discordant, certifiable_margin=certifiable,
        items_for_margin=needed, signals=signals, decided_by=list(decide_by), design_effect=effect,
        clusters=len(set(clusters)) if clusters else None, note=note,
    )

