"""What starting worker processes costs once the plan is GLM 5.2's size.

Every worker process (convert/processes.py) is handed what converting any shard reads: the plan and the source's
tensor list. A whole GLM 5.2 has about 119,000 source tensors and 180,000 output tensors in 92 shards; the conversions
that measured worker processes so far (10-20 GB) had plans a hundredth of that, so they never saw what a big plan adds
to each worker's start.

This converts a small GLM-5-shaped block-FP8 source (convert_speed.py's) in worker processes on the CPU, once with its
own plan and once with its plan and tensor list grown to GLM 5.2's size (plan_speed.py's config, planned from the
config alone; the added shards are carried, not converted). The difference is what the plan's size costs. Each
revision (this tree, and ``--baseline DIR``: a checkout's folder) runs in processes of its own, alternating, ``--reps``
times; outputs must be byte-identical.

    python benchmarks/process_startup.py --work /tmp/qps --workers-list 4,16 --baseline DIR --reps 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))


def child(src: Path, dst: Path, workers: int, big: bool) -> dict:
    """One conversion of ``src`` in worker processes, timed from the pool's start to its last shard."""
    from plan_speed import GLM5

    from quantkit.checkpoint.manifest import Manifest
    from quantkit.checkpoint.reader import open_checkpoint
    from quantkit.convert.pipeline import Job, Progress, ShardWork, Stats
    from quantkit.convert.processes import run_in_processes
    from quantkit.convert.tensor_plan import plan_conversion
    from quantkit.formats.recipe import load_recipe
    from quantkit.plan import virtual_checkpoint

    recipe = load_recipe("glm5-int4-experts-g32")
    ckpt = open_checkpoint(src)
    plan = plan_conversion(ckpt, recipe, 8 * 10**6)  # a shard or more for each of 16 workers
    todo = list(plan.shards)
    if big:  # GLM 5.2's tensors and shards beside the real ones, under other names
        config = dst.parent / "glm5-config"
        config.mkdir(parents=True, exist_ok=True)
        (config / "config.json").write_text(json.dumps(GLM5))
        glm5 = virtual_checkpoint(config)
        ckpt.tensors.update({f"glm5/{name}": info for name, info in glm5.tensors.items()})
        plan.shards.extend(plan_conversion(glm5, recipe, 5 * 10**9).shards)
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    manifest = Manifest(quantkit_version="bench", source_path=str(src), source_fingerprint="", recipe_name="",
                        recipe_sha256="", plan_sha256="", max_shard_size=0)
    job = Job(ShardWork(plan, ckpt, dst), manifest, Stats(), Progress(0, None))
    t0 = time.perf_counter()
    run_in_processes(job, todo, workers, ["cpu"])
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tensors": len(ckpt.tensors), "shards": len(plan.shards),
            "records": {name: record.sha256 for name, record in sorted(manifest.shards.items())}}


def run(tree: Path, src: Path, dst: Path, workers: int, big: bool) -> dict:
    """One child process on ``tree``'s code (run from its folder: the forkserver's imports come from there too)."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, str(HERE / "process_startup.py"), "--child", "--src", str(src.resolve()), "--dst",
           str(dst.resolve()), "--workers", str(workers)]
    out = subprocess.run(cmd + (["--big"] if big else []), env=env, cwd=tree, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"{tree}: {out.stderr.strip().splitlines()[-1]}")
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=Path("/tmp/quantkit-process-startup"))
    ap.add_argument("--gb", type=float, default=0.25, help="the small source's size")
    ap.add_argument("--workers-list", default="4,16")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--baseline", type=Path, default=None, help="a checkout of the code to compare with")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--src", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--dst", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--workers", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--big", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.src, args.dst, args.workers, args.big)))
        return
    from convert_speed import build_source

    src = args.work / "src"
    build_source(src, args.gb, args.gb / 4)
    trees = {"quantkit": REPO, **({"before": args.baseline.resolve()} if args.baseline else {})}
    best: dict = {}
    records = set()
    for workers in (int(w) for w in args.workers_list.split(",")):
        for _ in range(args.reps):
            for name, tree in trees.items():
                for big in (False, True):
                    got = run(tree, src, args.work / "dst", workers, big)
                    records.add(json.dumps(got["records"]))
                    key = (workers, name, big)
                    best[key] = min(best.get(key, float("inf")), got["seconds"])
                    print(f"{name} x{workers}, {got['tensors']} source tensors, {got['shards']} shards planned: "
                          f"{got['seconds']:.2f} s", flush=True)
    print("\n| workers | code | small plan, s | GLM 5.2's plan, s | what the plan's size adds, s |")
    print("|---|---|---|---|---|")
    for (workers, name, big), seconds in best.items():
        if big:
            small = best[workers, name, False]
            print(f"| {workers} | {name} | {small:.2f} | {seconds:.2f} | {seconds - small:.2f} |")
    print("outputs identical across every run:", len(records) == 1)


if __name__ == "__main__":
    main()
