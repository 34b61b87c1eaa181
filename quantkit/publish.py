"""``publish``: ship a converted checkpoint, and only the one that was gated.

The gate's verdict records the candidate's shard checksums; publish hashes DST's shards now and
refuses unless they are the same files (or ``force_ungated``, which the card then says). It writes
the model card into DST as README.md and uploads DST with huggingface_hub's resumable large-folder
upload, or copies it to a local folder for a ``file://`` target. The token is huggingface_hub's
business (HF_TOKEN or the stored login): quantkit never reads, prints or logs it.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from quantkit.errors import QuantkitError
from quantkit.shard_writer import sha256_file, write_bytes_atomic

HUB_FILE_LIMIT = 50 * 10**9  # the hub refuses larger files
CARD_NAME = "README.md"
# Never uploaded: upload state, partial files of an interrupted convert, RUN_DIRs kept beside the model.
IGNORE = [".cache/**", "*.partial", "*.tmp", ".*"]


class PublishRefused(QuantkitError):
    """What would be published is not what was gated (or was never gated)."""


@dataclass
class PublishResult:
    repo: str
    target: str  # "hub" or the local folder
    revision: str
    gated: bool
    dry_run: bool
    files: list[dict] = field(default_factory=list)  # name, bytes
    card: str = ""


def publish(
    dst: str | os.PathLike,
    repo: str,
    gate: str | os.PathLike | None = None,
    private: bool = False,
    revision: str | None = None,
    dry_run: bool = False,
    force_ungated: bool = False,
    base_model: str | None = None,
    api=None,
) -> PublishResult:
    """Check the gate against DST, write the card, upload. ``api``: an ``HfApi`` (tests pass a recorder)."""
    from quantkit.model_card import model_card

    dst = Path(dst)
    if not (dst / "config.json").is_file():
        raise QuantkitError("not a checkpoint folder (no config.json)", dst)
    verdict = check_gate(dst, gate, force_ungated)
    card = model_card(dst, repo, verdict, base_model)
    # The card as it will be written, whatever README.md DST holds now (a dry run writes nothing).
    files = sorted([f for f in upload_list(dst) if f["name"] != CARD_NAME] + [{"name": CARD_NAME, "bytes": len(card.encode())}],
                   key=lambda f: f["name"])
    result = PublishResult(repo, "hub", revision or "main", verdict is not None, dry_run, files, card)
    if dry_run:
        return result
    write_bytes_atomic(dst / CARD_NAME, card.encode())
    if repo.startswith("file://"):
        result.target = str(_publish_local(dst, Path(repo.removeprefix("file://")), result.files))
    else:
        _publish_hub(api, repo, dst, private, revision)
    return result


def check_gate(dst: Path, gate: str | os.PathLike | None, force_ungated: bool) -> dict | None:
    """The passing verdict whose checksums are DST's shards, or None when publishing ungated."""
    from quantkit.checkpoint import open_checkpoint

    if gate is None:
        if force_ungated:
            return None
        raise PublishRefused("no gate verdict given (--gate VERDICT.json); --force-ungated publishes without one "
                             "and says so in the card", dst)
    gate = Path(gate)
    try:
        verdict = json.loads(gate.read_text())
        recorded = dict(verdict["candidate_checksums"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise PublishRefused(f"not a gate verdict ({exc})", gate) from exc
    if not verdict.get("passed"):
        failed = [t["task"] for t in verdict.get("tasks", []) if not t.get("passed")]
        raise PublishRefused(f"the gate failed ({', '.join(failed) or 'no task passed'}); nothing is published", gate)
    shards = {s.name: s.path for s in open_checkpoint(dst).shards}
    for name in sorted(set(recorded) - set(shards)):
        raise PublishRefused(f"shard {name} was gated but is missing", dst / name)
    for name in sorted(set(shards) - set(recorded)):
        raise PublishRefused(f"shard {name} was not gated", dst / name)
    for name in sorted(shards):
        if sha256_file(shards[name]) != recorded[name]:
            raise PublishRefused(f"changed since it was gated (sha256 differs from {gate})", shards[name])
    return verdict


def upload_list(dst: Path) -> list[dict]:
    import fnmatch

    files = []
    for path in sorted(p for p in dst.rglob("*") if p.is_file()):
        name = path.relative_to(dst).as_posix()
        if any(fnmatch.fnmatch(name, pattern) or fnmatch.fnmatch(path.name, pattern) for pattern in IGNORE):
            continue
        size = path.stat().st_size
        if size > HUB_FILE_LIMIT:
            raise QuantkitError(f"{size / 1e9:.1f} GB is over the hub's 50 GB file limit; convert with a smaller "
                                "--max-shard-size", path)
        files.append({"name": name, "bytes": size})
    return files


def _publish_local(dst: Path, target: Path, files: list[dict]) -> Path:
    """Copy file by file (temporary name, then rename); files already there and equal are kept, so a re-run resumes."""
    target.mkdir(parents=True, exist_ok=True)
    for f in files:
        src, out = dst / f["name"], target / f["name"]
        if out.is_file() and out.stat().st_size == f["bytes"] and sha256_file(out) == sha256_file(src):
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".partial")
        shutil.copyfile(src, tmp)
        os.replace(tmp, out)
    return target


def _publish_hub(api, repo: str, dst: Path, private: bool, revision: str | None) -> None:
    from huggingface_hub import HfApi

    api = api or HfApi()
    api.create_repo(repo, repo_type="model", private=private, exist_ok=True)
    if revision and revision != "main":
        api.create_branch(repo, branch=revision, repo_type="model", exist_ok=True)
    # Resumable: its state lives in DST/.cache/huggingface, so a re-run uploads only what is missing.
    api.upload_large_folder(repo_id=repo, folder_path=str(dst), repo_type="model", revision=revision,
                            private=private, ignore_patterns=IGNORE)
