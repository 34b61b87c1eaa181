"""Shards converted in worker processes, one GPU slot each: the shard pipeline (convert/pipeline.py) run in processes.

Why processes on a GPU: with threads, 16 workers share one GIL, every call that releases it waits milliseconds to get
it back, and conversion stayed under half the memory ceiling however many workers ran (docs/benchmarks.md,
"Throughput II"). Here each worker process has a GIL of its own; it reads, converts, hashes and writes whole shards and
sends back only each shard's record, its stage times and its progress.

Workers are forked from a forkserver that imported torch once (spawn would import it in every worker) and never touches
CUDA itself; each worker makes its own CUDA context, stream and graphs. A worker watches this process and kills itself
when it ends (the forkserver, its parent, lives as long as any worker does), so none outlives a killed run to write
into DST after its lock is gone.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import select
import signal
import threading
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import forkserver

from quantkit.checkpoint.reader import Checkpoint
from quantkit.convert.pipeline import Job, Progress, ShardWork, Slot, Stats, convert_shard, each_result
from quantkit.convert.tensor_plan import Action, OutputShard

PRELOAD = ["torch", "quantkit.convert.processes"]
# Worker processes cost seconds to start (the forkserver's torch import, a CUDA context and graphs each: 6 s for 4
# and 9 s for 16 on one H100) and then convert twice as fast as threads (12.7 against 6.2 GB/s of input at 16
# workers, docs/benchmarks.md "Throughput III"): they finish first from about 100 GB of work.
PROCESSES_FROM_BYTES = 100 * 10**9


def uses_processes(devices: list[str], workers: int, todo_bytes: int) -> bool:
    """Processes for a large job on GPUs; threads on a CPU, where each tensor's torch work is long and releases the
    GIL and a laptop would pay a torch import per worker process."""
    return (devices[0].startswith("cuda") and workers > 1 and todo_bytes >= PROCESSES_FROM_BYTES
            and hasattr(os, "pidfd_open"))  # Linux 5.3+: how a worker sees the conversion's process end


def start_server() -> None:
    """Start the forkserver now: its torch import then overlaps whatever the conversion does before its shards."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()


@dataclass
class ShardDone:
    """What a worker sends back for one shard."""

    sha256: str
    size: int
    source_digest: str
    seconds: dict[str, float]
    warnings: list[str]


class _Worker:
    """This worker process's slot and the conversion it serves (set once, by ``_start``)."""

    work: ShardWork
    slot: Slot
    progress: Progress


class _SentProgress(Progress):
    """Progress in a worker: each step goes to the parent's bar."""

    def __init__(self, queue):
        super().__init__(0, None)
        self.queue = queue

    def add(self, n: int) -> None:
        self.queue.put(n)


def run_in_processes(job: Job, todo: list[OutputShard], workers: int, devices: list[str]) -> None:
    """Convert ``todo`` in ``workers`` processes, slots spread over ``devices`` in turn; a finished shard goes into
    the manifest at once. The first failure cancels the shards not started and is raised here as the worker raised
    it."""
    if not todo:
        return
    workers = min(workers, len(todo))  # every worker starts at once, with a CUDA context of its own
    start_server()
    context = multiprocessing.get_context("forkserver")
    slots, progress = context.Queue(), context.SimpleQueue()
    for i in range(workers):
        slots.put(devices[i % len(devices)])
    listener = threading.Thread(target=_forward_progress, args=(progress, job.progress), daemon=True)
    listener.start()
    threads = max(1, (os.cpu_count() or 1) // workers)
    frequent = job.work.graphed(todo)
    setup = (os.getpid(), _for_workers(job.work, frequent), frequent, slots, progress, threads)
    try:
        with ProcessPoolExecutor(workers, mp_context=context, initializer=_start, initargs=setup) as pool:
            futures = {pool.submit(_convert, shard, _sources(job.work.ckpt, shard.actions)): shard for shard in todo}
            each_result(futures, lambda shard, done: _recorded(job, shard, done))
    finally:
        progress.put(None)
        listener.join()


def _recorded(job: Job, shard: OutputShard, done: ShardDone) -> None:
    job.record(shard, done.sha256, done.size, done.source_digest)
    for stage, seconds in done.seconds.items():
        job.stats.add(stage, seconds)
    for warning in done.warnings:
        job.stats.warn(warning)


def _forward_progress(queue, progress: Progress) -> None:
    while (n := queue.get()) is not None:
        progress.add(n)


def _for_workers(work: ShardWork, frequent: list[Action]) -> ShardWork:
    """What every worker reads: the work less the plan's shards and less the source's tensors but those its graphs
    are captured from; each job brings its shard and that shard's source tensors. The pool pickles its workers' setup
    once for each worker, in this process, one after another: GLM 5.2's plan and tensor list are 31 MB pickled and
    added 40 s to starting 16 workers on our CPU (docs/benchmarks.md, "Throughput IV")."""
    plan = dataclasses.replace(work.plan, shards=[])
    return dataclasses.replace(work, plan=plan, ckpt=_sources(work.ckpt, frequent))


def _sources(ckpt: Checkpoint, actions: list[Action]) -> Checkpoint:
    """``ckpt`` with only the tensors ``actions`` read."""
    tensors = {name: ckpt.tensors[name] for a in actions for name in a.sources}
    return dataclasses.replace(ckpt, shards=[], tensors=tensors)


def _start(parent: int, work: ShardWork, frequent: list, slots, progress, threads: int) -> None:
    """A worker's setup: die with the conversion's process, take a device slot, capture the slot's CUDA graphs."""
    import torch

    threading.Thread(target=_die_with, args=(os.pidfd_open(parent),), daemon=True).start()
    torch.set_num_threads(threads)
    _Worker.work, _Worker.slot = work, Slot(slots.get())
    _Worker.progress = _SentProgress(progress)
    if _Worker.slot.device.startswith("cuda"):
        torch.cuda.set_device(_Worker.slot.device)
        _Worker.slot.capture(work, frequent)


def _die_with(parent_fd: int) -> None:
    select.select([parent_fd], [], [])  # readable once that process has ended
    os.kill(os.getpid(), signal.SIGKILL)


def _convert(shard: OutputShard, sources: Checkpoint) -> ShardDone:
    """One shard, read through ``sources``: the checkpoint with the shard's source tensors alone."""
    stats = Stats()
    work = dataclasses.replace(_Worker.work, ckpt=sources)
    written, digest = convert_shard(work, shard, _Worker.slot, stats, _Worker.progress)
    return ShardDone(written.sha256, written.size, digest, stats.seconds, stats.warnings)
