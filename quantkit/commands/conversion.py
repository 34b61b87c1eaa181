"""`convert`, `calibrate-kv` and `verify`: a checkpoint made, given KV-cache scales, and checked."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from quantkit.commands.common import (
    ALGORITHM_NAMES,
    BytesProgress,
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    MaxShardSizeOpt,
    TpOpt,
    emit_json,
    err,
    gib,
    out,
    shown,
)
from quantkit.settings import CALIBRATE, CONVERT, VERIFY


def convert_cmd(
    src: Annotated[Path, typer.Argument(help="Source checkpoint folder (never modified).")],
    dst: Annotated[Path, typer.Argument(help="Output folder.")],
    recipe: Annotated[str, typer.Option("--recipe", "-r", help="Recipe YAML path or built-in name (see recipes/).")],
    device: DeviceOpt = CONVERT.device,
    workers: Annotated[Optional[int], typer.Option(min=1, help="Concurrent shard jobs (default: 4 per GPU, or up to "
                                                               "4 on CPU).")] = CONVERT.workers,
    max_shard_size: MaxShardSizeOpt = CONVERT.max_shard_size,
    resume: Annotated[bool, typer.Option("--resume", help="Finish an interrupted run in DST.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace the quantkit run DST holds.")] = False,
    verify_reused: Annotated[bool, typer.Option("--verify-reused/--trust-manifest", help="--resume: re-hash the "
            "finished shards it keeps.")] = True,
    calibration_data: Annotated[Optional[Path], typer.Option(help="GPTQ recipes: calibration .jsonl (text or "
                                                                  "input_ids rows) or .txt instead of the "
                                                                  "recipe's.")] = None,
    dtype: Annotated[str, typer.Option(help="What a GPTQ recipe's layer walk computes in, the weights and scales "
                                            "unchanged: auto (the model's dtype on a GPU; on a CPU it or fp32, "
                                            "whichever a matmul probe finds faster), bf16, fp16 or fp32.")]
    = CONVERT.dtype,
    gpu_memory: Annotated[Optional[str], typer.Option(help="GPTQ and SignRound recipes: what one layer may hold on "
                                                            "each GPU, e.g. 70GiB (default: what the GPU has free, "
                                                            "less a margin); a MoE layer's experts are worked in "
                                                            "groups that fit.")] = CONVERT.gpu_memory,
    json_out: JsonOpt = False,
) -> None:
    """Convert a block-FP8 / BF16 checkpoint to compressed-tensors INT4 with a recipe (RTN, GPTQ or SignRound)."""
    from quantkit.convert import convert

    with BytesProgress(enabled=not json_out and err.is_terminal, label="converting") as on_progress:
        result = convert(src, dst, recipe, device=device, workers=workers, max_shard_size=max_shard_size,
                         resume=resume, force=force, verify_reused=verify_reused, calibration_data=calibration_data,
                         dtype=dtype, gpu_memory=gpu_memory, on_progress=on_progress,
                         on_layer=None if json_out else _CalibratedLayerLog())
    if json_out:
        emit_json(result)
        return
    stages = ", ".join(f"{k} {v:.1f}s" for k, v in result.stage_seconds.items())
    out.print(
        f"[green]done[/] {shown(result.dst)}: {result.shards_written} shard(s) written, {result.shards_reused} reused; "
        f"{gib(result.source_bytes)} -> {gib(result.output_bytes)} in {result.seconds:.1f}s "
        f"on {shown(','.join(result.devices))} x{result.workers} ({stages})"
    )
    for group, n in result.tensors_by_group.items():
        out.print(f"  recipe group {shown(group)}: {n} weight(s)", highlight=False)
    for name in result.skipped_files:
        out.print(f"  [yellow]not copied[/]: {shown(name)} (a weight file the index does not list)", highlight=False)
    for warning in result.warnings:
        out.print(f"  [yellow]warning[/]: {shown(warning)}", highlight=False)
    if result.calibrated:
        methods = ", ".join(f"{k} {v}" for k, v in result.calibrated.weights_by_method.items())
        out.print(f"  {result.calibrated.algorithm}: {methods} weight(s), layers computed in "
                  f"{result.calibrated.computed_in}; details per weight in DST's quantkit-manifest.json",
                  highlight=False)
        for reason, n in result.calibrated.rtn_reasons.items():
            out.print(f"  round-to-nearest: {n} x {shown(reason)}", highlight=False)
        if result.calibrated.rtn_outside_calibration:
            out.print(f"  round-to-nearest: {len(result.calibrated.rtn_outside_calibration)} weight(s) outside the "
                      "calibration forward (MTP layers)", highlight=False)


class _CalibratedLayerLog:
    """One line per layer of a GPTQ or SignRound walk on stderr: its time, loss, RTN fallbacks and the ETA of the
    rest."""

    def __init__(self):
        self.seen = 0
        self.times: list[float] = []  # layers quantized in this run (kept ones cost only a forward)

    def __call__(self, report, layers: int) -> None:
        self.seen += 1
        eta = ""
        if not report.reused:
            self.times.append(report.seconds)
        if self.times and self.seen < layers:
            eta = f", ETA {(layers - self.seen) * sum(self.times) / len(self.times) / 60:.1f} min"
        state = "kept from the interrupted run" if report.reused else f"{report.seconds:.1f}s, loss {report.loss:.4g}"
        rtn = f", {report.rtn} weight(s) RTN" if report.rtn else ""
        groups = f", experts in {report.expert_groups} groups" if report.expert_groups > 1 else ""
        peak = f", peak GPU {report.peak_device_bytes / 2**30:.1f} GiB" if report.peak_device_bytes else ""
        name = ALGORITHM_NAMES.get(report.method, report.method)
        err.print(f"{name} layer {report.layer} ({self.seen}/{layers}): {state}{rtn}{groups}{peak}{eta}",
                  highlight=False)


def calibrate_kv_cmd(
    model: Annotated[Path, typer.Argument(help="A BF16 source or a quantkit output (with its tokenizer).")],
    out_dir: Annotated[Optional[Path], typer.Option("--out", help="Write a copy with scales here (hard links where "
                                                                  "possible).")] = None,
    in_place: Annotated[bool, typer.Option("--in-place", help="Add the scales to MODEL itself.")] = False,
    data: Annotated[Optional[Path], typer.Option(help="Calibration text: .jsonl (see --text-field) or .txt; default: "
                                                      "built-in GSM8K-train text.")] = None,
    text_field: Annotated[str, typer.Option(help="The JSONL field holding the text.")] = CALIBRATE.text_field,
    samples: Annotated[int, typer.Option(min=1, help="Sequences to run.")] = CALIBRATE.samples,
    seq_len: Annotated[int, typer.Option(min=1, help="Tokens per sequence.")] = CALIBRATE.seq_len,
    batch_size: Annotated[int, typer.Option(min=1, help="Sequences per forward pass.")] = CALIBRATE.batch_size,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = CALIBRATE.device,
    dtype: DtypeOpt = CALIBRATE.dtype,
    json_out: JsonOpt = False,
) -> None:
    """FP8 (e4m3) KV-cache scales: absmax / 448 of what the engine caches (MLA: the latent), layer by layer."""
    from quantkit.kv.calibrate import calibrate_kv

    result = calibrate_kv(model, out=out_dir, in_place=in_place, data=data, text_field=text_field, samples=samples,
                          seq_len=seq_len, batch_size=batch_size, device=device, dtype=dtype)
    if json_out:
        emit_json(result)
        return
    ks = [k for k, _ in result.scales.values()]
    out.print(
        f"[green]done[/] {shown(result.out)}: {result.layers} layers ({result.attention}), {result.samples} x "
        f"{result.seq_len} "
        f"tokens in {result.seconds:.1f}s; k_scale {min(ks):.3g}..{max(ks):.3g}; {shown(result.json_path)}, "
        f"{shown(result.plot_path)}"
    )
    for engine, usage in result.engines.items():
        out.print(f"  {shown(engine)}: {shown(usage)}", highlight=False, soft_wrap=True)


def verify_cmd(
    path: Annotated[Path, typer.Argument(help="A converted checkpoint.")],
    source: Annotated[Optional[Path], typer.Option("--source", help="The source it came from: enables the numeric "
                                                                    "checks.")] = None,
    engine: Annotated[str, typer.Option(help="Whose kernel rules to check: sglang or vllm.")] = VERIFY.engine,
    tp: TpOpt = VERIFY.tp,
    smoke: Annotated[bool, typer.Option("--smoke/--no-smoke", help="Load and run small models; meta-check large "
                                                                   "ones.")] = VERIFY.smoke,
    plan_file: Annotated[Optional[Path], typer.Option("--plan", help="plan --json's output for this conversion: the "
                                                                     "output must weigh what it predicted.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Check structure, numbers, integrity and engine rules; exit 0 only when everything passes."""
    from quantkit.verify import planned_bytes_of, verify

    report = verify(path, source=source, engine=engine, tp=tp, smoke=smoke,
                    planned_bytes=planned_bytes_of(plan_file) if plan_file else None)
    if json_out:
        emit_json(report)
    else:
        checked = ", ".join(f"{v} {k}" for k, v in report.checked.items())
        out.print(f"[bold]{shown(report.path)}[/] for {shown(report.engine)} tp={report.tp}: checked {shown(checked)}")
        for note in report.notes:
            out.print(f"[yellow]not checked[/]: {shown(note)}", highlight=False)
        for remark in report.remarks:
            out.print(f"note: {shown(remark)}", highlight=False, soft_wrap=True)
        if report.worst:
            worst = report.worst[0]
            out.print(f"worst tensor: {shown(worst.tensor)} relative error {worst.relative_error:.4f}, SNR "
                      f"{worst.snr_db:.1f} dB")
        for f in report.findings:  # one line each, never cut: a log reader needs the whole file name
            out.print(f"[red]{f.check}[/] {shown(f.tensor or f.file or '')}: {shown(f.rule)}: "
                      f"{shown(f.message)}", highlight=False,
                      soft_wrap=True)
        out.print("[green]PASS[/]" if report.passed else f"[red]FAIL[/]: {len(report.findings)} finding(s)")
    raise typer.Exit(0 if report.passed else 1)

