"""What a calibrated recipe's walk did, for convert's result and ``--json``."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from quantkit.checkpoint.manifest import Manifest
from quantkit.convert.tensor_plan import ActionKind


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
