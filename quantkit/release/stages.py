"""The release's stages, in order: each one what it runs, the config sections and files it reads (its fingerprint),
and the files it leaves behind (what a resume checks are still there as it left them)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import Enum
from functools import cached_property
from pathlib import Path
from typing import Any

from quantkit.checkpoint.writer import LOCK_NAME, write_bytes_atomic
from quantkit.errors import QuantkitError
from quantkit.evaluation.run_dir import read_scores
from quantkit.release.config import ReleaseConfig, config_relative, publish_repo
from quantkit.release.state import STATE_NAME, ReleaseState
from quantkit.release.suite import Suite, load_suite


class StageStatus(str, Enum):
    RAN = "ran"
    RESUMED = "resumed"  # done by an earlier run with the same inputs
    REUSED = "reused"  # a finished run on disk (the baseline of another release)
    SKIPPED = "skipped"  # not configured

    def __str__(self) -> str:
        return self.value


@dataclass
class Chain:
    """One release in WORK: its config, its folders and what its stages hand each other."""

    config: ReleaseConfig
    config_path: Path
    work: Path
    state: ReleaseState
    api: Any = None
    on_progress: Callable[[str, int, int], None] | None = None
    on_launch: Callable[[list[str]], None] | None = None
    gate_table: str = ""
    published_files: list[str] = field(default_factory=list)

    def resolve(self, p: str | None) -> Path | None:
        """A path of the config, relative to the config's folder."""
        return None if p is None else self.path(p)

    def path(self, p: str) -> Path:
        return config_relative(self.config_path, p)

    @property
    def source(self) -> Path:
        return self.path(self.config.source)

    @property
    def recipe(self) -> str:
        recipe_file = self.path(self.config.recipe)
        return str(recipe_file) if recipe_file.is_file() else self.config.recipe  # else a built-in name

    @property
    def model(self) -> Path:
        return self.work / "model"

    @property
    def baseline_run(self) -> Path:
        return self.resolve(self.config.eval.baseline_run) or self.work / "runs" / "baseline"

    @property
    def candidate_run(self) -> Path:
        return self.work / "runs" / "candidate"

    @property
    def gate_dir(self) -> Path:
        return self.work / "gate"

    @property
    def suite(self) -> Path | None:
        return self.resolve(self.config.suite)

    @cached_property
    def gate_suite(self) -> Suite:
        """The suite the release gates by, read once (its file's edits re-run the gate: ``_suite_files``)."""
        return load_suite(self.suite, self.config.margin)

    @property
    def publish_target(self) -> tuple[str, str] | None:
        """The repo publish is given (a file:// target made absolute) and the folder or repo id it names; None when
        the release is not published."""
        if self.config.publish is None:
            return None
        repo = publish_repo(self.config_path, self.config.publish.repo)
        return repo, repo.removeprefix("file://")

    def evaluate(self, model: Path, out: Path, kv: str, repeat: int = 1,
                 fraction: float | dict[str, float] | None = None):
        from quantkit.evaluation import evaluate

        ev = self.config.eval
        return evaluate(model, settings=ev.common(), data_dir=self.resolve(ev.data_dir), kv_cache_dtype=kv,
                        repeat=repeat, out=out, order="file" if fraction is None else "seeded", fraction=fraction,
                        on_progress=self.on_progress, on_launch=self.on_launch)

    @property
    def candidate_kv(self) -> str:
        return self.config.candidate_kv


Outcome = str | tuple[StageStatus, str] | None  # a summary; a status other than RAN with it; None: not configured


@dataclass(frozen=True)
class Stage:
    name: str
    run: Callable[[Chain], Outcome]
    outputs: Callable[[Chain], tuple[list[Path], dict[str, str]]]  # its files, with the sha256 known of some
    sections: tuple[str, ...] = ()  # the config sections it reads; its fingerprint also covers every earlier stage's
    files: Callable[[Chain], list[Path]] = lambda chain: []  # files it reads, fingerprinted by content
    # what else it reads, by identity: the source checkpoint's fingerprint (a replaced source re-runs every stage)
    identity: Callable[[Chain], list[str]] = lambda chain: []


