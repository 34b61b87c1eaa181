"""ShardWriter starts the disk while a shard is still being written, and hashes in a thread of its own, without
changing a byte."""

import errno
import hashlib
import os
import random
import threading

import pytest
import torch

from quantkit.checkpoint import writer as writer_module
from quantkit.checkpoint.writer import BackgroundSha256, ShardWriter, sha256_file
from quantkit.errors import QuantkitError
from helpers import one_line_error, quantkit
from quantkit.checkpoint.writer import folder_lock
import shutil
from conftest import tree_bytes
from helpers import evaluate_small

TENSORS = {f"t{i}": torch.full((1000 + 37 * i, 64), i, dtype=torch.bfloat16) for i in range(12)}
ENTRIES = [(name, "BF16", tuple(t.shape)) for name, t in TENSORS.items()]


def write(path, chunk):
    with ShardWriter(path, ENTRIES, {"format": "pt"}, writeback_chunk=chunk) as w:
        for name, t in TENSORS.items():
            w.write(name, t)
        return w.finish()


def test_writeback_ranges_cover_the_file_in_order_and_bytes_do_not_change(tmp_path, monkeypatch):
    calls = []
    real = writer_module.sync_range
    monkeypatch.setattr(writer_module, "sync_range", lambda fd, off, n, wait: (calls.append((off, n, wait)),
                                                                                real(fd, off, n, wait)))
    chunked = write(tmp_path / "chunked.safetensors", chunk=256 << 10)
    started = [(off, n) for off, n, wait in calls if not wait]
    waited = [(off, n) for off, n, wait in calls if wait]
    assert len(started) >= 4
    # contiguous from byte 0, each range started once and waited for before the one after the next starts
    assert [off for off, _ in started] == [0] + [off + n for off, n in started[:-1]]
    assert waited == started[:-1]
    assert started[-1][0] + started[-1][1] <= chunked.size
    whole = write(tmp_path / "whole.safetensors", chunk=1 << 40)
    assert chunked.sha256 == whole.sha256 == sha256_file(tmp_path / "chunked.safetensors")
    assert chunked.size == whole.size == os.path.getsize(tmp_path / "whole.safetensors")


def test_the_kernel_call_itself_works_here(tmp_path):
    path = tmp_path / "f"
    with open(path, "wb") as f:
        f.write(b"x" * (1 << 20))
        f.flush()
        writer_module.sync_range(f.fileno(), 0, 1 << 20, wait=False)
        writer_module.sync_range(f.fileno(), 0, 1 << 20, wait=True)
    assert writer_module._sync_file_range is not None or not os.uname().sysname == "Linux"


def test_a_failed_writeback_is_a_write_error_naming_the_file(tmp_path, monkeypatch):
    def failing(fd, off, n, wait):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(writer_module, "sync_range", failing)
    with pytest.raises(QuantkitError, match="cannot write") as info:
        write(tmp_path / "bad.safetensors", chunk=256 << 10)
    assert "bad.safetensors" in str(info.value)
    assert list(tmp_path.iterdir()) == []  # the partial file is gone


def test_the_header_length_is_the_headers_without_building_it():
    """plan counts header bytes from each tensor's entry length and size; the count equals the real header's
    length for any names (quotes, backslashes, control characters, non-ASCII), shapes (0-D, empty dimensions,
    large) and metadata."""
    import math
    import random

    from quantkit.checkpoint.reader import DTYPES
    from quantkit.checkpoint.writer import header_entry_chars, safetensors_header, safetensors_header_length

    rng = random.Random(0)
    alphabet = 'ab.7_"\\\t\nü€😀\x00/'
    for _ in range(2000):
        entries: dict[str, tuple[str, tuple[int, ...]]] = {}
        for _ in range(rng.choice([0, 1, 2, 5, 30])):
            name = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
            shape = tuple(rng.choice([0, 1, 7, 10, 99, 100, 12345, 10**6]) for _ in range(rng.randint(0, 4)))
            entries[name] = (rng.choice(list(DTYPES)), shape)
        metadata = rng.choice([None, {}, {"format": "pt"}, {"ü": 'x"y', "a": ""}])
        listed = [(name, code, shape) for name, (code, shape) in entries.items()]
        counted = [(header_entry_chars(*e), math.prod(e[2]) * DTYPES[e[1]][0]) for e in listed]
        assert safetensors_header_length(counted, metadata) == len(safetensors_header(listed, metadata))


def test_the_background_hash_is_hashlibs_sha256_of_the_chunks_in_order():
    rng = random.Random(0)
    chunks = [rng.randbytes(rng.choice([0, 1, 7, 4096, 1 << 20])) for _ in range(40)]
    background = BackgroundSha256(depth=2)
    for chunk in chunks:
        background.update(memoryview(chunk))
    assert background.hexdigest() == hashlib.sha256(b"".join(chunks)).hexdigest()


def hash_threads():
    return sum(t.name == "sha256" for t in threading.enumerate())


def test_a_writer_that_fails_or_finishes_leaves_no_hash_thread_behind(tmp_path):
    before = hash_threads()
    with pytest.raises(RuntimeError, match="planned"):
        with ShardWriter(tmp_path / "bad.safetensors", ENTRIES) as w:
            w.write("t0", TENSORS["t1"])  # not the planned tensor
    write(tmp_path / "good.safetensors", chunk=256 << 10)
    assert hash_threads() == before
    assert [p.name for p in tmp_path.iterdir()] == ["good.safetensors"]


def test_a_link_planted_at_a_temporary_name_is_never_followed(llama_int4, tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("precious")
    for name in (".README.md.partial", ".config.json.partial", ".quantkit-manifest.json.partial"):
        (llama_int4 / name).symlink_to(outside)
    r = quantkit("publish", llama_int4, "--repo", f"file://{tmp_path / 'out'}", "--force-ungated")
    assert r.exit_code == 0, r.output
    assert outside.read_text() == "precious"
    assert not (tmp_path / "out" / ".README.md.partial").exists()


def test_a_second_writer_gets_in_use(synthetic, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    with folder_lock(dst):
        r = quantkit("convert", synthetic["llama"], dst, "-r", "dense-w4a16-g128", "--device", "cpu")
    one_line_error(r, str(dst), "in use by another quantkit process")
    assert not list(dst.glob("*.safetensors"))


def test_concurrent_writers_never_share_a_temporary_file(tmp_path):
    from quantkit.checkpoint.writer import write_bytes_atomic

    target = tmp_path / "config.json"
    payloads = [(str(i) * 100_000).encode() for i in range(8)]
    threads = [threading.Thread(target=write_bytes_atomic, args=(target, p)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert target.read_bytes() in payloads and not list(tmp_path.glob(".*partial"))


def test_work_folders_are_locked_and_the_refusal_names_the_holder(llama_pair, tmp_path):
    base, cand = llama_pair
    (tmp_path / "run").mkdir()
    with folder_lock(tmp_path / "run"):
        with pytest.raises(QuantkitError, match=rf"in use by another quantkit process \(pid {os.getpid()} on "):
            evaluate_small(base, tmp_path / "run")
    copy = tmp_path / "cand"
    shutil.copytree(cand, copy)
    with folder_lock(copy):
        r = quantkit("calibrate-kv", copy, "--in-place", "--samples", "2", "--seq-len", "32", "--device", "cpu")
    one_line_error(r, str(copy), f"pid {os.getpid()}")
    assert tree_bytes(copy) == tree_bytes(cand) | {".quantkit.lock": (copy / ".quantkit.lock").read_bytes()}
