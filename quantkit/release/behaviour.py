"""What the gate checks besides accuracy: how long the answers are, how many run away, and how much the
engine itself moves between two runs of the same model.

- Output length: per item, the tokens each model generated (evaluation/generation.py). The estimate is the
  mean over items of the per-answer ratio (candidate + 1) / (baseline + 1), with a paired bootstrap interval
  (items resampled, numpy). It fails when the whole interval lies above 1 + ``length_limit``: the candidate is
  shown to answer longer than the suite allows.
- Runaway generations: items that hit the length limit or loop. The estimate is the paired difference of
  the two runs' rates in points, with the same interval as accuracy (Tango's, release/stats.py); it fails
  when the whole interval lies above ``runaway_margin``.
- Engine noise (A/A): a second run of the baseline's model (``eval --repeat 2``, or any run of the same
  model with another batch size) measures how many items flip with nothing changed. A candidate whose flip
  rate against the baseline is within that floor is "indistinguishable from engine noise"; a failing task
  is called a regression only when its flip rate is beyond it.
"""

from __future__ import annotations

from pathlib import Path
from statistics import median
from typing import Literal

from quantkit.errors import CannotCompare, QuantkitError
from quantkit.evaluation.generation import runaway
from quantkit.evaluation.run_dir import RunRecord, SampleRecord, read_run_record
from quantkit.release.provenance import provenance_differences
from quantkit.release.stats import bootstrap_interval, paired_binary_interval
from quantkit.settings import Section

# A noise run is the baseline's model evaluated again: only these may differ from the baseline's run.
NOISE_MAY_DIFFER = ("engine.args.batch_size",)


class BehaviourCheck(Section):
    task: str
    check: Literal["output length", "runaway generations"]
    n: int
    baseline: float  # mean tokens per answer | runaway rate, percent
    candidate: float
    estimate: float  # candidate / baseline mean tokens | candidate - baseline rate, points
    low: float
    high: float
    limit: float  # the largest estimate the suite allows
    unit: str
    passed: bool
    median_ratio: float | None = None  # output length: median over items of candidate / baseline tokens
    baseline_tokens: list[int] | None = None  # output length: per item, for the report's distribution plot
    candidate_tokens: list[int] | None = None


class NoiseFloor(Section):
    task: str
    n: int
    flip_rate: float  # percent of items whose correctness differs between the two baseline runs
    delta: float  # accuracy points, second run minus first
    changed_answers: float | None = None  # generative tasks: percent of items whose generated answer differs


GENERATION_FIELDS = ("generated_tokens", "hit_limit", "repetition")


def has_generations(rows: dict[str, SampleRecord]) -> bool:
    return all(all(getattr(r, f) is not None for f in GENERATION_FIELDS) for r in rows.values())


def missing_generation(rows: dict[str, SampleRecord]) -> str | None:
    """The first item (by id) whose record lacks a field the behaviour checks read, or None."""
    return next((i for i in sorted(rows) if any(getattr(rows[i], f) is None for f in GENERATION_FIELDS)), None)


def is_generative(task: str, *runs: dict[str, SampleRecord]) -> bool:
    """A task whose answers are generated: by its definition, or by any record that holds a generated answer."""
    from quantkit.evaluation import task_spec

    try:
        generative = task_spec(task)["output_type"] == "generate_until"
    except QuantkitError:  # not a task quantkit defines: its records decide
        generative = False
    return generative or any(r.response is not None or r.generation is not None or r.generated_tokens is not None
                             for rows in runs for r in rows.values())


def length_check(task: str, ids: list[str], b: dict[str, SampleRecord], c: dict[str, SampleRecord], limit: float,
                 confidence: float, rounds: int) -> BehaviourCheck:
    tb = [b[i].generated_tokens or 0 for i in ids]  # every record has it: the gate refuses those without
    tc = [c[i].generated_tokens or 0 for i in ids]
    # per answer; +1: an empty answer has a ratio too
    ratios = [(y + 1) / (x + 1) for x, y in zip(tb, tc, strict=True)]

    low, high = bootstrap_interval(ratios, confidence, rounds, seed=task)
    return BehaviourCheck(task=task, check="output length", n=len(ids), baseline=sum(tb) / len(ids),
                          candidate=sum(tc) / len(ids), estimate=sum(ratios) / len(ratios), low=low, high=high,
                          limit=1 + limit, unit="x tokens", passed=low <= 1 + limit, median_ratio=median(ratios),
                          baseline_tokens=tb, candidate_tokens=tc)


def runaway_check(task: str, ids: list[str], b: dict[str, SampleRecord], c: dict[str, SampleRecord], margin: float,
                  z: float) -> BehaviourCheck:
    rb = [int(runaway(b[i].hit_limit, b[i].repetition)) for i in ids]
    rc = [int(runaway(c[i].hit_limit, c[i].repetition)) for i in ids]
    delta, low, high = paired_binary_interval(rb, rc, z)
    return BehaviourCheck(task=task, check="runaway generations", n=len(ids), baseline=100 * sum(rb) / len(ids),
                          candidate=100 * sum(rc) / len(ids), estimate=delta, low=low, high=high, limit=margin,
                          unit="points", passed=low <= margin)


def read_noise_run(noise: Path, baseline: RunRecord) -> RunRecord:
    """The A/A run: the baseline's model, tasks and engine, at most another batch size."""
    record = read_run_record(noise)
    if record.model_checksums != baseline.model_checksums:
        raise CannotCompare("the noise run is not of the baseline's model (its files' checksums differ)", noise)
    diffs = provenance_differences(baseline.model_dump(), record.model_dump())
    other = [d for d in diffs if d.split(":", 1)[0] not in NOISE_MAY_DIFFER]
    if other:
        raise CannotCompare(f"the noise run differs from the baseline's in more than {', '.join(NOISE_MAY_DIFFER)}: "
                            f"{'; '.join(other[:3])}", noise)
    return record


def noise_floor(task: str, ids: list[str], b: dict[str, SampleRecord], a: dict[str, SampleRecord]) -> NoiseFloor:
    flips = sum(b[i].correct != a[i].correct for i in ids)
    changed = (100 * sum(b[i].generation != a[i].generation for i in ids) / len(ids)
               if has_generations(b) and has_generations(a) else None)
    return NoiseFloor(task=task, n=len(ids), flip_rate=100 * flips / len(ids),
                      delta=100 * (sum(a[i].correct for i in ids) - sum(b[i].correct for i in ids)) / len(ids),
                      changed_answers=changed)
