"""quantkit's share of the unavoidable on a disk, cold cache, beside another checkout's code: the short form of
convert_speed.py's disk runs (no peer, no warm cache, no per-tensor overhead).

Per repetition and code: the page cache dropped, the ceiling probe (the source read in parallel while as many bytes
as the output are written with writeback and fsynced), the cache dropped again, then ``quantkit convert`` end to end.
The unavoidable is the probe plus a bare ``import torch``; the share is that over quantkit's seconds.

    python benchmarks/disk_share.py --workdir /root/qb --gb 3 --device cuda --baseline DIR --reps 2
"""

import argparse
from pathlib import Path

from convert_speed import bare_torch_import, build_source, ceiling_probe, drop_caches, run_quantkit


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", type=Path, required=True, help="on the disk to measure")
    ap.add_argument("--gb", type=float, default=3.0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--baseline", type=Path, default=None, help="a checkout of the code to compare with")
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    src = build_source(args.workdir / "src", args.gb, 1.0)
    print("source", src, flush=True)
    torch_import = bare_torch_import()
    out = run_quantkit(args.workdir / "src", args.workdir / "out", args.device, None)["output_bytes"]
    codes = {"now": None, **({"before": args.baseline.resolve()} if args.baseline else {})}
    for rep in range(args.reps):
        for label, code in codes.items():
            drop_caches([args.workdir / "src"])
            ceiling = ceiling_probe(args.workdir / "src", args.workdir / "probe", out)
            drop_caches([args.workdir / "src"])
            r = run_quantkit(args.workdir / "src", args.workdir / "out", args.device, None, code=code)
            print(f"{rep} {label}: ceiling {ceiling:.2f}s + import {torch_import:.2f}s; quantkit {r['seconds']:.2f}s "
                  f"end to end ({r['in_process_seconds']:.2f}s in process); share "
                  f"{(ceiling + torch_import) / r['seconds']:.0%}", flush=True)


if __name__ == "__main__":
    main()
