"""One CUDA graph replayed per tensor, instead of its thirty-odd kernels launched one by one.

On a GPU, converting one weight is some thirty small kernel launches. Each is a Python call that gives up the GIL and
takes it back, and each intermediate tensor freed takes it again; with many jobs at once these hand-offs, not the GPU,
the memory or the CPU's arithmetic, set the pace (docs/benchmarks.md: on one H200, 16 workers were no faster than 4,
their compute threads waiting for the GIL). A captured graph replays the same kernels with the same launch parameters,
so the same bits, in one call.

Each slot (one job's stream) keeps a graph per signature: what the computation closes over and its inputs' dtypes and
shapes. Graphs are captured before any job starts, for the signatures many tensors share (a GLM-5 checkpoint's routed
experts have two), because a capture fails when another thread works on the device meanwhile (seen on an H200:
``cudaErrorStreamCaptureInvalidated`` while other jobs ran, in CUDA's thread-local capture mode too); a signature
without a graph runs as launched. A replay's outputs are the graph's own memory, overwritten by the slot's next
replay: the caller copies them out before it asks for another. That strict turn-taking is also why a slot's graphs
may share one memory pool.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any


class GraphCache:
    """One slot's captured graphs, by signature."""

    def __init__(self) -> None:
        self._graphs: dict[Hashable, tuple[tuple, tuple, Any]] = {}
        self._pool: Any = None
        self.replays = 0

    def capture(self, key: Hashable, fn: Callable[..., tuple], inputs: tuple) -> None:
        """Capture ``fn(*inputs)`` (CUDA tensors in and out) on the current stream, after one warm-up run; only while
        no other thread uses the device. ``key`` must determine everything ``fn`` does besides its inputs' values."""
        import torch

        fn(*inputs)  # the warm-up: lazily loaded kernels and workspaces come before the capture, not in it
        static = tuple(x.clone() for x in inputs)  # the graph's own inputs, outside its pool
        torch.cuda.current_stream().synchronize()
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
        try:
            outputs = fn(*static)
        finally:
            graph.capture_end()
        self._pool = graph.pool()
        self._graphs[key] = static, tuple(outputs), graph

    def run(self, key: Hashable, fn: Callable[..., tuple], inputs: tuple) -> tuple:
        """``fn(*inputs)``: replayed from the key's graph, or run as launched where there is none."""
        entry = self._graphs.get(key)
        if entry is None:
            return fn(*inputs)
        static, outputs, graph = entry
        for x, value in zip(static, inputs, strict=True):
            x.copy_(value, non_blocking=True)
        graph.replay()
        self.replays += 1
        return outputs
