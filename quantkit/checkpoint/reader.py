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
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from quantkit.checkpoint.config import ModelConfig
from quantkit.errors import QuantkitError
from quantkit.gc_pause import gc_paused

INDEX_NAME = "model.safetensors.index.json"
# Pickle-based formats: loading one runs arbitrary code, so we never do.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
MAX_HEADER_BYTES = 100 * 1024 * 1024
PINNED_MAX = 64 << 20  # tensors up to this size go to and from a GPU through pinned (cached) host memory
HUB_FILE_LIMIT = 50 * 10**9  # the hub refuses larger files
SCALES_SHARD = "kv-scales.safetensors"  # calibrate-kv's KV-cache scales, added to a converted checkpoint
CARD_NAME = "README.md"  # the model card, which publish writes
# Never shipped: upload state, partial files of an interrupted writer, the lock, RUN_DIRs kept beside the model.
SHIP_IGNORE = [".cache/**", "*.partial", "*.tmp", ".*"]

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


class TensorInfo(NamedTuple):
    """Where one tensor lives and what it is, from the header alone. A tuple: a GLM-5-sized checkpoint has
    120,000 of them, which Python builds several times faster as tuples than as frozen dataclasses."""

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
    config: ModelConfig
    shards: list[Shard]
    tensors: dict[str, TensorInfo]
    other_files: list[str]  # tokenizer, templates, generation config: copied verbatim
    skipped_files: list[str] = field(default_factory=list)  # weight files the index does not own: never copied

    @property
    def total_bytes(self) -> int:
        return sum(s.size for s in self.shards)

    def fingerprint(self) -> str:
        """Identifies the source without reading tensor data: config, shard names, sizes, headers."""
        h = hashlib.sha256()
        h.update(json.dumps(self.config.raw, sort_keys=True).encode())
        for shard in self.shards:
            h.update(f"{shard.name}\0{shard.size}\0{shard.header_sha256}\n".encode())
        return h.hexdigest()


