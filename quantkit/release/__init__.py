"""``release``: the whole chain from one config file, resumable stage by stage.

plan -> convert -> calibrate-kv -> verify -> eval baseline -> eval candidate -> gate -> publish.

Each finished stage is recorded in WORK/release-state.json (release/state.py) with a fingerprint of
the config sections it depends on (its own and every earlier stage's) and the files it left behind.
``--resume`` skips a stage whose fingerprint is unchanged and whose files are all still there as it
left them, so fixing a later stage's settings re-runs only from there, and a deleted or edited output
runs its stage again. WORK is locked while a release runs in it. A baseline
run already on disk with the same shards, tasks and engine settings is reused without serving
the source again. A failure stops the chain with the stage, the cause and the command to resume.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from quantkit.checkpoint.writer import LOCK_NAME, folder_lock, sha256_file, work_folder, write_bytes_atomic, write_error
from quantkit.errors import QuantkitError, field_error
from quantkit.evaluation.run_dir import read_scores
from quantkit.packaged import recipe_path, suite_path
from quantkit.release.gate import DEFAULT_SUITE
from quantkit.release.state import STATE_NAME, ReleaseState, StageState, load_state

STAGES = ("plan", "convert", "calibrate-kv", "verify", "eval-baseline", "eval-candidate", "gate", "publish")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ConvertSettings(_Section):
    device: str = "auto"
    workers: int | None = None
    max_shard_size: str = "5GB"
    calibration_data: str | None = None  # GPTQ recipes: instead of the recipe's own calibration file


class CalibrateSettings(_Section):
    data: str | None = None  # default: quantkit's bundled GSM8K-train text
    text_field: str = "text"
    samples: int = 512
    seq_len: int = 2048
    batch_size: int = 4
    device: str = "auto"


class VerifySettings(_Section):
    engine: str = "sglang"
    tp: int = 1
    smoke: bool = True


class EvalSettings(_Section):
    engine: str = "hf"
    engine_cmd: str | None = None
    url: str | None = None
    tasks: list[str] = ["gsm8k", "arc_easy", "arc_challenge", "mmlu", "mmlu_pro", "needle_8k", "needle_32k"]  # the release suite's
    data_dir: str | None = None
    limit: int | None = None
    batch_size: int = 8
    tp: int = 1
    ep: int = 1
    mem_fraction: float | None = None
    health_timeout: float = 1800
    device: str = "auto"  # hf: where the model runs (auto: the first GPU, else the CPU)
    kv_cache_dtype: str = "auto"  # the baseline's: the prefill pool's BF16 KV cache
    candidate_kv_cache_dtype: str | None = None  # default: fp8_e4m3 when calibrate_kv is set, else as the baseline
    baseline_run: str | None = None  # default WORK/runs/baseline; point at another release's to reuse it
    repeat: int = Field(default=1, ge=1, le=2)  # 2: the baseline runs twice, the gate's engine-noise floor


class PublishSettings(_Section):
    repo: str  # ORG/NAME on the hub, or file://DIR
    private: bool = False
    revision: str | None = None
    base_model: str | None = None


class ReleaseConfig(_Section):
    source: str
    recipe: str
    work_dir: str | None = None  # default: <config name>-work beside the config
    convert: ConvertSettings = ConvertSettings()
    calibrate_kv: CalibrateSettings | None = None
    verify: VerifySettings = VerifySettings()
    eval: EvalSettings = EvalSettings()
    suite: str | None = None
    margin: float | None = None
    publish: PublishSettings


# The config sections each stage reads; a stage's fingerprint also covers all earlier stages'.
STAGE_INPUTS = {
    "plan": ("source", "recipe", "convert"),
    "convert": (),
    "calibrate-kv": ("calibrate_kv",),
    "verify": ("verify",),
    "eval-baseline": ("eval",),
    "eval-candidate": (),
    "gate": ("suite", "margin"),
    "publish": ("publish",),
}


class StageStatus(str, Enum):
    RAN = "ran"
    RESUMED = "resumed"  # done by an earlier run with the same inputs
    REUSED = "reused"  # a finished run on disk (the baseline of another release)
    SKIPPED = "skipped"  # not configured

    def __str__(self) -> str:
        return self.value


@dataclass
class StageRecord:
    stage: str
    status: StageStatus
    seconds: float = 0.0
    summary: str = ""


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
    def __init__(self, stage: str, cause: str, config: Path):
        self.stage = stage
        super().__init__(f"release stopped at stage {stage}: {cause}; "
                         f"after fixing it, resume with: quantkit release {config} --resume")


def load_config(path: str | os.PathLike) -> ReleaseConfig:
    from quantkit.yaml_file import load_yaml

    path = Path(path)
    doc = load_yaml(path, "release config")
    try:
        return ReleaseConfig.model_validate(doc)
    except ValidationError as exc:
        raise QuantkitError(field_error(exc), path) from exc


def _suite_tasks_evaluated(config: ReleaseConfig, suite: Path | None, config_path: Path) -> None:
    """The gate compares what eval ran: a suite task missing from eval.tasks is refused before hours of serving."""
    from quantkit.release.gate import load_suite

    missing = [t for t in load_suite(suite, config.margin).tasks if t not in config.eval.tasks]
    if missing:
        raise QuantkitError(f"the suite gates {', '.join(missing)}, which eval.tasks does not run", config_path)


def release(
    config_path: str | os.PathLike,
    resume: bool = False,
    on_stage: Callable[[StageRecord], None] | None = None,
    api=None,
    on_progress: Callable[[str, int, int], None] | None = None,
    on_launch: Callable[[list[str]], None] | None = None,
) -> ReleaseResult:
    """Run CONFIG's chain; ``on_stage`` after each stage, ``on_progress(task, done, total)`` during evals,
    ``on_launch(argv)`` before the config's engine command runs (it is executable configuration)."""
    config_path = Path(config_path).resolve()
    config = load_config(config_path)
    base = config_path.parent

    def resolve(p: str | None) -> Path | None:
        if p is None:
            return None
        return Path(p) if Path(p).is_absolute() else (base / p).resolve()

    _suite_tasks_evaluated(config, resolve(config.suite), config_path)
    work = resolve(config.work_dir) or base / f"{config_path.stem}-work"
    if load_state(work / STATE_NAME) and not resume:
        raise QuantkitError("holds a release already; --resume continues it, or remove the folder to start over", work)
    try:
        work.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise write_error(work, exc) from exc
    with folder_lock(work):  # read again under the lock: the state another process left, not a stale copy
        state = load_state(work / STATE_NAME) or ReleaseState()
        return _release(config, config_path, work, state, resolve, on_stage, api, on_progress, on_launch)


