"""Conversion speed: quantkit vs llm-compressor's model_free_ptq vs the disk's own limit, one run.

Builds a block-FP8 checkpoint with GLM-5's real routed-expert shapes (gate/up 2048x6144,
down 6144x2048, 128x128 FP8 blocks), measures the disk (sequential write with fdatasync, then
a cold-cache sequential read), then converts it with both tools to the same layout (experts INT4
symmetric group 32, everything else BF16), with a cold page cache and with a warm one. Also
measures per-tensor overhead on a checkpoint of thousands of tiny tensors, and peak RSS.

Before each quantkit run, in the same cache state, a ceiling probe moves the same bytes with no
conversion at all: parallel reader threads read every source shard while a writer writes as many
bytes as quantkit's output, with the same chunked writeback and a final fsync. The unavoidable
time is that ceiling plus a bare ``python -c "import torch"``; quantkit's share of it
(unavoidable / quantkit's end-to-end) is what its own start-up and stalls cost.

    python benchmarks/convert_speed.py --workdir /tmp/bench --gb 3 --device cpu
    python benchmarks/convert_speed.py --workdir /tmp/bench --gb 12 --device cuda

With the disk taken away (``--tmpfs``: WORKDIR on a tmpfs such as /dev/shm, source and outputs in memory), the
ceiling is the CPU's: N threads reading the source by offset while N threads write and sha256-hash the output's
bytes, as a conversion must; quantkit (in-process seconds, each worker count) and model_free_ptq are timed beside it,
and every quantkit output is checked byte-identical to the first:

    python benchmarks/convert_speed.py --tmpfs --workdir /dev/shm/bench --gb 8 --device cuda --workers-list 4,8,16

There each output shard size of ``--shard-sizes`` is run (a real GLM 5.2 has some 80 output shards of 5 GB, far more
than workers; a few GB of source at 5 GB per shard has two, one job each), and ``--baseline DIR`` runs the code of
another checkout (``git worktree add DIR REV``) beside each run, alternating, so that the two share the machine's
state.

Prints a Markdown table and writes the figures as JSON (--json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

HIDDEN, MOE_INTER = 6144, 2048
EXPERTS_RE = r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"


def drop_caches(paths: list[Path]) -> str:
    """Cold cache: drop the page cache (root), else advise the kernel to forget these files."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        for root in paths:
            for p in root.rglob("*") if root.is_dir() else [root]:
                if p.is_file():
                    fd = os.open(p, os.O_RDONLY)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    os.close(fd)
        return "fadvise"


def warm(path: Path) -> None:
    for p in sorted(path.glob("*.safetensors")):
        with open(p, "rb") as f:
            while f.read(64 << 20):
                pass


