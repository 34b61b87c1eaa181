"""Writing safetensors files atomically and deterministically, hashing as the bytes go out.

The same tensors in the same order always give the same bytes (what makes a resumed run
byte-identical to an uninterrupted one). A file appears under its final name only once it is
complete and fsynced; a failure removes the partial file.

A shard's bytes start for the disk while the shard is still being written: every
``WRITEBACK_CHUNK`` the kernel is asked to write the new range out (Linux ``sync_file_range``),
and the range before it is waited for, so at most two chunks per shard are dirty in memory and
the final fsync finds almost nothing left to do. Without this, each 5 GB shard sat in the page
cache until its fsync and all output reached the disk at the end of the run.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import queue
import secrets
import threading
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii
from pathlib import Path
from typing import Any

from quantkit.checkpoint.reader import DTYPES, TORCH_TO_CODE
from quantkit.errors import QuantkitError


@dataclass(frozen=True)
class WrittenFile:
    name: str
    size: int
    sha256: str


PARTIAL_SUFFIX = ".partial"
WRITEBACK_CHUNK = 64 << 20
LOCK_NAME = ".quantkit.lock"


def partial_name(path: Path) -> Path:
    """A fresh hidden temporary name beside ``path``: unique per call, so two writers never share one."""
    return path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}{PARTIAL_SUFFIX}")


def open_exclusive(tmp: Path):
    """Create ``tmp`` for writing; never follows a link planted there, never opens an existing file."""
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    return os.fdopen(fd, "wb")


def safetensors_header(entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str,
                                                                                       str] | None = None) -> bytes:
    """The header for tensors written in the given order; entries are (name, dtype code, shape)."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for name, code, shape in entries:
        nbytes = math.prod(shape) * DTYPES[code][0]
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the spec pads the header to 8-byte alignment with spaces
    return len(raw).to_bytes(8, "little") + raw


# One entry of safetensors_header's JSON less its name, dtype, shape digits and offset digits:
# "":{"dtype":"","shape":[],"data_offsets":[,]} (the quotes around name and dtype counted with them).
_ENTRY_CHARS = len(':{"dtype":,"shape":[],"data_offsets":[,]}')


_TYPE_CHARS: dict[tuple[str, tuple[int, ...]], int] = {}  # (dtype, shape) -> their characters: a model has few


def header_entry_chars(name: str, code: str, shape: tuple[int, ...]) -> int:
    """The characters of this tensor's entry in ``safetensors_header``'s JSON, its two offsets left out."""
    typed = _TYPE_CHARS.get((code, shape))
    if typed is None:
        if len(_TYPE_CHARS) > 4096:
            _TYPE_CHARS.clear()
        typed = _TYPE_CHARS[code, shape] = len(code) + 2 + len(",".join(map(str, shape))) + _ENTRY_CHARS
    return len(encode_basestring_ascii(name)) + typed


def safetensors_header_length(entries: Iterable[tuple[int, int]], metadata: dict[str, str] | None = None) -> int:
    """``len(safetensors_header(...))`` for tensors given in order as (``header_entry_chars``, bytes), counted
    without building the JSON: ``plan`` sizes the headers of some 180,000 tensors of a 700 GB checkpoint, and
    only their lengths."""
    chars = len(json.dumps({"__metadata__": metadata}, separators=(",", ":"))) if metadata else 2
    items = 1 if metadata else 0
    offset = 0
    for entry_chars, nbytes in entries:
        end = offset + nbytes
        chars += entry_chars + len(str(offset)) + len(str(end))
        offset = end
        items += 1
    chars += max(items - 1, 0)  # the commas between items
    return 8 + chars + (-chars % 8)


def tensor_code(t) -> str:
    return TORCH_TO_CODE[str(t.dtype).removeprefix("torch.")]


