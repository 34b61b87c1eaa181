"""What the CLI's commands share: the consoles, the options several commands take, and how results are shown."""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Annotated

import typer
from rich.console import Console

# Off a terminal (a log, a pipe) Rich would wrap at 80 columns and cut file names: no wrapping there.
out = Console(width=None if sys.stdout.isatty() else 10_000)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 10_000)
# how the CLI names each calibrated algorithm of convert/calibrated's registry (a test holds the two equal)
ALGORITHM_NAMES = {"gptq": "GPTQ", "signround": "SignRound"}


def shown(value) -> str:
    """Text from outside (a path, a tensor name, a server's answer) for a print that reads Rich markup:
    control characters shown as escapes (quantkit.inert), markup characters escaped."""
    from rich.markup import escape

    from quantkit.inert import visible

    return escape(visible(value))


# Options shared by several commands, declared once.
JsonOpt = Annotated[bool, typer.Option("--json", help="No progress display; print a JSON result.")]
DeviceOpt = Annotated[str, typer.Option(help="auto, cpu, cuda, or a list: cuda:0,cuda:1.")]
TpOpt = Annotated[int, typer.Option(min=1, help="Tensor-parallel size.")]
MaxShardSizeOpt = Annotated[str, typer.Option(help="Largest output shard (5GB, 512MiB, ...).")]
BatchSizeOpt = Annotated[int, typer.Option(min=1, help="Requests per forward pass (hf) or in flight (servers).")]
DtypeOpt = Annotated[str, typer.Option(help="What the model computes in, its weights unchanged: auto (the model's "
                                            "dtype on a GPU; on a CPU it or fp32, whichever a matmul probe finds "
                                            "faster), bf16, fp16 or fp32.")]


def emit_json(obj) -> None:
    if hasattr(obj, "model_dump"):
        data = obj.model_dump(mode="json")
    else:
        data = dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) and not isinstance(obj, type) else obj
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB ({n / 1e9:.3f} GB)"


def print_launch(argv: list[str]) -> None:
    """The engine command is executable configuration: the user sees what runs before it runs."""
    import shlex

    from quantkit.inert import visible

    err.print(f"starting the engine: {visible(shlex.join(argv))}", highlight=False, markup=False, soft_wrap=True)


def print_stage(record) -> None:
    mark = {"ran": "[green]done[/]", "resumed": "[cyan]done earlier[/]", "reused": "[cyan]reused[/]",
            "skipped": "[yellow]skipped[/]"}[str(record.status)]
    pool = f"{record.pool:>7} " if record.pool else ""
    out.print(f"{pool}{record.stage:>15}  {mark}  {record.seconds:6.1f}s  {shown(record.summary)}", highlight=False)


class BytesProgress:
    """A Rich progress bar over source bytes (rate, ETA) on a terminal; nothing otherwise."""

    def __init__(self, enabled: bool, label: str):
        self.enabled, self.label = enabled, label

    def __enter__(self):
        if not self.enabled:
            return None
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self.progress = Progress(
            f"[bold]{self.label}",
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=err,
        )
        self.progress.start()
        self.task = self.progress.add_task(self.label, total=None)

        def update(done: int, total: int) -> None:
            self.progress.update(self.task, completed=done, total=total)

        return update

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self.progress.stop()


class ItemsProgress:
    """One Rich progress row per task: items done, items/s and ETA; nothing off a terminal."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def __enter__(self):
        if not self.enabled:
            return None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TimeRemainingColumn
        from rich.text import Text

        class ItemsPerSecond(ProgressColumn):
            def render(self, task):
                return Text(f"{task.speed or 0:.1f} items/s")

        self.progress = Progress("[bold]{task.description}", BarColumn(), MofNCompleteColumn(), ItemsPerSecond(),
                                 TimeRemainingColumn(), console=err)
        self.progress.start()
        self.rows: dict[str, int] = {}

        def update(task: str, done: int, total: int) -> None:
            if task not in self.rows:
                self.rows[task] = self.progress.add_task(task, total=total)
            elif done == 0:  # the same task in the next run (release: baseline, then candidate)
                self.progress.reset(self.rows[task], total=total)
            self.progress.update(self.rows[task], completed=done, total=total)

        return update

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self.progress.stop()
