"""WORK/release-state.json: which stages of a release are done, and the files each one left behind.

A finished stage is skipped on ``--resume`` only while its fingerprint (the config sections and input files it
read) is unchanged and every file it wrote is still there and still the same: a published folder deleted since,
or a run directory edited, makes its stage (and every later one) run again instead of reporting work that no
longer exists. Files are compared by size and sha256; a file whose size and modification time are those recorded
keeps its recorded sha256 (as git's index does), so a resume does not hash a 700 GB model again.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import Field, ValidationError

from quantkit.checkpoint.writer import sha256_file, write_bytes_atomic
from quantkit.errors import QuantkitError, field_error
from quantkit.settings import Section

STATE_NAME = "release-state.json"


class FileRecord(Section):
    size: int = Field(ge=0)
    mtime_ns: int
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class StageState(Section):
    fingerprint: str
    seconds: float
    summary: str
    outputs: list[str] | None = None  # absolute paths; None: recorded by a quantkit that kept no outputs


class ReleaseState(Section):
    stages: dict[str, StageState] = Field(default_factory=dict)
    owns_model: bool = False  # WORK/model was written by this release (so it may replace it)
    files: dict[str, FileRecord] = Field(default_factory=dict)  # every output file of a finished stage, as left

    def record(self, paths: list[Path], known: dict[str, str] | None = None) -> list[str]:
        """Record ``paths`` as they are now; ``known``: sha256 already computed for some of them (absolute path ->
        sha256), trusted when the size is the one hashed. Returns the paths as stored."""
        names = []
        for path in paths:
            name = str(Path(path).absolute())
            info = os.stat(name)
            old = self.files.get(name)
            if old is not None and (old.size, old.mtime_ns) == (info.st_size, info.st_mtime_ns):
                digest = old.sha256
            else:
                digest = (known or {}).get(name) or sha256_file(Path(name))
            self.files[name] = FileRecord(size=info.st_size, mtime_ns=info.st_mtime_ns, sha256=digest)
            names.append(name)
        return names

    def changed_output(self, stage: str) -> str | None:
        """The first output of ``stage`` that is missing or differs from its record (or why it cannot be
        checked); None when all are as the stage left them."""
        done = self.stages[stage]
        if done.outputs is None:
            return "its outputs were not recorded"
        for name in done.outputs:
            record = self.files.get(name)
            path = Path(name)
            if record is None or path.is_symlink() or not path.is_file():
                return f"{name} is missing"
            info = path.stat()
            if info.st_size != record.size:
                return f"{name} changed"
            if info.st_mtime_ns != record.mtime_ns:
                if sha256_file(path) != record.sha256:
                    return f"{name} changed"
                self.files[name] = record.model_copy(update={"mtime_ns": info.st_mtime_ns})
        return None

    def forget_from(self, stages: tuple[str, ...]) -> None:
        """Drop ``stages``' records (they are to run again) and the files no remaining stage claims."""
        for stage in stages:
            self.stages.pop(stage, None)
        claimed = {name for s in self.stages.values() for name in s.outputs or []}
        self.files = {name: r for name, r in self.files.items() if name in claimed}

    def save(self, path: Path) -> None:
        write_bytes_atomic(path, (self.model_dump_json(indent=2) + "\n").encode())


def load_state(path: Path) -> ReleaseState | None:
    if not path.is_file():
        return None
    try:
        return ReleaseState.model_validate_json(path.read_bytes())
    except ValidationError as exc:
        raise QuantkitError(f"unreadable release state ({field_error(exc)}); remove it to start over", path) from exc