def _tensor_bytes(t) -> memoryview:
    import torch

    t = t.detach().to("cpu").contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class BackgroundSha256:
    """The sha256 of the bytes given to ``update``, computed in a thread of its own. A file's bytes must be hashed in
    order, one core at about 1 GiB/s (1.14 GiB/s on an H200 host), slower than writing them to the page cache (2.78
    GiB/s there): the writer hands each chunk over and goes on writing. At most ``depth`` chunks wait; the chunks
    must not change until hashed (the writer's are views of tensors nobody writes to again)."""

    def __init__(self, depth: int = 4):
        self._digest = hashlib.sha256()
        self._chunks: queue.Queue = queue.Queue(maxsize=depth)
        self._thread = threading.Thread(target=self._run, name="sha256", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (chunk := self._chunks.get()) is not None:
            self._digest.update(chunk)

    def update(self, chunk) -> None:
        self._chunks.put(chunk)

    def close(self) -> None:
        if self._thread.is_alive():
            self._chunks.put(None)
            self._thread.join()

    def hexdigest(self) -> str:
        self.close()
        return self._digest.hexdigest()


class ShardWriter:
    """Streams one safetensors file whose layout is known in advance.

    The header goes out first; tensors are then written one by one in the planned order, each
    checked against its planned dtype and shape, so a shard never has to sit whole in memory.
    """

    def __init__(self, path: Path, entries: list[tuple[str, str, tuple[int, ...]]], metadata=None,
                 writeback_chunk: int = WRITEBACK_CHUNK):
        self.path = path
        self.entries = list(entries)
        self._next = 0
        self._tmp = partial_name(path)
        self._digest: Any = None  # the running hash, from __enter__ on
        self._size = 0
        self._file: Any = None  # the open partial file, between __enter__ and finish
        self._header = safetensors_header(self.entries, metadata)
        self._chunk = writeback_chunk
        self._started = 0  # bytes handed to the kernel's writeback so far
        self._waited = 0  # bytes known to be on the disk

    def __enter__(self) -> "ShardWriter":
        self._digest = BackgroundSha256()
        self._file = self._guard(lambda: open_exclusive(self._tmp))
        self._emit(self._header)
        return self

    def write(self, name: str, tensor) -> None:
        if self._next >= len(self.entries):
            raise RuntimeError(f"{self.path}: unplanned tensor {name}")
        want = self.entries[self._next]
        got = (name, tensor_code(tensor), tuple(tensor.shape))
        if got != (want[0], want[1], tuple(want[2])):
            raise RuntimeError(f"{self.path}: planned {want}, produced {got}")
        self._next += 1
        self._emit(_tensor_bytes(tensor))

    def _emit(self, chunk) -> None:
        self._guard(lambda: self._file.write(chunk))
        self._digest.update(chunk)
        self._size += len(chunk)
        if self._size - self._started >= self._chunk:
            self._guard(self._write_back)

    def _write_back(self) -> None:
        """Start the disk on the bytes written since the last call; wait for the range before them."""
        self._file.flush()
        fd = self._file.fileno()
        if self._started > self._waited:
            sync_range(fd, self._waited, self._started - self._waited, wait=True)
            self._waited = self._started
        sync_range(fd, self._started, self._size - self._started, wait=False)
        self._started = self._size

    def _guard(self, op):
        try:
            return op()
        except OSError as exc:
            self._abort()
            raise write_error(self.path, exc) from exc

    def _abort(self) -> None:
        if self._digest is not None:
            self._digest.close()
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None
        self._tmp.unlink(missing_ok=True)

    def finish(self) -> WrittenFile:
        if self._next != len(self.entries):
            raise RuntimeError(f"{self.path}: {len(self.entries) - self._next} planned tensors not written")

        def close():
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None
            os.replace(self._tmp, self.path)
            fsync_dir(self.path.parent)

        self._guard(close)
        return WrittenFile(self.path.name, self._size, self._digest.hexdigest())

    def __exit__(self, exc_type, *rest) -> None:
        if self._file is not None:  # an error before finish(): leave nothing behind
            self._abort()


def write_safetensors(path: Path, tensors: dict, metadata: dict[str, str] | None = None) -> WrittenFile:
    """Write ``tensors`` in the given order to ``path`` atomically."""
    entries = [(name, tensor_code(t), tuple(t.shape)) for name, t in tensors.items()]
    with ShardWriter(path, entries, metadata) as writer:
        for name, t in tensors.items():
            writer.write(name, t)
        return writer.finish()


_SYNC_FILE_RANGE_WAIT_BEFORE, _SYNC_FILE_RANGE_WRITE, _SYNC_FILE_RANGE_WAIT_AFTER = 1, 2, 4  # linux/fs.h


def _libc_sync_file_range():
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return None
    fn = getattr(ctypes.CDLL(None, use_errno=True), "sync_file_range", None)
    if fn is not None:
        fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
        fn.restype = ctypes.c_int
    return fn


_sync_file_range = _libc_sync_file_range()


def sync_range(fd: int, offset: int, nbytes: int, wait: bool) -> None:
    """Start writeback of ``nbytes`` at ``offset`` (``wait``: and wait until they are on the disk).
    Where the call does not exist (not Linux), the final fsync does all the work, as before."""
    if _sync_file_range is None or nbytes <= 0:
        return
    flags = _SYNC_FILE_RANGE_WAIT_BEFORE | _SYNC_FILE_RANGE_WRITE | _SYNC_FILE_RANGE_WAIT_AFTER if wait \
        else _SYNC_FILE_RANGE_WRITE
    if _sync_file_range(fd, offset, nbytes, flags) != 0:
        import ctypes

        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ESPIPE):  # a file system without it
            raise OSError(err, os.strerror(err))


