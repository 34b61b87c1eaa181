"""The quantkit command line: parses arguments, calls one quantkit function, prints.

Heavy libraries (torch, transformers, compressed-tensors) are imported inside the commands,
so ``quantkit --help`` answers at once.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(
    help="Offline quantization and checkpoint conversion for giant Mixture-of-Experts LLMs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console()
err = Console(stderr=True)


def _fail(exc: Exception) -> None:
    err.print(f"[bold red]error:[/] {exc}", markup=True, highlight=False, soft_wrap=True)
    raise typer.Exit(1)


def _quiet_libraries() -> None:
    """lm-eval and transformers warn about things quantkit does on purpose (a pre-loaded model,
    the tokenizer's clean-up flag); the user's terminal is for progress and results."""
    import logging

    for name in ("lm_eval", "lm-eval", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _emit_json(obj) -> None:
    data = dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else obj
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB ({n / 1e9:.3f} GB)"


@app.command("inspect")
def inspect_cmd(
    path: Path = typer.Argument(..., help="Checkpoint folder (config.json + *.safetensors)."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
) -> None:
    """What a checkpoint holds, from config and safetensors headers only (no tensor data read)."""
    from quantkit.errors import QuantkitError
    from quantkit.inspection import inspect_checkpoint

    try:
        report = inspect_checkpoint(path)
    except QuantkitError as exc:
        _fail(exc)
    if json_out:
        _emit_json(report)
        return
    out.print(
        f"[bold]{report.path}[/]  {report.model_type} (family {report.family}), "
        f"{report.num_hidden_layers} layers + {report.mtp_layers} MTP, quantization: {report.quantization}"
    )
    table = Table("component", "parameters", "bytes on disk", "encodings")
    for name, c in report.components.items():
        enc = ", ".join(f"{k} {v / max(c.params, 1):.0%}" for k, v in c.encodings.items())
        table.add_row(name, f"{c.params:,}", _gib(c.bytes), enc)
    table.add_row("[bold]total[/]", f"[bold]{report.total_params:,}[/]", _gib(report.total_bytes), "")
    out.print(table)
    out.print(f"{len(report.shards)} shard(s)")


@app.command("convert")
def convert_cmd(
    src: Path = typer.Argument(..., help="Source checkpoint folder (never modified)."),
    dst: Path = typer.Argument(..., help="Output folder."),
    recipe: str = typer.Option(..., "--recipe", "-r", help="Recipe YAML path or built-in name (see recipes/)."),
    device: str = typer.Option("auto", help="auto, cpu, cuda, or a list: cuda:0,cuda:1."),
    workers: Optional[int] = typer.Option(None, help="Concurrent shard jobs (default: 2 per GPU, or up to 4 CPU)."),
    max_shard_size: str = typer.Option("5GB", help="Largest output shard (5GB, 512MiB, ...)."),
    resume: bool = typer.Option(False, "--resume", help="Finish an interrupted run in DST."),
    force: bool = typer.Option(False, "--force", help="Replace whatever run DST holds."),
    json_out: bool = typer.Option(False, "--json", help="No progress bar; print a JSON result."),
) -> None:
    """Convert a block-FP8 / BF16 checkpoint to compressed-tensors INT4 with a recipe."""
    from quantkit.convert import convert
    from quantkit.errors import QuantkitError

    if resume and force:
        _fail(QuantkitError("--resume and --force exclude each other"))
    try:
        with _bytes_progress(enabled=not json_out and err.is_terminal, label="converting") as on_progress:
            result = convert(src, dst, recipe, device, workers, max_shard_size, resume, force, on_progress)
    except QuantkitError as exc:
        _fail(exc)
    if json_out:
        _emit_json(result)
        return
    stages = ", ".join(f"{k} {v:.1f}s" for k, v in result.stage_seconds.items())
    out.print(
        f"[green]done[/] {result.dst}: {result.shards_written} shard(s) written, {result.shards_reused} reused; "
        f"{_gib(result.source_bytes)} -> {_gib(result.output_bytes)} in {result.seconds:.1f}s "
        f"on {','.join(result.devices)} x{result.workers} ({stages})"
    )


@app.command("calibrate-kv")
def calibrate_kv_cmd(
    model: Path = typer.Argument(..., help="A BF16 source or a quantkit output (with its tokenizer)."),
    out_dir: Optional[Path] = typer.Option(None, "--out", help="Write a copy with scales here (hard links where possible)."),
    in_place: bool = typer.Option(False, "--in-place", help="Add the scales to MODEL itself."),
    data: Optional[Path] = typer.Option(None, help="Calibration text: .jsonl (see --text-field) or .txt; default: built-in GSM8K-train text."),
    text_field: str = typer.Option("text", help="The JSONL field holding the text."),
    samples: int = typer.Option(512, help="Sequences to run."),
    seq_len: int = typer.Option(2048, help="Tokens per sequence."),
    batch_size: int = typer.Option(4, help="Sequences per forward pass."),
    device: str = typer.Option("auto", help="auto, cpu or cuda."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """FP8 (e4m3) KV-cache scales: absmax / 448 of what the engine caches (MLA: the latent), layer by layer."""
    from quantkit.calibrate_kv import calibrate_kv
    from quantkit.errors import QuantkitError

    try:
        result = calibrate_kv(model, out_dir, in_place, data, text_field, samples, seq_len, batch_size, device)
    except QuantkitError as exc:
        _fail(exc)
    if json_out:
        _emit_json(result)
        return
    ks = [k for k, _ in result.scales.values()]
    out.print(
        f"[green]done[/] {result.out}: {result.layers} layers ({result.attention}), {result.samples} x {result.seq_len} tokens "
        f"in {result.seconds:.1f}s; k_scale {min(ks):.3g}..{max(ks):.3g}; {result.json_path}, {result.plot_path}"
    )


@app.command("verify")
def verify_cmd(
    path: Path = typer.Argument(..., help="A converted checkpoint."),
    source: Optional[Path] = typer.Option(None, "--source", help="The source it came from: enables the numeric checks."),
    engine: str = typer.Option("sglang", help="Whose kernel rules to check: sglang or vllm."),
    tp: int = typer.Option(1, help="Tensor-parallel size the checkpoint will be served with."),
    smoke: bool = typer.Option(True, "--smoke/--no-smoke", help="Load and run small models; meta-check large ones."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
) -> None:
    """Check structure, numbers, integrity and engine rules; exit 0 only when everything passes."""
    from quantkit.verify import verify

    try:
        report = verify(path, source, engine, tp, smoke)
    except ValueError as exc:
        _fail(exc)
    if json_out:
        _emit_json(report)
    else:
        checked = ", ".join(f"{v} {k}" for k, v in report.checked.items())
        out.print(f"[bold]{report.path}[/] for {report.engine} tp={report.tp}: checked {checked}")
        if report.worst:
            worst = report.worst[0]
            out.print(f"worst tensor: {worst.tensor} relative error {worst.relative_error:.4f}, SNR {worst.snr_db:.1f} dB")
        if report.findings:
            table = Table("check", "tensor / file", "rule", "found")
            for f in report.findings:
                table.add_row(f.check, f.tensor or f.file or "", f.rule, f.message)
            out.print(table)
        out.print("[green]PASS[/]" if report.passed else f"[red]FAIL[/]: {len(report.findings)} finding(s)")
    raise typer.Exit(0 if report.passed else 1)


@app.command("plan")
def plan_cmd(
    src: Path = typer.Argument(..., help="Checkpoint folder, or a folder with config.json alone."),
    recipe: Optional[str] = typer.Option(None, "--recipe", "-r", help="Recipe to size the output for."),
    tp: int = typer.Option(1, help="Tensor-parallel size."),
    gpu: str = typer.Option("h200", help="h100, h200 or b200 (memory as the GPU reports it)."),
    gpu_mem: Optional[float] = typer.Option(None, help="GPU memory in GiB (overrides --gpu)."),
    kv_dtype: str = typer.Option("bf16", help="KV-cache dtype: bf16 or fp8_e4m3."),
    mem_fraction: float = typer.Option(0.88, help="Share of GPU memory for weights + KV (SGLang --mem-fraction-static)."),
    context_len: int = typer.Option(32768, help="Context length per request."),
    page_size: int = typer.Option(64, help="KV-cache page size in tokens."),
    max_shard_size: str = typer.Option("5GB", help="Output shard cap, as for convert."),
    deploy: bool = typer.Option(False, "--deploy", help="Plan the prefill (source, BF16 KV) and decode (INT4, FP8 KV) pools."),
    chart: Path = typer.Option(Path("plan-memory.png"), help="Where --deploy writes its PNG chart."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
) -> None:
    """Size the conversion and the deployment: bytes by component, per-GPU memory, KV capacity."""
    from quantkit.errors import QuantkitError
    from quantkit.plan import plan

    try:
        report = plan(src, recipe, tp, gpu, gpu_mem, kv_dtype, mem_fraction, context_len, page_size,
                      max_shard_size, deploy, chart)
    except QuantkitError as exc:
        _fail(exc)
    if json_out:
        _emit_json(report)
        return
    where = "shard headers" if report.from_headers else "config.json alone"
    out.print(f"[bold]{report.source}[/] ({report.family}, {report.attention}), from {where}: {report.total_params:,} parameters")
    table = Table("component", "parameters", "now", "after" if report.recipe else "")
    for name, c in report.components.items():
        table.add_row(name, f"{c.params:,}", _gib(c.bytes_now), _gib(c.bytes_after) if report.recipe else "")
    table.add_row("[bold]files[/]", "", _gib(report.bytes_now), _gib(report.bytes_after) if report.bytes_after else "")
    out.print(table)
    out.print(
        f"tp={report.tp} on {report.gpu_bytes / 2**30:.1f} GiB GPUs: weights {_gib(report.weights_per_gpu)} per GPU; "
        f"KV {report.kv_bytes_per_token:,} bytes/token; {report.kv_tokens_per_gpu:,} tokens per GPU = "
        f"{report.concurrent_requests} requests of {report.context_len:,}"
    )
    for pool in report.pools:
        out.print(f"[bold]{pool.role}[/] pool: weights {_gib(pool.weights_per_gpu)}/GPU, {pool.kv_dtype} KV "
                  f"{pool.kv_bytes_per_token:,} B/token, {pool.kv_tokens_per_gpu:,} tokens, {pool.concurrent_requests} requests")
        out.print(f"  {pool.launch}", highlight=False)
    if report.chart:
        out.print(f"chart: {report.chart}")


@app.command("eval")
def eval_cmd(
    model: Path = typer.Argument(..., help="Checkpoint folder (with its tokenizer)."),
    engine: str = typer.Option("hf", help="hf: transformers in-process; sglang: start a server for the run; openai: a running server at --url."),
    tasks: str = typer.Option("gsm8k,arc_easy,arc_challenge,mmlu,mmlu_pro", help="Comma-separated tasks."),
    data_dir: Optional[Path] = typer.Option(None, help="Local data in the hub's schema (e.g. shared/evaldata); else the hub."),
    limit: Optional[int] = typer.Option(None, help="First N items of each task."),
    kv_cache_dtype: str = typer.Option("auto", help="auto, or fp8_e4m3 (hf: emulated with calibrated scales; sglang: passed on)."),
    tp: int = typer.Option(1, help="sglang: tensor-parallel size."),
    ep: int = typer.Option(1, help="sglang: expert-parallel size."),
    mem_fraction: Optional[float] = typer.Option(None, help="sglang: --mem-fraction-static."),
    engine_cmd: Optional[str] = typer.Option(None, help="sglang: how to start it [env QUANTKIT_SGLANG_CMD; default: python -m sglang.launch_server]."),
    engine_timeout: float = typer.Option(1800, help="sglang: seconds to wait for the server to become healthy."),
    url: Optional[str] = typer.Option(None, help="openai: base URL of the server (http://host:port)."),
    out_dir: Optional[Path] = typer.Option(None, "--out", help="RUN_DIR (default runs/<model name>)."),
    batch_size: int = typer.Option(8, help="Requests per forward pass (hf) or in flight (servers)."),
    json_out: bool = typer.Option(False, "--json", help="No progress bars; print JSON."),
) -> None:
    """Run the benchmarks with lm-eval and keep per-item outcomes and provenance in RUN_DIR."""
    from quantkit.errors import QuantkitError
    from quantkit.evaluation import evaluate

    _quiet_libraries()
    try:
        with _items_progress(enabled=not json_out and err.is_terminal) as on_progress:
            result = evaluate(model, engine, [t.strip() for t in tasks.split(",") if t.strip()], data_dir, limit,
                              kv_cache_dtype, out_dir, batch_size, tp, ep, url, engine_cmd, mem_fraction,
                              engine_timeout, on_progress)
    except QuantkitError as exc:
        _fail(exc)
    except KeyboardInterrupt:
        err.print("[bold red]interrupted[/]: the engine was stopped; re-run with the same --out to resume")
        raise typer.Exit(130)
    if json_out:
        _emit_json(result)
        return
    for task, s in result.scores.items():
        out.print(f"{task}: {s['score']:.2f} ± {s['stderr']:.2f} (n={s['n']})")
    out.print(f"run directory: {result.run_dir} ({result.seconds:.0f}s)")


@app.command("gate")
def gate_cmd(
    baseline: Path = typer.Argument(..., help="The baseline's run directory."),
    candidate: Path = typer.Argument(..., help="The candidate's run directory."),
    suite: Optional[Path] = typer.Option(None, help="Suite file (default: eval/suites/release.yaml)."),
    margin: Optional[float] = typer.Option(None, help="One margin in accuracy points for every task (overrides the suite)."),
    report: Optional[Path] = typer.Option(None, help="Write verdict.json, report.md, report.html and forest.png here."),
    json_out: bool = typer.Option(False, "--json", help="Print the verdict as JSON."),
) -> None:
    """Paired non-inferiority test of candidate vs baseline: exit 0 pass, 1 a task fails, 2 cannot compare."""
    from quantkit.errors import QuantkitError
    from quantkit.gate import gate
    from quantkit.reporting import markdown

    try:
        result = gate(baseline, candidate, suite, margin, report)
    except QuantkitError as exc:  # CannotCompare, or a suite that cannot be read: no verdict either way
        err.print(f"[bold red]cannot compare:[/] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(2)
    if json_out:
        _emit_json(result)
    else:
        out.print(markdown(result), highlight=False, markup=False, soft_wrap=True)
    raise typer.Exit(0 if result.passed else 1)


@app.command("publish")
def publish_cmd(
    dst: Path = typer.Argument(..., help="The converted checkpoint to publish."),
    repo: str = typer.Option(..., help="ORG/NAME on the hub, or file://DIR for a local folder."),
    gate_verdict: Optional[Path] = typer.Option(None, "--gate", help="The passing gate's verdict.json."),
    private: bool = typer.Option(False, "--private", help="Create the hub repository private."),
    revision: Optional[str] = typer.Option(None, help="Branch to upload to (created if missing)."),
    base_model: Optional[str] = typer.Option(None, help="Hub id of the original model, for the card."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print what would be uploaded and the card; change nothing."),
    force_ungated: bool = typer.Option(False, "--force-ungated", help="Publish without a gate; the card says so."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Upload DST with its model card, only if the gate passed on exactly these shards."""
    from quantkit.errors import QuantkitError
    from quantkit.publish import publish

    try:
        result = publish(dst, repo, gate_verdict, private, revision, dry_run, force_ungated, base_model)
    except QuantkitError as exc:
        _fail(exc)
    if json_out:
        _emit_json(result)
        return
    table = Table("file", "bytes")
    for f in result.files:
        table.add_row(f["name"], f"{f['bytes']:,}")
    out.print(table)
    if dry_run:
        out.print(result.card, markup=False, highlight=False)
        out.print(f"[yellow]dry run[/]: nothing uploaded; would publish {len(result.files)} files to {repo}")
    else:
        where = result.target if result.target != "hub" else f"https://huggingface.co/{repo}"
        out.print(f"[green]published[/] {len(result.files)} files to {where} ({'gated' if result.gated else 'UNGATED'})")


@app.command("release")
def release_cmd(
    config: Path = typer.Argument(..., help="Release config YAML (see eval/release-example.yaml)."),
    resume: bool = typer.Option(False, "--resume", help="Continue after the last finished stage."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """plan -> convert -> calibrate-kv -> verify -> eval baseline -> eval candidate -> gate -> publish."""
    from quantkit.errors import QuantkitError
    from quantkit.release import release

    _quiet_libraries()
    try:
        with _items_progress(enabled=not json_out and err.is_terminal) as on_progress:
            result = release(config, resume, on_stage=None if json_out else _print_stage, on_progress=on_progress)
    except QuantkitError as exc:
        _fail(exc)
    if json_out:
        _emit_json(result)
        return
    out.print(result.gate_table, markup=False, highlight=False)
    out.print(f"[green]released[/]: {result.published}; report {result.report}")


@app.command("demo")
def demo_cmd(
    workdir: Path = typer.Option(Path("quantkit-demo"), help="Where everything goes (a re-run resumes)."),
    arc_items: int = typer.Option(500, help="ARC-Easy test items (the first N)."),
    gsm8k_items: int = typer.Option(16, help="GSM8K test items (the first N; evaluated, not gated)."),
    source_model: Optional[Path] = typer.Option(None, help="A local BF16 SmolLM2-135M-Instruct instead of fetching it."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Two gated releases of the real SmolLM2-135M from a block-FP8 source, offline on a CPU: INT4 and FP8."""
    from quantkit.demo import demo
    from quantkit.errors import QuantkitError

    def stage(name, record):
        out.print(f"[bold]{name:>4}[/] ", end="")
        _print_stage(record)

    _quiet_libraries()
    try:
        with _items_progress(enabled=not json_out and err.is_terminal) as on_progress:
            result = demo(workdir, arc_items, gsm8k_items, source_model=source_model,
                          on_stage=None if json_out else stage, on_progress=on_progress)
    except QuantkitError as exc:
        _fail(exc)
    if json_out:
        _emit_json(result)
        return
    out.print(f"source (block-FP8): {result.source}")
    for r in result.releases:
        out.print(f"\n[bold]{r.name}[/] ({r.recipe})", highlight=False)
        out.print(r.gate_table, markup=False, highlight=False)
        if r.published:
            out.print(f"[green]published[/] {r.published} (model card: {Path(r.published) / 'README.md'}); report {r.report}")
        else:
            out.print(f"[red]not published[/]: the gate failed; report {r.report}")
    out.print(f"done in {result.seconds:.0f}s")


def _print_stage(record) -> None:
    mark = {"ran": "[green]done[/]", "resumed": "[cyan]done earlier[/]", "reused": "[cyan]reused[/]",
            "skipped": "[yellow]skipped[/]"}[record.status]
    out.print(f"{record.stage:>15}  {mark}  {record.seconds:6.1f}s  {record.summary}", highlight=False)


@app.command("synth")
def synth_cmd(
    family: str = typer.Argument(..., help="glm_moe_dsa, deepseek_v3 or llama."),
    out_dir: Path = typer.Argument(..., help="Folder to write the checkpoint to."),
    seed: int = typer.Option(0, help="Random seed for the weights."),
    bf16: bool = typer.Option(False, "--bf16", help="Write BF16 weights instead of block-FP8."),
    experts: Optional[int] = typer.Option(None, help="Routed experts per layer (MoE families)."),
    layers: Optional[int] = typer.Option(None, help="Decoder layers."),
) -> None:
    """Build a small synthetic checkpoint with a real release's on-disk layout (tests, demos)."""
    from quantkit.synthetic import build_synthetic

    overrides = {}
    if experts is not None:
        overrides["n_routed_experts"] = experts
    if layers is not None:
        overrides["num_hidden_layers"] = layers
    try:
        path = build_synthetic(family, out_dir, seed=seed, fp8=False if bf16 else None, **overrides)
    except ValueError as exc:
        _fail(exc)
    out.print(f"wrote {path}")


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
