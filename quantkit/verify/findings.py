"""What verify reports: each finding naming the check, the rule, the tensor and the file; each quantized tensor's
error against its source."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class Finding:
    check: Literal["structure", "numbers", "integrity", "engine", "smoke"]
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