def write_json(path: Path, report) -> None:
    write_bytes_atomic(path, (json.dumps(asdict(report), indent=2, default=str) + "\n").encode())


def _plan(chain: Chain) -> Outcome:
    from quantkit.plan import plan

    report = plan(chain.source, chain.recipe, tp=chain.config.verify.tp,
                  max_shard_size=chain.config.convert.max_shard_size)
    write_json(chain.work / "plan.json", report)
    return f"{report.bytes_now / 1e9:.3f} GB -> {(report.bytes_after or 0) / 1e9:.3f} GB"  # a recipe: never None


def _convert(chain: Chain) -> Outcome:
    from quantkit.convert import DifferentRun, convert

    c, dst = chain.config.convert, chain.model
    # WORK/model is replaced only when this release wrote it (state says so): never a checkpoint put there by hand.
    if any(p.name != LOCK_NAME for p in dst.iterdir()) and not chain.state.owns_model:
        raise QuantkitError("holds files this release did not write; move them away or set another work_dir", dst)
    chain.state.owns_model = True
    chain.state.save(chain.work / STATE_NAME)
    def run(resume: bool):
        return convert(chain.source, dst, chain.recipe, device=c.device, workers=c.workers,
                       max_shard_size=c.max_shard_size, calibration_data=chain.resolve(c.calibration_data),
                       dtype=c.dtype, gpu_memory=c.gpu_memory, resume=resume, force=not resume)

    try:
        done = run(resume=True)
    except DifferentRun:  # the recipe or source changed since this release converted: its own output, replaced
        done = run(resume=False)
    return f"{done.shards_written} shard(s), {done.output_bytes / 1e9:.3f} GB"


def _calibrate(chain: Chain) -> Outcome:
    if chain.config.calibrate_kv is None:
        return None
    from quantkit.kv.calibrate import calibrate_kv

    k = chain.config.calibrate_kv
    done = calibrate_kv(chain.model, in_place=True, data=chain.resolve(k.data), text_field=k.text_field,
                        samples=k.samples, seq_len=k.seq_len, batch_size=k.batch_size, device=k.device, dtype=k.dtype)
    return f"{done.layers} layers, {done.samples} x {done.seq_len} tokens"


def _verify(chain: Chain) -> Outcome:
    from quantkit.verify import planned_bytes_of, verify

    v = chain.config.verify
    report = verify(chain.model, source=chain.source, engine=v.engine, tp=v.tp, smoke=v.smoke,
                    planned_bytes=planned_bytes_of(chain.work / "plan.json"))
    write_json(chain.work / "verify.json", report)
    if not report.passed:
        raise QuantkitError(refused(report, chain.work / "verify.json"))
    return f"passed for {v.engine} tp={v.tp}"


def refused(report, saved: Path) -> str:
    """Why verify stops a release: how many findings, the first one, and where all of them are."""
    first = report.findings[0]
    where = first.tensor or first.file or first.rule  # a finding about the whole checkpoint names its rule
    return f"{len(report.findings)} finding(s), first: {first.check} {where}: {first.message} (all in {saved})"


def _eval_baseline(chain: Chain) -> Outcome:
    from quantkit.devices import resolve_device
    from quantkit.evaluation import engine_settings, finished_run
    from quantkit.evaluation.run_dir import REPEAT_DIR

    ev, run = chain.config.eval, chain.baseline_run
    data_dir = chain.resolve(ev.data_dir)
    device = resolve_device(ev.device) if ev.engine == "hf" else None
    settings = engine_settings(ev.engine, ev, chain.source, device)
    repeated = ev.repeat == 1 or finished_run(run / REPEAT_DIR, chain.source, ev.engine, ev.tasks, data_dir,
                                              ev.limit, settings)
    if repeated and finished_run(run, chain.source, ev.engine, ev.tasks, data_dir, ev.limit, settings):
        scores = {t: s.model_dump() for t, s in read_scores(run).items()}
        return StageStatus.REUSED, _scores(scores)
    return _scores(chain.evaluate(chain.source, run, ev.kv_cache_dtype, ev.repeat).scores)


