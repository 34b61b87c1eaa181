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

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist

from quantkit.errors import QuantkitError

# Provenance fields allowed to differ between baseline and candidate: what is compared and where it was served.
MODEL_FIELDS = ("model", "model_checksums", "created", "server")
DEFAULT_SUITE = Path(__file__).resolve().parent.parent / "eval" / "suites" / "release.yaml"


class CannotCompare(QuantkitError):
    """The runs differ in something other than the model: no verdict is possible (exit 2)."""


@dataclass
class Suite:
    tasks: dict[str, float]  # task -> margin in accuracy points
    alpha: float = 0.05
    correction: str = "bonferroni"
    decide_by: list[str] = field(default_factory=lambda: ["accuracy"])
    loglik_margin: float = 0.1  # nats: the correct answer's log-likelihood may drop this much at most
    # Provenance fields the candidate may change besides its weights, because they ship with it
    # (the decode pool's FP8 KV cache: engine.args.kv_cache_dtype). Printed with every verdict.
    may_differ: list[str] = field(default_factory=list)


@dataclass
class Signal:
    name: str
    estimate: float
    low: float
    high: float
    unit: str


@dataclass
class TaskVerdict:
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
    signals: list[Signal] = field(default_factory=list)
    decided_by: list[str] = field(default_factory=list)


@dataclass
class GateReport:
    baseline: str
    candidate: str
    passed: bool
    confidence: float  # per task, after the correction
    correction: str
    tasks: list[TaskVerdict]
    candidate_checksums: dict[str, str]
    allowed_differences: list[str] = field(default_factory=list)  # by the suite's may_differ
    report_files: list[str] = field(default_factory=list)


def load_suite(path: str | os.PathLike | None, margin: float | None = None) -> Suite:
    import yaml

    path = Path(path) if path else DEFAULT_SUITE
    if not path.is_file():
        raise QuantkitError("suite file not found", path)
    doc = yaml.safe_load(path.read_text()) or {}
    tasks = {}
    for name, spec in (doc.get("tasks") or {}).items():
        spec = spec or {}
        tasks[name] = float(margin if margin is not None else spec.get("margin", doc.get("margin", 1.0)))
    if not tasks:
        raise QuantkitError("suite lists no tasks", path)
    decide = list(doc.get("decide_by") or ["accuracy"])
    unknown = set(decide) - {"accuracy", "loglik"}
    if unknown:
        raise QuantkitError(f"decide_by: unknown signal {sorted(unknown)[0]} (accuracy, loglik)", path)
    return Suite(tasks, float(doc.get("alpha", 0.05)), str(doc.get("correction", "bonferroni")), decide,
                 float(doc.get("loglik_margin", 0.1)), [str(f) for f in doc.get("may_differ") or []])


def load_run(run_dir: Path) -> tuple[dict, dict[str, dict[str, dict]]]:
    meta_path = run_dir / "run.json"
    if not meta_path.is_file():
        raise CannotCompare("not a run directory (no run.json)", run_dir)
    meta = json.loads(meta_path.read_text())
    samples: dict[str, dict[str, dict]] = {}
    for f in sorted((run_dir / "samples").glob("*.jsonl")):
        rows = {}
        for n, line in enumerate(f.read_text().splitlines(), 1):
            if line.strip():
                try:
                    row = json.loads(line)
                    rows[str(row["item_id"])] = row
                except (json.JSONDecodeError, KeyError) as exc:
                    raise CannotCompare(f"line {n}: malformed sample ({exc})", f) from exc
        samples[f.stem] = rows
    return meta, samples


def provenance_differences(a: dict, b: dict, prefix: str = "") -> list[str]:
    diffs = []
    for key in sorted(set(a) | set(b)):
        if not prefix and key in MODEL_FIELDS:
            continue
        va, vb = a.get(key), b.get(key)
        if isinstance(va, dict) and isinstance(vb, dict):
            if va.get("name") != vb.get("name"):  # another engine: its settings differ as a matter of course
                diffs.append(f"{prefix}{key}.name: {va.get('name')!r} vs {vb.get('name')!r}")
                continue
            diffs += provenance_differences(va, vb, f"{prefix}{key}.")
        elif va != vb:
            diffs.append(f"{prefix}{key}: {va!r} vs {vb!r}")
    return diffs


def paired_interval(diffs: list[float], z: float) -> tuple[float, float, float]:
    """Mean of paired differences with a normal-approximation interval."""
    n = len(diffs)
    mean = sum(diffs) / n
    var = sum((d - mean) ** 2 for d in diffs) / (n - 1) if n > 1 else 0.0
    half = z * math.sqrt(var / n)
    return mean, mean - half, mean + half


