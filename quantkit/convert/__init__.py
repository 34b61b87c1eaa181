"""``convert``: a source checkpoint and a recipe in, a compressed-tensors checkpoint out.

Streaming, shard by shard. Each output shard is one job: a reader thread preads the source
tensors ahead, the job thread decodes / quantizes / packs them on its device, and a writer
streams the results into the shard behind a header planned in advance. Jobs run on a pool of
workers (CPU threads or GPUs). Memory is a few tensors per worker, not a shard, not a model.

The manifest in DST makes the run resumable after any kill: finished shards are recorded with
their sha256, files only appear under their final names once complete, and a re-run with
``--resume`` redoes only what is missing, giving byte-identical output.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from quantkit import __version__
from quantkit.checkpoint.families import detect_family
from quantkit.checkpoint.manifest import MANIFEST_NAME, Manifest, ManifestStatus, ShardRecord, load_manifest
from quantkit.checkpoint.reader import DTYPES, INDEX_NAME, Checkpoint, TensorReader, open_checkpoint
from quantkit.checkpoint.writer import (
    LOCK_NAME,
    PARTIAL_SUFFIX,
    ShardWriter,
    copy_file_atomic,
    folder_lock,
    work_folder,
    write_bytes_atomic,
    write_error,
)
from quantkit.convert.tensor_plan import Action, ActionKind, ConversionPlan, OutputShard, plan_conversion
from quantkit.devices import resolve_devices
from quantkit.errors import QuantkitError
from quantkit.formats.recipe import Recipe, load_recipe

STAGES = ("read", "decode", "quantize", "pack", "write")
GPTQ_DONE = "quantkit.gptq"  # a read-ahead item holding a weight GPTQ already quantized
PREFETCH = 4  # source tensors read ahead per worker: overlaps IO with compute, bounds memory
PINNED_MAX = 64 << 20  # outputs up to this size come back from the GPU through pinned (cached) host memory


@dataclass
class ConvertResult:
    src: str
    dst: str
    family: str
    recipe: str
    source_bytes: int
    output_bytes: int
    shards_total: int
    shards_written: int
    shards_reused: int
    tensors_by_kind: dict[str, int]
    devices: list[str]
    workers: int
    seconds: float
    stage_seconds: dict[str, float] = field(default_factory=dict)
    tensors_by_group: dict[str, int] = field(default_factory=dict)  # recipe group -> weights it took
    gptq: dict | None = None  # GPTQ recipes: weights by method, tokens per expert, per-layer loss
    skipped_files: list[str] = field(default_factory=list)  # weight files in SRC the index does not own
    warnings: list[str] = field(default_factory=list)


class DifferentRun(QuantkitError):
    """DST holds a quantkit run of another source, recipe or layout."""


def parse_size(text: str | int) -> int:
    """'5GB' -> 5e9, '512MiB' -> 512 * 2**20, plain numbers are bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d{1,15}(?:\.\d{1,15})?)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)  # bounded
    if not m:
        raise QuantkitError(f"cannot read size {text!r} (examples: 5GB, 512MiB, 1000000)")
    number, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    power = " KMGT".index(unit or " ")
    return int(number * (1024 if binary else 1000) ** power)


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    recipe: str | os.PathLike,
    *,
    device: str = "auto",
    workers: int | None = None,
    max_shard_size: str | int = "5GB",
    resume: bool = False,
    force: bool = False,
    verify_reused: bool = True,
    calibration_data: str | os.PathLike | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    on_gptq_layer: Callable | None = None,
) -> ConvertResult:
    """Convert SRC into DST with RECIPE.

    :param device: ``auto``, ``cpu``, ``cuda`` or a list ``cuda:0,cuda:1``.
    :param workers: concurrent shard jobs (default 4 per GPU, or up to 4 on CPU).
    :param max_shard_size: largest output file, e.g. ``5GB``.
    :param resume: finish the interrupted run of the same job in DST.
    :param force: replace the quantkit run DST holds (never a folder of other files).
    :param verify_reused: on resume, re-hash each finished shard before keeping it.
    :param calibration_data: a GPTQ recipe's calibration file, instead of the recipe's own.
    :param on_progress: ``on_progress(done_bytes, total_bytes)`` over source bytes.
    :param on_gptq_layer: ``on_gptq_layer(report, layers)`` after each GPTQ layer (convert/gptq.py).
    """
    from quantkit.convert import gptq  # torch: only a conversion needs it (imported before the clock starts)

    started = time.perf_counter()
    if resume and force:
        raise QuantkitError("--resume and --force exclude each other")
    if workers is not None and workers < 1:
        raise QuantkitError(f"--workers must be at least 1 (got {workers})")
    src_path, dst_path = Path(src), Path(dst)
    _check_paths(src_path, dst_path)
    ckpt = open_checkpoint(src_path)
    rec = load_recipe(recipe)
    plan = plan_conversion(ckpt, rec, parse_size(max_shard_size))
    devices = resolve_devices(device)
    if calibration_data is not None and rec.calibration is None:
        raise QuantkitError(f"--calibration-data is for GPTQ and SignRound recipes; {rec.name} is round-to-nearest")
    if rec.gptq:
        gptq.llmcompressor_gptq()  # its absence stops the run here, before DST exists
    if rec.signround:
        from quantkit.convert import signround

        signround.llmcompressor_autoround()
        signround.check_targets(ckpt, plan, rec)
    batches = gptq_batches(ckpt, rec, calibration_data) if rec.calibration else None
    # GPUs: enough jobs per device to keep the disk busy while others compute; CPU: one per core
    workers = workers or (4 * len(devices) if devices[0] != "cpu" else min(4, os.cpu_count() or 1))

    manifest = Manifest(
        quantkit_version=__version__,
        source_path=str(src_path.resolve()),
        source_fingerprint=ckpt.fingerprint(),
        recipe_name=rec.name,
        recipe_sha256=rec.sha256,
        plan_sha256=plan.digest(),
        max_shard_size=parse_size(max_shard_size),
        calibration_sha256=gptq.calibration_digest(batches, rec) if batches else None,
    )
    _make_folder(dst_path)
    _refuse_foreign(dst_path)  # before the lock file is created in someone else's folder; again under the lock
    with folder_lock(dst_path):
        manifest, finished = _prepare_dst(dst_path, manifest, resume, force)
        todo = [s for s in plan.shards if not _is_done(dst_path, s, manifest, verify_reused)]
        total = sum(s.source_bytes for s in plan.shards)
        progress = _Progress(total, on_progress)
        progress.add(total - sum(s.source_bytes for s in todo))
        stats = _Stats()
        if finished and todo:
            manifest.status = ManifestStatus.RUNNING
            manifest.save(dst_path)
            stats.warn(f"{len(todo)} finished shard(s) differed from the manifest and were written again; "
                       "config.json and the index are rewritten, so KV scales added since must be calibrated again")
        quantized = None
        if batches and _needs_gptq(todo, ckpt, plan, rec):
            run = gptq.run_gptq if rec.gptq else signround.run_signround
            quantized = run(ckpt, rec, plan, dst_path, manifest, batches, devices, on_gptq_layer)
        if todo or not finished:  # a finished run with every shard intact keeps its files (and calibrate-kv's additions)
            _run_all(todo, workers, devices, plan, ckpt, dst_path, stats, progress, manifest, quantized)
            _finish(ckpt, rec, plan, dst_path, manifest)
        shutil.rmtree(dst_path / gptq.WORK_DIR, ignore_errors=True)  # every calibrated result is in the shards now
    kinds = Counter(a.kind.value for s in plan.shards for a in s.actions)
    planned = {s.name for s in plan.shards}
    return ConvertResult(
        src=str(src_path),
        dst=str(dst_path),
        family=detect_family(ckpt.config).name,
        recipe=rec.name,
        source_bytes=ckpt.total_bytes,
        output_bytes=sum(r.size for name, r in manifest.shards.items() if name in planned),
        shards_total=len(plan.shards),
        shards_written=len(todo),
        shards_reused=len(plan.shards) - len(todo),
        tensors_by_kind=dict(kinds),
        devices=devices,
        workers=workers,
        seconds=time.perf_counter() - started,
        stage_seconds=dict(stats.seconds),
        tensors_by_group={g: plan.weights_by_group[g] for g in rec.config.config_groups},
        gptq=_gptq_summary(manifest, quantized, ckpt, plan, rec) if rec.calibration else None,
        skipped_files=list(ckpt.skipped_files),
        warnings=list(stats.warnings),
    )


