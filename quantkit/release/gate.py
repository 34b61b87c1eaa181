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

from quantkit.checkpoint.writer import refuse_inside
from quantkit.errors import CannotCompare, QuantkitError
from quantkit.evaluation.run_dir import REPEAT_DIR, RunRecord, SampleRecord, read_run_record, read_samples
from quantkit.release.behaviour import (
    BehaviourCheck,
    is_generative,
    length_check,
    missing_generation,
    noise_floor,
    read_noise_run,
    runaway_check,
)
from quantkit.release.looks import decision, look, overall
from quantkit.release.provenance import provenance_differences
from quantkit.release.stats import (
    argmax,
    certifiable_margin,
    choice_kl,
    design_effect,
    items_for_margin,
    paired_binary_interval,
    t_interval,
    z_of,
    z_tail,
)
from quantkit.release.suite import Suite, load_suite, shared_tasks
from quantkit.release.verdict import GateReport, Signal, TaskVerdict

__all__ = ["CannotCompare", "GateReport", "Suite", "TaskVerdict", "gate", "load_samples", "load_suite"]


def load_samples(run_dir: Path, record: RunRecord, task: str) -> dict[str, SampleRecord]:
    """One task's records of a run, strictly validated against the run's item count."""
    if task not in record.tasks:
        raise CannotCompare(f"task {task} is not in this run", run_dir / "run.json")
    return read_samples(run_dir, task, record.tasks[task])


def gate(
    baseline: str | os.PathLike,
    candidate: str | os.PathLike,
    *,
    suite: str | os.PathLike | Suite | None = None,
    margin: float | None = None,
    report_dir: str | os.PathLike | None = None,
    noise: str | os.PathLike | None = None,
) -> GateReport:
    """Compare CANDIDATE's run with BASELINE's per the suite (a file, a built-in name, or one ``load_suite`` read
    already); write the report files when ``report_dir`` is given. ``noise``: a second run of the baseline's model
    (A/A) giving the engine's own flip rate; without it, BASELINE/repeat-2 is used when ``eval --repeat 2`` wrote
    one. Raises CannotCompare (no verdict either way) when the runs or the suite cannot be read, or the runs differ
    in more than the model and what the suite's ``may_differ`` allows."""
    baseline, candidate = Path(baseline).resolve(), Path(candidate).resolve()
    try:
        spec = suite if isinstance(suite, Suite) else load_suite(suite, margin)
    except QuantkitError as exc:  # CannotCompare is one: raised again as it was
        raise exc if isinstance(exc, CannotCompare) else CannotCompare(exc.message, exc.file, exc.tensor) from exc
    base_record, cand_record = read_run_record(baseline), read_run_record(candidate)
    _served_as_given((base_record, baseline), (cand_record, candidate))
    for record in (base_record, cand_record) if report_dir is not None else ():  # never into a model folder:
        if record.model and Path(record.model).is_dir():  # its checksums would change, the next convert copy it
            refuse_inside(Path(record.model), Path(report_dir or ""), "--report")
    spec, gated = shared_tasks(spec, base_record, cand_record, candidate) if spec.path is None else (spec, None)
    _require_tasks(spec, (base_record, baseline), (cand_record, candidate))
    allowed = _allowed_differences(spec, base_record, cand_record, candidate)
    k = len(spec.tasks)
    alpha = spec.alpha / k if spec.correction == "bonferroni" else spec.alpha  # two-sided, per task
    at = look(spec, base_record, cand_record, alpha / 2, candidate) if spec.sequential else None
    z = z_of(at.alpha if at else alpha / 2)
    if noise is None and (baseline / REPEAT_DIR / "run.json").is_file():
        noise = baseline / REPEAT_DIR
    noise = Path(noise).resolve() if noise is not None else None
    noise_record = read_noise_run(noise, base_record) if noise is not None else None
    verdicts, behaviour, floors = [], [], []
    for task, task_spec in spec.tasks.items():
        b, c = load_samples(baseline, base_record, task), load_samples(candidate, cand_record, task)
        ids = _paired_items(task, b, c, candidate, subset=spec.sequential is not None)
        clusters = _clusters(task, task_spec.cluster, base_record, ids, b, baseline)
        verdict = _task_verdict(task, ids, b, c, task_spec.margin, z, spec, clusters)
        verdict.decision = decision(verdict, at)
        verdict.passed = verdict.decision == "pass"
        behaviour += _behaviour_checks(task, ids, [(baseline, b), (candidate, c)], spec, z)
        if noise is not None and noise_record is not None:
            again = load_samples(noise, noise_record, task)
            _paired_items(task, b, again, noise)
            floor = noise_floor(task, ids, b, again)
            floors.append(floor)
            within = verdict.flip_rate <= floor.flip_rate
            verdict.engine_noise = "indistinguishable from engine noise" if within else "beyond engine noise"
            verdict.regression = verdict.decision == "fail" and not within
        verdicts.append(verdict)
    decided = overall(verdicts, behaviour, at)
    report = GateReport(
        baseline=str(baseline),
        candidate=str(candidate),
        passed=decided == "pass",
        confidence=1 - 2 * z_tail(z),
        correction=f"{spec.correction} over {k} tasks" if spec.correction == "bonferroni" else "none",
        tasks=verdicts,
        candidate_checksums=dict(cand_record.model_checksums or {}),
        allowed_differences=allowed,
        behaviour=behaviour,
        noise_run=str(noise) if noise is not None else None,
        gated=gated,
        noise=floors,
        decision=decided,
        sequential=at,
        suite=spec.path,
        margin=spec.margin,
    )
    if report_dir is not None:
        from quantkit.release.report import write_gate_report

        if Path(report_dir).exists() and not Path(report_dir).is_dir():
            raise CannotCompare("the report folder is a file", Path(report_dir))
        report.report_files = [str(p) for p in write_gate_report(report, Path(report_dir))]
    return report


def _served_as_given(*runs) -> None:
    """A run whose post-boot probe failed measured another model than the one it names (evaluation/probe.py)."""
    for record, folder in runs:
        if record.probe is not None and record.probe.status == "fail":
            raise CannotCompare(f"its engine did not serve the checkpoint it was given ({record.probe.reason}): "
                                "its scores are another model's", folder / "run.json")


def _require_tasks(spec: Suite, *runs: tuple[RunRecord, str | os.PathLike]) -> None:
    for record, run in runs:
        missing = [t for t in spec.tasks if t not in record.tasks]
        if missing:
            raise CannotCompare(f"task {missing[0]} is not in this run (the suite gates {', '.join(spec.tasks)})",
                                Path(run) / "run.json")


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


def _clusters(task: str, key: str | None, record: RunRecord, ids: list[str], b: dict[str, SampleRecord],
              baseline) -> list[str] | None:
    """Each item's cluster, when the suite clusters the task by KEY: the runs must carry the key the suite names."""
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
    if "loglik" in decide_by:  # a task without choices (generative) has no loglik signal: it cannot pass on one
        passed &= loglik_ok and bool(with_choices)
        if not with_choices:
            note = (note + "; " if note else "") + "decide_by loglik, but the task has no choice log-likelihoods"
    return TaskVerdict(
        task=task, n=n, baseline=100 * sum(acc_b) / n, candidate=100 * sum(acc_c) / n, delta=delta, low=low,
        high=high, margin=margin, passed=passed, flip_rate=100 * discordant, certifiable_margin=certifiable,
        items_for_margin=needed, signals=signals, decided_by=list(decide_by), design_effect=effect,
        clusters=len(set(clusters)) if clusters else None, note=note,
    )