def gate(
    baseline: str | os.PathLike,
    candidate: str | os.PathLike,
    suite: str | os.PathLike | None = None,
    margin: float | None = None,
    report_dir: str | os.PathLike | None = None,
) -> GateReport:
    spec = load_suite(suite, margin)
    base_meta, base = load_run(Path(baseline))
    cand_meta, cand = load_run(Path(candidate))
    all_diffs = provenance_differences(base_meta, cand_meta)
    allowed = [d for d in all_diffs if d.split(":", 1)[0] in spec.may_differ]
    diffs = [d for d in all_diffs if d not in allowed]
    if diffs:
        raise CannotCompare(f"runs differ in more than the model: {'; '.join(diffs[:5])}", candidate)
    k = len(spec.tasks)
    alpha = spec.alpha / k if spec.correction == "bonferroni" else spec.alpha
    z = NormalDist().inv_cdf(1 - alpha / 2)
    verdicts = []
    for task, task_margin in spec.tasks.items():
        if task not in base or task not in cand:
            raise CannotCompare(f"task {task} missing from {'baseline' if task not in base else 'candidate'}", candidate)
        b, c = base[task], cand[task]
        if set(b) != set(c):
            raise CannotCompare(f"task {task}: the runs scored different items ({len(set(b) ^ set(c))} differ)", candidate)
        ids = sorted(b)
        for i in ids:
            if b[i].get("prompt_hash") != c[i].get("prompt_hash"):
                raise CannotCompare(f"task {task}: item {i} was prompted differently", candidate)
        verdicts.append(_task_verdict(task, ids, b, c, task_margin, z, spec))
    report = GateReport(
        baseline=str(baseline),
        candidate=str(candidate),
        passed=all(v.passed for v in verdicts),
        confidence=1 - alpha,
        correction=f"{spec.correction} over {k} tasks" if spec.correction == "bonferroni" else "none",
        tasks=verdicts,
        candidate_checksums=dict(cand_meta.get("model_checksums") or {}),
        allowed_differences=allowed,
    )
    if report_dir is not None:
        from quantkit.reporting import write_gate_report

        report.report_files = [str(p) for p in write_gate_report(report, Path(report_dir))]
    return report


def _task_verdict(task, ids, b, c, margin, z, spec: Suite) -> TaskVerdict:
    decide_by = spec.decide_by
    n = len(ids)
    acc_b = [float(b[i]["correct"]) for i in ids]
    acc_c = [float(c[i]["correct"]) for i in ids]
    delta, low, high = paired_interval([100 * (y - x) for x, y in zip(acc_b, acc_c)], z)
    discordant = sum(x != y for x, y in zip(acc_b, acc_c)) / n
    certifiable = z * 100 * math.sqrt(discordant / n) if n else math.inf
    needed = math.ceil(z * z * discordant * 1e4 / (margin * margin)) if margin > 0 else 0
    signals = []
    loglik_ok = True
    with_choices = [i for i in ids if b[i].get("choice_logprobs") and "gold" in b[i] and c[i].get("choice_logprobs")]
    if with_choices:
        d_ll = [c[i]["choice_logprobs"][c[i]["gold"]] - b[i]["choice_logprobs"][b[i]["gold"]] for i in with_choices]
        m, lo, hi = paired_interval(d_ll, z)
        signals.append(Signal("delta loglik of the correct answer", m, lo, hi, "nats"))
        loglik_ok = lo > -spec.loglik_margin
        flips = sum(_argmax(b[i]["choice_logprobs"]) != _argmax(c[i]["choice_logprobs"]) for i in with_choices)
        signals.append(Signal("choice flip rate", 100 * flips / len(with_choices), math.nan, math.nan, "%"))
        kls = [_kl(b[i]["choice_logprobs"], c[i]["choice_logprobs"]) for i in with_choices]
        m, lo, hi = paired_interval(kls, z)
        signals.append(Signal("KL(baseline || candidate) of choices", m, lo, hi, "nats"))
    passed = True
    if "accuracy" in decide_by:
        passed &= low > -margin
    if "loglik" in decide_by and with_choices:
        passed &= loglik_ok
    return TaskVerdict(
        task=task, n=n, baseline=100 * sum(acc_b) / n, candidate=100 * sum(acc_c) / n, delta=delta, low=low,
        high=high, margin=margin, passed=passed, flip_rate=100 * discordant, certifiable_margin=certifiable,
        items_for_margin=needed, signals=signals, decided_by=list(decide_by),
    )


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


def _kl(p_logits: list[float], q_logits: list[float]) -> float:
    def log_softmax(x):
        top = max(x)
        s = math.log(sum(math.exp(v - top) for v in x)) + top
        return [v - s for v in x]

    lp, lq = log_softmax(p_logits), log_softmax(q_logits)
    return sum(math.exp(a) * (a - b) for a, b in zip(lp, lq))
