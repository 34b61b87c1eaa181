"""Reading a Hugging Face checkpoint folder: config, index, safetensors headers, tensor bytes.

Headers are parsed and checked by hand (not through safetensors' reader) so that every lie a
file can tell — sizes that disagree with shapes, offsets past the end, a truncated copy — is
caught before any work starts and reported with the file and the tensor it concerns. Tensor
bytes are read with ``os.pread`` into fresh buffers: sequential, no mmap page-fault storms on
700 GB of cold data, and nothing kept alive after a shard is done.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from quantkit.errors import QuantkitError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# Pickle-based formats: loading one runs arbitrary code, so we never do.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
MAX_HEADER_BYTES = 100 * 1024 * 1024

# safetensors dtype code -> (bytes per element, torch dtype name)
DTYPES: dict[str, tuple[int, str]] = {
    "F64": (8, "float64"),
    "F32": (4, "float32"),
    "F16": (2, "float16"),
    "BF16": (2, "bfloat16"),
    "I64": (8, "int64"),
    "I32": (4, "int32"),
    "I16": (2, "int16"),
    "I8": (1, "int8"),
    "U8": (1, "uint8"),
    "BOOL": (1, "bool"),
    "F8_E4M3": (1, "float8_e4m3fn"),
    "F8_E5M2": (1, "float8_e5m2"),
}
TORCH_TO_CODE = {torch_name: code for code, (_, torch_name) in DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives and what it is, from the header alone."""

    name: str
    file: str  # shard file name, relative to the checkpoint folder
    dtype: str  # safetensors code, e.g. "BF16", "F8_E4M3"
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class Shard:
    name: str
    path: Path
    size: int
    header_sha256: str
    tensors: dict[str, TensorInfo] = field(default_factory=dict)


