"""What one host's cores do per thread, the ingredients of a conversion's ceiling: memory copies, sha256, writing to
a tmpfs, pread from it into pinned memory, fresh pinned allocations, and a GPU round trip per tensor, at 1, 4 and 16
threads.

    python benchmarks/host_limits.py        # needs a CUDA GPU for the last two; /dev/shm for the files

Figures in docs/benchmarks.md ("With the disk taken away").
"""

import hashlib
import os
import shutil
import threading
import time

import numpy as np
import torch

WORK = "/dev/shm/quantkit-host-limits"
CHUNK = 64 << 20
COPY = 256 << 20  # per thread: far past any cache


def parallel(n: int, fn) -> float:
    threads = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def copy_rates() -> None:
    """Memory copies, each thread from its own array to its own, both touched first (no page faults timed)."""
    sources = [np.ones(COPY, np.uint8) for _ in range(16)]
    targets = [np.ones(COPY, np.uint8) for _ in range(16)]

    def copy(i, reps=4):  # numpy lets go of the GIL while it copies
        for _ in range(reps):
            np.copyto(targets[i], sources[i])

    for n in (1, 4, 16):
        s = parallel(n, copy)
        print(f"memcpy, {n} threads: {n * 4 * COPY / s / 1e9:.1f} GB/s copied ({2 * n * 4 * COPY / s / 1e9:.1f} GB/s "
              "of reads and writes)", flush=True)


def main() -> None:
    block = memoryview(os.urandom(CHUNK))
    os.makedirs(WORK, exist_ok=True)

    def sha(i, reps=8):
        digest = hashlib.sha256()
        for _ in range(reps):
            digest.update(block)

    def write(i, reps=16):
        with open(f"{WORK}/w{i}", "wb") as f:
            for _ in range(reps):
                f.write(block)

    def read(i):
        fd = os.open(f"{WORK}/w{i}", os.O_RDONLY)
        buf = torch.empty(CHUNK, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        offset = 0
        while n := os.preadv(fd, [buf.numpy().data], offset):
            offset += n
        os.close(fd)

    copy_rates()
    for n in (1, 4, 16):
        s = parallel(n, sha)
        print(f"sha256, {n} threads: {n * 8 * CHUNK / s / 1e9:.2f} GB/s", flush=True)
    for n in (1, 4, 16):
        s = parallel(n, write)
        print(f"tmpfs write, 64 MiB chunks, {n} threads: {n * 16 * CHUNK / s / 1e9:.2f} GB/s", flush=True)
    for n in (1, 4, 16):
        s = parallel(n, read)
        print(f"tmpfs pread into pinned memory, {n} threads: {n * 16 * CHUNK / s / 1e9:.2f} GB/s", flush=True)
    shutil.rmtree(WORK)
    if not torch.cuda.is_available():
        return
    torch.cuda.init()

    def allocate(i, k=20):
        [torch.empty(12_600_000, dtype=torch.uint8, pin_memory=True) for _ in range(k)]

    def round_trip(i, k=50):  # a GLM-5 expert's FP8 weight in, its packed INT4 out, one wait
        src = torch.empty(12_600_000, dtype=torch.uint8, pin_memory=True)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for _ in range(k):
                d = src.to("cuda", non_blocking=True)
                torch.empty(6_300_000, dtype=torch.uint8, pin_memory=True).copy_(d[:6_300_000], non_blocking=True)
                stream.synchronize()

    for n in (1, 16):
        s = parallel(n, allocate)
        print(f"fresh pinned allocations of 12.6 MB, {n} threads: {n * 20 * 12.6e6 / s / 1e9:.2f} GB/s", flush=True)
    for n in (1, 4, 16):
        s = parallel(n, round_trip)
        print(f"12.6 MB to the GPU and 6.3 MB back, one wait, {n} threads with a stream each: {n * 50 / s:.0f} "
              f"tensors/s", flush=True)


if __name__ == "__main__":
    main()
