"""ShardWriter starts the disk while a shard is still being written, without changing a byte."""

import errno
import os

import pytest
import torch

from quantkit.checkpoint import writer as writer_module
from quantkit.checkpoint.writer import ShardWriter, sha256_file
from quantkit.errors import QuantkitError

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
