"""The calibrated recipes (GPTQ, SignRound): the layer walk with the recipe's algorithm (``QUANTIZERS``: the next
algorithm is one module and one entry). What a conversion decides before the walk is in preflight.py, which modules
the walk makes in walk.py, what it did in summary.py."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable

from quantkit.checkpoint.manifest import Manifest
from quantkit.checkpoint.reader import Checkpoint
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
