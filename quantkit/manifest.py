"""The run manifest in DST: what was converted from what, and which output shards are done.

It is rewritten atomically after every finished shard, so after a kill -9 it names exactly
the shards that are complete on disk; ``verify`` and ``publish`` later read the checksums.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from quantkit.errors import QuantkitError
from quantkit.shard_writer import write_bytes_atomic

MANIFEST_NAME = "quantkit-manifest.json"
FORMAT_VERSION = 1


@dataclass
class ShardRecord:
    sha256: str
    size: int


@dataclass
class Manifest:
    quantkit_version: str
    source_path: str
    source_fingerprint: str
    recipe_name: str
    recipe_sha256: str
    plan_sha256: str
    max_shard_size: int
    status: str = "running"  # "running" until every shard, config and index is written
    shards: dict[str, ShardRecord] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def same_job(self, other: "Manifest") -> list[str]:
        """What differs between two runs that must not be mixed in one folder."""
        diffs = []
        if self.source_fingerprint != other.source_fingerprint:
            diffs.append(f"source ({other.source_path} vs {self.source_path})")
        if self.recipe_sha256 != other.recipe_sha256:
            diffs.append(f"recipe ({other.recipe_name} vs {self.recipe_name})")
        if self.plan_sha256 != other.plan_sha256:
            diffs.append("output layout (--max-shard-size or quantkit version)")
        return diffs

    def save(self, folder: Path) -> None:
        data = asdict(self)
        write_bytes_atomic(folder / MANIFEST_NAME, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode())


def load_manifest(folder: Path) -> Manifest | None:
    path = folder / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        shards = {k: ShardRecord(**v) for k, v in data.pop("shards").items()}
        return Manifest(**data, shards=shards)
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise QuantkitError(f"unreadable manifest ({exc}); use --force to start over", path) from exc
