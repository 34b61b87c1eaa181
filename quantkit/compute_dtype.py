"""The dtype a forward pass computes in, from what the user typed: ``auto``, ``bf16``, ``fp16`` or ``fp32``.

The weights stay what the checkpoint holds; a BF16 weight widened to FP32 is the same number, so only the arithmetic
changes. ``auto`` is the model's own dtype on a GPU (what the serving engines compute in), and on a CPU whichever of
the model's dtype and FP32 a short matmul probe runs faster: a CPU without native BF16 ran torch's BF16 matmul at
11 GFLOPS against 139 for FP32 (2 cores, AVX2; benchmarks/demo_time.py prints both), another ran BF16 faster, and
CPU flags do not tell what torch's kernels make of them.
"""

from __future__ import annotations

import functools
import time

import torch

from quantkit.errors import QuantkitError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SPELLINGS = "auto, " + ", ".join(DTYPES)


def check_dtype(spec: str) -> None:
    if spec != "auto" and spec not in DTYPES:
        raise QuantkitError(f"unknown compute dtype {spec!r} ({SPELLINGS})")


def compute_dtype(spec: str, device: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype ``spec`` names for a model stored in ``model_dtype`` running on ``device``."""
    check_dtype(spec)
    if spec != "auto":
        return DTYPES[spec]
    if device.startswith("cuda") or model_dtype == torch.float32:
        return model_dtype
    return faster_on_cpu(model_dtype)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``bfloat16``: how run.json and the KV record write it."""
    return str(dtype).removeprefix("torch.")


@functools.cache
def faster_on_cpu(dtype: torch.dtype) -> torch.dtype:
    """``dtype`` or FP32, whichever runs a decoder-sized linear layer faster on this CPU. The two are timed in turns,
    best of five each, so that another process busy on the same cores slows both alike (tests run beside servers)."""
    best = {dtype: float("inf"), torch.float32: float("inf")}
    for _ in range(5):
        for d in best:
            best[d] = min(best[d], _linear_seconds(d))
    return min(best, key=best.__getitem__)


def _linear_seconds(dtype: torch.dtype) -> float:
    # 67 MFLOP: 6 ms at the 11 GFLOPS of BF16 without native support, half a millisecond in FP32
    x = torch.randn(128, 512).to(dtype)
    w = torch.randn(512, 512).to(dtype)
    torch.nn.functional.linear(x, w)  # first call: kernel selection and allocation
    started = time.perf_counter()
    torch.nn.functional.linear(x, w)
    return time.perf_counter() - started
