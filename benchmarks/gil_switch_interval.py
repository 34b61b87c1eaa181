"""Does a shorter GIL switch interval help the thread pipeline? A conversion's threads wait for the GIL after each call
that lets it go (docs/benchmarks.md, "Throughput II"); Python makes a waiting thread wait up to the switch interval
(``sys.setswitchinterval``, 5 ms by default) before it asks the holder to let go. This converts convert_speed.py's
``--tmpfs`` source again and again in one process (the steady state: no CUDA context, graph capture or first pinned
allocations inside the figures), each worker count with each interval in turn, ``--reps`` rounds; outputs must be
byte-identical. Then the memory ceiling at 16 threads each way, twice.

    python benchmarks/gil_switch_interval.py --workdir /dev/shm/qa --gb 10 --device cuda --workers-list 4,16 \\
        --intervals 0.005,0.0005,0.0001 --reps 3
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    import convert_speed as cs

    from quantkit.convert import convert

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, required=True, help="a tmpfs folder, e.g. /dev/shm/qa")
    ap.add_argument("--gb", type=float, default=10)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--workers-list", default="4,16")
    ap.add_argument("--intervals", default="0.005,0.0005,0.0001")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    src = cs.build_source(args.workdir / "src", args.gb, 0.5)
    out = args.workdir / "out"
    default, digests = sys.getswitchinterval(), set()
    seconds: dict[tuple[int, float], list[float]] = {}
    for rep in range(args.reps):
        for workers in [int(w) for w in args.workers_list.split(",")]:
            for interval in [float(x) for x in args.intervals.split(",")]:
                sys.setswitchinterval(interval)
                shutil.rmtree(out, ignore_errors=True)
                try:
                    r = convert(args.workdir / "src", out, "glm5-int4-experts-g32", device=args.device,
                                workers=workers, max_shard_size="0.4GB")
                finally:
                    sys.setswitchinterval(default)
                digests.add(cs.output_digest(out))
                seconds.setdefault((workers, interval), []).append(r.seconds)
                print(f"round {rep + 1}, {workers} workers, interval {interval * 1e3:g} ms: {r.seconds:.2f} s",
                      flush=True)
    out_bytes = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    ceilings = [cs.memory_ceiling(args.workdir / "src", args.workdir / "probe", out_bytes, 16) for _ in range(2)]
    print(f"\nsource {src['bytes'] / 1e9:.2f} GB; outputs identical: {len(digests) == 1}; memory ceiling at 16 "
          f"threads each way: {', '.join(f'{c:.2f}' for c in ceilings)} s\n")
    print("| workers | switch interval, ms | s, each round |\n|---|---|---|")
    for (workers, interval), runs in seconds.items():
        print(f"| {workers} | {interval * 1e3:g} | {' / '.join(f'{s:.2f}' for s in runs)} |")


if __name__ == "__main__":
    main()
