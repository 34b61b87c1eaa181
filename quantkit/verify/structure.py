"""Structure: config, index and shards agree; quantization_config describes what is stored; packed sizes match
weight_shape; every expert complete; the MTP layer kept. Read from headers (and the tiny weight_shape tensors)."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from quantkit.checkpoint.describe import config_mismatches
from quantkit.checkpoint.names import EXPERT
from quantkit.checkpoint.reader import SCALES_SHARD, Checkpoint, TensorReader
from quantkit.verify.findings import Finding


@dataclass(frozen=True)
class Stored:
    """How one Linear is stored in the output, from headers (and its tiny weight_shape)."""

    kind: str  # int4 | fp8 | float
    out_features: int
    in_features: int
    group_size: int | None = None  # int4: -1 for channel-wise


def stored_modules(ckpt: Checkpoint, findings: list[Finding]) -> dict[str, Stored]:
    from quantkit.checkpoint.describe import described_by

    described = described_by(ckpt)
    out: dict[str, Stored] = {}
    with TensorReader(ckpt) as reader:
        for name, info in ckpt.tensors.items():
            module, _, param = name.rpartition(".")
            if param == "weight_packed":
                shape_name, scale_name = f"{module}.weight_shape", f"{module}.weight_scale"
                if shape_name not in ckpt.tensors or scale_name not in ckpt.tensors:
                    findings.append(Finding("structure", "packed INT4 has weight_scale and weight_shape",
                                            "missing weight_scale or weight_shape", name, info.file))
                    continue
                dims = reader.read_ints(shape_name)
                if len(dims) != 2:
                    findings.append(Finding("structure", "weight_shape holds [out, in]", f"{dims}", shape_name,
                                            ckpt.tensors[shape_name].file))
                    continue
                rows, cols = dims
                scale = ckpt.tensors[scale_name]
                if tuple(info.shape) != (rows, math.ceil(cols / 8)) or info.dtype != "I32":
                    findings.append(Finding("structure", "weight_packed is int32 [out, in/8] of weight_shape",
                                            f"{info.dtype}{list(info.shape)} for weight_shape [{rows}, "
                                            f"{cols}]", name, info.file))
                    continue
                if len(scale.shape) != 2 or scale.shape[0] != rows or cols % scale.shape[1]:
                    findings.append(Finding("structure", "weight_scale is [out, in/group_size]",
                                            f"{list(scale.shape)} for weight_shape [{rows}, "
                                            f"{cols}]", scale_name, scale.file))
                    continue
                scheme = described.scheme_for(module, True) if described else None
                weights = scheme[1].weights if scheme is not None else None
                channel = weights is not None and weights.strategy == "channel"
                zero = ckpt.tensors.get(f"{module}.weight_zero_point")
                asymmetric = weights is not None and not weights.symmetric
                if asymmetric and zero is None:
                    findings.append(Finding("structure", "an asymmetric group stores weight_zero_point",
                                            "missing weight_zero_point", name, info.file))
                    continue
                if zero is not None and (not asymmetric or zero.dtype != "I32"
                                         or tuple(zero.shape) != ((rows + 7) // 8, scale.shape[1])):
                    findings.append(Finding("structure", "weight_zero_point is int32 [ceil(out/8), in/group_size] of "
                                            "an asymmetric group", f"{zero.dtype}{list(zero.shape)}, group "
                                            f"{'asymmetric' if asymmetric else 'symmetric'}", zero.name, zero.file))
                    continue
                out[module] = Stored("int4", rows, cols, -1 if channel else cols // scale.shape[1])
                if f"{module}.weight_g_idx" in ckpt.tensors:
                    findings.append(Finding("engine", "no g_idx (act-order) for MoE kernels", "weight_g_idx "
                            "present", name, info.file))
            elif param == "weight" and f"{module}.weight_packed" in ckpt.tensors:
                packed = ckpt.tensors[f"{module}.weight_packed"]
                findings.append(Finding("structure", "a module is stored once: packed or unpacked, never both",
                                        f"weight {info.dtype}{list(info.shape)} in {info.file} beside weight_packed "
                                        f"in {packed.file}", name, info.file))
            elif param == "weight" and len(info.shape) == 2:
                kind = "fp8" if info.dtype.startswith("F8") else "float"
                if kind == "fp8":
                    problem = _fp8_scale_problem(ckpt, module, info, described)
                    if problem:
                        findings.append(Finding("structure", "an FP8 weight's scale has its scheme's shape (a row "
                                                "each for channel, a 128x128 block each for block)", problem[0],
                                                problem[1], ckpt.tensors[problem[1]].file
                                                if problem[1] in ckpt.tensors else info.file))
                        continue
                out[module] = Stored(kind, info.shape[0], info.shape[1])
    return out


def _fp8_scale_problem(ckpt: Checkpoint, module: str, weight, described) -> tuple[str, str] | None:
    """What is wrong with an FP8 weight's scale, and the tensor: missing, or not the shape the engines load for the
    scheme describing it ([out, 1] per channel: both engines assert it, a 1-D scale fails their load; one per
    block otherwise)."""
    from quantkit.formats.shapes import expected_scale_shape

    name = next((n for n in (f"{module}.weight_scale", f"{module}.weight_scale_inv") if n in ckpt.tensors), None)
    if name is None:
        return "no weight_scale or weight_scale_inv", weight.name
    scheme = described.scheme_for(module, True) if described else None
    weights = scheme[1].weights if scheme is not None else None
    rows, cols = weight.shape
    want: tuple[int, ...]
    if weights is not None and weights.strategy == "channel":
        want = (rows, 1)
    elif weights is not None and weights.strategy == "tensor":
        return None
    else:
        b = weights.block_structure if weights is not None and weights.block_structure else ckpt.config.fp8_block
        want = expected_scale_shape((rows, cols), (int(b[0]), int(b[1])))
    got = tuple(ckpt.tensors[name].shape)
    return (f"{list(got)}, expected {list(want)} for weight [{rows}, {cols}]", name) if got != want else None


SIZE_BAND = 0.01  # plan's prediction is exact to the byte; the band covers shards written by another layout


def planned_size(ckpt: Checkpoint, planned: int) -> list[Finding]:
    """The output's weight shards weigh what ``plan`` predicted for its source and recipe, within SIZE_BAND: an
    artifact that stores something twice or keeps a stale shard is several times too large."""
    stored = sum(s.size for s in ckpt.shards if s.name != SCALES_SHARD)  # calibrate-kv's scales: after the plan
    if planned > 0 and abs(stored - planned) <= SIZE_BAND * planned:
        return []
    return [Finding("structure", f"the output weighs what plan predicted, within {SIZE_BAND:.0%}",
                    f"{stored:,} bytes against {planned:,} planned ({stored / max(planned, 1):.2f}x)",
                    None, str(ckpt.root))]


def structure(ckpt: Checkpoint, stored: dict[str, Stored]) -> list[Finding]:
    found = [
        Finding("structure", "quantization_config describes every quantized tensor", m.problem, m.tensor,
                ckpt.tensors[m.tensor].file)
        for m in config_mismatches(ckpt)
    ]
    config = ckpt.config
    n_experts = config.num_experts
    experts: dict[str, dict[int, set[str]]] = defaultdict(lambda: defaultdict(set))
    for module in stored:
        m = EXPERT.match(module)
        if m:
            experts[m["prefix"]][int(m["index"])].add(m["proj"])
    for prefix, by_index in experts.items():
        missing = [f"{prefix}.{e}.{p}_proj" for e in range(int(n_experts or len(by_index)))
                   for p in ("gate", "up", "down") if p not in by_index.get(e, set())]
        if missing:
            found.append(Finding("structure", f"every MoE layer has all {n_experts} experts with gate/up/down",
                                 f"{len(missing)} expert projections missing", missing[0]))
    mtp, layers = config.num_nextn_predict_layers or 0, config.layers
    for index in range(layers, layers + mtp):
        if not any(n.startswith(f"model.layers.{index}.") for n in ckpt.tensors):
            found.append(Finding("structure", "the MTP layer is kept", f"no tensors of layer "
                    f"{index}", f"model.layers.{index}"))
    return found
