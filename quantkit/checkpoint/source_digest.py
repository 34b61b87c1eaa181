"""A source's identity by content: what a conversion read, so that a resumed run never mixes two revisions.

A revision updated in place can keep every name, size and safetensors header (the checkpoint's ``fingerprint``), so
the identity that matters covers the bytes. It is xxh3-128, computed on the bytes as they are read (15 GB/s on one
core, beside the disk's 2-7): cheap enough to run on every byte of a 700 GB conversion. It guards against mixing
revisions, not against forgery: whoever can rewrite the source and the manifest can rewrite anything.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash

from quantkit.checkpoint.reader import Checkpoint, TensorReader
from quantkit.checkpoint.writer import write_bytes_atomic

CHUNK = 64 << 20
READERS = 8


class SourceDigest:
    """Tensors by name and bytes, in the order added."""

    def __init__(self, start: str = ""):
        self._h = xxhash.xxh3_128(start.encode())

    def add(self, name: str, data) -> None:
        """``data``: the tensor's bytes (any buffer, or a torch tensor, whose storage is read as it lies)."""
        if hasattr(data, "numpy"):
            import torch

            data = data.reshape(-1).view(torch.uint8).numpy()
        self._h.update(name.encode() + b"\0")
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def tensors_digest(reader: TensorReader, names: list[str], start: str = "") -> str:
    """The digest ``SourceDigest`` gives ``names`` read in this order from the source now."""
    digest = SourceDigest(start)
    for name in names:
        digest.add(name, reader.read_bytes(name))
    return digest.hexdigest()


def layer_tensors(ckpt: Checkpoint, i: int) -> list[str]:
    """Decoder layer ``i``'s source tensors, in name order."""
    prefix = f"model.layers.{i}."
    return sorted(n for n in ckpt.tensors if n.startswith(prefix))


def file_digests(ckpt: Checkpoint, cache: Path) -> dict[str, str]:
    """Each shard file's digest, whole; kept in ``cache`` under the file's size, times and inode, so a file is read
    again only once it may have changed (an edit in place moves its ctime, which no tool sets back)."""
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    known = known if isinstance(known, dict) else {}
    stamps = {}
    for shard in ckpt.shards:
        st = os.stat(ckpt.root / shard.name)
        stamps[shard.name] = f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}"
    stale = [name for name, stamp in stamps.items()
             if not (isinstance(known.get(name), list) and len(known[name]) == 2 and known[name][0] == stamp)]
    with ThreadPoolExecutor(max_workers=READERS) as pool:  # the hash lets go of the GIL: files read side by side
        fresh = dict(zip(stale, pool.map(lambda name: _file_digest(ckpt.root / name), stale), strict=True))
    kept = {name: [stamp, fresh[name] if name in fresh else known[name][1]] for name, stamp in stamps.items()}
    digests = {name: entry[1] for name, entry in kept.items()}
    if kept != known:
        write_bytes_atomic(cache, json.dumps(kept, indent=1, sort_keys=True).encode())
    return digests


def _file_digest(path: Path) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()
