"""`plan` and `budget`: what a conversion will make and what serving it will need."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from quantkit.commands.common import DtypeOpt, JsonOpt, MaxShardSizeOpt, TpOpt, emit_json, gib, out, shown
from quantkit.settings import BUDGET, PLAN


def plan_cmd(
    src: Annotated[Path, typer.Argument(help="Checkpoint folder, or a folder with config.json alone.")],
    recipe: Annotated[Optional[str], typer.Option("--recipe", "-r", help="Recipe to size the output for.")] = None,
    tp: TpOpt = PLAN.tp,
    gpu: Annotated[str, typer.Option(help="h100, h200 or b200 (memory as the GPU reports it).")] = str(PLAN.gpu),
    gpu_mem_gib: Annotated[Optional[float], typer.Option(
        "--gpu-mem-gib", "--gpu-mem", min=1, help="GPU memory in GiB (overrides --gpu; --gpu-mem: its older name).")
    ] = PLAN.gpu_mem_gib,
    kv_dtype: Annotated[str, typer.Option(help="KV-cache dtype: bf16 or fp8_e4m3.")] = PLAN.kv_dtype,
    mem_fraction: Annotated[float, typer.Option(min=0.01, max=1.0, help="Share of GPU memory for weights + KV "
            "(SGLang --mem-fraction-static).")] = PLAN.mem_fraction,
    context_len: Annotated[int, typer.Option(min=1, help="Context length per request.")] = PLAN.context_len,
    page_size: Annotated[int, typer.Option(min=1, help="KV-cache page size in tokens.")] = PLAN.page_size,
    max_shard_size: MaxShardSizeOpt = PLAN.max_shard_size,
    deploy: Annotated[bool, typer.Option("--deploy", help="Plan the prefill (source, BF16 KV) and decode (INT4, FP8 "
                                                          "KV) pools.")] = False,
    chart: Annotated[Path, typer.Option(help="Where --deploy writes its PNG chart.")] = Path("plan-memory.png"),
    prefill_recipe: Annotated[Optional[str], typer.Option(help="With --deploy: the prefill pool serves this recipe's "
                                                               "output instead of the source as released.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Size the conversion and the deployment: bytes by component, per-GPU memory, KV capacity."""
    from quantkit.plan import plan

    report = plan(src, recipe=recipe, tp=tp, gpu=gpu, gpu_mem_gib=gpu_mem_gib, kv_dtype=kv_dtype,
                  mem_fraction=mem_fraction, context_len=context_len, page_size=page_size,
                  max_shard_size=max_shard_size, deploy=deploy, chart=chart, prefill_recipe=prefill_recipe)
    if json_out:
        emit_json(report)
        return
    where = "shard headers" if report.from_headers else "config.json alone"
    out.print(f"[bold]{shown(report.source)}[/] ({report.family}, {report.attention}), from {where}: "
              f"{report.total_params:,} parameters")
    table = Table("component", "parameters", "now", "after" if report.recipe else "")
    for name, c in report.components.items():
        table.add_row(shown(name), f"{c.params:,}", gib(c.bytes_now), gib(c.bytes_after) if report.recipe else "")
    table.add_row("[bold]files[/]", "", gib(report.bytes_now), gib(report.bytes_after) if report.bytes_after else "")
    out.print(table)
    out.print(
        f"tp={report.tp} on {report.gpu_bytes / 2**30:.1f} GiB GPUs: weights {gib(report.weights_per_gpu)} per GPU; "
        f"KV {report.kv_bytes_per_token:,} bytes/token; {report.kv_tokens_per_gpu:,} tokens per GPU = "
        f"{report.concurrent_requests} requests of {report.context_len:,}"
    )
    for pool in report.pools:
        out.print(f"[bold]{pool.role}[/] pool: weights {gib(pool.weights_per_gpu)}/GPU, {pool.kv_dtype} KV "
                  f"{pool.kv_bytes_per_token:,} B/token, {pool.kv_tokens_per_gpu:,} tokens, "
                  f"{pool.concurrent_requests} requests")
        out.print(f"  {shown(pool.launch)}", highlight=False)
        if pool.kv_scales:
            out.print(f"  FP8 KV scales: {shown(pool.kv_scales)}", highlight=False, soft_wrap=True)
    if report.chart:
        out.print(f"chart: {shown(report.chart)}")


def budget_cmd(
    src: Annotated[Path, typer.Argument(help="The source checkpoint (never modified).")],
    recipe: Annotated[str, typer.Option("--recipe", "-r", help="The round-to-nearest recipe whose INT4 groups may "
                                                               "change format.")],
    size: Annotated[str, typer.Option("--budget", help="Largest output: a size (421GB, 512MiB) or a fraction of the "
                                                       "source's bytes (0.6).")],
    recipe_out: Annotated[Path, typer.Option("--out", help="Where the chosen recipe is written (YAML).")],
    data: Annotated[Optional[Path], typer.Option(help="Calibration text (.jsonl or .txt); default: built-in "
                                                      "GSM8K-train text.")] = None,
    samples: Annotated[int, typer.Option(min=1, help="Sequences the sensitivity is measured on.")] = BUDGET.samples,
    seq_len: Annotated[int, typer.Option(min=8, help="Tokens per sequence.")] = BUDGET.seq_len,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = BUDGET.device,
    dtype: DtypeOpt = BUDGET.dtype,
    json_out: JsonOpt = False,
) -> None:
    """Measure each INT4 group's sensitivity and write the recipe that fits a size budget with the least damage."""
    from quantkit.budget import budget

    result = budget(src, recipe=recipe, size=size, out=recipe_out, data=data, samples=samples, seq_len=seq_len,
                    device=device, dtype=dtype)
    if json_out:
        emit_json(result)
        return
    table = Table("group", *(o for o in ("int4-g128", "int4-g32", "fp8") if any(o in g.kl for g in result.groups)),
                  "chosen")
    options = [c.header for c in table.columns[1:-1]]
    for g in result.groups:
        table.add_row(shown(g.name), *(f"{g.kl[o]:.5f}" if o in g.kl else "-" for o in options), g.choice)
    out.print(table)
    out.print(f"KL per token with each group alone in each format (nats), on {result.samples} x {result.seq_len} "
              f"tokens")
    out.print(f"[green]wrote[/] {shown(result.recipe)}: predicted {gib(result.predicted_bytes)} for a budget of "
              f"{gib(result.budget_bytes)} (source {gib(result.source_bytes)}); {result.int4_share:.0%} of the "
              f"groups' weights in INT4; predicted damage {result.predicted_kl:.4f} nats per token")

