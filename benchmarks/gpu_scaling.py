"""Do GPUs add up? One GPU against two on the same machine, warm page cache, output on tmpfs.

With the source in the page cache and the output in memory (/dev/shm), the disk is out of the way
and what is left is quantkit's own work per tensor: the host's reading, copying, hashing and
writing, and the GPUs' decoding and quantizing. Each configuration runs twice; the faster run
counts, and every run's shard hashes must equal the first's (same bits whatever the devices).

    python benchmarks/gpu_scaling.py --source /tmp/bench/src --gb 6 --out /dev/shm/scaling

The source is benchmarks/convert_speed.py's (GLM-5 routed-expert shapes, block-FP8), built there
when missing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path


def warm(folder: Path) -> None:
    for p in sorted(folder.glob("*.safetensors")):
        with open(p, "rb") as f:
            while f.read(64 << 20):
                pass


def run(src: Path, dst: Path, device: str, workers: int) -> tuple[float, dict, dict]:
    shutil.rmtree(dst, ignore_errors=True)
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "quantkit", "convert", str(src), str(dst), "--recipe",
                           "glm5-int4-experts-g32", "--device", device, "--workers", str(workers), "--json"],
                          capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode:
        raise SystemExit(done.stderr[-2000:])
    result = json.loads(done.stdout)
    manifest = json.loads((dst / "quantkit-manifest.json").read_text())
    hashes = {name: record["sha256"] for name, record in manifest["shards"].items()}
    return seconds, result, hashes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", type=Path, required=True)
    ap.add_argument("--gb", type=float, default=6.0, help="source size, when it has to be built")
    ap.add_argument("--shard-gb", type=float, default=2.0)
    ap.add_argument("--out", type=Path, default=Path("/dev/shm/quantkit-scaling"))
    ap.add_argument("--workers", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    import torch
    from convert_speed import build_source

    gpus = torch.cuda.device_count()
    assert gpus >= 2, "needs two GPUs"
    print("source:", build_source(args.source, args.gb, args.shard_gb), flush=True)
    warm(args.source)
    reference = None
    figures = {}
    for workers in args.workers:
        for device in ("cuda:0", "cuda:0,cuda:1"):
            best = None
            for _ in range(2):
                seconds, result, hashes = run(args.source, args.out, device, workers)
                reference = reference or hashes
                assert hashes == reference, f"{device} with {workers} workers wrote other bytes"
                if best is None or seconds < best[0]:
                    best = (seconds, result)
            seconds, result = best
            figures[f"{device} x{workers}"] = {"seconds": seconds, "in_process_seconds": result["seconds"],
                                                "stage_seconds": result["stage_seconds"]}
            print(device, workers, f"{seconds:.1f}s end to end, {result['seconds']:.1f}s converting",
                  {k: round(v, 1) for k, v in result["stage_seconds"].items()}, flush=True)
        one, two = figures[f"cuda:0 x{workers}"], figures[f"cuda:0,cuda:1 x{workers}"]
        figures[f"speedup x{workers}"] = one["in_process_seconds"] / two["in_process_seconds"]
        print(f"two GPUs / one, {workers} workers: {figures[f'speedup x{workers}']:.2f}x (converting)", flush=True)
    shutil.rmtree(args.out, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
