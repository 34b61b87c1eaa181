"""What a calibrated recipe (GPTQ, SignRound) adds to a conversion: its calibration tokens, the dtype its walk computes
in, whether the shards still to write need the layer walk, the walk itself with the recipe's algorithm
(``QUANTIZERS``: the next algorithm is one module and one entry), and the summary of what it did per weight and per
layer."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from quantkit.checkpoint.manifest import Manifest
from quantkit.checkpoint.reader import Checkpoint
from quantkit.convert.tensor_plan import ActionKind
from quantkit.errors import QuantkitError
from quantkit.formats.recipe import Recipe

if TYPE_CHECKING:
    import torch

    from quantkit.convert.calibrated.memory import Budget
    from quantkit.convert.calibrated.walk import CalibratedResult, LayerQuantizer


def _gptq() -> type[LayerQuantizer]:
    from quantkit.convert.calibrated.gptq import GPTQ

    return GPTQ


def _signround() -> type[LayerQuantizer]:
    from quantkit.convert.calibrated.signround import SignRound

    return SignRound


# the recipe's algorithm -> its part of the layer walk (imported when used: llm-compressor is optional)
QUANTIZERS: dict[str, Callable[[], type[LayerQuantizer]]] = {"gptq": _gptq, "signround": _signround}


def run_calibrated(ckpt: Checkpoint, recipe: Recipe, plan, dst: Path, manifest: Manifest, batches: list,
                   devices: list[str], on_layer: Callable | None = None, dtype: torch.dtype | None = None,
                   budget: Budget | None = None, store: str | None = None) -> CalibratedResult:
    """The recipe's algorithm over the calibrated layer walk (convert/calibrated/walk.py), each layer planned
    against ``budget`` (convert/calibrated/memory.py), the layer inputs waiting on ``store`` (None: the device)."""
    from quantkit.convert.calibrated.walk import layer_folder, walk_layers

    quantizer = QUANTIZERS[recipe.algorithm]()(ckpt, recipe, batches, devices, layer_folder(dst), dtype, budget,
                                                store)
    return walk_layers(ckpt, recipe, plan, dst, manifest, quantizer, on_layer)


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


def target_modules(ckpt, plan, rec) -> frozenset[str]:
    """The modules a calibrated recipe's layer walk quantizes (none for round-to-nearest)."""
    if rec.calibration is None:
        return frozenset()
    from quantkit.convert.calibrated.walk import calibration_targets

    return frozenset(t.module for layer in calibration_targets(ckpt, plan, rec).values() for t in layer)


def needs_layer_walk(todo, ckpt, plan, rec) -> bool:
    targets = target_modules(ckpt, plan, rec)
    return any(a.module in targets for s in todo for a in s.actions)


@dataclass
class CalibratedSummary:
    """What the calibrated algorithm did, for the result and ``--json``: weights by method, each layer's loss, the
    experts' token counts, the dtype its layers computed in."""

    weights_by_method: dict[str, int]
    rtn_outside_calibration: list[str]  # INT4 weights the walk does not reach (MTP layers)
    rtn_reasons: dict[str | None, int]  # why weights in the walk fell back to round-to-nearest
    expert_tokens: dict[str, int]  # routed expert -> calibration tokens it saw
    layers: list[dict]  # each layer's report (convert/calibrated/walk.py LayerReport)
    algorithm: str
    settings: dict
    computed_in: str


def summary(manifest: Manifest, quantized, ckpt, plan, rec) -> CalibratedSummary:
    from quantkit.modeling import model_dtype

    assert rec.calibrated is not None  # only a calibrated recipe has one
    int4_modules = [a.module for s in plan.shards for a in s.actions if a.kind == ActionKind.INT4]
    records = manifest.calibrated_modules
    methods: Counter[str] = Counter(records[m].method if m in records else "rtn" for m in int4_modules)
    experts = {m: records[m].tokens for m in int4_modules
               if m in records and ".experts." in m and m.endswith("down_proj")}
    return CalibratedSummary(
        weights_by_method=dict(methods),
        rtn_outside_calibration=sorted(m for m in int4_modules if m not in records),
        rtn_reasons=dict(Counter(r.reason for r in records.values() if r.method == "rtn")),
        expert_tokens={m.removesuffix(".down_proj"): n for m, n in experts.items()},
        layers=[vars(r) for r in quantized.layers] if quantized else [],
        algorithm=rec.algorithm,
        settings=rec.calibrated.model_dump(),
        computed_in=manifest.computed_in or str(model_dtype(ckpt.config)).removeprefix("torch."),
    )
