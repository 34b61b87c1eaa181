"""`publish`, `release` and `demo`: a gated checkpoint shipped, the whole chain, and the chain on a built-in example."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from quantkit.commands.common import ItemsProgress, JsonOpt, emit_json, err, out, print_launch, print_stage, shown


def publish_cmd(
    dst: Annotated[Path, typer.Argument(help="The converted checkpoint to publish.")],
    repo: Annotated[str, typer.Option(help="ORG/NAME on the hub, or file://DIR for a new or empty local folder.")],
    gate_verdict: Annotated[Optional[Path], typer.Option("--gate", help="The passing gate's verdict.json.")] = None,
    private: Annotated[bool, typer.Option("--private", help="Create the hub repository private.")] = False,
    revision: Annotated[Optional[str], typer.Option(help="Branch to upload to (created if missing).")] = None,
    base_model: Annotated[Optional[str], typer.Option(help="Hub id of the original model, for the card.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would be uploaded and the card; change "
                                                            "nothing.")] = False,
    force_ungated: Annotated[bool, typer.Option("--force-ungated", help="Publish without a gate; the card says "
            "so.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Upload DST with its model card, only if the gate passed on exactly these files."""
    from quantkit.release.publish import publish

    result = publish(dst, repo, gate=gate_verdict, private=private, revision=revision, dry_run=dry_run,
                     force_ungated=force_ungated, base_model=base_model)
    if json_out:
        emit_json(result)
        return
    table = Table("file", "bytes")
    for f in result.files:
        table.add_row(shown(f["name"]), f"{f['bytes']:,}")
    out.print(table)
    if dry_run:
        out.print(result.card, markup=False, highlight=False)
        out.print(f"[yellow]dry run[/]: nothing uploaded; would publish {len(result.files)} files to {shown(repo)}")
    else:
        where = result.target if result.target != "hub" else f"https://huggingface.co/{repo}"
        out.print(f"[green]published[/] {len(result.files)} files to {shown(where)} "
                  f"({'gated' if result.gated else 'UNGATED'})")


def release_cmd(
    config: Annotated[Path, typer.Argument(help="Release config YAML (see eval/release-example.yaml).")],
    resume: Annotated[bool, typer.Option("--resume", help="Continue after the last finished stage.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """plan -> convert -> calibrate-kv -> verify -> eval baseline -> eval candidate -> gate -> publish."""
    from quantkit.release import ReleaseResult, release

    with ItemsProgress(enabled=not json_out and err.is_terminal) as on_progress:
        result = release(config, resume=resume, on_stage=None if json_out else print_stage, on_progress=on_progress,
                         on_launch=print_launch)
    if json_out:
        emit_json(result)
        return
    if isinstance(result, ReleaseResult):
        out.print(result.gate_table, markup=False, highlight=False)
        out.print(f"[green]released[/]: {shown(result.published)}; report {shown(result.report)}")
        return
    for p in result.pools:
        if p.release is not None:
            out.print(f"\n[bold]{p.name}[/] ({shown(p.recipe)})", highlight=False)
            out.print(p.release.gate_table, markup=False, highlight=False)
        else:
            out.print(f"\n[bold]{p.name}[/]: the source as released, {shown(p.model)} (the baseline itself)",
                      highlight=False)
        if p.published:
            out.print(f"[green]released[/]: {shown(p.published)}", highlight=False)
    out.print(f"both pools sized for the deployment in {shown(result.plan)}; the pools' card: {shown(result.card)}")


def demo_cmd(
    workdir: Annotated[Path, typer.Option(help="Where everything goes (a re-run resumes).")] = Path("quantkit-demo"),
    arc_items: Annotated[int, typer.Option(min=1, help="ARC-Easy test items (the first N).")] = 500,
    gsm8k_items: Annotated[int, typer.Option(min=1, help="GSM8K test items (the first N; evaluated, not gated).")] = 8,
    source_model: Annotated[Optional[Path], typer.Option(help="A local BF16 SmolLM2-135M-Instruct instead of "
                                                              "fetching it.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """The recipe's two pools for the real SmolLM2-135M from a block-FP8 source, gated and published offline on a CPU:
    prefill (FP8 weights per row, FP8 activations per token, BF16 KV) and decode (asymmetric INT4 MLP, the INT4 that
    measured best here, with a calibrated FP8 KV cache)."""
    from quantkit.examples.demo import demo

    def stage(name, record):
        out.print(f"[bold]{shown(name):>4}[/] ", end="")
        print_stage(record)

    with ItemsProgress(enabled=not json_out and err.is_terminal) as on_progress:
        result = demo(workdir, arc_items=arc_items, gsm8k_items=gsm8k_items, source_model=source_model,
                      on_stage=None if json_out else stage, on_progress=on_progress)
    if json_out:
        emit_json(result)
        return
    out.print(f"source (block-FP8): {shown(result.source)}")
    for r in result.releases:
        out.print(f"\n[bold]{shown(r.name)}[/] ({shown(r.recipe)})", highlight=False)
        out.print(r.gate_table, markup=False, highlight=False)
        if r.published:
            card = Path(r.published) / "README.md"
            out.print(f"[green]published[/] {shown(r.published)} (model card: {shown(card)}); report {shown(r.report)}")
        else:
            out.print(f"[red]not published[/]: {shown(r.stopped or '')}", highlight=False)
    out.print(f"done in {result.seconds:.0f}s")