def _eval_candidate(chain: Chain) -> Outcome:
    from quantkit.release.gate import gate

    looks = chain.gate_suite.sequential
    if looks is None:
        return _scores(chain.evaluate(chain.model, chain.candidate_run, chain.candidate_kv).scores)
    # sequential: the candidate's gated tasks in the seeded order, one look at a time, until the gate decides; each
    # look answers the earlier looks' items from the run's request cache. A task the suite does not gate is
    # evaluated whole at the first look (the rest answer it from the cache): generation runs to its longest answer
    # per batch, and three small batches of GSM8K cost the demo three 256-token runaways instead of one
    for at in range(1, len(looks.looks) + 1):
        fraction = looks.looks[at - 1]
        shares = {task: fraction for task in chain.gate_suite.tasks}
        done = chain.evaluate(chain.model, chain.candidate_run, chain.candidate_kv, fraction=shares)
        decision = gate(chain.baseline_run, chain.candidate_run, suite=chain.gate_suite).decision
        if decision != "continue":
            break
    return f"look {at} of {len(looks.looks)} ({fraction:.0%} of the items, {decision}): {_scores(done.scores)}"


def _gate(chain: Chain) -> Outcome:
    from quantkit.release.gate import gate
    from quantkit.release.report import markdown

    report = gate(chain.baseline_run, chain.candidate_run, suite=chain.gate_suite, report_dir=chain.gate_dir)
    chain.gate_table = markdown(report)
    if not report.passed:
        failed = ", ".join([f"{t.task} {t.delta:+.2f} [{t.low:+.2f}, {t.high:+.2f}] vs -{t.margin:g}"
                            for t in report.tasks if not t.passed]
                           + [f"{c.task} {c.check} {c.estimate:.3g} [{c.low:.3g}, {c.high:.3g}] vs {c.limit:g}"
                              for c in report.behaviour if not c.passed])
        raise QuantkitError(f"the candidate fails the gate: {failed}; nothing is published "
                            f"(report: {chain.gate_dir / 'report.html'})")
    return "pass: " + ", ".join(f"{t.task} {t.delta:+.2f}" for t in report.tasks)


def _publish(chain: Chain) -> Outcome:
    from quantkit.release.publish import publish

    p, to = chain.config.publish, chain.publish_target
    if p is None or to is None:
        return None
    repo, target = to
    done = publish(chain.model, repo, gate=chain.gate_dir / "verdict.json", private=p.private, revision=p.revision,
                   base_model=p.base_model, api=chain.api)
    chain.published_files[:] = [f["name"] for f in done.files]
    return f"{len(done.files)} files to {target}"


def _published(chain: Chain) -> tuple[list[Path], dict[str, str]]:
    if chain.publish_target is None:
        return [], {}
    repo, target = chain.publish_target
    if not repo.startswith("file://"):  # the hub's copy cannot be checked offline; its upload resumes on its own
        return [], {}
    files, dst = chain.state.files, chain.model
    known = {str(Path(target) / name): files[str(dst / name)].sha256
             for name in chain.published_files if str(dst / name) in files}
    return [Path(target) / name for name in chain.published_files], known


def _model_files(chain: Chain) -> tuple[list[Path], dict[str, str]]:
    """Every file of the converted model, with the sha256 its manifest records for the shards (already hashed as
    they were written)."""
    from quantkit.checkpoint.manifest import load_manifest
    from quantkit.checkpoint.reader import CARD_NAME, shipped_files

    model = chain.model
    manifest = load_manifest(model)
    recorded = manifest.shards if manifest is not None else {}
    files, known = [], {}
    for f in shipped_files(model):
        if f["name"] == CARD_NAME:  # publish's own file, rewritten by it (a source's card is copied, then replaced)
            continue
        path = model / f["name"]
        files.append(path)
        if f["name"] in recorded and recorded[f["name"]].size == f["bytes"]:
            known[str(path.absolute())] = recorded[f["name"]].sha256
    return files, known


