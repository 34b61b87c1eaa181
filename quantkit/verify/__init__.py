"""``verify``: trust a converted checkpoint before it costs GPU hours.

Five kinds of check, each finding naming the tensor and the rule:
  structure  config, index and shards agree; quantization_config describes what is stored;
             packed sizes match weight_shape; every expert complete; nothing stray or missing
  numbers    per-tensor error of the dequantized output against the dequantized source
  integrity  every shard's sha256 against the manifest
  engine     the INT4 kernels' rules for the chosen engine and tensor-parallel size, and every tensor name
             through that engine's loader renaming (engines/loaders.py): nothing it would skip
  smoke      small models load and run a forward pass; large ones are checked on the meta device
Streaming like ``convert``: one module's tensors in memory at a time.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field

from quantkit.checkpoint.config import num_experts
from quantkit.checkpoint.manifest import load_manifest
from quantkit.checkpoint.reader import Checkpoint, TensorReader, open_checkpoint
from quantkit.engines.kernels import FUSED_GROUPS, ROW_PARALLEL, EngineRules, engine_rules
from quantkit.errors import QuantkitError
from quantkit.formats.describe import config_mismatches

# Relative error ||w' - w|| / ||w|| above which a quantized tensor is broken, not just INT4:
# healthy symmetric INT4 RTN sits near 0.1 (g32) to 0.13 (g128) on real and Gaussian weights;
# a scale off by 2x gives ~1, a scrambled pack more than 1.
MAX_RELATIVE_ERROR = 0.3
KV_SCALES = (".k_scale", ".v_scale")
SMOKE_MAX_PARAMS = 2_000_000_000
_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<index>\d+)\.(?P<proj>gate|up|down)_proj$")


@dataclass(frozen=True)
class Finding:
    check: str  # structure | numbers | integrity | engine | smoke
    rule: str
    message: str
    tensor: str | None = None
    file: str | None = None


@dataclass(frozen=True)
class TensorError:
    tensor: str
    relative_error: float  # ||w' - w|| / ||w||
    snr_db: float  # 20 log10(||w|| / ||w' - w||)


def tensor_error(tensor: str, source, converted) -> TensorError:
    """How far a converted weight is from its source (both decoded): the one error measure of quantkit."""
    noise, signal = (converted.float() - source.float()).norm().item(), source.float().norm().item()
    rel = noise / signal if signal else math.inf
    snr = 20 * math.log10(signal / noise) if signal and noise else math.inf
    return TensorError(tensor, rel, snr)


@dataclass
class VerifyReport:
    path: str
    source: str | None
    engine: str
    tp: int
    passed: bool
    findings: list[Finding]
    worst: list[TensorError]
    checked: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what was not checked, and why
    seconds: float = 0.0
    remarks: list[str] = field(default_factory=list)  # what the engine does with what passed (read in its source)


@dataclass(frozen=True)
class _Stored:
    """How one Linear is stored in the output, from headers (and its tiny weight_shape)."""

    kind: str  # int4 | fp8 | float
    out_features: int
    in_features: int
    group_size: int | None = None  # int4: -1 for channel-wise


def verify(
    path: str | os.PathLike,
    source: str | os.PathLike | None = None,
    engine: str | EngineRules = "sglang",
    tp: int = 1,
    smoke: bool = True,
) -> VerifyReport:
    started = time.perf_counter()
    rules = engine if isinstance(engine, EngineRules) else engine_rules(engine)
    findings: list[Finding] = []
    checked: dict[str, int] = defaultdict(int)
    notes: list[str] = []
    worst: list[TensorError] = []
    try:
        ckpt = open_checkpoint(path)
    except QuantkitError as exc:
        findings.append(Finding("structure", "readable checkpoint", exc.message, exc.tensor, exc.file))
        return VerifyReport(str(path), str(source) if source else None, rules.name, tp, False, findings, [])

    stored = _stored_modules(ckpt, findings)
    checked["modules"] = len(stored)
    remarks = [f"asymmetric INT4: {rules.asymmetric}"] if any(n.endswith(".weight_zero_point") for n in ckpt.tensors) \
        else []
    findings += _structure(ckpt, stored)
    findings += _engine(ckpt, stored, rules, tp)
    findings += _names_load(ckpt, rules.name, checked, notes)
    findings += _integrity(ckpt, checked)
    if source is not None:
        try:
            src = open_checkpoint(source)
        except QuantkitError as exc:
            findings.append(Finding("structure", "readable source", exc.message, exc.tensor, exc.file))
        else:
            mismatch = _not_the_source(src, ckpt)
            if mismatch is not None:
                findings.append(mismatch)
            else:
                findings += _same_modules(src, ckpt)
                worst = _numbers(src, ckpt, findings, checked)
    if smoke:
        findings += _smoke(ckpt, checked)
    return VerifyReport(
        path=str(path),
        source=str(source) if source else None,
        engine=rules.name,
        tp=tp,
        passed=not findings,
        findings=findings,
        worst=worst[:10],
        checked=dict(checked),
        notes=notes,
        seconds=time.perf_counter() - started,
        remarks=remarks,
    )


def _stored_modules(ckpt: Checkpoint, findings: list[Finding]) -> dict[str, _Stored]:
    from quantkit.formats.describe import described_by

    described = described_by(ckpt)
    out: dict[str, _Stored] = {}
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
                                            f"{info.dtype}{list(info.shape)} for weight_shape [{rows}, {cols}]", name, info.file))
                    continue
                if len(scale.shape) != 2 or scale.shape[0] != rows or cols % scale.shape[1]:
                    findings.append(Finding("structure", "weight_scale is [out, in/group_size]",
                                            f"{list(scale.shape)} for weight_shape [{rows}, {cols}]", scale_name, scale.file))
                    continue
                scheme = described.scheme_for(module, True) if described else None
                channel = scheme is not None and scheme[1].weights.strategy == "channel"
                zero = ckpt.tensors.get(f"{module}.weight_zero_point")
                asymmetric = scheme is not None and not scheme[1].weights.symmetric
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
                out[module] = _Stored("int4", rows, cols, -1 if channel else cols // scale.shape[1])
                if f"{module}.weight_g_idx" in ckpt.tensors:
                    findings.append(Finding("engine", "no g_idx (act-order) for MoE kernels", "weight_g_idx present", name, info.file))
            elif param == "weight" and len(info.shape) == 2:
                kind = "fp8" if info.dtype.startswith("F8") else "float"
                out[module] = _Stored(kind, info.shape[0], info.shape[1])
    return out


def _structure(ckpt: Checkpoint, stored: dict[str, _Stored]) -> list[Finding]:
    found = [
        Finding("structure", "quantization_config describes every quantized tensor", m.problem, m.tensor,
                ckpt.tensors[m.tensor].file)
        for m in config_mismatches(ckpt)
    ]
    config = ckpt.config
    n_experts = num_experts(config)
    experts: dict[str, dict[int, set[str]]] = defaultdict(lambda: defaultdict(set))
    for module in stored:
        m = _EXPERT.match(module)
        if m:
            experts[m["prefix"]][int(m["index"])].add(m["proj"])
    for prefix, by_index in experts.items():
        missing = [f"{prefix}.{e}.{p}_proj" for e in range(int(n_experts or len(by_index)))
                   for p in ("gate", "up", "down") if p not in by_index.get(e, set())]
        if missing:
            found.append(Finding("structure", f"every MoE layer has all {n_experts} experts with gate/up/down",
                                 f"{len(missing)} expert projections missing", missing[0]))
    mtp = int(config.get("num_nextn_predict_layers") or 0)
    layers = int(config.get("num_hidden_layers") or 0)
    for index in range(layers, layers + mtp):
        if not any(n.startswith(f"model.layers.{index}.") for n in ckpt.tensors):
            found.append(Finding("structure", "the MTP layer is kept", f"no tensors of layer {index}", f"model.layers.{index}"))
    return found


def _engine(ckpt: Checkpoint, stored: dict[str, _Stored], rules: EngineRules, tp: int) -> list[Finding]:
    found: list[Finding] = []
    qc = ckpt.config.get("quantization_config") or {}
    if qc.get("format") == "mixed-precision" and not rules.serves_mixed_precision:
        found.append(Finding("engine", f"{rules.name} serves one format per checkpoint",
                             "format mixed-precision (INT4 + FP8) is not confirmed to load on this engine"))
    where = lambda module: ckpt.tensors[f"{module}.weight_packed"].file  # noqa: E731
    for module, s in stored.items():
        if s.kind != "int4":
            continue
        tensor = f"{module}.weight_packed"
        if s.group_size not in rules.group_sizes:
            found.append(Finding("engine", f"group size in {sorted(rules.group_sizes)} ({rules.name} kernels)",
                                 f"group size {s.group_size}", tensor, where(module)))
        # each rank holds a slice of the input dim of row-parallel layers, all of it otherwise
        per_rank = s.in_features / tp if ROW_PARALLEL.search(module) else s.in_features
        if per_rank != int(per_rank) or (s.group_size > 0 and per_rank % s.group_size):
            found.append(Finding("engine", f"tp={tp}: each rank's input slice is a multiple of the group size",
                                 f"in_features {s.in_features} / {tp} = {per_rank:g}, group {s.group_size}", tensor, where(module)))
        elif rules.marlin_k and per_rank % rules.marlin_k:
            found.append(Finding("engine", f"tp={tp}: each rank's input is a multiple of {rules.marlin_k} (Marlin kernels)",
                                 f"input {per_rank:g} per rank", tensor, where(module)))
    found += _shared_schemes(stored)
    return found


def _scheme(s: _Stored | None) -> tuple:
    return ("absent",) if s is None else (s.kind, s.group_size)


def _shared_schemes(stored: dict[str, _Stored]) -> list[Finding]:
    found = []
    experts: dict[str, dict[str, _Stored]] = defaultdict(dict)
    for module, s in stored.items():
        m = _EXPERT.match(module)
        if m:
            experts[f"{m['prefix']}.{m['index']}"][m["proj"]] = s
    for expert, projs in experts.items():
        if len({_scheme(s) for s in projs.values()}) > 1:
            detail = ", ".join(f"{p}: {_scheme(s)}" for p, s in sorted(projs.items()))
            found.append(Finding("engine", "gate/up/down of every expert share one scheme", detail, f"{expert}.gate_proj"))
    for members in FUSED_GROUPS:
        prefixes = {m.removesuffix("." + members[0]) for m in stored if m.endswith("." + members[0])}
        for prefix in sorted(prefixes):
            if _EXPERT.match(f"{prefix}.{members[0]}"):
                continue  # experts are checked above
            schemes = {member: _scheme(stored.get(f"{prefix}.{member}")) for member in members}
            present = {k: v for k, v in schemes.items() if v != ("absent",)}
            if len(set(present.values())) > 1:
                detail = ", ".join(f"{k}: {v}" for k, v in present.items())
                found.append(Finding("engine", f"fused {'+'.join(members)} share one scheme", detail, f"{prefix}.{members[0]}"))
    return found


def _integrity(ckpt: Checkpoint, checked: dict[str, int]) -> list[Finding]:
    from quantkit.checkpoint.writer import sha256_file

    manifest = load_manifest(ckpt.root)
    if manifest is None:
        return [Finding("integrity", "a quantkit manifest records each shard's sha256", "no quantkit-manifest.json")]
    found = []
    for shard in ckpt.shards:
        record = manifest.shards.get(shard.name)
        if record is None:
            found.append(Finding("integrity", "every shard is recorded in the manifest", "not recorded", file=str(shard.path)))
            continue
        checked["shards hashed"] += 1
        if shard.size != record.size or sha256_file(shard.path) != record.sha256:
            found.append(Finding("integrity", "shard sha256 equals the manifest's",
                                 "contents changed since conversion (flipped bit, truncated or replaced copy)", file=str(shard.path)))
    for name in set(manifest.shards) - {s.name for s in ckpt.shards}:
        found.append(Finding("integrity", "every recorded shard is present", "recorded but not in the index", file=name))
    return found


def _names_load(ckpt: Checkpoint, engine: str, checked: dict[str, int], notes: list[str]) -> list[Finding]:
    """Every tensor of the index lands on a parameter of the engine's model after its loader's renaming
    (engines/loaders.py, read in the engine's source): a tensor it has no place for is skipped or fails
    the load at serve time - a KV scale skipped this way leaves FP8 KV at scale 1.0 without a word."""
    from quantkit.engines.loaders import loader_rules, unplaced_tensors

    rules = loader_rules(engine, ckpt.config.get("model_type"))
    if rules is None:
        notes.append(f"{engine}'s loader for model_type {ckpt.config.get('model_type')!r} was not read in its source: "
                     "tensor names not checked against it")
        return []
    names = sorted(ckpt.tensors)
    checked["tensor names mapped"] = len(names)
    return [Finding("engine", f"every tensor lands on a {rules.engine} {rules.version} parameter of {rules.model_class}",
                    u.reason, u.name, ckpt.tensors[u.name].file)
            for u in unplaced_tensors(names, ckpt.config, rules)]


def _not_the_source(src: Checkpoint, dst: Checkpoint) -> Finding | None:
    """Numbers compared against anything but the checkpoint DST was made from prove nothing (DST against itself
    always passes): ``--source`` must be DST's source as its manifest recorded it (fingerprint of config and headers)."""
    rule = "--source is the checkpoint the manifest says DST was converted from"
    if src.root.resolve() == dst.root.resolve():
        return Finding("structure", rule, "--source is DST itself", file=str(src.root))
    manifest = load_manifest(dst.root)
    if manifest is not None and manifest.source_fingerprint != src.fingerprint():
        return Finding("structure", rule, f"its config and headers differ from those of the recorded source "
                       f"({manifest.source_path})", file=str(src.root))
    return None


def _param_key(name: str) -> str:
    module, _, param = name.rpartition(".")
    return module if param in ("weight", "weight_packed", "weight_scale", "weight_shape", "weight_scale_inv",
                               "weight_zero_point") else name


def _same_modules(src: Checkpoint, dst: Checkpoint) -> list[Finding]:
    a, b = {_param_key(n) for n in src.tensors}, {_param_key(n) for n in dst.tensors}
    found = [Finding("structure", "every source tensor is in the output", "missing", name) for name in sorted(a - b)[:20]]
    added = {n for n in b - a if n.endswith(KV_SCALES)}  # calibrate-kv's additions are expected
    found += [Finding("structure", "the output holds nothing the source lacks", "stray", name) for name in sorted(b - a - added)[:20]]
    return found


def _numbers(src: Checkpoint, dst: Checkpoint, findings: list[Finding], checked: dict[str, int]) -> list[TensorError]:
    import torch

    from quantkit.modeling import read_weight

    errors: list[TensorError] = []
    src_modules = {n.rpartition(".")[0] for n in src.tensors if n.endswith((".weight", ".weight_packed"))}
    with TensorReader(src) as rs, TensorReader(dst) as rd:
        for module in sorted(src_modules):
            if f"{module}.weight" not in dst.tensors and f"{module}.weight_packed" not in dst.tensors:
                continue
            a, b = read_weight(src, rs, module), read_weight(dst, rd, module)
            name = f"{module}.weight_packed" if f"{module}.weight_packed" in dst.tensors else f"{module}.weight"
            file = dst.tensors[name].file
            if a.shape != b.shape:
                findings.append(Finding("numbers", "same shape as the source", f"{list(b.shape)} vs {list(a.shape)}", name, file))
                continue
            if not bool(torch.isfinite(b).all()):
                findings.append(Finding("numbers", "no NaN or Inf", "non-finite values", name, file))
                continue
            checked["tensors compared"] += 1
            a, b = a.float(), b.float()
            if torch.equal(a, b):
                continue
            source_weight = src.tensors.get(f"{module}.weight")
            newly_fp8 = dst.tensors[name].dtype.startswith("F8") and not (source_weight and source_weight.dtype.startswith("F8"))
            quantized = name.endswith("weight_packed") or newly_fp8
            error = tensor_error(name, a, b)
            rel, snr = error.relative_error, error.snr_db
            errors.append(error)
            if not quantized:
                findings.append(Finding("numbers", "tensors no group targets equal the (dequantized) source",
                                        f"differs: relative error {rel:.3g}", name, file))
            elif rel > MAX_RELATIVE_ERROR:
                findings.append(Finding("numbers", f"relative error <= {MAX_RELATIVE_ERROR} (healthy INT4 is ~0.1)",
                                        f"relative error {rel:.3g}, SNR {snr:.1f} dB: a wrong scale or a scrambled pack", name, file))
    return sorted(errors, key=lambda e: -e.relative_error)


def _smoke(ckpt: Checkpoint, checked: dict[str, int]) -> list[Finding]:
    import torch

    from quantkit.checkpoint.inspection import inspect_checkpoint
    from quantkit.modeling import load_model, meta_structure_mismatches

    try:
        if inspect_checkpoint(ckpt.root).total_params > SMOKE_MAX_PARAMS:
            problems = meta_structure_mismatches(ckpt)
            checked["meta structure check"] = 1
            return [Finding("smoke", "fits the model class (meta device)", p) for p in problems[:10]]
        model = load_model(ckpt.root)
        ids = torch.arange(16).unsqueeze(0) % int(ckpt.config.get("vocab_size", 16))
        with torch.no_grad():
            logits = model(ids).logits
        checked["forward pass"] = 1
        if not bool(torch.isfinite(logits).all()):
            return [Finding("smoke", "a forward pass gives finite logits", "NaN or Inf in logits")]
    except QuantkitError as exc:
        return [Finding("smoke", "loads into its transformers model", exc.message, exc.tensor, exc.file)]
    except Exception as exc:  # noqa: BLE001 - any failure to build or run the model is the finding
        return [Finding("smoke", "loads into its transformers model", f"{type(exc).__name__}: {exc}".splitlines()[0])]
    return []
