"""Runs of a shard's like weights, converted on a GPU as one piece.

Per tensor, a shard job on a GPU made some thirty-five GIL hand-offs across its threads (a read, a buffer for the
digest, a copy in, a graph replay, copies out, a wait, a write, a hash); with 16 jobs at once those hand-offs, not
the hardware, set the pace (docs/benchmarks.md, Throughput II). A run is consecutive weights of one shard that lie
together in one source file and are converted to INT4: it is read with one ``pread``, copied to the device in one
copy, each computation it holds runs once on its weights stacked along the output dimension, the outputs are laid out
on the device as the shard's bytes, copied back in one copy, and written and hashed as one piece.

Stacking changes no bit, because every step of the conversion is row-local: an FP8 scale block spans ``block[0]``
rows of one weight when its rows are a multiple of that, an INT4 group lies within a row, packing joins the columns of
one row, and an asymmetric scheme's zero points join eight rows. Each weight's rows come out as they would alone
(tests/test_convert.py holds it on the CPU, tests/test_gpu.py on CUDA).
"""

from __future__ import annotations

import math
import struct
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from quantkit.checkpoint.reader import DTYPES, PINNED_MAX, Checkpoint
from quantkit.checkpoint.writer import tensor_code
from quantkit.convert.actions import _computation, _on_device, _Step, run_action
from quantkit.convert.cuda_graphs import GraphCache
from quantkit.convert.tensor_plan import Action, ActionKind, ConversionPlan, OutputTensor

RUN_BYTES = 32 << 20  # the source bytes of one run at most: runs in flight per job stay a few pinned blocks
_STACKED_ROWS = 128  # a multiple of the FP8 block's rows and of the eight rows a zero-point word joins


@dataclass
class Run:
    """Consecutive actions of one shard whose sources lie in ``[start, end)`` of one source file."""

    file: str
    start: int
    end: int
    actions: list[Action] = field(default_factory=list)

    @property
    def source_bytes(self) -> int:
        return sum(a.source_bytes for a in self.actions)

    @property
    def outputs(self) -> list[OutputTensor]:
        return [o for a in self.actions for o in a.outputs]


def stackable(action: Action, plan: ConversionPlan, ckpt: Checkpoint) -> bool:
    """Whether ``action`` converts in a run: an INT4 conversion of a float or block-FP8 weight whose rows stack
    without sharing a scale block or a zero-point word with the next weight's, its sources in one file and small
    enough for pinned memory."""
    if action.kind != ActionKind.INT4 or action.encoding not in ("float", "fp8_block"):
        return False
    infos = [ckpt.tensors[name] for name in action.sources]
    rows = infos[0].shape[0] if len(infos[0].shape) == 2 else 0
    return (rows > 0 and rows % math.lcm(_STACKED_ROWS, plan.block[0]) == 0 and len({i.file for i in infos}) == 1
            and action.source_bytes <= PINNED_MAX)


def runs_of(actions: list[Action], plan: ConversionPlan, ckpt: Checkpoint, skip: frozenset[str] | set[str],
            run_bytes: int | None = None) -> list[Action | Run]:
    """``actions`` in order, the stackable ones (not in ``skip``) gathered into runs of up to ``run_bytes`` (by
    default RUN_BYTES) of source whose span in their file holds little else (at most an eighth more than their own
    bytes)."""
    run_bytes = RUN_BYTES if run_bytes is None else run_bytes
    items: list[Action | Run] = []
    run: Run | None = None
    for action in actions:
        if action.module in skip or not stackable(action, plan, ckpt):
            items.append(action)
            run = None
            continue
        infos = [ckpt.tensors[name] for name in action.sources]
        start, end = min(i.start for i in infos), max(i.end for i in infos)
        if run is not None and run.file == infos[0].file:
            lo, hi = min(run.start, start), max(run.end, end)
            total = run.source_bytes + action.source_bytes
            if total <= run_bytes and hi - lo <= total + total // 8 and _aligned([*run.actions, action], lo, ckpt):
                run.start, run.end = lo, hi
                run.actions.append(action)
                continue
        run = Run(infos[0].file, start, end, [action])
        if not _aligned(run.actions, start, ckpt):
            items.append(action)
            run = None
            continue
        items.append(run)
    return items