def gptq_batches(ckpt: Checkpoint, rec: Recipe, override: str | os.PathLike | None):
    """The calibration token batches of a GPTQ recipe: exactly ``samples`` x ``seq_len`` tokens, one
    sequence per batch (llm-compressor oneshot's default, so Hessians sum in the same order)."""
    from quantkit.calibration_data import DEFAULT_DATA, calibration_batches, model_tokenizer

    cal = rec.calibration
    data = Path(override) if override is not None else (rec.calibration_data() or DEFAULT_DATA)
    limit = int(ckpt.config.get("max_position_embeddings") or cal.seq_len)
    if cal.seq_len > limit:
        raise QuantkitError(f"recipe {rec.name}: calibration seq_len {cal.seq_len} exceeds the model's context ({limit})",
                            ckpt.root / "config.json")
    return calibration_batches(data, cal.text_field, cal.samples, cal.seq_len, 1, lambda: model_tokenizer(ckpt.root),
                               ckpt.config.get("vocab_size"), require_all=True)


def _needs_gptq(todo, ckpt, plan, rec) -> bool:
    from quantkit.convert import gptq

    targets = {t.module for layer in gptq.gptq_targets(ckpt, plan, rec).values() for t in layer}
    return any(a.module in targets for s in todo for a in s.actions)