@gc_paused
def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Read config.json, the index (if any) and every shard header; refuse anything unsafe."""
    root = Path(path)
    if not root.is_dir():
        raise QuantkitError("not a checkpoint folder (expected config.json and *.safetensors)", root)
    roots = link_roots(root)
    config = read_config(root)

    shard_names, weight_map = _shard_names(root, roots)
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
    other: list[str] = []
    skipped: list[str] = []
    for rel in _files_below(root):
        if rel in weights or _is_private(Path(rel)):
            continue
        checked_file(root, rel, roots)
        # A weight file the index does not list (a consolidated copy, an old format) is not a side file.
        (skipped if rel.endswith((".safetensors", *PICKLE_SUFFIXES, ".gguf")) else other).append(rel)
    return Checkpoint(root=root, config=config, shards=shards, tensors=tensors, other_files=other,
                      skipped_files=skipped)


def read_config(root: Path) -> ModelConfig:
    """config.json checked and typed (what every command reads first), or a one-line error naming it."""
    config_path = root / "config.json"
    if not config_path.is_file():
        raise QuantkitError("config.json not found", root)
    checked_file(root, "config.json", link_roots(root))
    try:
        config = json.loads(config_path.read_text())
    except (ValueError, RecursionError) as exc:  # bad JSON or UTF-8, an integer of thousands of digits, deep nesting
        raise QuantkitError(f"invalid JSON: {_first_words(exc)}", config_path) from exc
    if not isinstance(config, dict):
        raise QuantkitError(f"not a JSON object but {type(config).__name__}", config_path)
    return ModelConfig.read(config, config_path)


def _first_words(exc: BaseException) -> str:
    """An exception's message on one line, cut where Python's advice to the programmer starts."""
    return " ".join(str(exc).split(";")[0].split())


def link_roots(root: Path) -> list[Path]:
    """Where links inside a model folder may lead: the folder itself and, for a Hugging Face hub
    cache snapshot (``models--org--name/snapshots/REV``), that model's repo folder, whose
    ``blobs/`` hold the files every snapshot entry links to."""
    roots = [root.resolve()]
    parts = root.absolute().parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith(("models--", "datasets--")):
        roots.append(Path(*parts[:-2]).resolve())
    return roots


def checked_file(root: Path, rel: str, roots: list[Path]) -> Path:
    """``root/rel`` if it is a regular file that stays inside ``roots`` after following links; else an error naming
    it."""
    path = root / rel
    real = path.resolve()
    if not any(real == r or r in real.parents for r in roots):
        raise QuantkitError(f"links to {real}, outside the model's folder: refused (a link may only stay inside "
                            f"it)", path)
    try:
        mode = os.stat(real).st_mode
    except OSError as exc:
        raise QuantkitError(f"cannot read ({exc.strerror})", path) from exc
    if not stat.S_ISREG(mode):
        raise QuantkitError("not a regular file (a folder, pipe or device)", path)
    return path


def _files_below(root: Path) -> list[str]:
    """Every non-folder entry below ``root`` (links to folders are not walked), relative, sorted."""
    found = []
    for folder, dirs, files in os.walk(root):
        rel_folder = Path(folder).relative_to(root)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and not (Path(folder) / d).is_symlink())
        found += [(rel_folder / f).as_posix() for f in files]
    return sorted(found)


def _is_private(rel: Path) -> bool:
    # quantkit's own state files and hidden folders (.cache, .git) never travel with a model
    return any(part.startswith(".") for part in rel.parts) or rel.name.startswith("quantkit-")


def _shard_names(root: Path, roots: list[Path]) -> tuple[list[str], dict[str, str] | None]:
    index_path = root / INDEX_NAME
    if index_path.is_file():
        checked_file(root, INDEX_NAME, roots)
        try:
            index = json.loads(index_path.read_text())
            weight_map = dict(index["weight_map"])
        except (KeyError, TypeError, ValueError, RecursionError) as exc:
            raise QuantkitError(f"invalid index: {_first_words(exc)}", index_path) from exc
        for tensor, name in weight_map.items():
            if not isinstance(name, str) or not isinstance(tensor, str):
                raise QuantkitError(f"invalid index: weight_map value {name!r} is not a file "
                                    f"name", index_path, str(tensor))
            if os.path.isabs(name) or ".." in Path(name).parts:
                raise QuantkitError(f"index path {name!r} escapes the checkpoint folder", index_path, tensor)
        names = sorted(set(weight_map.values()))
        for name in names:
            if not (root / name).exists():
                tensor = next(t for t, f in weight_map.items() if f == name)
                raise QuantkitError(f"index names missing file {name}", index_path, tensor)
            checked_file(root, name, roots)
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
    for name in names:
        checked_file(root, name, roots)
    return names, None


def read_shard_header(root: Path, name: str) -> Shard:
    """One shard's header, checked; the caller has passed the file through ``checked_file`` (a FIFO
    would block the read for ever)."""
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
    except (ValueError, RecursionError) as exc:
        raise QuantkitError(f"corrupt header: {_first_words(exc)}", path) from exc
    if not isinstance(header, dict):
        raise QuantkitError("corrupt header: not a JSON object", path)
    header.pop("__metadata__", None)

    base = 8 + header_len
    data_size = size - base
    tensors: dict[str, TensorInfo] = {}
    spans = []
    for tname, entry in header.items():
        if _LONG_NUMBER.search(tname):
            raise QuantkitError("a number of more than 9 digits in the tensor name (layer and expert indices are "
                                "far smaller): refused", path, tname[:200])
        dtype, shape, begin, end = _header_entry(entry, path, tname)
        expected = math.prod(shape) * DTYPES[dtype][0]
        if end - begin != expected:
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


# Tensor names are parsed for layer and expert indices in many places; bounding the digits here bounds them all.
_LONG_NUMBER = re.compile(r"\d{10}")


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _header_entry(entry, path: Path, tname: str) -> tuple[str, tuple[int, ...], int, int]:
    """(dtype, shape, begin, end) of one header entry, each checked for its type: the format
    stores integers, and a float, string or negative value is a corrupt (or hostile) file."""
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise QuantkitError("malformed header entry (needs exactly dtype, shape, data_offsets)", path, tname)
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise QuantkitError(f"unsupported dtype {dtype!r}", path, tname)
    if not isinstance(shape, list) or len(shape) > 8 or not all(_is_count(d) for d in shape):
        raise QuantkitError(f"malformed shape {shape!r} (a list of non-negative integers)", path, tname)
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise QuantkitError(f"malformed data_offsets {offsets!r} (two non-negative integers)", path, tname)
    return dtype, tuple(shape), offsets[0], offsets[1]


def shipped_files(folder: Path) -> list[dict]:
    """Every file that ships with a model folder (name, bytes): what publish uploads and what a gate
    verdict binds. A link leading out of the folder, or a non-file, is refused, naming it."""
    import fnmatch

    files = []
    roots = link_roots(folder)
    for path in sorted(p for p in folder.rglob("*") if not p.is_dir()):
        name = path.relative_to(folder).as_posix()
        if any(fnmatch.fnmatch(name, pattern) or fnmatch.fnmatch(path.name, pattern) for pattern in SHIP_IGNORE):
            continue
        checked_file(folder, name, roots)
        size = path.stat().st_size
        if size > HUB_FILE_LIMIT:
            raise QuantkitError(f"{size / 1e9:.1f} GB is over the hub's 50 GB file limit; convert with a smaller "
                                "--max-shard-size", path)
        files.append({"name": name, "bytes": size})
    return files


# safetensors integer codes as struct formats (little-endian: the only byte order quantkit runs on)
_INT_FORMATS = {"I8": "b", "U8": "B", "I16": "h", "U16": "H", "I32": "i", "U32": "I", "I64": "q", "U64": "Q"}


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

    def read_bytes(self, name: str) -> bytearray:
        buf = bytearray(self.checkpoint.tensors[name].nbytes)
        self._read_into(name, memoryview(buf))
        return buf

    def _read_into(self, name: str, view: memoryview) -> None:
        info = self.checkpoint.tensors[name]
        fd, done = self._fd(info.file), 0
        while done < info.nbytes:
            got = os.preadv(fd, [view[done:]], info.start + done)
            if got == 0:
                raise QuantkitError("truncated while reading", self.checkpoint.root / info.file, name)
            done += got

    def read(self, name: str, pinned: bool = False):
        """The tensor, read into memory of its own (never zero-filled first); ``pinned``: page-locked memory that a
        GPU copies from without staging, for tensors up to PINNED_MAX (a larger one would stay pinned in torch's
        cache for the rest of the process)."""
        import torch

        info = self.checkpoint.tensors[name]
        dtype = getattr(torch, DTYPES[info.dtype][1])
        out = torch.empty(info.nbytes, dtype=torch.uint8, pin_memory=pinned and 0 < info.nbytes <= PINNED_MAX)
        if info.nbytes:
            self._read_into(name, out.numpy().data)
        return out.view(dtype).reshape(info.shape)

    def read_ints(self, name: str) -> list[int]:
        """A small integer tensor's values, flattened, without torch (``weight_shape`` and the like)."""
        info = self.checkpoint.tensors[name]
        if info.dtype not in _INT_FORMATS:
            raise QuantkitError(f"expected an integer tensor, found "
                                f"{info.dtype}", self.checkpoint.root / info.file, name)
        return memoryview(self.read_bytes(name)).cast(_INT_FORMATS[info.dtype]).tolist()  # type: ignore[call-overload]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> "TensorReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
