"""The shard pipeline: shards converted ``workers`` at a time, each by three threads (read ahead -> compute -> write
and hash) joined by bounded queues that never block for ever; a finished shard goes into the manifest at once.

A failing job cancels the rest: the first error propagates, queued shards are cancelled and the prefetch thread of a
failed shard is told to stop (it must never block on a queue nobody drains).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from quantkit.checkpoint.manifest import Manifest, ShardRecord
from quantkit.checkpoint.reader import Checkpoint, TensorReader
from quantkit.checkpoint.source_digest import SourceDigest
from quantkit.checkpoint.writer import ShardWriter
from quantkit.convert.actions import calibrated_outputs, capture_graphs, frequent_computations, run_action
from quantkit.convert.cuda_graphs import GraphCache
from quantkit.convert.tensor_plan import SHARD_METADATA, ConversionPlan, OutputShard

if TYPE_CHECKING:
    from quantkit.convert.calibrated.walk import CalibratedResult

STAGES = ("read", "decode", "quantize", "pack", "write")
PREFETCH = 4  # source tensors read ahead per worker: overlaps IO with compute, bounds memory


class Stats:
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


class Progress:
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


@dataclass
class ShardWork:
    """What converting any shard of one conversion reads: a worker process gets it once (it pickles)."""

    plan: ConversionPlan
    ckpt: Checkpoint
    dst: Path
    quantized: CalibratedResult | None = None  # the calibrated walk's layer files, read instead of computed
    calibrated: frozenset[str] = frozenset()  # modules the calibrated walk makes (their source bytes: its digest)

    def graphed(self, todo: list[OutputShard]) -> list:
        """The computations enough of ``todo``'s tensors share to be worth a CUDA graph per slot."""
        done = self.quantized.files if self.quantized is not None else {}
        computed = [a for s in todo for a in s.actions if a.module not in done]
        return frequent_computations(computed, self.plan, self.ckpt)


@dataclass
class Job:
    """One conversion: what its shards read, and where their records, timings and progress go."""

    work: ShardWork
    manifest: Manifest
    stats: Stats
    progress: Progress

    def record(self, shard: OutputShard, sha256: str, size: int, digest: str) -> None:
        """A finished shard into the manifest, saved at once (a resumed run keeps it)."""
        self.manifest.shards[shard.name] = ShardRecord(sha256=sha256, size=size, source_digest=digest)
        self.manifest.save(self.work.dst)


def run_all(job: Job, todo: list[OutputShard], workers: int, devices: list[str]) -> None:
    """Convert the shards still to do, ``workers`` threads at a time; each finished shard goes into the manifest."""
    import torch

    threads = torch.get_num_threads()
    if devices[0] == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    try:
        _run_jobs(job, todo, workers, devices)
    finally:
        torch.set_num_threads(threads)  # the worker split is convert's own: later work in this process gets all cores


def _run_jobs(job: Job, todo: list[OutputShard], workers: int, devices: list[str]) -> None:
    """A pool of ``workers`` threads, each job holding one device slot while it runs. On a GPU each slot has a CUDA
    stream of its own (on the one default stream every job's waits, for its outputs, would wait for every other job's
    kernels too) and CUDA graphs of its own, captured here before any job starts."""
    lock = threading.Lock()
    slots: queue.Queue[Slot] = queue.Queue()
    frequent = None
    for i in range(workers):
        slot = Slot(devices[i % len(devices)])
        if slot.device.startswith("cuda"):  # every slot's graphs before any job runs (convert/cuda_graphs.py)
            frequent = job.work.graphed(todo) if frequent is None else frequent
            slot.capture(job.work, frequent)
        slots.put(slot)

    def one(shard: OutputShard) -> None:
        slot = slots.get()
        try:
            written, digest = convert_shard(job.work, shard, slot, job.stats, job.progress)
        finally:
            slots.put(slot)
        with lock:
            job.record(shard, written.sha256, written.size, digest)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        each_result({pool.submit(one, s): s for s in todo}, lambda shard, result: None)


def each_result(futures: dict, on_result: Callable) -> None:
    """``on_result(key, result)`` for each future in the order submitted. The first failure stops the run: the
    futures not started are cancelled (running jobs end on their own) and it is raised as the job raised it."""
    try:
        for future, key in futures.items():
            on_result(key, future.result())
    except BaseException:
        for future in futures:
            future.cancel()
        raise


@dataclass
class Slot:
    """A place a job runs: a device, and on a GPU the slot's own stream and CUDA graphs (made when the pool is set up;
    one job at a time uses them)."""

    device: str
    stream: Any = None
    graphs: GraphCache | None = None

    def on_stream(self):
        if not self.device.startswith("cuda"):
            return contextlib.nullcontext()
        import torch

        if self.stream is None:
            self.stream, self.graphs = torch.cuda.Stream(device=self.device), GraphCache()
        return torch.cuda.stream(self.stream)

    def capture(self, work: ShardWork, frequent: list) -> None:
        """This slot's CUDA graphs of ``frequent`` computations, on its own stream."""
        with self.on_stream():
            assert self.graphs is not None
            capture_graphs(self.graphs, frequent, work.plan, work.ckpt, self.device)


def convert_shard(work: ShardWork, shard: OutputShard, slot: Slot, stats: Stats, progress: Progress):
    """Three threads per shard: read ahead -> compute (this thread) -> write and hash. For a GPU the source tensors
    are read into pinned memory, so that their copies to the device run on the slot's stream without a staging
    copy."""
    quantized, device = work.quantized, slot.device
    pinned = device.startswith("cuda")
    entries = [(o.name, o.dtype, o.shape) for o in shard.tensors]
    stop = threading.Event()
    loaded, computed = _Pipe(PREFETCH, stop), _Pipe(PREFETCH, stop)
    failures: list[BaseException] = []
    written: list = []
    digest = SourceDigest()  # the source bytes this shard is made of, as they are read

    def read_ahead():
        try:
            layer_files: dict = {}
            with TensorReader(work.ckpt) as reader:
                for action in shard.actions:
                    t0 = time.perf_counter()
                    done = quantized is not None and action.module in quantized.files
                    if done:  # the calibrated walk's packed tensors, not the source's
                        tensors = quantized.read(action.module, layer_files)
                    else:
                        tensors = {name: reader.read(name, pinned=pinned) for name in action.sources}
                    if action.module not in work.calibrated:
                        for name in action.sources:
                            digest.add(name, tensors[name])
                    stats.add("read", time.perf_counter() - t0)
                    if not loaded.put((action, tensors, done)):
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

    with ShardWriter(work.dst / shard.name, entries, SHARD_METADATA) as writer:
        threads = [threading.Thread(target=read_ahead, daemon=True),
                   threading.Thread(target=write_behind, args=(writer,), daemon=True)]
        for t in threads:
            t.start()
        try:
            with slot.on_stream():
                while (item := loaded.get()) is not _DONE:
                    action, tensors, done = item
                    outputs = calibrated_outputs(action, tensors) if done else run_action(
                        action, tensors, work.plan, work.ckpt, device, stats, slot.graphs)
                    if not computed.put((action, outputs)):
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
        return written[0], digest.hexdigest()
