"""Integrity: every shard's sha256 against the manifest written as it was converted."""

from __future__ import annotations

from quantkit.checkpoint.manifest import load_manifest
from quantkit.checkpoint.reader import Checkpoint
from quantkit.verify.findings import Finding


def integrity(ckpt: Checkpoint, checked: dict[str, int]) -> list[Finding]:
    from quantkit.checkpoint.writer import sha256_file

    manifest = load_manifest(ckpt.root)
    if manifest is None:
        return [Finding("integrity", "a quantkit manifest records each shard's sha256", "no quantkit-manifest.json")]
    found = []
    for shard in ckpt.shards:
        record = manifest.shards.get(shard.name)
        if record is None:
            found.append(Finding("integrity", "every shard is recorded in the "
                                              "manifest", "not recorded", file=str(shard.path)))
            continue
        checked["shards hashed"] += 1
        if shard.size != record.size or sha256_file(shard.path) != record.sha256:
            found.append(Finding("integrity", "shard sha256 equals the manifest's",
                                 "contents changed since conversion (flipped bit, truncated or replaced "
                                 "copy)", file=str(shard.path)))
    for name in set(manifest.shards) - {s.name for s in ckpt.shards}:
        found.append(Finding("integrity", "every recorded shard is present", "recorded but not in the "
                "index", file=name))
    return found
