"""`inspect` and `synth`: what a checkpoint holds, and a small one made to try the rest on."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from quantkit.commands.common import JsonOpt, emit_json, gib, out, shown


def inspect_cmd(
    path: Annotated[Path, typer.Argument(help="Checkpoint folder (config.json + *.safetensors).")],
    json_out: JsonOpt = False,
) -> None:
    """What a checkpoint holds, from config and safetensors headers only (no tensor data read)."""
    from quantkit.checkpoint.inspection import inspect_checkpoint

    report = inspect_checkpoint(path)
    if json_out:
        emit_json(report)
        return
    out.print(
        f"[bold]{shown(report.path)}[/]  {shown(report.model_type)} (family {report.family}), "
        f"{report.num_hidden_layers} layers + {report.mtp_layers} MTP, quantization: {shown(report.quantization)}"
    )
    table = Table("component", "parameters", "bytes on disk", "encodings")
    for name, c in report.components.items():
        enc = ", ".join(f"{k} {v / max(c.params, 1):.0%}" for k, v in c.encodings.items())
        table.add_row(shown(name), f"{c.params:,}", gib(c.bytes), shown(enc))
    table.add_row("[bold]total[/]", f"[bold]{report.total_params:,}[/]", gib(report.total_bytes), "")
    out.print(table)
    out.print(f"{len(report.shards)} shard(s)")


def synth_cmd(
    family: Annotated[str, typer.Argument(help="glm_moe_dsa, deepseek_v3 or llama.")],
    out_dir: Annotated[Path, typer.Argument(help="Folder to write the checkpoint to.")],
    seed: Annotated[int, typer.Option(help="Random seed for the weights.")] = 0,
    bf16: Annotated[bool, typer.Option("--bf16", help="Write BF16 weights instead of block-FP8.")] = False,
    experts: Annotated[Optional[int], typer.Option(min=1, max=256, help="Routed experts per layer (MoE "
            "families).")] = None,
    layers: Annotated[Optional[int], typer.Option(min=1, max=64, help="Decoder layers.")] = None,
) -> None:
    """Build a small synthetic checkpoint with a real release's on-disk layout (tests, demos)."""
    from quantkit.examples.synthetic import build_synthetic

    path = build_synthetic(family, out_dir, seed=seed, fp8=False if bf16 else None, experts=experts, layers=layers)
    out.print(f"wrote {shown(path)}")

