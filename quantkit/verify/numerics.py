"""Per-tensor error of a converted checkpoint against its source, both dequantized."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class TensorError:
    name: str
    relative_error: float  # ||w' - w|| / ||w||
    snr_db: float  # 10 log10(||w||^2 / ||w' - w||^2)


def tensor_errors(source: str | os.PathLike, converted: str | os.PathLike) -> list[TensorError]:
    """Every weight that differs between the two checkpoints, worst first.

    Loads both fully dequantized: meant for small models (tests, the demo); the streaming
    per-shard form belongs to ``verify``.
    """
    import torch

    from quantkit.modeling import dequantized_state_dict

    a, b = dequantized_state_dict(source), dequantized_state_dict(converted)
    errors = []
    for name, w in a.items():
        if name not in b or not w.is_floating_point():
            continue
        w, v = w.float(), b[name].float()
        if torch.equal(w, v):
            continue
        noise = (v - w).norm().item()
        signal = w.norm().item()
        rel = noise / signal if signal else math.inf
        snr = 20 * math.log10(signal / noise) if noise and signal else math.inf
        errors.append(TensorError(name, rel, snr))
    return sorted(errors, key=lambda e: -e.relative_error)