def _gptq_summary(manifest: Manifest, quantized, ckpt, plan, rec) -> dict:
    """What GPTQ did, for the result and ``--json``: weights by method, each layer's loss, the experts' token counts."""
    int4_modules = [a.module for s in plan.shards for a in s.actions if a.kind == ActionKind.INT4]
    records = manifest.gptq_modules
    methods = Counter(records[m].method if m in records else "rtn" for m in int4_modules)
    experts = {m: records[m].tokens for m in int4_modules if m in records and ".experts." in m and m.endswith("down_proj")}
    return {
        "weights_by_method": dict(methods),
        "rtn_outside_calibration": sorted(m for m in int4_modules if m not in records),  # MTP layers
        "rtn_reasons": dict(Counter(r.reason for r in records.values() if r.method == "rtn")),
        "expert_tokens": {m.removesuffix(".down_proj"): n for m, n in experts.items()},
        "layers": [vars(r) for r in quantized.layers] if quantized else [],
        "algorithm": rec.algorithm,
        "settings": (rec.gptq or rec.signround).model_dump(),
    }


def _run_all(todo, workers, devices, plan, ckpt, dst_path, stats, progress, manifest, quantized=None) -> None:
    import torch

    threads = torch.get_num_threads()
    if devices[0] == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    try:
        _run_jobs(todo, workers, devices, plan, ckpt, dst_path, stats, progress, manifest, quantized)
    finally:
        torch.set_num_threads(threads)  # the worker split is convert's own: later work in this process gets all cores


def _make_folder(dst: Path) -> None:
    if dst.exists() and not dst.is_dir():
        raise QuantkitError("exists and is not a folder", dst)
    try:
        dst.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise write_error(dst, exc) from exc


def _check_paths(src: Path, dst: Path) -> None:
    s, d = src.resolve(), dst.resolve()
    if d == s or s in d.parents:
        raise QuantkitError(f"DST must not be the source folder or inside it ({src})", dst)
    if d in s.parents:
        raise QuantkitError(f"DST must not contain the source folder ({src})", dst)


def _prepare_dst(dst: Path, fresh: Manifest, resume: bool, force: bool) -> tuple[Manifest, bool]:
    """Decide whether DST is new, ours to resume, or someone else's; returns the manifest to
    continue and whether DST already holds this job, finished. Runs under DST's lock."""
    try:
        old = load_manifest(dst)
    except QuantkitError:
        if not force:
            raise
        old = None
    _refuse_foreign(dst)
    finished = False
    if force:
        _clear_outputs(dst)
    elif old is not None:
        diffs = old.differences(fresh)
        if diffs:
            raise DifferentRun(f"holds another run (different {', '.join(diffs)}); use --force to replace it", dst)
        if not resume:
            raise QuantkitError("holds a previous run of this conversion; use --resume to finish it or --force", dst)
        fresh.shards = old.shards
        fresh.gptq_layers, fresh.gptq_modules = old.gptq_layers, old.gptq_modules
        finished = old.status == ManifestStatus.COMPLETE
    for stale in dst.glob(f".*{PARTIAL_SUFFIX}"):  # ours: no other writer holds the lock
        stale.unlink()
    if not finished:
        fresh.save(dst)  # status RUNNING, as every new manifest starts
    return fresh, finished


