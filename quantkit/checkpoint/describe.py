"""Whether a checkpoint's ``quantization_config`` describes every quantized tensor it holds.

An engine decides how to load each Linear from the config alone. A quantized tensor that no
config group targets (say, FP8 attention weights left beside INT4 experts) is loaded as if it
were plain float and serves garbage; a group that claims a float tensor breaks the other way.
"""

from __future__ import annotations

from dataclasses import dataclass

from quantkit.checkpoint.families import is_linear_weight
from quantkit.checkpoint.reader import Checkpoint
from quantkit.formats.recipe import WRITTEN_FORMAT, Recipe


@dataclass(frozen=True)
class Mismatch:
    tensor: str
    problem: str


def described_by(ckpt: Checkpoint) -> Recipe | None:
    """The checkpoint's compressed-tensors quantization_config, read as a recipe for lookups."""
    config = ckpt.config.quantization.compressed()
    return None if config is None else Recipe("config", "", config)


def config_mismatches(ckpt: Checkpoint) -> list[Mismatch]:
    described = described_by(ckpt)
    found: list[Mismatch] = []
    for name, info in ckpt.tensors.items():
        module, _, param = name.rpartition(".")
        if param == "weight_packed":
            stored = "int4"
        elif param == "weight" and info.dtype.startswith("F8"):
            stored = "fp8"
        elif param == "weight" and is_linear_weight(name, len(info.shape)):
            stored = "float"
        else:
            continue
        match = described.scheme_for(module, True) if described is not None else None
        if described is None or match is None:
            if stored != "float":
                found.append(Mismatch(name, f"{stored} tensor that no quantization_config group describes"))
            continue
        others = described.groups_for(module, True)[1:]
        if others:
            found.append(Mismatch(name, f"matched by groups {match[0]} and {others[0][0]}: engines resolve overlaps "
                                        f"differently"))
        weights = match[1].weights
        int4 = weights is not None and weights.type == "int" and weights.num_bits == 4
        claimed = "int4" if int4 else "fp8" if weights is not None and weights.num_bits == 8 else "other"
        if claimed != stored:
            found.append(Mismatch(name, f"group {match[0]} says {claimed}, tensor is {stored}"))
            continue
        # an engine picks its loader by the format named (an INT4 tensor under nvfp4-pack-quantized is read as FP4)
        named = match[1].format or described.config.format
        written = WRITTEN_FORMAT.get(("int", 4) if stored == "int4" else ("float", 8))
        if named not in (None, "mixed-precision", written):
            found.append(Mismatch(name, f"group {match[0]} names format {named!r}; the tensor is stored {written}"))
    return found

