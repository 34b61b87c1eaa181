"""The quantkit command line: parses arguments, calls one quantkit function, prints.

Heavy libraries (torch, transformers, compressed-tensors) are imported inside the commands,
so ``quantkit --help`` answers at once. Errors are turned into one line in one place
(``_one_line``), as huggingface_hub's ``hf`` does: a QuantkitError is the user's to fix (exit 1),
a run that cannot be compared exits 2, file-system and network failures name the path or the
host, and anything else is a bug in quantkit, reported in one line (the traceback with --debug).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from quantkit.settings import BUDGET, CALIBRATE, CONVERT, EVAL, PLAN, VERIFY

app = typer.Typer(
    help="Offline quantization and checkpoint conversion for giant Mixture-of-Experts LLMs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# Off a terminal (a log, a pipe) Rich would wrap at 80 columns and cut file names: no wrapping there.
out = Console(width=None if sys.stdout.isatty() else 10_000)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 10_000)
# how the CLI names each calibrated algorithm of convert/calibrated's registry (a test holds the two equal)
ALGORITHM_NAMES = {"gptq": "GPTQ", "signround": "SignRound"}
_debug = {"on": os.environ.get("QUANTKIT_DEBUG", "") not in ("", "0")}



def _t(value) -> str:
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


def _print_version(value: bool) -> None:
    if value:
        from quantkit import __version__

        out.print(f"quantkit {__version__}", highlight=False)
        raise typer.Exit(0)


@app.callback()
def _main_options(
    debug: Annotated[bool, typer.Option("--debug", help="Show the traceback of an unexpected error.")] = False,
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="Print quantkit's version and exit.")] = False,
) -> None:
    """Offline quantization and checkpoint conversion for giant Mixture-of-Experts LLMs."""
    if debug:
        _debug["on"] = True
    _quiet_libraries()


def command(name: str):
    """Register a command whose every failure ends as one line and an exit code (``_one_line``)."""

    def register(fn):
        @functools.wraps(fn)
        def handled(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except (typer.Exit, typer.Abort, SystemExit):
                raise
            except BaseException as exc:  # noqa: BLE001 - the one place every failure is reported
                kind, message, code = _one_line(exc)
                if _debug["on"] and kind == "internal error":
                    traceback.print_exc()
                err.print(f"[bold red]{kind}:[/] {_t(message)}", markup=True, highlight=False, soft_wrap=True)
                raise typer.Exit(code) from None

        return app.command(name)(handled)

    return register


def _one_line(exc: BaseException) -> tuple[str, str, int]:
    """(kind, the message on one line, exit code) for any failure of a command."""
    from quantkit.errors import CannotCompare, QuantkitError, describe_os_error

    def flat(text: object) -> str:
        return " ".join(str(text).split())

    if isinstance(exc, CannotCompare):
        return "cannot compare", flat(exc), 2
    if isinstance(exc, QuantkitError):
        return "error", flat(exc), 1
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted", "stopped; files under their final names are complete, re-run to resume", 130
    if isinstance(exc, OSError) and not type(exc).__module__.startswith(("requests", "urllib3")):
        return "error", flat(describe_os_error(exc)), 1
    module = type(exc).__module__.split(".")[0]
    if module in ("httpx", "requests", "urllib3", "huggingface_hub", "httpcore"):
        return "error", f"network or hub failure ({type(exc).__name__}): {flat(exc)[:400]}", 1
    hint = "" if _debug["on"] else " (re-run with --debug for the traceback)"
    return ("internal error", f"{type(exc).__name__}: {flat(exc)[:400]}; this is a bug in quantkit, please report "
            f"it{hint}", 1)


def _quiet_libraries() -> None:
    """lm-eval and transformers warn about things quantkit does on purpose (a pre-loaded model,
    the tokenizer's clean-up flag); the user's terminal is for progress and results. Off a
    terminal, libraries' own progress bars would fill a log with carriage returns."""
    import logging

    for name in ("lm_eval", "lm-eval", "transformers", "datasets", "huggingface_hub"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # transformers and datasets set their loggers' level from these when first imported (after this runs)
    for variable in ("TRANSFORMERS_VERBOSITY", "HF_DATASETS_VERBOSITY", "HF_HUB_VERBOSITY"):
        os.environ.setdefault(variable, "error")
    if not err.is_terminal:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TQDM_DISABLE", "1")


def _emit_json(obj) -> None:
    if hasattr(obj, "model_dump"):
        data = obj.model_dump(mode="json")
    else:
        data = dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) and not isinstance(obj, type) else obj
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB ({n / 1e9:.3f} GB)"


@command("inspect")
def inspect_cmd(
    path: Annotated[Path, typer.Argument(help="Checkpoint folder (config.json + *.safetensors).")],
    json_out: JsonOpt = False,
) -> None:
    """What a checkpoint holds, from config and safetensors headers only (no tensor data read)."""
    from quantkit.checkpoint.inspection import inspect_checkpoint

    report = inspect_checkpoint(path)
    if json_out:
        _emit_json(report)
        return
    out.print(
        f"[bold]{_t(report.path)}[/]  {_t(report.model_type)} (family {report.family}), "
        f"{report.num_hidden_layers} layers + {report.mtp_layers} MTP, quantization: {_t(report.quantization)}"
    )
    table = Table("component", "parameters", "bytes on disk", "encodings")
    for name, c in report.components.items():
        enc = ", ".join(f"{k} {v / max(c.params, 1):.0%}" for k, v in c.encodings.items())
        table.add_row(_t(name), f"{c.params:,}", _gib(c.bytes), _t(enc))
    table.add_row("[bold]total[/]", f"[bold]{report.total_params:,}[/]", _gib(report.total_bytes), "")
    out.print(table)
    out.print(f"{len(report.shards)} shard(s)")


@command("convert")
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

    with _bytes_progress(enabled=not json_out and err.is_terminal, label="converting") as on_progress:
        result = convert(src, dst, recipe, device=device, workers=workers, max_shard_size=max_shard_size,
                         resume=resume, force=force, verify_reused=verify_reused, calibration_data=calibration_data,
                         dtype=dtype, gpu_memory=gpu_memory, on_progress=on_progress,
                         on_layer=None if json_out else _CalibratedLayerLog())
    if json_out:
        _emit_json(result)
        return
    stages = ", ".join(f"{k} {v:.1f}s" for k, v in result.stage_seconds.items())
    out.print(
        f"[green]done[/] {_t(result.dst)}: {result.shards_written} shard(s) written, {result.shards_reused} reused; "
        f"{_gib(result.source_bytes)} -> {_gib(result.output_bytes)} in {result.seconds:.1f}s "
        f"on {_t(','.join(result.devices))} x{result.workers} ({stages})"
    )
    for group, n in result.tensors_by_group.items():
        out.print(f"  recipe group {_t(group)}: {n} weight(s)", highlight=False)
    for name in result.skipped_files:
        out.print(f"  [yellow]not copied[/]: {_t(name)} (a weight file the index does not list)", highlight=False)
    for warning in result.warnings:
        out.print(f"  [yellow]warning[/]: {_t(warning)}", highlight=False)
    if result.calibrated:
        methods = ", ".join(f"{k} {v}" for k, v in result.calibrated["weights_by_method"].items())
        out.print(f"  {result.calibrated['algorithm']}: {methods} weight(s), layers computed in "
                  f"{result.calibrated['computed_in']}; details per weight in DST's quantkit-manifest.json",
                  highlight=False)
        for reason, n in result.calibrated["rtn_reasons"].items():
            out.print(f"  round-to-nearest: {n} x {_t(reason)}", highlight=False)
        if result.calibrated["rtn_outside_calibration"]:
            out.print(f"  round-to-nearest: {len(result.calibrated['rtn_outside_calibration'])} weight(s) outside the "
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


@command("calibrate-kv")
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
        _emit_json(result)
        return
    ks = [k for k, _ in result.scales.values()]
    out.print(
        f"[green]done[/] {_t(result.out)}: {result.layers} layers ({result.attention}), {result.samples} x "
        f"{result.seq_len} "
        f"tokens in {result.seconds:.1f}s; k_scale {min(ks):.3g}..{max(ks):.3g}; {_t(result.json_path)}, "
        f"{_t(result.plot_path)}"
    )
    for engine, usage in result.engines.items():
        out.print(f"  {_t(engine)}: {_t(usage)}", highlight=False, soft_wrap=True)


@command("verify")
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
        _emit_json(report)
    else:
        checked = ", ".join(f"{v} {k}" for k, v in report.checked.items())
        out.print(f"[bold]{_t(report.path)}[/] for {_t(report.engine)} tp={report.tp}: checked {_t(checked)}")
        for note in report.notes:
            out.print(f"[yellow]not checked[/]: {_t(note)}", highlight=False)
        for remark in report.remarks:
            out.print(f"note: {_t(remark)}", highlight=False, soft_wrap=True)
        if report.worst:
            worst = report.worst[0]
            out.print(f"worst tensor: {_t(worst.tensor)} relative error {worst.relative_error:.4f}, SNR "
                      f"{worst.snr_db:.1f} dB")
        for f in report.findings:  # one line each, never cut: a log reader needs the whole file name
            out.print(f"[red]{f.check}[/] {_t(f.tensor or f.file or '')}: {_t(f.rule)}: "
                      f"{_t(f.message)}", highlight=False,
                      soft_wrap=True)
        out.print("[green]PASS[/]" if report.passed else f"[red]FAIL[/]: {len(report.findings)} finding(s)")
    raise typer.Exit(0 if report.passed else 1)


@command("plan")
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
        _emit_json(report)
        return
    where = "shard headers" if report.from_headers else "config.json alone"
    out.print(f"[bold]{_t(report.source)}[/] ({report.family}, {report.attention}), from {where}: "
              f"{report.total_params:,} parameters")
    table = Table("component", "parameters", "now", "after" if report.recipe else "")
    for name, c in report.components.items():
        table.add_row(_t(name), f"{c.params:,}", _gib(c.bytes_now), _gib(c.bytes_after) if report.recipe else "")
    table.add_row("[bold]files[/]", "", _gib(report.bytes_now), _gib(report.bytes_after) if report.bytes_after else "")
    out.print(table)
    out.print(
        f"tp={report.tp} on {report.gpu_bytes / 2**30:.1f} GiB GPUs: weights {_gib(report.weights_per_gpu)} per GPU; "
        f"KV {report.kv_bytes_per_token:,} bytes/token; {report.kv_tokens_per_gpu:,} tokens per GPU = "
        f"{report.concurrent_requests} requests of {report.context_len:,}"
    )
    for pool in report.pools:
        out.print(f"[bold]{pool.role}[/] pool: weights {_gib(pool.weights_per_gpu)}/GPU, {pool.kv_dtype} KV "
                  f"{pool.kv_bytes_per_token:,} B/token, {pool.kv_tokens_per_gpu:,} tokens, "
                  f"{pool.concurrent_requests} requests")
        out.print(f"  {_t(pool.launch)}", highlight=False)
        if pool.kv_scales:
            out.print(f"  FP8 KV scales: {_t(pool.kv_scales)}", highlight=False, soft_wrap=True)
    if report.chart:
        out.print(f"chart: {_t(report.chart)}")


@command("budget")
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
        _emit_json(result)
        return
    table = Table("group", *(o for o in ("int4-g128", "int4-g32", "fp8") if any(o in g.kl for g in result.groups)),
                  "chosen")
    options = [c.header for c in table.columns[1:-1]]
    for g in result.groups:
        table.add_row(_t(g.name), *(f"{g.kl[o]:.5f}" if o in g.kl else "-" for o in options), g.choice)
    out.print(table)
    out.print(f"KL per token with each group alone in each format (nats), on {result.samples} x {result.seq_len} "
              f"tokens")
    out.print(f"[green]wrote[/] {_t(result.recipe)}: predicted {_gib(result.predicted_bytes)} for a budget of "
              f"{_gib(result.budget_bytes)} (source {_gib(result.source_bytes)}); {result.int4_share:.0%} of the "
              f"groups' weights in INT4; predicted damage {result.predicted_kl:.4f} nats per token")


@command("eval")
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
    with _items_progress(enabled=not json_out and err.is_terminal) as on_progress:
        result = evaluate(model, engine=engine, tasks=names, data_dir=data_dir, limit=limit,
                          kv_cache_dtype=kv_cache_dtype, out=out_dir, batch_size=batch_size, tp=tp, ep=ep, url=url,
                          engine_cmd=engine_cmd, mem_fraction=mem_fraction, health_timeout=health_timeout,
                          device=device, dtype=dtype, order=order, fraction=fraction, on_progress=on_progress,
                          on_launch=_print_launch, repeat=repeat)
    if json_out:
        _emit_json(result)
        return
    for task, s in result.scores.items():
        out.print(f"{_t(task)}: {s['score']:.2f} ± {s['stderr']:.2f} (n={s['n']})")
    out.print(f"run directory: {_t(result.run_dir)} ({result.seconds:.0f}s)")


def _print_launch(argv: list[str]) -> None:
    """The engine command is executable configuration: the user sees what runs before it runs."""
    import shlex

    from quantkit.inert import visible

    err.print(f"starting the engine: {visible(shlex.join(argv))}", highlight=False, markup=False, soft_wrap=True)


@command("gate")
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
        _emit_json(result)
    else:
        out.print(markdown(result), highlight=False, markup=False, soft_wrap=True)
    raise typer.Exit({"pass": 0, "fail": 1, "continue": 3}[result.decision])


@command("publish")
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
        _emit_json(result)
        return
    table = Table("file", "bytes")
    for f in result.files:
        table.add_row(_t(f["name"]), f"{f['bytes']:,}")
    out.print(table)
    if dry_run:
        out.print(result.card, markup=False, highlight=False)
        out.print(f"[yellow]dry run[/]: nothing uploaded; would publish {len(result.files)} files to {_t(repo)}")
    else:
        where = result.target if result.target != "hub" else f"https://huggingface.co/{repo}"
        out.print(f"[green]published[/] {len(result.files)} files to {_t(where)} "
                  f"({'gated' if result.gated else 'UNGATED'})")


@command("release")
def release_cmd(
    config: Annotated[Path, typer.Argument(help="Release config YAML (see eval/release-example.yaml).")],
    resume: Annotated[bool, typer.Option("--resume", help="Continue after the last finished stage.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """plan -> convert -> calibrate-kv -> verify -> eval baseline -> eval candidate -> gate -> publish."""
    from quantkit.release import ReleaseResult, release

    with _items_progress(enabled=not json_out and err.is_terminal) as on_progress:
        result = release(config, resume=resume, on_stage=None if json_out else _print_stage, on_progress=on_progress,
                         on_launch=_print_launch)
    if json_out:
        _emit_json(result)
        return
    if isinstance(result, ReleaseResult):
        out.print(result.gate_table, markup=False, highlight=False)
        out.print(f"[green]released[/]: {_t(result.published)}; report {_t(result.report)}")
        return
    for p in result.pools:
        if p.release is not None:
            out.print(f"\n[bold]{p.name}[/] ({_t(p.recipe)})", highlight=False)
            out.print(p.release.gate_table, markup=False, highlight=False)
        else:
            out.print(f"\n[bold]{p.name}[/]: the source as released, {_t(p.model)} (the baseline itself)",
                      highlight=False)
        if p.published:
            out.print(f"[green]released[/]: {_t(p.published)}", highlight=False)
    out.print(f"both pools sized for the deployment in {_t(result.plan)}; the pools' card: {_t(result.card)}")


@command("demo")
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
        out.print(f"[bold]{_t(name):>4}[/] ", end="")
        _print_stage(record)

    with _items_progress(enabled=not json_out and err.is_terminal) as on_progress:
        result = demo(workdir, arc_items=arc_items, gsm8k_items=gsm8k_items, source_model=source_model,
                      on_stage=None if json_out else stage, on_progress=on_progress)
    if json_out:
        _emit_json(result)
        return
    out.print(f"source (block-FP8): {_t(result.source)}")
    for r in result.releases:
        out.print(f"\n[bold]{_t(r.name)}[/] ({_t(r.recipe)})", highlight=False)
        out.print(r.gate_table, markup=False, highlight=False)
        if r.published:
            out.print(f"[green]published[/] {_t(r.published)} (model card: {_t(Path(r.published) / 'README.md')}); "
                      f"report {_t(r.report)}")
        else:
            out.print(f"[red]not published[/]: {_t(r.stopped or '')}", highlight=False)
    out.print(f"done in {result.seconds:.0f}s")


def _print_stage(record) -> None:
    mark = {"ran": "[green]done[/]", "resumed": "[cyan]done earlier[/]", "reused": "[cyan]reused[/]",
            "skipped": "[yellow]skipped[/]"}[str(record.status)]
    pool = f"{record.pool:>7} " if record.pool else ""
    out.print(f"{pool}{record.stage:>15}  {mark}  {record.seconds:6.1f}s  {_t(record.summary)}", highlight=False)


@command("synth")
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
    out.print(f"wrote {_t(path)}")


class _bytes_progress:
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


class _items_progress:
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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