def refuse_inside(model: Path, out: Path, option: str) -> None:
    """An output of a command that reads MODEL lies outside it: a file written into a model folder replaces one of
    its own, changes the checksums eval binds a run to, or is copied along by the next convert."""
    m, o = model.resolve(), out.resolve()
    if o == m or m in o.parents:
        raise QuantkitError(f"{option} must not be the model folder or inside it ({model})", out)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    tmp = partial_name(path)
    try:
        with open_exclusive(tmp) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise write_error(path, exc) from exc


@contextmanager
def folder_lock(folder: Path):
    """Hold an exclusive lock on ``folder`` while writing into it. The holder writes who it is into the lock
    file (process id, host, command, start time), so a second writer's one-line error names it."""
    import fcntl

    path = folder / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as exc:
        raise write_error(path, exc) from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise QuantkitError(f"in use by another quantkit process ({_lock_holder(fd)}); wait for it to end",
                                folder) from exc
        os.ftruncate(fd, 0)
        os.pwrite(fd, _holder_record(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)  # released: an empty lock file, the same bytes after every run
    finally:
        os.close(fd)


def _holder_record() -> bytes:
    import socket
    import sys
    import time

    return json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv)[:500],
                       "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode()


def _lock_holder(fd: int) -> str:
    """Who holds the lock, as its holder wrote it; the bare lock file's name when that cannot be read."""
    try:
        record = json.loads(os.pread(fd, 4096, 0))
        return (f"pid {int(record['pid'])} on {record['host']} since {record['since']}: "
                f"{' '.join(str(record['command']).split())}")
    except (OSError, ValueError, KeyError, TypeError):
        return f"it holds {LOCK_NAME}"


def work_folder(root: Path, rel: str | Path) -> Path:
    """``root/rel``, created folder by folder, none of them a link: quantkit's own sub-folders of a folder the
    user named (a RUN_DIR's cache, DST's GPTQ work) must not lead writes anywhere else, as a planted link
    would. ``root`` itself is the user's choice and may be a link."""
    path = Path(root)
    for part in Path(rel).parts:
        path = path / part
        if path.is_symlink():
            raise QuantkitError("is a link: refused (quantkit writes only inside the folder you named)", path)
        try:
            path.mkdir(exist_ok=True)
        except FileExistsError as exc:
            raise QuantkitError("exists and is not a folder", path) from exc
        except OSError as exc:
            raise write_error(path, exc) from exc
    return path


def copy_file_atomic(src: Path, path: Path, chunk: int = 16 << 20) -> None:
    """Copy ``src`` to ``path`` through an exclusive temporary file; nothing under the final name until complete."""
    tmp = partial_name(path)
    try:
        with open(src, "rb") as fin, open_exclusive(tmp) as fout:
            while block := fin.read(chunk):
                fout.write(block)
            fout.flush()
            os.fsync(fout.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.filename is not None and Path(exc.filename) == src:
            raise QuantkitError(f"cannot read: {exc.strerror}", src) from exc
        raise write_error(path, exc) from exc


def write_error(path: Path, exc: OSError) -> QuantkitError:
    reason = "disk full" if exc.errno == errno.ENOSPC else (exc.strerror or str(exc))
    return QuantkitError(f"cannot write: {reason}", path)


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path, chunk: int = 16 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()