def _refuse_foreign(dst: Path) -> None:
    """DST must be empty or hold a quantkit run: another folder's files are never written into or cleared (not even with --force)."""
    if any(p.name != LOCK_NAME and not p.name.endswith(PARTIAL_SUFFIX) for p in dst.iterdir()) and not (
            dst / MANIFEST_NAME).is_file():
        raise QuantkitError(f"holds other files and no {MANIFEST_NAME}, so it is not a quantkit output; "
                            "choose an empty or new folder", dst)


def _clear_outputs(dst: Path) -> None:
    for p in dst.glob("*.safetensors"):
        p.unlink()
    for name in (INDEX_NAME, MANIFEST_NAME, "config.json"):
        (dst / name).unlink(missing_ok=True)


def _is_done(dst: Path, shard: OutputShard, manifest: Manifest, verify: bool) -> bool:
    """Whether a finished shard can be kept: recorded, present, and (``verify``) still the bytes recorded."""
    record = manifest.shards.get(shard.name)
    return record is not None and record.matches(dst / shard.name, rehash=verify)


class _Stats:
    def __init__(self):
        self.seconds = {s: 0.0 for s in STAGES}
        self.warnings: list[str] = []
        self._lock = threading.Lock()

    def add(self, stage: str, seconds: float) -> None:
        with self._lock:
            self.seconds[stage] += seconds

    def warn(self, message: str) -> None:
        with self._lock:
            self.warnings.append(message)


class _Progress:
    def __init__(self, total: int, callback):
        self.total, self.done, self.callback = total, 0, callback
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n
            if self.callback:
                self.callback(self.done, self.total)


_DONE = object()


class _Pipe:
    """A bounded queue between two threads that never blocks forever: once either side has
    stopped (finished or failed), puts give up instead of waiting for a reader that is gone."""

    def __init__(self, depth: int, stop: threading.Event):
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = stop

    def put(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def get(self):
        while True:
            try:
                return self.queue.get(timeout=0.1)
            except queue.Empty:
                if self.stop.is_set():
                    return _DONE


def _run_jobs(todo, workers, devices, plan, ckpt, dst_path, stats, progress, manifest, quantized) -> None:
    """Convert the shards still to do, ``workers`` at a time; each finished shard goes into the manifest."""
    lock = threading.Lock()
    slots: queue.Queue[str] = queue.Queue()
    for i in range(workers):
        slots.put(devices[i % len(devices)])

    def job(shard: OutputShard) -> None:
        dev = slots.get()
        try:
            written = _convert_shard(shard, plan, ckpt, dst_path, dev, stats, progress, quantized)
        finally:
            slots.put(dev)
        with lock:
            manifest.shards[shard.name] = ShardRecord(sha256=written.sha256, size=written.size)
            manifest.save(dst_path)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(job, s) for s in todo]
        try:
            for future in futures:
                future.result()
        except BaseException:
            for future in futures:  # the first failure stops the run; running jobs end on their own
                future.cancel()
            raise


def _convert_shard(shard, plan, ckpt, dst, device, stats, progress, quantized=None):
    """Three threads per shard: read ahead -> compute (this thread) -> write and hash. Weights GPTQ
    quantized (``quantized``) are read from its layer files instead of computed."""
    entries = [(o.name, o.dtype, o.shape) for o in shard.tensors]
    stop = threading.Event()
    loaded, computed = _Pipe(PREFETCH, stop), _Pipe(PREFETCH, stop)
    failures: list[BaseException] = []
    written: list = []

    def read_ahead():
        try:
            layer_files: dict = {}
            with TensorReader(ckpt) as reader:
                for action in shard.actions:
                    t0 = time.perf_counter()
                    if quantized is not None and action.module in quantized.files:
                        tensors = {GPTQ_DONE: quantized.read(action.module, layer_files)}
                    else:
                        tensors = {name: reader.read(name) for name in action.sources}
                    stats.add("read", time.perf_counter() - t0)
                    if not loaded.put((action, tensors)):
                        return
            loaded.put(_DONE)
        except BaseException as exc:
            failures.append(exc)
            stop.set()

    def write_behind(writer: ShardWriter):
        try:
            while (item := computed.get()) is not _DONE:
                action, outputs = item
                t0 = time.perf_counter()
                for name, tensor in outputs.items():
                    writer.write(name, tensor)
                stats.add("write", time.perf_counter() - t0)
                progress.add(action.source_bytes)
            if not stop.is_set():
                t0 = time.perf_counter()
                written.append(writer.finish())
                stats.add("write", time.perf_counter() - t0)
        except BaseException as exc:
            failures.append(exc)
            stop.set()

    with ShardWriter(dst / shard.name, entries, {"format": "pt"}) as writer:
        threads = [threading.Thread(target=read_ahead, daemon=True), threading.Thread(target=write_behind, args=(writer,), daemon=True)]
        for t in threads:
            t.start()
        try:
            while (item := loaded.get()) is not _DONE:
                action, tensors = item
                if not computed.put((action, run_action(action, tensors, plan, ckpt, device, stats))):
                    break
            computed.put(_DONE)
            threads[1].join()
        except BaseException as exc:
            failures.append(exc)
        finally:
            stop.set()
            for t in threads:
                t.join()
        if failures:
            raise failures[0]
        return written[0]