def _run_files(run_dir: Path, tasks: list[str], repeat: int) -> list[Path]:
    """What the gate reads of an evaluation run (its provenance, scores and per-item records), and of its repeat."""
    from quantkit.evaluation.run_dir import REPEAT_DIR

    files = [run_dir / "run.json", run_dir / "results.json"] + [run_dir / "samples" / f"{t}.jsonl" for t in tasks]
    return files + (_run_files(run_dir / REPEAT_DIR, tasks, 1) if repeat == 2 else [])


def _scores(scores: dict) -> str:
    return ", ".join(f"{task} {s['score']:.2f} (n={s['n']})" for task, s in scores.items())


def _recipe_files(chain: Chain) -> list[Path]:
    from quantkit.packaged import recipe_path

    return [recipe_path(chain.recipe)]


def _calibration_files(chain: Chain) -> list[Path]:
    """The GPTQ calibration file convert reads (none for an RTN recipe): edited, it re-runs convert."""
    from quantkit.calibration_data import DEFAULT_DATA
    from quantkit.formats.recipe import load_recipe

    rec = load_recipe(chain.recipe)
    if rec.calibration is None:
        return []
    return [chain.resolve(chain.config.convert.calibration_data) or rec.calibration_data() or DEFAULT_DATA]


def _kv_data_files(chain: Chain) -> list[Path]:
    k = chain.config.calibrate_kv
    return [chain.path(k.data)] if k and k.data else []


def _suite_files(chain: Chain) -> list[Path]:
    from quantkit.packaged import suite_path
    from quantkit.release.suite import DEFAULT_SUITE

    return [suite_path(chain.suite or DEFAULT_SUITE)]


SOURCE_DIGESTS = "source-digests.json"


def _source_identity(chain: Chain) -> list[str]:
    """The source by its config, shard names, headers and bytes: a revision updated in place under the same headers
    re-runs every stage (a file is read again only once its size, times or inode moved: checkpoint/source_digest.py)."""
    from quantkit.checkpoint.reader import open_checkpoint
    from quantkit.checkpoint.source_digest import file_digests

    ckpt = open_checkpoint(chain.source)
    digests = file_digests(ckpt, chain.work / SOURCE_DIGESTS)
    return [ckpt.fingerprint(), *(f"{name}:{digest}" for name, digest in sorted(digests.items()))]


def _one(name: str) -> Callable[[Chain], tuple[list[Path], dict[str, str]]]:
    return lambda chain: ([chain.work / name], {})


STAGES = [
    Stage("plan", _plan, _one("plan.json"), ("source", "recipe", "convert"), _recipe_files, _source_identity),
    Stage("convert", _convert, _model_files, (), _calibration_files),
    Stage("calibrate-kv", _calibrate, _model_files, ("calibrate_kv",), _kv_data_files),
    Stage("verify", _verify, _one("verify.json"), ("verify",)),
    Stage("eval-baseline", _eval_baseline,
          lambda chain: (_run_files(chain.baseline_run, chain.config.eval.tasks, chain.config.eval.repeat), {}),
          ("eval",)),
    Stage("eval-candidate", _eval_candidate,
          lambda chain: (_run_files(chain.candidate_run, chain.config.eval.tasks, 1), {})),
    Stage("gate", _gate,
          lambda chain: (sorted(p for p in chain.gate_dir.iterdir() if p.is_file() and not p.name.startswith(".")),
                         {}),
          ("suite", "margin"), _suite_files),
    Stage("publish", _publish, _published, ("publish",)),
]