def _aligned(actions: list[Action], start: int, ckpt: Checkpoint) -> bool:
    """Whether every source of ``actions`` lies at a multiple of its element size from ``start`` (a tensor is a
    view of the run's bytes)."""
    infos = [ckpt.tensors[name] for a in actions for name in a.sources]
    return all((i.start - start) % DTYPES[i.dtype][0] == 0 for i in infos)


def source_view(run: Run, data, ckpt: Checkpoint, name: str):
    """Tensor ``name``'s bytes within the run's ``data`` (its span, as read)."""
    info = ckpt.tensors[name]
    return data[info.start - run.start:info.end - run.start]


def layout(run: Run, plan: ConversionPlan, ckpt: Checkpoint) -> tuple:
    """All that a run's device work depends on besides its bytes: each action's computation, where its sources lie
    in the span and where its outputs go. The key of the run's CUDA graph: a GLM-5 checkpoint's runs have a few."""
    where = _output_offsets(run)
    return (run.end - run.start, tuple(
        (_Step(a, {}, plan, ckpt, "cpu", None).signature(), tuple(ckpt.tensors[n].start - run.start for n in a.sources),
         tuple(where[o.name][0] for o in a.outputs)) for a in run.actions))


def device_work(run: Run, plan: ConversionPlan, ckpt: Checkpoint) -> Callable:
    """The run's device work as a function of its span's bytes on the device: each computation once, on its weights
    stacked along their rows, its outputs laid out as the shard has them (``weight_shape`` left to the host), and
    per computation the count of non-finite decoded values and of zero FP8 scales. Device work only, no wait for the
    device, so that it can be captured in a CUDA graph; any run of the same ``layout`` may replay it."""
    import torch

    groups = list(_by_signature(run, plan, ckpt).values())
    where = _output_offsets(run)
    nbytes = sum(o.nbytes for o in run.outputs)

    def work(source) -> tuple:
        out = torch.empty(nbytes, dtype=torch.uint8, device=source.device)
        checks = []
        for members in groups:
            step = _Step(members[0], {}, plan, ckpt, str(source.device), None)
            parts = tuple(torch.cat([_tensor(run, source, ckpt, a.sources[i]) for a in members])
                          for i in range(len(members[0].sources)))
            compute, suffixes = _computation(members[0])
            *outputs, check = _on_device(step, compute, *parts)
            checks.append(check)
            for suffix, stacked in zip(suffixes, outputs, strict=True):
                for action, piece in zip(members, stacked.chunk(len(members)), strict=True):
                    offset, planned = where[f"{action.module}.{suffix}"]
                    _check_planned(planned, piece)
                    out[offset:offset + planned.nbytes].copy_(piece.reshape(-1).view(torch.uint8))
        return out, torch.stack(checks)

    return work