def run_action(action: Action, src: dict, plan: ConversionPlan, ckpt: Checkpoint, device: str, stats=None) -> dict:
    """Compute one action's output tensors (on CPU) from its source tensors.

    On CUDA a tensor costs two waits for the GPU, not one per step: the zero-scale count and the
    finiteness check come back in one read, and the outputs come back together at the end (the
    stage times then count the host's time per step; the GPU's work is counted in ``pack``, where
    the host waits for it).
    """
    import torch

    from quantkit.formats import fp8_block, int4
    from quantkit.formats.weights import decode_weight

    def timed(stage, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        if stats is not None:
            stats.add(stage, time.perf_counter() - t0)
        return out

    kind, m = action.kind, action.module
    if GPTQ_DONE in src:  # packed and scale computed by convert/gptq.py; the shape is the plan's
        out = dict(src[GPTQ_DONE])
        packed = out[f"{m}.weight_packed"]
        out[f"{m}.weight_shape"] = torch.tensor([packed.shape[0], packed.shape[1] * 8], dtype=torch.int64)
        return out
    dtype = getattr(torch, DTYPES[plan.model_dtype][1])
    where = lambda name: ckpt.root / ckpt.tensors[name].file  # noqa: E731

    def finite(t, name):
        if t.is_floating_point() and t.dtype.itemsize > 1 and not bool(torch.isfinite(t).all()):
            raise QuantkitError("NaN or Inf values", where(name), name)
        return t

    def fp8_finite(t, name):
        # e4m3fn has no Inf; NaN is every exponent-and-mantissa bit set (0x7F / 0xFF)
        if bool(((t.view(torch.uint8) & 0x7F) == 0x7F).any()):
            raise QuantkitError("NaN values in FP8 weight", where(name), name)
        return t

    def decode() -> "torch.Tensor":
        """The source weight on ``device`` (formats.weights.decode_weight): the model dtype, or for an
        INT4 source the scale's dtype, which the plan gives its outputs. One finiteness check of the
        decoded weight covers the weight and its scales; only when it fails are the sources examined
        one by one, to name the culprit."""
        parts = tuple(src[name].to(device) for name in action.sources)
        out_dtype = dtype
        if action.encoding == "int4_packed":
            packed, scale, _ = parts
            parts = (packed, scale, (packed.shape[0], scale.shape[1] * action.source_group_size))
            out_dtype = scale.dtype
        w = timed("decode", decode_weight, action.encoding, parts, out_dtype, plan.block)
        zeros = (parts[1] == 0).sum() if action.encoding == "fp8_block" else torch.zeros((), dtype=torch.int64,
                                                                                          device=w.device)
        nonfinite, zero = torch.stack([(~torch.isfinite(w)).sum(), zeros]).tolist()
        if nonfinite:
            for name in action.sources:
                t = src[name]
                fp8_finite(t, name) if t.dtype == torch.float8_e4m3fn else finite(t, name)
            raise QuantkitError("Inf after dequantization (scale too large)", where(action.sources[-1]), action.sources[0])
        if zero and stats is not None:
            s_name = action.sources[1]
            stats.warn(f"{where(s_name)}: tensor {s_name}: {zero} scale block(s) are 0, so their weights decode to 0")
        return w

    def to_host(**outputs) -> dict:
        """The outputs on the CPU, copied back together with one wait (pinned buffers on CUDA)."""
        first = next(iter(outputs.values()))
        if first.device.type == "cpu":
            return outputs
        t0 = time.perf_counter()
        host = {}
        for name, t in outputs.items():
            if t.nbytes > PINNED_MAX:  # an embedding table: the pinned pool would keep gigabytes
                host[name] = t.cpu()
                continue
            host[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host[name].copy_(t, non_blocking=True)
        torch.cuda.current_stream(first.device).synchronize()
        if stats is not None:
            stats.add("pack", time.perf_counter() - t0)
        return host

    weight_name = f"{m}.weight"
    if kind in (ActionKind.COPY, ActionKind.KEEP_FLOAT):
        (name,) = action.sources
        return {name: finite(src[name], name)}
    if kind == ActionKind.INT4_KEEP:
        finite(src[action.sources[1]], action.sources[1])
        return {name: src[name] for name in action.sources}
    if kind == ActionKind.FP8_KEEP:
        w_name, s_name = action.sources
        return {
            weight_name: fp8_finite(src[w_name], w_name),
            f"{m}.weight_scale": finite(src[s_name], s_name).to(torch.float32),
        }
    w = decode()
    if kind in (ActionKind.DEQUANTIZE, ActionKind.INT4_DEQUANT):
        return to_host(**{weight_name: w})
    if kind == ActionKind.FP8_QUANTIZE:
        q, s = timed("quantize", fp8_block.quantize_fp8_block, w, plan.block)
        return to_host(**{weight_name: q, f"{m}.weight_scale": s})
    if kind in (ActionKind.INT4, ActionKind.INT4_REQUANT) and not action.symmetric:
        q, scale, zero = timed("quantize", int4.quantize_int4_asym, w, action.group_size)
        packed, zero = timed("pack", lambda: (int4.pack_int4(q), int4.pack_zero_point(zero)))
        return {
            **to_host(**{f"{m}.weight_packed": packed, f"{m}.weight_scale": scale}),
            f"{m}.weight_shape": torch.tensor(list(w.shape), dtype=torch.int64),
            **to_host(**{f"{m}.weight_zero_point": zero}),
        }
    if kind in (ActionKind.INT4, ActionKind.INT4_REQUANT):
        q, scale = timed("quantize", int4.quantize_int4, w, action.group_size)
        packed = timed("pack", int4.pack_int4, q)
        return {
            **to_host(**{f"{m}.weight_packed": packed, f"{m}.weight_scale": scale}),
            f"{m}.weight_shape": torch.tensor(list(w.shape), dtype=torch.int64),
        }
    raise AssertionError(f"unknown action kind {kind}")


def output_quantization_config(recipe: Recipe, plan: ConversionPlan) -> dict:
    """quantization_config for config.json: compressed-tensors' JSON of the recipe's groups.

    Only groups that quantized something are kept, so the config describes exactly the
    quantized tensors the checkpoint holds; the format is the single one used, or
    ``mixed-precision`` when groups differ. The JSON is formats/quant_config.py's, which
    tests/test_quant_config.py holds equal to compressed-tensors' own dump of the same config
    (importing compressed-tensors would add seconds of transformers imports to every conversion).
    """
    from importlib.metadata import version

    used = plan.weights_by_group
    groups = {name: scheme for name, scheme in recipe.config.config_groups.items() if name in used}
    formats = {scheme.format for scheme in groups.values()}
    fmt = formats.pop() if len(formats) == 1 else ("mixed-precision" if formats else "dense")
    config = recipe.config.model_copy(update={"config_groups": groups, "ignore": list(recipe.config.ignore or []),
                                              "quantization_status": "compressed", "format": fmt})
    return {"version": version("compressed-tensors"), "quant_method": "compressed-tensors",
            **config.model_dump(mode="json")}


def _finish(ckpt: Checkpoint, recipe: Recipe, plan: ConversionPlan, dst: Path, manifest: Manifest) -> None:
    for rel in ckpt.other_files:
        folder = work_folder(dst, Path(rel).parent)  # a link planted at DST/sub would send the copy elsewhere
        copy_file_atomic(ckpt.root / rel, folder / Path(rel).name)
    weight_map = {o.name: s.name for s in plan.shards for o in s.tensors}
    index = {"metadata": {"total_size": plan.output_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    write_bytes_atomic(dst / INDEX_NAME, (json.dumps(index, indent=2) + "\n").encode())
    config = dict(ckpt.config)
    config["quantization_config"] = output_quantization_config(recipe, plan)
    # No sort_keys: config_groups keep the recipe's order, which first-match readers rely on.
    write_bytes_atomic(dst / "config.json", (json.dumps(config, indent=2) + "\n").encode())
    manifest.status = ManifestStatus.COMPLETE
    manifest.save(dst)
