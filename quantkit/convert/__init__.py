"""``convert``: a source checkpoint and a recipe in, a compressed-tensors checkpoint out.

Streaming, shard by shard. Each output shard is one job: a reader thread preads the source
tensors ahead, the job thread decodes / quantizes / packs them on its device, and a writer
streams the results into the shard behind a header planned in advance. Jobs run on a pool of
workers: threads, or on GPUs for a large job processes (convert/processes.py). Memory is a few
tensors per worker, not a shard, not a model. What is decided before DST is touched is in
conversion.py.

The manifest in DST makes the run resumable after any kill: finished shards are recorded with
their sha256, files only appear under their final names once complete, and a re-run with
``--resume`` redoes only what is missing, giving byte-identical output.
"""

from __future__ import annotations

import os
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from quantkit.checkpoint.families import detect_family
from quantkit.checkpoint.manifest import Manifest, ManifestStatus
from quantkit.checkpoint.writer import folder_lock
from quantkit.convert import calibrated
from quantkit.convert import dst as dst_folder
from quantkit.convert.calibrated.preflight import calibration_batches_of as calibration_batches
from quantkit.convert.calibrated.summary import CalibratedSummary, summary
from quantkit.convert.conversion import Conversion, checked_and_planned, manifest_of
from quantkit.convert.dst import DifferentRun, output_quantization_config
from quantkit.convert.pipeline import Job, Progress, ShardWork, Stats, run_all
from quantkit.convert.processes import run_in_processes, start_server, uses_processes
from quantkit.settings import CONVERT
from quantkit.sizes import parse_size

__all__ = ["ConvertResult", "DifferentRun", "calibration_batches", "convert", "output_quantization_config"]

