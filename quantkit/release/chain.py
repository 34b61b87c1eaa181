"""One artifact's release chain in WORK: its stages run in order, each resumed when its fingerprint and files are as
it left them (release/state.py), and a stop that names the stage, the cause and the command to resume."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel

from quantkit.checkpoint.writer import folder_lock, sha256_file, work_folder, write_error
from quantkit.errors import QuantkitError
from quantkit.release.config import ReleaseConfig, work_dir_of
from quantkit.release.stages import STAGES as _STAGES
from quantkit.release.stages import Chain, Stage, StageStatus
from quantkit.release.state import STATE_NAME, ReleaseState, StageState, load_state
from quantkit.release.suite import Suite

STAGES = tuple(s.name for s in _STAGES)


@dataclass
class StageRecord:
    stage: str
    status: StageStatus
    seconds: float = 0.0
    summary: str = ""
    pool: str | None = None  # in a release of the recipe's pools (release/pools.py), whose stage it is


@dataclass
class ReleaseResult:
    config: str
    work_dir: str
    stages: list[StageRecord] = field(default_factory=list)
    verdict: str | None = None
    report: str | None = None
    published: str | None = None
    gate_table: str = ""


class ReleaseStopped(QuantkitError):
    def __init__(self, stage: str, cause: str, config: Path, pool: str | None = None):
        self.stage, self.cause, self.pool = stage, cause, pool
        where = f"the {pool} pool's stage {stage}" if pool else f"stage {stage}"
        super().__init__(f"release stopped at {where}: {cause}; "
                         f"after fixing it, resume with: quantkit release {config} --resume")


def release_one(
    config: ReleaseConfig,
    config_path: Path,
    *,
    resume: bool = False,
    on_stage: Callable[[StageRecord], None] | None = None,
    api=None,
    on_progress: Callable[[str, int, int], None] | None = None,
    on_launch: Callable[[list[str]], None] | None = None,
) -> ReleaseResult:
    """One artifact's chain, from a config read from ``config_path`` (whose folder relative paths start from)."""
    chain = Chain(config, config_path, Path(), ReleaseState(), api, on_progress, on_launch)
    _suite_tasks_evaluated(config, chain.gate_suite, config_path)
    work = work_dir_of(config_path, config.work_dir)
    if load_state(work / STATE_NAME) and not resume:
        raise QuantkitError("holds a release already; --resume continues it, or remove the folder to start over", work)
    try:
        work.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise write_error(work, exc) from exc
    with folder_lock(work):  # read again under the lock: the state another process left, not a stale copy
        chain.work, chain.state = work, load_state(work / STATE_NAME) or ReleaseState()
        return _run_chain(chain, on_stage)


def _suite_tasks_evaluated(config: ReleaseConfig, suite: Suite, config_path: Path) -> None:
    """The gate compares what eval ran: a suite task missing from eval.tasks is refused before hours of serving."""
    missing = [t for t in suite.tasks if t not in (config.eval.tasks or [])]
    if missing:
        raise QuantkitError(f"the suite gates {', '.join(missing)}, which eval.tasks does not run", config_path)


def _run_chain(chain: Chain, on_stage: Callable[[StageRecord], None] | None) -> ReleaseResult:
    """The stages in WORK, which the caller holds locked: each one resumed when its fingerprint and files are as it
    left them, else run (and every later stage's record dropped)."""
    for sub in ("model", "runs", "runs/candidate", "gate"):  # quantkit's own sub-folders: never links leading out
        work_folder(chain.work, sub)
    if chain.config.eval.baseline_run is None:
        work_folder(chain.work, "runs/baseline")
    result = ReleaseResult(str(chain.config_path), str(chain.work))
    state = chain.state
    fingerprint = hashlib.sha256()
    for index, stage in enumerate(_STAGES):
        try:  # reading what the stage reads (the source's headers) can fail as the stage itself would
            digest = _fingerprint(fingerprint, chain, stage)
        except QuantkitError as exc:
            raise ReleaseStopped(stage.name, str(exc), chain.config_path) from exc
        done = state.stages.get(stage.name)
        changed = state.changed_output(stage.name) if done and done.fingerprint == digest else None
        if done and done.fingerprint == digest and changed is None:
            record = StageRecord(stage.name, StageStatus.RESUMED, done.seconds, done.summary)
        else:
            record = _run_stage(chain, stage, changed)
            state.forget_from(STAGES[index:])  # this stage's old result, and every later stage built on it, are stale
            files, known = stage.outputs(chain) if record.status != StageStatus.SKIPPED else ([], {})
            state.stages[stage.name] = StageState(fingerprint=digest, seconds=record.seconds, summary=record.summary,
                                                  outputs=state.record(files, known))
            state.save(chain.work / STATE_NAME)
        result.stages.append(record)
        if on_stage is not None:
            on_stage(record)
    # every stage, publish included, is done and its files are in place
    result.published = chain.publish_target[1] if chain.publish_target else None
    if (chain.gate_dir / "report.md").is_file():
        result.gate_table = chain.gate_table or (chain.gate_dir / "report.md").read_text()
        result.verdict, result.report = str(chain.gate_dir / "verdict.json"), str(chain.gate_dir / "report.html")
    return result


def _fingerprint(running, chain: Chain, stage: Stage) -> str:
    """The stage's inputs added to the running hash of every earlier stage's: its config sections, and the files
    it reads by content (an edited recipe or suite re-runs its stage)."""
    sections = {name: getattr(chain.config, name) for name in stage.sections}
    running.update(json.dumps({k: v.model_dump() if isinstance(v, BaseModel) else v
                               for k, v in sections.items()}, sort_keys=True).encode())
    for path in stage.files(chain):
        running.update(f"{path.name}:{sha256_file(path) if path.is_file() else 'missing'}".encode())
    for identity in stage.identity(chain):
        running.update(identity.encode())
    return running.hexdigest()


def _run_stage(chain: Chain, stage: Stage, changed: str | None) -> StageRecord:
    started = time.perf_counter()
    try:
        outcome = stage.run(chain)
    except QuantkitError as exc:
        raise ReleaseStopped(stage.name, str(exc), chain.config_path) from exc
    status, summary = outcome if isinstance(outcome, tuple) else (StageStatus.RAN, outcome)
    if summary is None:
        status, summary = StageStatus.SKIPPED, "not configured"
    if changed is not None:
        summary += f" (run again: {changed})"
    return StageRecord(stage.name, status, round(time.perf_counter() - started, 1), summary)