@dataclass
class Checkpoint:
    """A validated checkpoint folder. Nothing here has read tensor data yet."""

    root: Path
    config: dict
    shards: list[Shard]
    tensors: dict[str, TensorInfo]
    other_files: list[str]  # tokenizer, templates, generation config: copied verbatim

    @property
    def total_bytes(self) -> int:
        return sum(s.size for s in self.shards)

    def fingerprint(self) -> str:
        """Identifies the source without reading tensor data: config, shard names, sizes, headers."""
        h = hashlib.sha256()
        h.update(json.dumps(self.config, sort_keys=True).encode())
        for shard in self.shards:
            h.update(f"{shard.name}\0{shard.size}\0{shard.header_sha256}\n".encode())
        return h.hexdigest()


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Read config.json, the index (if any) and every shard header; refuse anything unsafe."""
    root = Path(path)
    if not root.is_dir():
        raise QuantkitError("not a checkpoint folder (expected config.json and *.safetensors)", root)
    config_path = root / "config.json"
    if not config_path.is_file():
        raise QuantkitError("config.json not found", root)
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise QuantkitError(f"invalid JSON: {exc}", config_path) from exc

    shard_names, weight_map = _shard_names(root)
    shards = [read_shard_header(root, name) for name in shard_names]
    tensors: dict[str, TensorInfo] = {}
    for shard in shards:
        for name, info in shard.tensors.items():
            if name in tensors:
                raise QuantkitError(f"tensor also stored in {tensors[name].file}", shard.path, name)
            tensors[name] = info
    if weight_map is not None:
        for name, file in weight_map.items():
            if name not in tensors:
                raise QuantkitError(f"index names {file} but the tensor is not in it", root / INDEX_NAME, name)
            if tensors[name].file != file:
                raise QuantkitError(f"index says {file}, found in {tensors[name].file}", root / INDEX_NAME, name)

    weights = set(shard_names) | {INDEX_NAME, "config.json"}
    other = sorted(
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.is_file() and str(p.relative_to(root)) not in weights and not _is_private(p.relative_to(root))
    )
    return Checkpoint(root=root, config=config, shards=shards, tensors=tensors, other_files=other)


def _is_private(rel: Path) -> bool:
    # quantkit's own state files and hidden folders (.cache, .git) never travel with a model
    return any(part.startswith(".") for part in rel.parts) or rel.name.startswith("quantkit-")


def _shard_names(root: Path) -> tuple[list[str], dict[str, str] | None]:
    index_path = root / INDEX_NAME
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text())
            weight_map = dict(index["weight_map"])
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise QuantkitError(f"invalid index: {exc}", index_path) from exc
        names = sorted(set(weight_map.values()))
        resolved_root = root.resolve()
        for name in names:
            target = (root / name).resolve()
            if os.path.isabs(name) or resolved_root not in target.parents:
                raise QuantkitError(f"index path {name!r} escapes the checkpoint folder", index_path)
            if not target.is_file():
                tensor = next(t for t, f in weight_map.items() if f == name)
                raise QuantkitError(f"index names missing file {name}", index_path, tensor)
        return names, weight_map
    names = sorted(p.name for p in root.glob("*.safetensors"))
    if not names:
        pickles = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise QuantkitError(
                f"pickle-only checkpoint ({pickles[0]}): quantkit never unpickles; convert it to safetensors first",
                root / pickles[0],
            )
        raise QuantkitError("no *.safetensors files", root)
    return names, None


def read_shard_header(root: Path, name: str) -> Shard:
    path = root / name
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise QuantkitError(f"truncated: {size} bytes, not even a header length", path)
        header_len = int.from_bytes(head, "little")
        if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
            raise QuantkitError(f"truncated or corrupt: header of {header_len} bytes in a {size}-byte file", path)
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise QuantkitError(f"corrupt header: {exc}", path) from exc
    if not isinstance(header, dict):
        raise QuantkitError("corrupt header: not a JSON object", path)
    header.pop("__metadata__", None)

    base = 8 + header_len
    data_size = size - base
    tensors: dict[str, TensorInfo] = {}
    spans = []
    for tname, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise QuantkitError(f"malformed header entry: {exc}", path, tname) from exc
        if dtype not in DTYPES:
            raise QuantkitError(f"unsupported dtype {dtype}", path, tname)
        expected = math.prod(shape) * DTYPES[dtype][0]
        if end - begin != expected or begin < 0:
            raise QuantkitError(
                f"header lies about its size: {dtype}{list(shape)} needs {expected} bytes, offsets span {end - begin}",
                path,
                tname,
            )
        if end > data_size:
            raise QuantkitError(f"truncated: data ends at byte {base + end}, file has {size}", path, tname)
        spans.append((begin, end, tname))
        tensors[tname] = TensorInfo(tname, name, dtype, shape, base + begin, base + end)
    spans.sort()
    cursor = 0
    for begin, end, tname in spans:
        if begin != cursor:
            raise QuantkitError(f"header offsets overlap or leave a gap at byte {base + begin}", path, tname)
        cursor = end
    if cursor != data_size:
        raise QuantkitError(f"file size {size} disagrees with header (data should end at {base + cursor})", path)
    return Shard(name, path, size, hashlib.sha256(raw).hexdigest(), tensors)


class TensorReader:
    """Reads tensors by name with pread; one open descriptor per shard, safe across threads."""

    def __init__(self, checkpoint: Checkpoint):
        self.checkpoint = checkpoint
        self._fds: dict[str, int] = {}

    def _fd(self, file: str) -> int:
        fd = self._fds.get(file)
        if fd is None:
            fd = os.open(self.checkpoint.root / file, os.O_RDONLY)
            self._fds[file] = fd
        return fd

    def read(self, name: str):
        import torch

        info = self.checkpoint.tensors[name]
        buf = bytearray(info.nbytes)
        view = memoryview(buf)
        fd, done = self._fd(info.file), 0
        while done < info.nbytes:
            got = os.preadv(fd, [view[done:]], info.start + done)
            if got == 0:
                raise QuantkitError("truncated while reading", self.checkpoint.root / info.file, name)
            done += got
        dtype = getattr(torch, DTYPES[info.dtype][1])
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(info.shape)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> "TensorReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
