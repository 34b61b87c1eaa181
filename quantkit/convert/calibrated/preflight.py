"""What a calibrated conversion decides before DST is touched: its calibration tokens, the dtype its layer walk
computes in (its quantizer's choice, kept across a resume where the quantizer wants that), and where the walk keeps the
layer inputs on the device's budget."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from quantkit.checkpoint.reader import Checkpoint
from quantkit.convert.calibrated import QUANTIZERS
from quantkit.errors import QuantkitError
from quantkit.formats.recipe import Recipe

if TYPE_CHECKING:
    import torch

    from quantkit.convert.calibrated.memory import Budget


def calibration_batches_of(ckpt: Checkpoint, rec: Recipe, override: str | os.PathLike | None):
    """The calibration token batches of a GPTQ recipe: exactly ``samples`` x ``seq_len`` tokens, one
    sequence per batch (llm-compressor oneshot's default, so Hessians sum in the same order)."""
    from quantkit.calibration_data import DEFAULT_DATA, calibration_batches, model_tokenizer

    cal = rec.calibration
    if cal is None:
        raise QuantkitError(f"recipe {rec.name} is round-to-nearest: it takes no calibration data")
    data = Path(override) if override is not None else (rec.calibration_data() or DEFAULT_DATA)
    ckpt.config.check_context(cal.seq_len, f"recipe {rec.name}: calibration seq_len")
    return calibration_batches(data, cal.text_field, cal.samples, cal.seq_len, 1, lambda: model_tokenizer(ckpt.root),
                               ckpt.config.vocab_size, require_all=True)


def walk_dtype(rec: Recipe, spec: str, device: str, ckpt: Checkpoint) -> torch.dtype | None:
    """The dtype the recipe's layer walk computes in where it is not the model's own (its quantizer's choice)."""
    from quantkit.modeling import model_dtype

    if rec.calibrated is None:
        return None
    return QUANTIZERS[rec.algorithm]().walk_dtype(rec, spec, device, model_dtype(ckpt.config))


def resumed_dtype(rec: Recipe, spec: str, dst: Path, ckpt: Checkpoint) -> str:
    """--dtype for a resumed run: ``auto`` becomes what the run in DST started in where the quantizer wants that."""
    if spec != "auto" or rec.calibrated is None or not QUANTIZERS[rec.algorithm]().resumes_started_dtype:
        return spec
    return started_in(dst, ckpt)


def started_in(dst: Path, ckpt: Checkpoint) -> str:
    """``auto`` resumed: the dtype the run in DST started in (a probe now could pick the other one), else ``auto``."""
    from quantkit.checkpoint.manifest import load_manifest
    from quantkit.compute_dtype import DTYPES, dtype_name
    from quantkit.modeling import model_dtype

    try:
        started = load_manifest(dst)
    except QuantkitError:
        return "auto"  # prepare_dst says what is wrong with it
    if started is None or started.calibration_sha256 is None:
        return "auto"
    spelled = {dtype_name(d): name for name, d in DTYPES.items()}
    return spelled.get(started.computed_in or dtype_name(model_dtype(ckpt.config)), "auto")


def memory_plan(ckpt: Checkpoint, plan, recipe: Recipe, batches: list, budget: Budget | None,
                dtype: torch.dtype | None) -> str | None:
    """Where the layer walk keeps the layer inputs between layers (None: on the device; ``cpu``: in host memory, a
    batch moved to the device as it runs), from the largest layer's least need: on the device while they and that
    need take at most three quarters of the budget. A layer that cannot fit the budget either way is refused here,
    before DST exists."""
    from quantkit.convert.calibrated.memory import Run, layer_inputs_bytes, where_inputs_wait
    from quantkit.convert.calibrated.walk import calibration_targets
    from quantkit.modeling import model_dtype

    if budget is None or not budget.device.startswith("cuda") or not batches:
        return None
    width = (dtype or model_dtype(ckpt.config)).itemsize
    sequences, seq_len = len(batches), batches[0].shape[-1]
    quantizer = QUANTIZERS[recipe.algorithm]()
    inputs = layer_inputs_bytes(ckpt.config, sequences, seq_len, width)
    one = layer_inputs_bytes(ckpt.config, 1, seq_len, width)
    targets = calibration_targets(ckpt, plan, recipe)
    if not targets:
        return None
    on_device = max((quantizer.least_bytes(ckpt, recipe, i, t, Run(sequences, seq_len, width)), i)
                    for i, t in targets.items())
    if on_device[0] + inputs <= budget.limit * 3 // 4:  # a quarter left for larger expert groups: fewer passes
        return None
    on_host = max((quantizer.least_bytes(ckpt, recipe, i, t, Run(sequences, seq_len, width, False)), i)
                  for i, t in targets.items())
    return where_inputs_wait(ckpt.root, budget, on_host, inputs, one)