def build_source(folder: Path, gb: float, shard_gb: float, tiny: bool = False, tiny_layers: int = 40) -> dict:
    """Routed experts only (what dominates a real checkpoint), plus a router and norms per layer."""
    import torch

    from quantkit.checkpoint.writer import write_safetensors

    if folder.is_dir() and (folder / "config.json").is_file():
        return json.loads((folder / "bench.json").read_text())
    folder.mkdir(parents=True, exist_ok=True)
    hidden, inter = (256, 128) if tiny else (HIDDEN, MOE_INTER)
    per_expert = 3 * hidden * inter
    experts_per_layer = 32
    # tiny: 40 layers of 32 experts = 3,840 small tensors, where per-tensor overhead dominates
    layers = tiny_layers if tiny else max(1, round(gb * 1e9 / (per_expert * experts_per_layer)))
    gen = torch.Generator().manual_seed(0)

    def fp8(out, inn):
        u = torch.randint(0, 256, (out, inn), dtype=torch.uint8, generator=gen)
        u[(u & 0x7F) == 0x7F] ^= 1  # no NaN codes
        scale = torch.rand((out + 127) // 128, (inn + 127) // 128, generator=gen) * 1e-4 + 1e-5
        return u.view(torch.float8_e4m3fn), scale

    shard, size, n_shard, weight_map, total, count = {}, 0, 0, {}, 0, 0

    def flush():
        nonlocal shard, size, n_shard
        if shard:
            n_shard += 1
            name = f"model-{n_shard:05d}.safetensors"
            write_safetensors(folder / name, shard)
            weight_map.update({k: name for k in shard})
            shard, size = {}, 0

    for layer in range(layers):
        p = f"model.layers.{layer}."
        shard[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        shard[p + "mlp.gate.weight"] = (torch.randn(experts_per_layer, hidden, generator=gen) * 0.02).bfloat16()
        for e in range(experts_per_layer):
            for proj, (o, i) in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter))):
                w, s = fp8(o, i)
                shard[f"{p}mlp.experts.{e}.{proj}.weight"] = w
                shard[f"{p}mlp.experts.{e}.{proj}.weight_scale_inv"] = s
                size += w.numel() + s.numel() * 4
                count += 1
            if size >= shard_gb * 1e9:
                flush()
    flush()
    total = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    config = {
        "model_type": "glm_moe_dsa", "architectures": ["GlmMoeDsaForCausalLM"], "hidden_size": hidden,
        "moe_intermediate_size": inter, "num_hidden_layers": layers, "n_routed_experts": experts_per_layer,
        "dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                "activation_scheme": "dynamic"},
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    # the rename below turns the shard names into the hub's -of- form the index expects
    names = sorted(folder.glob("model-*.safetensors"))
    renames = {p.name: f"model-{i + 1:05d}-of-{len(names):05d}.safetensors" for i, p in enumerate(names)}
    for old, new in renames.items():
        (folder / old).rename(folder / new)
    index = {"metadata": {"total_size": total}, "weight_map": {k: renames[v] for k, v in weight_map.items()}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    info = {"bytes": total, "expert_tensors": count, "shards": len(names),
            "largest_shard": max(p.stat().st_size for p in folder.glob("*.safetensors"))}
    (folder / "bench.json").write_text(json.dumps(info))
    return info


def disk_limit(workdir: Path, nbytes: int) -> dict:
    """Sequential write with fdatasync, then sequential read with a cold cache, in GB/s."""
    path = workdir / "disk-probe.bin"
    block = os.urandom(64 << 20)
    n = max(1, nbytes // len(block))
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(n):
            f.write(block)
        f.flush()
        os.fdatasync(f.fileno())
    write = n * len(block) / (time.perf_counter() - t0) / 1e9
    cache = drop_caches([path])
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(64 << 20):
            pass
    read = n * len(block) / (time.perf_counter() - t0) / 1e9
    path.unlink()
    return {"read_GBps": read, "write_GBps": write, "probe_bytes": n * len(block), "cold_cache_by": cache}


def read_files(files) -> None:
    """pread each file whole into one reused 16 MiB buffer: the reading a conversion cannot skip."""
    buf = bytearray(16 << 20)
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            offset = 0
            while n := os.preadv(fd, [buf], offset):
                offset += n
        finally:
            os.close(fd)


def write_hashed(path, nbytes: int, block: bytes) -> None:
    """Write ``nbytes`` of ``block`` repeated to ``path`` and sha256 them as written: the writing and hashing a
    conversion cannot skip."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "wb") as f:
        done = 0
        while done < nbytes:
            chunk = memoryview(block)[:min(len(block), nbytes - done)]
            f.write(chunk)
            digest.update(chunk)
            done += len(chunk)


def ceiling_probe(src: Path, out_dir: Path, out_bytes: int, readers: int = 4) -> float:
    """Seconds to read every source shard (``readers`` threads, pread) while writing ``out_bytes`` to one
    file in 64 MiB chunks with writeback started per chunk, then fsync: the IO a conversion cannot skip."""
    import threading

    from quantkit.checkpoint.writer import WRITEBACK_CHUNK, sync_range

    files = sorted(src.glob("*.safetensors"))
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / "ceiling-probe.bin"

    def write():
        block = os.urandom(WRITEBACK_CHUNK)
        with open(target, "wb") as f:
            done = waited = 0
            while done < out_bytes:
                n = min(len(block), out_bytes - done)
                f.write(memoryview(block)[:n])
                f.flush()
                if done > waited:
                    sync_range(f.fileno(), waited, done - waited, wait=True)
                    waited = done
                sync_range(f.fileno(), done, n, wait=False)
                done += n
            os.fsync(f.fileno())

    t0 = time.perf_counter()
    threads = [threading.Thread(target=read_files, args=(files[i::readers],)) for i in range(readers)]
    threads.append(threading.Thread(target=write))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    target.unlink()
    return seconds


def memory_ceiling(src: Path, out_dir: Path, out_bytes: int, threads: int) -> float:
    """Seconds for ``threads`` readers to pread every source shard while ``threads`` writers write and sha256-hash
    ``out_bytes`` in as many files: the bytes a conversion moves and hashes, with nothing computed."""
    import threading

    files = sorted(src.glob("*.safetensors"))
    out_dir.mkdir(parents=True, exist_ok=True)
    block = os.urandom(16 << 20)
    share = -(-out_bytes // threads)
    workers = [threading.Thread(target=read_files, args=(files[i::threads],)) for i in range(threads)]
    workers += [threading.Thread(target=write_hashed, args=(out_dir / f"ceiling-{i}.bin", share, block))
                for i in range(threads)]
    t0 = time.perf_counter()
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    seconds = time.perf_counter() - t0
    shutil.rmtree(out_dir)
    return seconds


def output_digest(folder: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    for p in sorted(folder.glob("*.safetensors")):
        h.update(p.name.encode() + bytes.fromhex(hashlib.sha256(p.read_bytes()).hexdigest()))
    return h.hexdigest()


def tmpfs_main(args) -> None:
    """Throughput with the disk taken away: the memory ceiling, quantkit at each worker count and output shard size
    (and the code before, alternating), model_free_ptq."""
    work = args.workdir
    src = build_source(work / "src", args.gb, args.shard_gb)
    gb = src["bytes"] / 1e9
    print(f"source {gb:.1f} GB in {src['shards']} shard(s) on {work}", flush=True)
    codes = {"quantkit": None, **({"before": args.baseline.resolve()} if args.baseline else {})}
    runs, digests = {}, {}
    for size in args.shard_sizes.split(","):
        for workers in [int(w) for w in args.workers_list.split(",")]:
            for label, code in codes.items():
                r = run_quantkit(work / "src", work / "out", args.device, workers, max_shard_size=size, code=code)
                r["GBps"] = gb / r["in_process_seconds"]
                digests[f"{label} {size} x{workers}"] = output_digest(work / "out")
                runs[f"{label} {size} x{workers}"] = r
                print(f"{label}, {size} shards ({r['shards']}), x{workers}: {r['in_process_seconds']:.2f}s in process "
                      f"({r['GBps']:.2f} GB/s of input), {r['seconds']:.1f}s end to end, peak RSS "
                      f"{r['peak_rss_GiB']:.1f} GiB (whole tree, PSS: {r['peak_tree_pss_GiB']:.1f} GiB); "
                      f"stages { {k: round(v, 1) for k, v in r['stage_seconds'].items()} }",
                      flush=True)
    out_bytes = next(iter(runs.values()))["output_bytes"]
    ceilings = {}
    for workers in sorted({int(w) for w in args.workers_list.split(",")}):
        ceilings[workers] = memory_ceiling(work / "src", work / "probe", out_bytes, workers)
        print(f"memory ceiling, {workers} readers + {workers} writers/hashers: {ceilings[workers]:.2f}s "
              f"({gb / ceilings[workers]:.2f} GB/s of input)", flush=True)
    peer = run_peer(work / "src", work / "out-peer", args.device, args.peer_workers)
    peer_work = peer["seconds"] - peer["import_seconds"]
    print(f"model_free_ptq x{args.peer_workers}: {peer['seconds']:.1f}s end to end, {peer_work:.1f}s after imports "
          f"({gb / peer_work:.2f} GB/s of input)", flush=True)
    best = min(ceilings.values())
    print("\n| run | s | GB/s of input | share of the memory ceiling | peak memory, whole tree (PSS) GiB |\n"
          "|---|---|---|---|---|")
    for name, r in runs.items():
        share = 100 * best / r["in_process_seconds"]
        print(f"| {name} | {r['in_process_seconds']:.2f} | {r['GBps']:.2f} | {share:.0f} % | "
              f"{r['peak_tree_pss_GiB']:.2f} |")
    print(f"| model_free_ptq x{args.peer_workers} (after imports) | {peer_work:.1f} | {gb / peer_work:.2f} | "
          f"{100 * best / peer_work:.0f} % |")
    print(f"| ceiling (best of {sorted(ceilings)}) | {best:.2f} | {gb / best:.2f} | 100 % |")
    for size in args.shard_sizes.split(","):
        same = {d for k, d in digests.items() if f" {size} " in k}
        print(f"{size} shards: outputs identical across worker counts and code:", len(same) == 1, flush=True)
    if args.json:
        args.json.write_text(json.dumps({"source": src, "runs": runs, "ceilings": ceilings, "peer": peer,
                                         "digests": digests}, indent=2, default=str))


def bare_torch_import() -> float:
    """Seconds for a fresh interpreter to import torch and exit (second of two runs: files cached)."""
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        times.append(time.perf_counter() - t0)
    return times[-1]


PEER_SCRIPT = textwrap.dedent(
    """
    import sys, time
    t0 = time.perf_counter()
    from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer
    from llmcompressor import model_free_ptq
    from quantkit.formats.recipe import load_recipe
    t1 = time.perf_counter()
    src, dst, device, workers = sys.argv[1:5]
    model_free_ptq(src, dst, config=load_recipe("glm5-int4-experts-g32").config.to_compressed_tensors(), device=device,
                   max_workers=int(workers), converter=FP8BlockDequantizer(targets=[sys.argv[5]]))
    print(f"PEER_IMPORT_SECONDS {t1 - t0:.3f}")
    """
)

# Peak memory of the whole process tree (a conversion on GPUs runs in worker processes): the sum of each process's
# PSS, sampled every 50 ms (PSS splits the pages forked workers share, so torch's pages count once); and the largest
# single process's RSS as the kernel counted it.
TREE_MEMORY = textwrap.dedent("""
    import resource, subprocess, sys, time
    from pathlib import Path

    def children(pids):
        out = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                if int(stat.read_text().rsplit(")", 1)[1].split()[1]) in pids:
                    out.append(int(stat.parent.name))
            except (OSError, ValueError, IndexError):
                pass
        return out

    def pss_kb(pid):
        try:
            line = next(x for x in open(f"/proc/{pid}/smaps_rollup") if x.startswith("Pss:"))
            return int(line.split()[1])
        except (OSError, StopIteration):
            return 0

    p = subprocess.Popen(sys.argv[1:])
    peak = 0
    while p.poll() is None:
        tree, level = [p.pid], [p.pid]
        while level:
            level = children(set(level))
            tree += level
        peak = max(peak, sum(pss_kb(q) for q in tree))
        time.sleep(0.05)
    print("PEAK_RSS_KB", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)
    print("PEAK_TREE_PSS_KB", peak, file=sys.stderr)
    sys.exit(p.returncode)
""")


def timed_run(cmd: list[str], env=None, cwd=None) -> dict:
    """Wall time until the output is durable: a tool that leaves its writes in the page cache
    (safetensors' save_file does not fsync) pays for the flush in the final sync, as it would
    before anyone could rely on the files."""
    os.sync()
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", TREE_MEMORY, *cmd], capture_output=True, text=True, env=env, cwd=cwd)
    t1 = time.perf_counter()
    os.sync()
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    kb = {k: int(v) for k, v in (line.split() for line in done.stderr.splitlines() if line.startswith("PEAK_"))}
    return {"seconds": seconds, "sync_seconds": seconds - (t1 - t0), "peak_rss_GiB": kb["PEAK_RSS_KB"] / 2**20,
            "peak_tree_pss_GiB": kb["PEAK_TREE_PSS_KB"] / 2**20, "stdout": done.stdout}


# quantkit with each shard left in the page cache until its final fsync (the writer before chunked writeback)
NO_WRITEBACK = ("import sys; from quantkit.checkpoint import writer; "
                "writer.ShardWriter.__init__.__defaults__ = (None, 1 << 62); "
                "from quantkit.cli import app; sys.argv[0] = 'quantkit'; app()")


def run_quantkit(src: Path, dst: Path, device: str, workers: int | None, writeback: bool = True,
                 max_shard_size: str | None = None, code: Path | None = None) -> dict:
    """quantkit's own conversion; ``code``: a checkout whose quantkit runs instead (``-m`` finds the working
    directory's package first)."""
    shutil.rmtree(dst, ignore_errors=True)
    start = ["-m", "quantkit"] if writeback else ["-c", NO_WRITEBACK]
    cmd = [sys.executable, *start, "convert", str(src), str(dst), "--recipe", "glm5-int4-experts-g32",
           "--device", device, "--json"]
    if workers:
        cmd += ["--workers", str(workers)]
    if max_shard_size:
        cmd += ["--max-shard-size", max_shard_size]
    r = timed_run(cmd, cwd=code or Path(__file__).resolve().parent.parent)
    result = json.loads(r.pop("stdout"))
    r.update(stage_seconds=result["stage_seconds"], in_process_seconds=result["seconds"],
             output_bytes=result["output_bytes"], workers=result["workers"], shards=result["shards_total"])
    return r


def run_peer(src: Path, dst: Path, device: str, workers: int) -> dict:
    shutil.rmtree(dst, ignore_errors=True)
    r = timed_run([sys.executable, "-c", PEER_SCRIPT, str(src), str(dst), device, str(workers), EXPERTS_RE])
    out = r.pop("stdout")
    r["import_seconds"] = float(next(l.split()[1] for l in out.splitlines() if l.startswith("PEER_IMPORT")))
    r["output_bytes"] = sum(p.stat().st_size for p in dst.glob("*.safetensors"))
    return r


def same_experts(a: Path, b: Path, sample: int = 24) -> dict:
    """How many packed words of a sample of experts the two outputs share."""
    import torch
    from safetensors import safe_open

    def index(folder):
        return json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]

    ia, ib = index(a), index(b)
    names = sorted(n for n in ia if n.endswith("weight_packed"))[:sample]
    same = total = scales_equal = 0
    for n in names:
        with safe_open(a / ia[n], "pt") as fa, safe_open(b / ib[n], "pt") as fb:
            x, y = fa.get_tensor(n), fb.get_tensor(n)
            same += int((x == y).sum())
            total += x.numel()
            s = n.replace("weight_packed", "weight_scale")
            scales_equal += int(torch.equal(fa.get_tensor(s), fb.get_tensor(s)))
    return {"experts_compared": len(names), "packed_words_equal": same / max(total, 1),
            "scales_equal": f"{scales_equal}/{len(names)}"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/quantkit-bench"))
    ap.add_argument("--gb", type=float, default=3.0, help="source checkpoint size")
    ap.add_argument("--shard-gb", type=float, default=1.0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--workers", type=int, default=None, help="quantkit workers (default: its own choice)")
    ap.add_argument("--peer-workers", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--writeback-ab", action="store_true", help="also time a cold run without chunked writeback")
    ap.add_argument("--tmpfs", action="store_true", help="WORKDIR is in memory: the memory ceiling and worker counts")
    ap.add_argument("--workers-list", default="4,8,16", help="--tmpfs: quantkit's worker counts")
    ap.add_argument("--shard-sizes", default="5GB", help="--tmpfs: quantkit's --max-shard-size values")
    ap.add_argument("--baseline", type=Path, default=None, help="--tmpfs: a checkout of the code to compare with")
    args = ap.parse_args()
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    if args.tmpfs:
        tmpfs_main(args)
        return

    t0 = time.perf_counter()
    src = build_source(work / "src", args.gb, args.shard_gb)
    tiny = build_source(work / "tiny", 0.0, 0.05, tiny=True)
    print(f"built sources in {time.perf_counter() - t0:.0f}s: {src}", flush=True)
    figures: dict = {"source": src, "device": args.device, "nproc": os.cpu_count()}
    figures["disk"] = disk_limit(work, min(src["bytes"], 4 << 30))
    print("disk", figures["disk"], flush=True)

    figures["bare_torch_import_seconds"] = bare_torch_import()
    expected_out = None
    runs = {}
    for cache in ("cold", "warm"):
        for tool in ("quantkit", "model_free_ptq"):
            drop_caches([work / "src"]) if cache == "cold" else warm(work / "src")
            dst = work / f"out-{tool}"
            if tool == "quantkit":
                if expected_out is None:  # the output size, from a first conversion (its figures are not kept)
                    expected_out = run_quantkit(work / "src", dst, args.device, args.workers)["output_bytes"]
                    drop_caches([work / "src"]) if cache == "cold" else warm(work / "src")
                ceiling = ceiling_probe(work / "src", work / "probe", expected_out)
                drop_caches([work / "src"]) if cache == "cold" else warm(work / "src")
                r = run_quantkit(work / "src", dst, args.device, args.workers)
                r["ceiling_seconds"] = ceiling
                r["share_of_unavoidable"] = (ceiling + figures["bare_torch_import_seconds"]) / r["seconds"]
            else:
                r = run_peer(work / "src", dst, args.device, args.peer_workers)
            r["GBps_source"] = src["bytes"] / r["seconds"] / 1e9
            runs[f"{tool}/{cache}"] = r
            print(tool, cache, {k: v for k, v in r.items() if k != "stage_seconds"}, flush=True)
    figures["runs"] = runs
    if args.writeback_ab:  # the same cold run without chunked writeback, then with it again
        ab = {}
        for label, writeback in (("without", False), ("with", True)):
            drop_caches([work / "src"])
            ab[label] = run_quantkit(work / "src", work / "out-quantkit", args.device, args.workers, writeback)["seconds"]
        figures["writeback_ab_cold_seconds"] = ab
        print("writeback A/B, cold cache, end to end:", ab, flush=True)
    figures["agreement"] = same_experts(work / "out-quantkit", work / "out-model_free_ptq")

    out_bytes = runs["quantkit/cold"]["output_bytes"]
    disk = figures["disk"]
    limit_s = src["bytes"] / (disk["read_GBps"] * 1e9) + out_bytes / (disk["write_GBps"] * 1e9)
    figures["disk_limit_seconds"] = limit_s
    for key, r in runs.items():
        r["percent_of_disk_limit"] = 100 * limit_s / r["seconds"]
        # without interpreter start-up and imports (torch, transformers: seconds on slow filesystems)
        r["work_seconds"] = r.get("in_process_seconds", r["seconds"] - r["sync_seconds"] - r.get("import_seconds", 0)) + r["sync_seconds"]
        r["percent_of_disk_limit_work"] = 100 * limit_s / r["work_seconds"]

    # per-tensor overhead: thousands of tiny experts, where compute is negligible; the difference between
    # 3,840 and 384 of them, so that start-up, imports and CUDA initialisation cancel out
    few = build_source(work / "tiny-few", 0.0, 0.05, tiny=True, tiny_layers=4)
    over = {}
    for tool in ("quantkit", "model_free_ptq"):
        seconds = {}
        for name, source in (("many", work / "tiny"), ("few", work / "tiny-few")):
            warm(source)
            dst = work / f"tiny-out-{tool}"
            r = run_quantkit(source, dst, args.device, args.workers) if tool == "quantkit" else \
                run_peer(source, dst, args.device, args.peer_workers)
            seconds[name] = r["seconds"]
        extra = tiny["expert_tensors"] - few["expert_tensors"]
        over[tool] = {"tensors": [tiny["expert_tensors"], few["expert_tensors"]], "seconds": seconds,
                      "ms_per_tensor": 1000 * (seconds["many"] - seconds["few"]) / extra}
    figures["per_tensor_overhead"] = over

    print()
    print("| run | wall s | % of disk limit | work s (no imports) | % of disk limit | peak RSS GiB |")
    print("|---|---|---|---|---|---|")
    for key, r in runs.items():
        print(f"| {key} | {r['seconds']:.1f} | {r['percent_of_disk_limit']:.0f} % | {r['work_seconds']:.1f} | "
              f"{r['percent_of_disk_limit_work']:.0f} % | {r['peak_rss_GiB']:.2f} |")
    for cache in ("cold", "warm"):
        ratio = runs[f"model_free_ptq/{cache}"]["seconds"] / runs[f"quantkit/{cache}"]["seconds"]
        work = runs[f"model_free_ptq/{cache}"]["work_seconds"] / runs[f"quantkit/{cache}"]["work_seconds"]
        figures[f"speedup_{cache}"] = ratio
        figures[f"speedup_{cache}_work"] = work
        print(f"speedup over model_free_ptq, {cache} cache: {ratio:.2f}x wall, {work:.2f}x without imports")
    for cache in ("cold", "warm"):
        r = runs[f"quantkit/{cache}"]
        print(f"quantkit, {cache} cache: ceiling {r['ceiling_seconds']:.1f}s + bare torch import "
              f"{figures['bare_torch_import_seconds']:.1f}s = {r['ceiling_seconds'] + figures['bare_torch_import_seconds']:.1f}s "
              f"unavoidable; quantkit {r['seconds']:.1f}s end to end: {100 * r['share_of_unavoidable']:.0f} % of it")
    print("quantkit stages (s):", runs["quantkit/warm"]["stage_seconds"])
    print("per-tensor overhead:", over)
    print("agreement:", figures["agreement"])
    print(f"disk limit: {limit_s:.1f}s (read {disk['read_GBps']:.2f} GB/s, write {disk['write_GBps']:.2f} GB/s)")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
