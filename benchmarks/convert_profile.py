"""Where a conversion's time goes, in one process: its phases, its stages' thread-seconds and the GIL's contention.

Converts a GLM-5-shaped block-FP8 source (convert_speed.py's) ``--reps`` times per worker count in this process, so
that the first run's one-off costs (CUDA context, lazy kernels, graph captures, the pinned-memory pool) show apart
from the steady state. For each run it prints:

- phases, wall seconds: ``setup`` (open, plan, devices), ``capture`` (CUDA graphs, before the jobs), ``run_all``
  (the shard jobs in threads, captures included), ``run_in_processes`` (the same in worker processes), ``finish``
  (index, config);
- ``jobs_thread_s``: the shard jobs' summed seconds, and the stages' own thread-seconds (read, pack, write...);
- a GIL probe: a thread that sleeps 0.5 ms in a loop and measures how late it wakes, that is how long it waits to
  take the GIL back (near 0.05 ms on an idle interpreter).

Then the memory ceiling of convert_speed.py for each worker count. With a tmpfs work folder this is the measure
behind docs/benchmarks.md's "Throughput II":

    python benchmarks/convert_profile.py --workdir /dev/shm/qb --gb 10 --device cuda --workers-list 4,16 --reps 2

For where the threads wait, run ``py-spy record --idle --threads`` (or ``--gil``) of ``quantkit convert`` beside it.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert_speed import build_source, memory_ceiling, output_digest  # noqa: E402


class GilProbe:
    """How late a thread that sleeps 0.5 ms wakes: its wait for the GIL."""

    def __init__(self):
        self.stop, self.late = False, []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stop:
            t0 = time.perf_counter()
            time.sleep(0.0005)
            self.late.append(time.perf_counter() - t0 - 0.0005)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop = True
        self.thread.join()

    def summary(self) -> str:
        late = sorted(self.late) or [0.0]
        return (f"mean {1e3 * sum(late) / len(late):.2f} ms, p50 {1e3 * late[len(late) // 2]:.2f}, "
                f"p90 {1e3 * late[int(0.9 * len(late))]:.2f} ({len(late)} wakes)")


def timed_phases(phases: dict) -> None:
    """Wrap the conversion's phase functions so that each adds its wall seconds to ``phases``."""
    import quantkit.convert as convert_module
    from quantkit.convert import dst, pipeline

    def wrap(module, name, key):
        fn = getattr(module, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                phases[key] = phases.get(key, 0.0) + time.perf_counter() - t0

        setattr(module, name, timed)

    wrap(convert_module, "checked_and_planned", "setup")
    wrap(pipeline.Slot, "capture", "capture")
    wrap(pipeline, "convert_shard", "jobs_thread_s")
    wrap(convert_module, "run_all", "run_all")
    wrap(convert_module, "run_in_processes", "run_in_processes")
    wrap(dst, "finish", "finish")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", type=Path, default=Path("/dev/shm/quantkit-profile"))
    ap.add_argument("--gb", type=float, default=10.0)
    ap.add_argument("--shard-gb", type=float, default=0.5)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--workers-list", default="4,16")
    ap.add_argument("--max-shard-size", default="0.4GB")
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    src = build_source(args.workdir / "src", args.gb, args.shard_gb)
    gb = src["bytes"] / 1e9
    from quantkit.convert import convert

    phases: dict = {}
    timed_phases(phases)
    digests, out_bytes = set(), 0
    workers_list = [int(w) for w in args.workers_list.split(",")]
    for workers in workers_list:
        for rep in range(args.reps):
            shutil.rmtree(args.workdir / "out", ignore_errors=True)
            phases.clear()
            with GilProbe() as probe:
                result = convert(args.workdir / "src", args.workdir / "out", "glm5-int4-experts-g32",
                                 device=args.device, workers=workers, max_shard_size=args.max_shard_size)
            digests.add(output_digest(args.workdir / "out"))
            out_bytes = result.output_bytes
            print(f"x{workers} run {rep + 1}: {result.seconds:.2f} s in convert ({gb / result.seconds:.2f} GB/s of "
                  f"input), {result.shards_total} shards; phases { {k: round(v, 3) for k, v in phases.items()} }; "
                  f"stages { {k: round(v, 2) for k, v in result.stage_seconds.items()} }; GIL probe: "
                  f"{probe.summary()}", flush=True)
    print("outputs identical across runs:", len(digests) == 1)
    for workers in workers_list:
        seconds = memory_ceiling(args.workdir / "src", args.workdir / "probe", out_bytes, workers)
        print(f"memory ceiling x{workers}: {seconds:.2f} s ({gb / seconds:.2f} GB/s of input)", flush=True)


if __name__ == "__main__":
    main()
