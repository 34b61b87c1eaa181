"""One evaluation as ``evaluate`` checked it: what the engines and the runner share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from quantkit.evaluation.run_dir import Order
from quantkit.evaluation.tasks import TaskConfig
from quantkit.settings import EvalSettings


@dataclass
class EvalRun:
    """One evaluation, as ``evaluate`` checked it (shared by its first run and its repeat)."""

    path: Path
    settings: EvalSettings
    tasks: list[str]
    order: Order = "file"
    fraction: float | dict[str, float] | None = None  # per task, for a sequential gate's looks
    on_progress: Callable[[str, int, int], None] | None = None
    on_launch: Callable[[list[str]], None] | None = None
    device: str | None = None  # hf: the device the model runs on
    scales: dict | None = None  # hf with FP8 KV: the checkpoint's calibrated scales
    tokenizer: object = None
    configs: dict[str, TaskConfig] = field(default_factory=dict)