@dataclass
class ConvertResult:
    src: str
    dst: str
    family: str
    recipe: str
    source_bytes: int
    output_bytes: int
    shards_total: int
    shards_written: int
    shards_reused: int
    tensors_by_kind: dict[str, int]
    devices: list[str]
    workers: int
    seconds: float
    stage_seconds: dict[str, float] = field(default_factory=dict)
    tensors_by_group: dict[str, int] = field(default_factory=dict)  # recipe group -> weights it took
    calibrated: CalibratedSummary | None = None  # GPTQ, SignRound recipes
    skipped_files: list[str] = field(default_factory=list)  # weight files in SRC the index does not own
    warnings: list[str] = field(default_factory=list)


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    recipe: str | os.PathLike,
    *,
    device: str = CONVERT.device,
    workers: int | None = CONVERT.workers,
    max_shard_size: str | int = CONVERT.max_shard_size,
    resume: bool = False,
    force: bool = False,
    verify_reused: bool = True,
    calibration_data: str | os.PathLike | None = None,
    dtype: str = CONVERT.dtype,
    gpu_memory: str | int | None = CONVERT.gpu_memory,
    on_progress: Callable[[int, int], None] | None = None,
    on_layer: Callable | None = None,
) -> ConvertResult:
    """Convert SRC into DST with RECIPE.

    :param device: ``auto``, ``cpu``, ``cuda`` or a list ``cuda:0,cuda:1``.
    :param workers: concurrent shard jobs (default 4 per GPU, or up to 4 on CPU).
    :param max_shard_size: largest output file, e.g. ``5GB``.
    :param resume: finish the interrupted run of the same job in DST.
    :param force: replace the quantkit run DST holds (never a folder of other files).
    :param verify_reused: on resume, re-hash each finished shard, and re-read the source bytes it was made from,
        before keeping it.
    :param calibration_data: a GPTQ recipe's calibration file, instead of the recipe's own.
    :param dtype: what a GPTQ recipe's layer walk computes in (``auto``, ``bf16``, ``fp16``, ``fp32``; weights and
        scales are the checkpoint's either way). ``auto``: the model's dtype on a GPU, on a CPU it or FP32, whichever
        runs faster there. SignRound tunes in the model's dtype, as llm-compressor does.
    :param gpu_memory: what a GPTQ or SignRound layer may hold on each GPU (e.g. ``70GiB``; default: what the GPU has
        free, less a margin); a MoE layer's experts are worked in groups that fit it (convert/calibrated/memory.py).
    :param on_progress: ``on_progress(done_bytes, total_bytes)`` over source bytes.
    :param on_layer: ``on_layer(report, layers)`` after each layer of a GPTQ or SignRound recipe's walk
        (convert/calibrated/walk.py).
    """
    from quantkit.convert.calibrated import walk  # torch: only a conversion needs it (imported before the clock)

    started = time.perf_counter()
    job = checked_and_planned(Path(src), Path(dst), recipe, device, workers, parse_size(max_shard_size), resume,
                              force, calibration_data, dtype, gpu_memory)
    if uses_processes(job.devices, job.workers, job.ckpt.total_bytes):
        start_server()
    manifest = manifest_of(job)
    dst_folder.make_folder(job.dst)
    dst_folder.refuse_foreign(job.dst)  # before the lock file is created in someone else's folder; again under the lock
    with folder_lock(job.dst):
        manifest, finished = dst_folder.prepare_dst(job.dst, manifest, resume, force)
        todo = [s for s in job.plan.shards if not dst_folder.is_done(job.dst, s, manifest, verify_reused)]
        made_by_walk = walk.target_modules(job.ckpt, job.plan, job.recipe)
        if verify_reused:
            kept = [s for s in job.plan.shards if s not in todo]
            dst_folder.same_source(job.ckpt, kept, manifest, made_by_walk, job.workers)
        total = sum(s.source_bytes for s in job.plan.shards)
        progress = Progress(total, on_progress)
        progress.add(total - sum(s.source_bytes for s in todo))
        stats = Stats()
        if finished and todo:
            manifest.status = ManifestStatus.RUNNING
            manifest.save(job.dst)
            stats.warn(f"{len(todo)} finished shard(s) differed from the manifest and were written again; "
                       "config.json and the index are rewritten, so KV scales added since must be calibrated again")
        quantized = None
        if job.batches and walk.needs_layer_walk(todo, job.ckpt, job.plan, job.recipe):
            quantized = _calibrate(job, manifest, on_layer)
        # a finished run with every shard intact keeps its files (and calibrate-kv's additions)
        if todo or not finished:
            todo_bytes = sum(s.source_bytes for s in todo)
            run = run_in_processes if uses_processes(job.devices, job.workers, todo_bytes) else run_all
            run(Job(ShardWork(job.plan, job.ckpt, job.dst, quantized, made_by_walk), manifest, stats, progress), todo,
                job.workers, job.devices)
            dst_folder.finish(job.ckpt, job.recipe, job.plan, job.dst, manifest)
        for folder in (walk.WORK_DIR, walk.LEGACY_WORK_DIR):  # every calibrated result is in the shards now
            shutil.rmtree(job.dst / folder, ignore_errors=True)
    return _result(job, manifest, todo, stats, quantized, time.perf_counter() - started)


def _calibrate(job: Conversion, manifest: Manifest, on_layer: Callable | None):
    """GPTQ's or SignRound's layer walk; its packed weights wait in DST's work folder for the shards."""
    assert job.batches is not None  # set for every calibrated recipe
    return calibrated.run_calibrated(job.ckpt, job.recipe, job.plan, job.dst, manifest, job.batches, job.devices,
                                     on_layer, job.compute, job.budget, job.store)


def _result(job: Conversion, manifest: Manifest, todo: list, stats: Stats, quantized, seconds: float) -> ConvertResult:
    plan, rec = job.plan, job.recipe
    planned = {s.name for s in plan.shards}
    return ConvertResult(
        src=str(job.src),
        dst=str(job.dst),
        family=detect_family(job.ckpt.config).name,
        recipe=rec.name,
        source_bytes=job.ckpt.total_bytes,
        output_bytes=sum(r.size for name, r in manifest.shards.items() if name in planned),
        shards_total=len(plan.shards),
        shards_written=len(todo),
        shards_reused=len(plan.shards) - len(todo),
        tensors_by_kind=dict(Counter(a.kind.value for s in plan.shards for a in s.actions)),
        devices=job.devices,
        workers=job.workers,
        seconds=seconds,
        stage_seconds=dict(stats.seconds),
        tensors_by_group={g: plan.weights_by_group[g] for g in rec.config.config_groups},
        calibrated=summary(manifest, quantized, job.ckpt, plan, rec) if rec.calibration else None,
        skipped_files=list(job.ckpt.skipped_files),
        warnings=list(stats.warnings),
    )
