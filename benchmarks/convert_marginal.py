"""A conversion's fixed cost and its marginal rate, with worker threads and with worker processes.

A whole GLM 5.2 is 705 GB: what decides its conversion time is the rate once the workers run, not their start-up. On
a tmpfs work folder this converts a GLM-5-shaped block-FP8 source (convert_speed.py's) of ``--gb`` and of twice that,
with each worker count and each kind of worker, and splits the in-process seconds into

- the marginal rate: the extra bytes over the extra seconds, T(2 x GB) - T(GB);
- the fixed cost: T(GB) less what the marginal rate takes for GB.

Worker processes are what quantkit uses on GPUs from convert/processes.py's PROCESSES_FROM_BYTES of work; here that
threshold is set to 0 (processes) or out of reach (threads) in the converting process. The memory ceiling is measured
both ways too: N reader and N writer/hasher threads in one process (convert_speed.py's), and N processes that each
read their share and write and hash theirs. Outputs must be byte-identical across every run of one size.

    python benchmarks/convert_marginal.py --workdir /dev/shm/qm --gb 10 --device cuda --workers-list 4,16
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert_speed import build_source, memory_ceiling, output_digest, read_files, timed_run, write_hashed  # noqa: E402,E501

KINDS = {"threads": 10**18, "processes": 0}  # PROCESSES_FROM_BYTES for each kind of worker
RUN = ("import sys; from quantkit.convert import processes; processes.PROCESSES_FROM_BYTES = int(sys.argv.pop(1)); "
       "from quantkit.cli import app; sys.argv[0] = 'quantkit'; app()")


def convert(src: Path, dst: Path, device: str, workers: int, kind: str) -> dict:
    shutil.rmtree(dst, ignore_errors=True)
    cmd = [sys.executable, "-c", RUN, str(KINDS[kind]), "convert", str(src), str(dst), "--recipe",
           "glm5-int4-experts-g32", "--device", device, "--json", "--workers", str(workers), "--max-shard-size",
           "0.4GB"]
    r = timed_run(cmd, cwd=Path(__file__).resolve().parent.parent)
    result = json.loads(r.pop("stdout"))
    return {"seconds": result["seconds"], "peak_tree_pss_GiB": r["peak_tree_pss_GiB"], "digest": output_digest(dst)}


def process_ceiling(src: Path, out_dir: Path, out_bytes: int, processes: int) -> float:
    """Seconds for ``processes`` processes, started before the clock, to read their share of the source and write
    and sha256-hash their share of ``out_bytes``."""
    files = sorted(str(p) for p in src.glob("*.safetensors"))
    out_dir.mkdir(parents=True, exist_ok=True)
    share = -(-out_bytes // processes)
    context = multiprocessing.get_context("forkserver")
    start, procs = context.Event(), []
    for i in range(processes):
        procs.append(context.Process(target=_after, args=(start, files[i::processes], str(out_dir / f"p{i}"), share)))
        procs[-1].start()
    time.sleep(1.0)  # every process waiting on the event
    t0 = time.perf_counter()
    start.set()
    for p in procs:
        p.join()
    seconds = time.perf_counter() - t0
    shutil.rmtree(out_dir)
    return seconds


def _after(start, files, out, nbytes) -> None:
    import os

    start.wait()
    read_files(files)
    write_hashed(out, nbytes, os.urandom(16 << 20))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--gb", type=float, default=10)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--workers-list", default="4,16")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    workers_list = [int(w) for w in args.workers_list.split(",")]
    shutil.rmtree(args.workdir, ignore_errors=True)
    runs, sizes, digests = {}, {}, {}
    for scale in (1, 2):
        src = build_source(args.workdir / "src", args.gb * scale, 0.5)
        sizes[scale] = src["bytes"] / 1e9
        for workers in workers_list:
            for kind in KINDS:
                r = convert(args.workdir / "src", args.workdir / "out", args.device, workers, kind)
                runs[(scale, workers, kind)] = r
                digests.setdefault(scale, set()).add(r["digest"])
                print(f"{sizes[scale]:.1f} GB, x{workers} {kind}: {r['seconds']:.2f}s in process, peak memory "
                      f"(whole tree, PSS) {r['peak_tree_pss_GiB']:.2f} GiB", flush=True)
        if scale == 2:
            out_bytes = json.loads((args.workdir / "out" / "quantkit-manifest.json").read_text())
            out_bytes = sum(s["size"] for s in out_bytes["shards"].values())
            ceilings = {w: (memory_ceiling(args.workdir / "src", args.workdir / "probe", out_bytes, w),
                            process_ceiling(args.workdir / "src", args.workdir / "probe", out_bytes, w))
                        for w in workers_list}
        shutil.rmtree(args.workdir / "src")
    extra = sizes[2] - sizes[1]
    if extra <= 0:
        raise SystemExit(f"--gb {args.gb}: the source is one layer at either size; take 2 or more GB")
    print("\n| workers | kind | fixed s | marginal GB/s | share of the process ceiling | peak memory GiB |\n"
          "|---|---|---|---|---|---|")
    rows = {}
    for workers in workers_list:
        for kind in KINDS:
            marginal = runs[(2, workers, kind)]["seconds"] - runs[(1, workers, kind)]["seconds"]
            rate = extra / marginal
            fixed = runs[(1, workers, kind)]["seconds"] - sizes[1] / rate
            ceiling = sizes[2] / ceilings[workers][1]
            rows[f"x{workers} {kind}"] = {"fixed_s": fixed, "marginal_GBps": rate, "ceiling_share": rate / ceiling}
            print(f"| {workers} | {kind} | {fixed:.2f} | {rate:.2f} | {100 * rate / ceiling:.0f} % | "
                  f"{max(runs[(s, workers, kind)]['peak_tree_pss_GiB'] for s in (1, 2)):.2f} |")
    for workers, (threads_s, processes_s) in ceilings.items():
        print(f"memory ceiling x{workers}, {sizes[2]:.1f} GB: threads {threads_s:.2f}s ({sizes[2] / threads_s:.2f} "
              f"GB/s), processes {processes_s:.2f}s ({sizes[2] / processes_s:.2f} GB/s)")
    print("outputs identical at each size:", all(len(d) == 1 for d in digests.values()), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"sizes_GB": sizes, "rows": rows, "ceilings": ceilings,
                                         "runs": {" ".join(map(str, k)): v for k, v in runs.items()}}, indent=2))


if __name__ == "__main__":
    main()