def convert_run(run: Run, data, plan: ConversionPlan, ckpt: Checkpoint, device: str, stats,
                graphs: GraphCache | None = None):
    """The run's output bytes, laid out as the shard has them, in host memory (pinned for a GPU), from ``data``: its
    span of the source file. On a GPU on the current stream, one graph replay where ``graphs`` has the run's layout,
    with one wait for the device. When a weight decodes to a non-finite value or an FP8 scale is 0, the run is
    converted again one action at a time, which names the tensor."""
    import torch

    t0 = time.perf_counter()
    key = layout(run, plan, ckpt)
    if graphs is not None and key in graphs:
        out, checks = graphs.run(key, device_work(run, plan, ckpt), (data,))  # the copy in is the copy to the GPU
    else:
        out, checks = device_work(run, plan, ckpt)(data.to(device, non_blocking=True))
    on_gpu = out.device.type == "cuda"
    host = torch.empty(out.shape, dtype=torch.uint8, pin_memory=on_gpu)
    host.copy_(out, non_blocking=True)
    found = torch.empty(checks.shape, dtype=checks.dtype, pin_memory=on_gpu)
    found.copy_(checks, non_blocking=True)
    if on_gpu:
        torch.cuda.current_stream(out.device).synchronize()
    if stats is not None:
        stats.add("pack", time.perf_counter() - t0)
    if bool(found.any()):
        return _one_by_one(run, data, plan, ckpt, device, stats)
    raw, where = host.numpy(), _output_offsets(run)
    for action in run.actions:  # weight_shape: [out, in] of the packed weight, the plan's
        rows, words = where[f"{action.module}.weight_packed"][1].shape
        offset, _ = where[f"{action.module}.weight_shape"]
        raw[offset:offset + 16] = memoryview(struct.pack("<qq", rows, words * 8))
    return host


def capture(graphs: GraphCache, runs: list[Run], plan: ConversionPlan, ckpt: Checkpoint, device: str) -> None:
    """A graph of each run's device work, on the current stream, from zeros; only while no other thread uses the
    device (convert/cuda_graphs.py)."""
    import torch

    for run in runs:
        zeros = torch.zeros(run.end - run.start, dtype=torch.uint8, device=device)
        graphs.capture(layout(run, plan, ckpt), device_work(run, plan, ckpt), (zeros,))


RUN_GRAPH_MIN = 4  # a layout this many runs share gets a CUDA graph per slot


def frequent_layouts(runs: list[Run], plan: ConversionPlan, ckpt: Checkpoint) -> list[Run]:
    """One run of each layout at least RUN_GRAPH_MIN of ``runs`` share."""
    counts: Counter = Counter()
    first: dict[tuple, Run] = {}
    for run in runs:
        key = layout(run, plan, ckpt)
        counts[key] += 1
        first.setdefault(key, run)
    return [first[key] for key, n in counts.items() if n >= RUN_GRAPH_MIN]


def _output_offsets(run: Run) -> dict[str, tuple[int, OutputTensor]]:
    where, offset = {}, 0
    for o in run.outputs:
        where[o.name] = (offset, o)
        offset += o.nbytes
    return where


def _by_signature(run: Run, plan: ConversionPlan, ckpt: Checkpoint) -> dict[tuple, list[Action]]:
    groups: dict[tuple, list[Action]] = {}
    for action in run.actions:
        groups.setdefault(_Step(action, {}, plan, ckpt, "cpu", None).signature(), []).append(action)
    return groups


def _tensor(run: Run, data, ckpt: Checkpoint, name: str):
    """Tensor ``name`` as a view of the run's span ``data`` (on the host or the device)."""
    import torch

    info = ckpt.tensors[name]
    return source_view(run, data, ckpt, name).view(getattr(torch, DTYPES[info.dtype][1])).reshape(info.shape)


def _check_planned(planned: OutputTensor, tensor) -> None:
    got = (tensor_code(tensor), tuple(tensor.shape))
    if got != (planned.dtype, planned.shape):
        raise RuntimeError(f"{planned.name}: planned {(planned.dtype, planned.shape)}, produced {got}")


def _one_by_one(run: Run, data, plan: ConversionPlan, ckpt: Checkpoint, device: str, stats):
    """The run converted action by action (the path that names a bad tensor), laid out as ``convert_run`` does."""
    import torch

    chunks: list = []
    for action in run.actions:
        src = {name: _tensor(run, data, ckpt, name) for name in action.sources}
        outputs = run_action(action, src, plan, ckpt, device, stats)
        chunks.extend(t.contiguous().reshape(-1).view(torch.uint8) for t in outputs.values())
    return torch.cat(chunks)
