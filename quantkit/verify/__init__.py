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

import os
import time
from collections import defaultdict

from quantkit.checkpoint.reader import open_checkpoint
from quantkit.engines.kernels import EngineRules, engine_rules
from quantkit.errors import QuantkitError
from quantkit.settings import VERIFY
from quantkit.verify.engine import engine_findings, names_load, schemes_chosen
from quantkit.verify.findings import Finding, TensorError, VerifyReport, tensor_error
from quantkit.verify.integrity import integrity
from quantkit.verify.numbers import kv_scale_values, not_the_source, numbers, same_modules
from quantkit.verify.smoke import smoke_findings
from quantkit.verify.structure import planned_size, stored_modules, structure

__all__ = ["Finding", "TensorError", "VerifyReport", "planned_bytes_of", "tensor_error", "verify"]


def planned_bytes_of(plan_file: str | os.PathLike) -> int:
    """The converted size a saved plan (``plan --json``, a release's plan.json) predicted."""
    import json
    from pathlib import Path

    path = Path(plan_file)
    try:
        after = json.loads(path.read_text()).get("bytes_after")
    except (OSError, ValueError, AttributeError) as exc:
        raise QuantkitError(f"not a readable plan ({exc.__class__.__name__})", path) from None
    if not isinstance(after, int) or isinstance(after, bool) or after <= 0:
        raise QuantkitError("not a plan with a recipe (no bytes_after): run plan with --recipe --json", path)
    return after


def verify(
    path: str | os.PathLike,
    *,
    source: str | os.PathLike | None = None,
    engine: str | EngineRules = VERIFY.engine,
    tp: int = VERIFY.tp,
    smoke: bool = VERIFY.smoke,
    planned_bytes: int | None = None,
) -> VerifyReport:
    """Check the converted checkpoint at PATH for ``engine`` at tensor-parallel size ``tp``; with ``source``, its
    numbers against the checkpoint it was made from; with ``smoke``, a load and a forward pass; with
    ``planned_bytes`` (``plan``'s ``bytes_after``), its size."""
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

    stored = stored_modules(ckpt, findings)
    checked["modules"] = len(stored)
    remarks = [f"asymmetric INT4: {rules.asymmetric}"] if any(n.endswith(".weight_zero_point") for n in ckpt.tensors) \
        else []
    findings += structure(ckpt, stored)
    if planned_bytes is not None:
        findings += planned_size(ckpt, planned_bytes)
        checked["planned size"] = 1
    findings += engine_findings(ckpt, stored, rules, tp)
    findings += names_load(ckpt, rules.name, checked, notes)
    findings += schemes_chosen(ckpt, stored, rules.name, tp, checked, notes)
    findings += integrity(ckpt, checked)
    findings += kv_scale_values(ckpt, checked)
    if source is not None:
        try:
            src = open_checkpoint(source)
        except QuantkitError as exc:
            findings.append(Finding("structure", "readable source", exc.message, exc.tensor, exc.file))
        else:
            mismatch = not_the_source(src, ckpt)
            if mismatch is not None:
                findings.append(mismatch)
            else:
                findings += same_modules(src, ckpt)
                worst = numbers(src, ckpt, findings, checked)
    if smoke:
        findings += smoke_findings(ckpt, checked)
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
