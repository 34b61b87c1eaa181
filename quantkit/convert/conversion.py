"""A conversion checked and planned before DST is touched: its arguments checked, the source opened, the recipe read
and planned, devices and workers chosen, a calibrated recipe's tokens, walk dtype and memory plan decided; and the
manifest it will write."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from quantkit import __version__
from quantkit.checkpoint.manifest import Manifest
from quantkit.checkpoint.reader import Checkpoint, open_checkpoint
from quantkit.convert import calibrated
from quantkit.convert import dst as dst_folder
from quantkit.convert.calibrated import preflight
from quantkit.convert.calibrated.memory import Budget
from quantkit.convert.tensor_plan import ConversionPlan, plan_conversion
from quantkit.devices import resolve_devices
from quantkit.errors import QuantkitError
from quantkit.formats.recipe import Recipe, load_recipe
from quantkit.settings import CONVERT

if TYPE_CHECKING:
    import torch


@dataclass
class Conversion:
    """A conversion checked and planned, before DST is touched."""

    src: Path
    dst: Path
    ckpt: Checkpoint
    recipe: Recipe
    plan: ConversionPlan
    shard_size: int
    devices: list[str]
    workers: int
    batches: list | None  # a calibrated recipe's token batches
    compute: torch.dtype | None = None  # what a GPTQ walk computes in; None: the model's dtype
    budget: Budget | None = None  # the GPU memory a calibrated layer may hold
    store: str | None = None  # where the calibrated walk keeps the layer inputs (None: on the device)


def checked_and_planned(src: Path, dst: Path, recipe, device: str, workers: int | None, shard_size: int, resume: bool,
                        force: bool, calibration_data, dtype: str = CONVERT.dtype,
                        gpu_memory: str | int | None = None) -> Conversion:
    if resume and force:
        raise QuantkitError("--resume and --force exclude each other")
    from quantkit.compute_dtype import check_dtype

    check_dtype(dtype)
    if workers is not None and workers < 1:
        raise QuantkitError(f"--workers must be at least 1 (got {workers})")
    dst_folder.check_paths(src, dst)
    ckpt = open_checkpoint(src)
    rec = load_recipe(recipe)
    plan = plan_conversion(ckpt, rec, shard_size)
    devices = resolve_devices(device)
    if calibration_data is not None and rec.calibration is None:
        raise QuantkitError(f"--calibration-data is for GPTQ and SignRound recipes; {rec.name} is round-to-nearest")
    if rec.calibration:  # the algorithm's libraries and reach, checked before DST exists
        calibrated.QUANTIZERS[rec.algorithm]().check(ckpt, plan, rec)
    if resume:
        dtype = preflight.resumed_dtype(rec, dtype, dst, ckpt)
    compute = preflight.walk_dtype(rec, dtype, devices[0], ckpt)
    batches = preflight.calibration_batches_of(ckpt, rec, calibration_data) if rec.calibration else None
    if gpu_memory is not None and not devices[0].startswith("cuda"):
        raise QuantkitError(f"--gpu-memory is for GPU devices; this conversion runs on {devices[0]}")
    budget = Budget.of(devices[0], gpu_memory) if rec.calibration else None
    store = preflight.memory_plan(ckpt, plan, rec, batches or [], budget, compute)
    # GPUs: enough jobs per device to keep the disk busy while others compute; CPU: one per core
    workers = workers or (4 * len(devices) if devices[0] != "cpu" else min(4, os.cpu_count() or 1))
    return Conversion(src, dst, ckpt, rec, plan, shard_size, devices, workers, batches, compute, budget, store)


def manifest_of(job: Conversion) -> Manifest:
    """The manifest this conversion writes; a resumed run must match it in everything but its shards."""
    from quantkit.compute_dtype import dtype_name
    from quantkit.convert.calibrated.walk import calibration_digest

    return Manifest(
        quantkit_version=__version__,
        source_path=str(job.src.resolve()),
        source_fingerprint=job.ckpt.fingerprint(),
        recipe_name=job.recipe.name,
        recipe_sha256=job.recipe.sha256,
        plan_sha256=job.plan.digest(),
        max_shard_size=job.shard_size,
        calibration_sha256=calibration_digest(job.batches, job.recipe) if job.batches else None,
        computed_in=dtype_name(job.compute) if job.compute is not None else None,
    )
