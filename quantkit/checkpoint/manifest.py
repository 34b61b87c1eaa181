"""The run manifest in DST: what was converted from what, and which output shards are done.

It is rewritten atomically after every finished shard, so after a kill -9 it names exactly
the shards that are complete on disk; ``verify`` and ``publish`` later read the checksums.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError

from quantkit.checkpoint.writer import sha256_file, write_bytes_atomic
from quantkit.errors import QuantkitError, field_error

MANIFEST_NAME = "quantkit-manifest.json"
FORMAT_VERSION = 1


class ManifestStatus(str, Enum):
    RUNNING = "running"  # until every shard, the config and the index are written
    COMPLETE = "complete"


class ShardRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(ge=0)
    # what it was made from (checkpoint/source_digest.py): an output shard, the source tensors it read; a calibrated
    # layer, every source layer up to it (its inputs came through them). A resumed run re-reads and compares it.
    source_digest: str | None = Field(default=None, pattern=r"^[0-9a-f]{32}$")

    def matches(self, path: Path, rehash: bool = True) -> bool:
        """Whether ``path`` is still the file recorded: a regular file (not a link), of the recorded size and,
        with ``rehash``, the recorded sha256. What a resumed run checks before it keeps a finished file."""
        if not path.is_file() or path.is_symlink() or path.stat().st_size != self.size:
            return False
        return not rehash or sha256_file(path) == self.sha256


class CalibratedModuleRecord(BaseModel):
    """How one INT4 weight of a GPTQ or SignRound recipe was quantized, and on how much calibration."""

    model_config = ConfigDict(extra="forbid")

    method: Literal["gptq", "signround", "rtn"]
    tokens: int = Field(ge=0)  # calibration tokens that reached it (routed to its expert, for experts)
    loss: float | None = None  # GPTQ's reported loss; SignRound: its layer's best block-output MSE
    reason: str | None = None  # why RTN, or how the Hessian was built when not from routed tokens


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    quantkit_version: str
    source_path: str
    source_fingerprint: str
    recipe_name: str
    recipe_sha256: str
    plan_sha256: str
    max_shard_size: int
    status: ManifestStatus = ManifestStatus.RUNNING
    shards: dict[str, ShardRecord] = Field(default_factory=dict)
    calibration_sha256: str | None = None  # GPTQ, SignRound: the calibration tokens and settings
    computed_in: str | None = None  # a GPTQ walk's dtype where not the model's own (older manifests: the model's)
    # a calibrated recipe's finished layers (resume) and what it did per weight; quantkit before the calibrated walk
    # had one named them gptq_layers and gptq_modules, for SignRound too: those manifests still load and resume
    calibrated_layers: dict[str, ShardRecord] = Field(default_factory=dict,
                                                      validation_alias=AliasChoices("calibrated_layers", "gptq_layers"))
    calibrated_modules: dict[str, CalibratedModuleRecord] = Field(
        default_factory=dict, validation_alias=AliasChoices("calibrated_modules", "gptq_modules"))
    format_version: int = FORMAT_VERSION

    def differences(self, other: "Manifest") -> list[str]:
        """What differs between two runs that must not be mixed in one folder."""
        diffs = []
        if self.source_fingerprint != other.source_fingerprint:
            diffs.append(f"source ({other.source_path} vs {self.source_path})")
        if self.recipe_sha256 != other.recipe_sha256:
            diffs.append(f"recipe ({other.recipe_name} vs {self.recipe_name})")
        if self.calibration_sha256 != other.calibration_sha256:
            diffs.append("calibration data")
        if self.computed_in != other.computed_in:
            ours, theirs = other.computed_in or "the model's", self.computed_in or "the model's"
            diffs.append(f"compute dtype ({ours} vs {theirs})")
        if self.plan_sha256 != other.plan_sha256:
            diffs.append("output layout (--max-shard-size or quantkit version)")
        return diffs

    def save(self, folder: Path) -> None:
        """Written with every record in name order, not in the order work finished: the manifest ships with
        the model and the gate binds its bytes, so identical inputs must give identical files."""
        ordered = self.model_copy(update={field: dict(sorted(getattr(self, field).items()))
                                          for field in ("shards", "calibrated_layers", "calibrated_modules")})
        text = ordered.model_dump_json(indent=2)
        write_bytes_atomic(folder / MANIFEST_NAME, (text + "\n").encode())


def load_manifest(folder: Path) -> Manifest | None:
    path = folder / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        return Manifest.model_validate_json(path.read_bytes())
    except ValidationError as exc:
        raise QuantkitError(f"unreadable manifest ({field_error(exc)}); convert --force starts over", path) from exc
