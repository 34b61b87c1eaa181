"""`eval` and `gate`: a model's accuracy measured, and two runs compared."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from quantkit.commands.common import (
    BatchSizeOpt,
    DtypeOpt,
    ItemsProgress,
    JsonOpt,
    emit_json,
    err,
    out,
    print_launch,
    shown,
)
from quantkit.settings import EVAL


def eval_cmd(
    model: Annotated[Path, typer.Argument(help="Checkpoint folder (with its tokenizer).")],
    engine: Annotated[str, typer.Option(help="hf: transformers in-process; sglang, vllm: start a server for the "
                                             "run; openai: a running server at --url.")] = EVAL.engine,
    tasks: Annotated[Optional[list[str]], typer.Option("--tasks", help="Tasks, comma-separated or repeated (default: "
            "all five).")] = None,
    data_dir: Annotated[Optional[Path], typer.Option(help="Local data in the hub's schema (e.g. shared/evaldata); "
                                                          "else the hub.")] = None,
    limit: Annotated[Optional[int], typer.Option(min=1, help="First N items of each task.")] = None,
    kv_cache_dtype: Annotated[str, typer.Option(help="auto, or fp8_e4m3 (hf: emulated with calibrated scales; "
                                                     "sglang: passed on).")] = EVAL.kv_cache_dtype,
    tp: Annotated[int, typer.Option(min=1, help="sglang, vllm: tensor-parallel size.")] = EVAL.tp,
    ep: Annotated[int, typer.Option(min=1, help="sglang: expert-parallel size.")] = EVAL.ep,
    mem_fraction: Annotated[Optional[float], typer.Option(min=0.01, max=1.0,
                                                          help="sglang: --mem-fraction-static.")] = None,
    engine_cmd: Annotated[Optional[str], typer.Option(help="sglang, vllm: the command that starts it, run as given "
                                                           "[env QUANTKIT_SGLANG_CMD / QUANTKIT_VLLM_CMD; default: "
                                                           "python -m sglang.launch_server / python -m "
                                                           "vllm.entrypoints.openai.api_server].")] = None,
    health_timeout: Annotated[float, typer.Option("--health-timeout", "--engine-timeout", min=1,
                                                  help="sglang, vllm: seconds to wait for the server to become "
                                                       "healthy (--engine-timeout: its older name).")
                              ] = EVAL.health_timeout,
    url: Annotated[Optional[str], typer.Option(help="openai: base URL of the server (http://host:port).")] = None,
    out_dir: Annotated[Optional[Path], typer.Option("--out", help="RUN_DIR (default runs/<model name>).")] = None,
    batch_size: BatchSizeOpt = EVAL.batch_size,
    repeat: Annotated[int, typer.Option(min=1, max=2, help="2: run everything a second time into RUN_DIR/repeat-2, "
                                                           "the engine's own noise floor for gate.")] = EVAL.repeat,
    device: Annotated[str, typer.Option(help="hf: auto, cpu, cuda or cuda:N.")] = EVAL.device,
    dtype: DtypeOpt = EVAL.dtype,
    order: Annotated[str, typer.Option(help="file, or seeded: each task's items in a fixed seeded order (sequential "
                                            "gating).")] = "file",
    fraction: Annotated[Optional[float], typer.Option(min=0.0, max=1.0, help="With --order seeded: the first share "
            "of each task's items (a sequential look).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Run the benchmarks with lm-eval and keep per-item outcomes and provenance in RUN_DIR."""
    from quantkit.evaluation import evaluate

    names = [t.strip() for item in tasks or [] for t in item.split(",") if t.strip()] or None
    with ItemsProgress(enabled=not json_out and err.is_terminal) as on_progress:
        result = evaluate(model, engine=engine, tasks=names, data_dir=data_dir, limit=limit,
                          kv_cache_dtype=kv_cache_dtype, out=out_dir, batch_size=batch_size, tp=tp, ep=ep, url=url,
                          engine_cmd=engine_cmd, mem_fraction=mem_fraction, health_timeout=health_timeout,
                          device=device, dtype=dtype, order=order, fraction=fraction, on_progress=on_progress,
                          on_launch=print_launch, repeat=repeat)
    if json_out:
        emit_json(result)
        return
    for task, s in result.scores.items():
        out.print(f"{shown(task)}: {s['score']:.2f} ± {s['stderr']:.2f} (n={s['n']})")
    out.print(f"run directory: {shown(result.run_dir)} ({result.seconds:.0f}s)")


def gate_cmd(
    baseline: Annotated[Path, typer.Argument(help="The baseline's run directory.")],
    candidate: Annotated[Path, typer.Argument(help="The candidate's run directory.")],
    suite: Annotated[Optional[Path], typer.Option(help="Suite file (default: the built-in release suite).")] = None,
    margin: Annotated[Optional[float], typer.Option(min=0, help="One margin in accuracy points for every task "
                                                                "(overrides the suite).")] = None,
    report: Annotated[Optional[Path], typer.Option(help="Write verdict.json, report.md, report.html and forest.png "
                                                        "here.")] = None,
    noise: Annotated[Optional[Path], typer.Option(help="A second run of the baseline's model (A/A): the engine's "
                                                       "noise floor [default: BASELINE/repeat-2 when "
                                                       "present].")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the verdict as JSON.")] = False,
) -> None:
    """Paired non-inferiority test of candidate vs baseline: exit 0 pass, 1 a task fails, 2 cannot compare,
    3 undecided at a sequential look before the last (evaluate the next look)."""
    from quantkit.release.gate import gate
    from quantkit.release.report import markdown

    result = gate(baseline, candidate, suite=suite, margin=margin, report_dir=report, noise=noise)
    if json_out:
        emit_json(result)
    else:
        out.print(markdown(result), highlight=False, markup=False, soft_wrap=True)
    raise typer.Exit({"pass": 0, "fail": 1, "continue": 3}[result.decision])