def _release(config: ReleaseConfig, config_path: Path, work: Path, state: ReleaseState, resolve, on_stage, api,
             on_progress, on_launch) -> ReleaseResult:
    """The chain in WORK, which the caller holds locked."""
    state_path = work / STATE_NAME
    source = resolve(config.source)
    recipe_file = resolve(config.recipe)
    recipe = str(recipe_file) if recipe_file.is_file() else config.recipe  # else a built-in name
    # Files a stage reads, fingerprinted by content: an edited recipe or suite must re-run its stage.
    file_inputs = {"plan": [recipe_path(recipe)], "gate": [suite_path(resolve(config.suite) or DEFAULT_SUITE)],
                   "convert": _calibration_files(recipe, resolve(config.convert.calibration_data)),
                   "calibrate-kv": [resolve(config.calibrate_kv.data)] if config.calibrate_kv and config.calibrate_kv.data else []}
    dst = work / "model"
    runs = work / "runs"
    baseline_run = resolve(config.eval.baseline_run) or runs / "baseline"
    candidate_run = runs / "candidate"
    gate_dir = work / "gate"
    for sub in ("model", "runs", "runs/candidate", "gate"):  # quantkit's own sub-folders: never links leading out
        work_folder(work, sub)
    if config.eval.baseline_run is None:
        work_folder(work, "runs/baseline")
    ev = config.eval
    data_dir = resolve(ev.data_dir)
    cand_kv = ev.candidate_kv_cache_dtype or ("fp8_e4m3" if config.calibrate_kv else ev.kv_cache_dtype)
    result = ReleaseResult(str(config_path), str(work))

    def run_eval(model: Path, out: Path, kv: str, repeat: int = 1, fraction: float | None = None):
        from quantkit.evaluation import evaluate

        return evaluate(model, engine=ev.engine, tasks=ev.tasks, data_dir=data_dir, limit=ev.limit, kv_cache_dtype=kv,
                        out=out, batch_size=ev.batch_size, tp=ev.tp, ep=ev.ep, url=ev.url, engine_cmd=ev.engine_cmd,
                        mem_fraction=ev.mem_fraction, health_timeout=ev.health_timeout, device=ev.device,
                        order="file" if fraction is None else "seeded", fraction=fraction,
                        on_progress=on_progress, on_launch=on_launch, repeat=repeat)

    def stage_plan():
        from quantkit.plan import plan

        report = plan(source, recipe, tp=config.verify.tp, max_shard_size=config.convert.max_shard_size)
        write_bytes_atomic(work / "plan.json", (json.dumps(asdict(report), indent=2, default=str) + "\n").encode())
        return f"{report.bytes_now / 1e9:.3f} GB -> {report.bytes_after / 1e9:.3f} GB"

    def stage_convert():
        from quantkit.convert import DifferentRun, convert

        c = config.convert
        # WORK/model is replaced only when this release wrote it (state says so): never a checkpoint put there by hand.
        if any(p.name != LOCK_NAME for p in dst.iterdir()) and not state.owns_model:
            raise QuantkitError("holds files this release did not write; move them away or set another work_dir", dst)
        state.owns_model = True
        state.save(state_path)
        settings = {"device": c.device, "workers": c.workers, "max_shard_size": c.max_shard_size,
                    "calibration_data": resolve(c.calibration_data)}
        try:
            done = convert(source, dst, recipe, resume=True, **settings)
        except DifferentRun:  # the recipe or source changed since this release converted: its own output, replaced
            done = convert(source, dst, recipe, force=True, **settings)
        return f"{done.shards_written} shard(s), {done.output_bytes / 1e9:.3f} GB"

    def stage_calibrate():
        if config.calibrate_kv is None:
            return None
        from quantkit.kv.calibrate import calibrate_kv

        k = config.calibrate_kv
        done = calibrate_kv(dst, in_place=True, data=resolve(k.data), text_field=k.text_field, samples=k.samples,
                            seq_len=k.seq_len, batch_size=k.batch_size, device=k.device)
        return f"{done.layers} layers, {done.samples} x {done.seq_len} tokens"

    def stage_verify():
        from quantkit.verify import verify

        v = config.verify
        report = verify(dst, source=source, engine=v.engine, tp=v.tp, smoke=v.smoke)
        write_bytes_atomic(work / "verify.json", (json.dumps(asdict(report), indent=2, default=str) + "\n").encode())
        if not report.passed:
            first = report.findings[0]
            raise QuantkitError(f"{len(report.findings)} finding(s), first: {first.check} {first.tensor or first.file}: "
                                f"{first.message} (all in {work / 'verify.json'})")
        return f"passed for {v.engine} tp={v.tp}"

    def stage_eval_baseline():
        from quantkit.devices import resolve_device
        from quantkit.evaluation import REPEAT_DIR, engine_settings, finished_run

        device = resolve_device(ev.device) if ev.engine == "hf" else None
        settings = engine_settings(ev.engine, ev.kv_cache_dtype, ev.batch_size, ev.tp, ev.ep, ev.mem_fraction, device)
        repeated = ev.repeat == 1 or finished_run(baseline_run / REPEAT_DIR, source, ev.engine, ev.tasks, data_dir,
                                                  ev.limit, settings)
        if repeated and finished_run(baseline_run, source, ev.engine, ev.tasks, data_dir, ev.limit, settings):
            scores = {t: s.model_dump() for t, s in read_scores(baseline_run).items()}
            return StageStatus.REUSED, _scores(scores)
        return _scores(run_eval(source, baseline_run, ev.kv_cache_dtype, ev.repeat).scores)

    def stage_eval_candidate():
        from quantkit.release.gate import gate, load_suite

        plan = load_suite(resolve(config.suite), config.margin).sequential
        if plan is None:
            return _scores(run_eval(dst, candidate_run, cand_kv).scores)
        # sequential: the candidate's items in the seeded order, one look at a time, until the gate decides; each
        # look answers the earlier looks' items from the run's request cache
        for at, fraction in enumerate(plan.looks, 1):
            done = run_eval(dst, candidate_run, cand_kv, fraction=fraction)
            decision = gate(baseline_run, candidate_run, suite=resolve(config.suite), margin=config.margin).decision
            if decision != "continue":
                break
        return f"look {at} of {len(plan.looks)} ({fraction:.0%} of the items, {decision}): {_scores(done.scores)}"

    def stage_gate():
        from quantkit.release.gate import gate
        from quantkit.release.report import markdown

        report = gate(baseline_run, candidate_run, suite=resolve(config.suite), margin=config.margin, report_dir=gate_dir)
        result.gate_table = markdown(report)
        if not report.passed:
            failed = ", ".join([f"{t.task} {t.delta:+.2f} [{t.low:+.2f}, {t.high:+.2f}] vs -{t.margin:g}"
                                for t in report.tasks if not t.passed]
                               + [f"{c.task} {c.check} {c.estimate:.3g} [{c.low:.3g}, {c.high:.3g}] vs {c.limit:g}"
                                  for c in report.behaviour if not c.passed])
            raise QuantkitError(f"the candidate fails the gate: {failed}; nothing is published "
                                f"(report: {gate_dir / 'report.html'})")
        return "pass: " + ", ".join(f"{t.task} {t.delta:+.2f}" for t in report.tasks)

    p = config.publish
    local = p.repo.startswith("file://")
    repo = "file://" + str(resolve(p.repo.removeprefix("file://"))) if local else p.repo
    target = repo.removeprefix("file://")

    def stage_publish():
        from quantkit.release.publish import publish

        done = publish(dst, repo, gate=gate_dir / "verdict.json", private=p.private, revision=p.revision,
                       base_model=p.base_model, api=api)
        published_files[:] = [f["name"] for f in done.files]
        return f"{len(done.files)} files to {target}"

    published_files: list[str] = []

    def outputs(stage: str) -> tuple[list[Path], dict[str, str]]:
        """The files a stage just left behind (what a resume checks), with the sha256 already known of some."""
        if stage == "plan":
            return [work / "plan.json"], {}
        if stage in ("convert", "calibrate-kv"):
            return _model_files(dst)
        if stage == "verify":
            return [work / "verify.json"], {}
        if stage == "eval-baseline":
            return _run_files(baseline_run, ev.tasks, ev.repeat), {}
        if stage == "eval-candidate":
            return _run_files(candidate_run, ev.tasks, 1), {}
        if stage == "gate":
            return sorted(p for p in gate_dir.iterdir() if p.is_file() and not p.name.startswith(".")), {}
        if not local:  # the hub's copy cannot be checked offline; its upload resumes on its own
            return [], {}
        known = {str(Path(target) / name): state.files[str(dst / name)].sha256
                 for name in published_files if str(dst / name) in state.files}
        return [Path(target) / name for name in published_files], known

    steps = {"plan": stage_plan, "convert": stage_convert, "calibrate-kv": stage_calibrate, "verify": stage_verify,
             "eval-baseline": stage_eval_baseline, "eval-candidate": stage_eval_candidate, "gate": stage_gate,
             "publish": stage_publish}
    fingerprint = hashlib.sha256()
    for index, stage in enumerate(STAGES):
        sections = {name: getattr(config, name) for name in STAGE_INPUTS[stage]}
        fingerprint.update(json.dumps({k: v.model_dump() if isinstance(v, BaseModel) else v
                                       for k, v in sections.items()}, sort_keys=True).encode())
        for path in file_inputs.get(stage, []):
            fingerprint.update(f"{path.name}:{sha256_file(path) if path.is_file() else 'missing'}".encode())
        digest = fingerprint.hexdigest()
        done = state.stages.get(stage)
        changed = state.changed_output(stage) if done and done.fingerprint == digest else None
        if done and done.fingerprint == digest and changed is None:
            record = StageRecord(stage, StageStatus.RESUMED, done.seconds, done.summary)
        else:
            started = time.perf_counter()
            try:
                outcome = steps[stage]()
            except QuantkitError as exc:
                raise ReleaseStopped(stage, str(exc), config_path) from exc
            status, summary = outcome if isinstance(outcome, tuple) else (StageStatus.RAN, outcome)
            if summary is None:
                status, summary = StageStatus.SKIPPED, "not configured"
            if changed is not None:
                summary += f" (run again: {changed})"
            record = StageRecord(stage, status, round(time.perf_counter() - started, 1), summary)
            # this stage's old result, and every later stage built on it, are stale now
            state.forget_from(STAGES[index:])
            files, known = outputs(stage) if status != StageStatus.SKIPPED else ([], {})
            state.stages[stage] = StageState(fingerprint=digest, seconds=record.seconds, summary=record.summary,
                                             outputs=state.record(files, known))
            state.save(state_path)
        result.stages.append(record)
        if on_stage is not None:
            on_stage(record)
    result.published = target  # every stage, publish included, is done and its files are in place
    if (gate_dir / "report.md").is_file():
        result.gate_table = result.gate_table or (gate_dir / "report.md").read_text()
        result.verdict, result.report = str(gate_dir / "verdict.json"), str(gate_dir / "report.html")
    return result


def _model_files(model: Path) -> tuple[list[Path], dict[str, str]]:
    """Every file of a converted model, with the sha256 its manifest records for the shards (already hashed as
    they were written)."""
    from quantkit.checkpoint.manifest import load_manifest
    from quantkit.checkpoint.reader import CARD_NAME, shipped_files

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
    from quantkit.evaluation import REPEAT_DIR

    files = [run_dir / "run.json", run_dir / "results.json"] + [run_dir / "samples" / f"{t}.jsonl" for t in tasks]
    return files + (_run_files(run_dir / REPEAT_DIR, tasks, 1) if repeat == 2 else [])


def _scores(scores: dict) -> str:
    return ", ".join(f"{task} {s['score']:.2f} (n={s['n']})" for task, s in scores.items())


def _calibration_files(recipe: str, override: Path | None) -> list[Path]:
    """The GPTQ calibration file convert reads (none for an RTN recipe): edited, it re-runs convert."""
    from quantkit.calibration_data import DEFAULT_DATA
    from quantkit.formats.recipe import load_recipe

    rec = load_recipe(recipe)
    if rec.calibration is None:
        return []
    return [override or rec.calibration_data() or DEFAULT_DATA]
