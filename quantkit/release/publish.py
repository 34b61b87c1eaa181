"""``publish``: ship a converted checkpoint, and only the one that was gated.

The gate's verdict records the sha256 of every file the candidate ships (weights, config,
tokenizer, code); publish hashes DST's files now and refuses unless they are the same files (or
``force_ungated``, which the card then says). It writes the model card into DST as README.md and uploads
DST with huggingface_hub's resumable large-folder upload, or copies it to a local folder for a ``file://``
target. The token is huggingface_hub's business (HF_TOKEN or the stored login): quantkit never reads, prints or logs it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from quantkit.checkpoint.reader import CARD_NAME, shipped_files
from quantkit.checkpoint.writer import (
    LOCK_NAME,
    PARTIAL_SUFFIX,
    copy_file_atomic,
    folder_lock,
    sha256_file,
    write_bytes_atomic,
)
from quantkit.errors import QuantkitError, field_error

if TYPE_CHECKING:
    from quantkit.release.verdict import GateReport

# Generated answers, all word for word the baseline's with no log-likelihood item to compare, that mark a candidate
# run as the baseline's copy: a few short answers can agree in full, this many long ones from a converted model do not.
COPIED_GENERATIONS = 32


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
    *,
    gate: str | os.PathLike | None = None,
    private: bool = False,
    revision: str | None = None,
    dry_run: bool = False,
    force_ungated: bool = False,
    base_model: str | None = None,
    api=None,
    pools: list[str] | None = None,
) -> PublishResult:
    """Check the gate against DST, write the card, upload. ``api``: an ``HfApi`` (tests pass a recorder).

    :param repo: ``ORG/NAME`` on the hub, or ``file://DIR`` for a new or empty local folder.
    :param gate: the passing verdict.json whose checksums must equal every file DST ships now.
    :param pools: the card's section on the deployment's pools, when DST is one of them (release/pools.py).
    """
    from quantkit.release.card import model_card

    dst = Path(dst)
    if not (dst / "config.json").is_file():
        raise QuantkitError("not a checkpoint folder (no config.json)", dst)
    local = repo.startswith("file://")
    target = _local_target(dst, repo) if local else None
    if not local:
        from quantkit.release.card import hub_id

        if "/" not in repo:
            raise QuantkitError(f"invalid repo id {repo!r}: expected ORG/NAME or file://DIR")
        hub_id(repo, "--repo")
    shipped = [f for f in shipped_files(dst) if f["name"] != CARD_NAME]
    if target is not None:  # first: a target full of other files is refused before any hashing or card work
        _check_target_contents(target, {f["name"] for f in shipped} | {CARD_NAME})
    verdict = check_gate(dst, gate, force_ungated)
    card = model_card(dst, repo, verdict, base_model, pools)
    # The card as it will be written, whatever README.md DST holds now (a dry run writes nothing).
    files = sorted(shipped + [{"name": CARD_NAME, "bytes": len(card.encode())}], key=lambda f: f["name"])
    result = PublishResult(repo, "hub", revision or "main", verdict is not None, dry_run, files, card)
    if dry_run:
        return result
    write_bytes_atomic(dst / CARD_NAME, card.encode())
    if target is not None:
        result.target = str(_publish_local(dst, target, result.files))
    else:
        _publish_hub(api, repo, dst, private, revision, [f["name"] for f in result.files])
    return result


def check_gate(dst: Path, gate: str | os.PathLike | None, force_ungated: bool) -> GateReport | None:
    """The passing verdict whose checksums are every file DST ships now, or None when publishing ungated."""
    from quantkit.release.verdict import GateReport

    if gate is None:
        if force_ungated:
            return None
        raise PublishRefused("no gate verdict given (--gate VERDICT.json); --force-ungated publishes without one "
                             "and says so in the card", dst)
    gate = Path(gate)
    try:
        verdict = GateReport.model_validate_json(gate.read_bytes())
    except OSError as exc:
        raise PublishRefused(f"cannot read the gate verdict ({exc.strerror})", gate) from exc
    except ValidationError as exc:
        raise PublishRefused(f"not a gate verdict ({field_error(exc)})", gate) from exc
    verdict = _gate_again(verdict, gate)
    if not verdict.passed or not verdict.tasks or not all(t.passed for t in verdict.tasks):
        failed = [t.task for t in verdict.tasks if not t.passed]
        raise PublishRefused(f"the gate failed ({', '.join(failed) or 'no task passed'}); nothing is published", gate)
    recorded = verdict.candidate_checksums
    shipped = {f["name"] for f in shipped_files(dst) if f["name"] != CARD_NAME}
    for name in sorted(set(recorded) - shipped):
        raise PublishRefused(f"{name} was gated but is missing", dst / name)
    for name in sorted(shipped - set(recorded)):
        raise PublishRefused(f"{name} was not gated (added after the gate); remove it or gate again", dst / name)
    for name in sorted(shipped):
        if sha256_file(dst / name) != recorded[name]:
            raise PublishRefused(f"changed since it was gated (sha256 differs from {gate})", dst / name)
    _runs_are_of_this_model(dst, verdict, gate)
    return verdict


def _runs_are_of_this_model(dst: Path, verdict: GateReport, gate: Path) -> None:
    """The card says the release was tested against the original: the verdict's candidate run must have evaluated
    DST (its checkpoint fingerprint; a failed post-boot probe already stopped the gate run again above) and its
    baseline run the checkpoint DST was converted from (its manifest names it), not DST itself or any other model."""
    from quantkit.checkpoint.manifest import load_manifest
    from quantkit.checkpoint.reader import open_checkpoint
    from quantkit.evaluation.run_dir import read_run_record

    manifest = load_manifest(dst)
    if manifest is None:
        raise PublishRefused("has no quantkit manifest, so nothing says which model it was made from; a gated "
                             "publish needs one (convert writes it)", dst)
    candidate = read_run_record(Path(verdict.candidate))
    if candidate.model_fingerprint != open_checkpoint(dst).fingerprint():  # a baseline's run copied, checksums edited
        raise PublishRefused("the gate's candidate run does not record an evaluation of this checkpoint (its "
                             "checkpoint fingerprint is another model's, or none); evaluate this folder and gate "
                             "again", gate)
    baseline = read_run_record(Path(verdict.baseline))
    if _answers_copied(verdict, baseline, candidate):
        raise PublishRefused("the gate's candidate run gives the baseline run's answers on every item (log-"
                             "probabilities to the last digit, generated text word for word): no evaluation of this "
                             "checkpoint does that (a copy of the baseline's run?); evaluate this folder and gate "
                             "again", gate)
    if baseline.model_fingerprint != manifest.source_fingerprint:
        what = ("a run that does not record which checkpoint it evaluated (re-run eval)"
                if baseline.model_fingerprint is None else f"{baseline.model}")
        raise PublishRefused(f"the gate's baseline run evaluated {what}, not {manifest.source_path}, the model "
                             "this checkpoint was converted from; gate against a run of that model", gate)


def _answers_copied(verdict: GateReport, baseline, candidate) -> bool:
    """Whether the candidate's answers are the baseline's on every item both runs answered: the same log-probabilities
    where scored by log-likelihood, the same text where generated. A converted model's log-probabilities differ in the
    last digits on almost every item, and its greedy answers part from the source's somewhere in most long ones; so
    runs alike everywhere, on at least one log-likelihood item or COPIED_GENERATIONS of generated ones, are the
    baseline's run under another name. Fewer generated items alone are not told apart this way."""
    from quantkit.release.gate import load_samples

    scored = generated = 0
    for task in (t.task for t in verdict.tasks):
        theirs = load_samples(Path(verdict.baseline), baseline, task)
        for item, ours in load_samples(Path(verdict.candidate), candidate, task).items():
            other = theirs.get(item)
            if other is None:
                continue
            if ours.choice_logprobs is not None and other.choice_logprobs is not None:
                if ours.choice_logprobs != other.choice_logprobs:
                    return False
                scored += 1
            elif ours.generation is not None and other.generation is not None:
                if ours.generation != other.generation:
                    return False
                generated += 1
    return scored > 0 or generated >= COPIED_GENERATIONS


def _gate_again(verdict: GateReport, path: Path) -> GateReport:
    """The verdict computed again from the two run folders it names, by the suite and margin it records: a verdict
    edited to pass, or runs changed since the gate, are refused instead of trusted."""
    from quantkit.errors import CannotCompare
    from quantkit.release.gate import gate

    try:
        again = gate(verdict.baseline, verdict.candidate, suite=verdict.suite, margin=verdict.margin,
                     noise=verdict.noise_run)
    except CannotCompare as exc:
        raise PublishRefused(f"cannot gate again from the runs the verdict names: {exc}", path) from exc
    if again.model_dump(exclude={"report_files"}) != verdict.model_dump(exclude={"report_files"}):
        raise PublishRefused("differs from the verdict its runs give when gated again (edited, or the runs changed "
                             "since); gate again", path)
    return again


def _local_target(dst: Path, repo: str) -> Path:
    """The folder a ``file://`` publish writes: new, or empty, or holding only an earlier copy of these
    files; never DST, the source it came from, or a folder inside or around either."""
    from quantkit.checkpoint.manifest import load_manifest

    text = repo.removeprefix("file://")
    if not text.strip():
        raise QuantkitError("file:// needs a folder: file:///path/to/new-folder")
    target = Path(text).expanduser().resolve()
    manifest = load_manifest(dst)
    guarded = [("the checkpoint being published", dst.resolve())]
    if manifest is not None:
        guarded.append(("its source checkpoint", Path(manifest.source_path).resolve()))
    for what, folder in guarded:
        if target == folder or folder in target.parents or target in folder.parents:
            raise QuantkitError(f"the target is, or is inside or around, {what} ({folder}); choose a new "
                                f"folder", target)
    if target.exists() and not target.is_dir():
        raise QuantkitError("the target exists and is not a folder", target)
    return target


def _check_target_contents(target: Path, names: set[str]) -> None:
    """A local target may hold only an earlier, interrupted copy of these files: never merged into. The first
    entry that is not one of them refuses, before anything else is looked at (``file://~`` stops at once
    instead of walking a home folder)."""
    if not target.is_dir():
        return
    folders = {Path(n).parent.as_posix() for n in names} - {"."}
    folders |= {p.as_posix() for f in list(folders) for p in Path(f).parents if p.as_posix() != "."}
    pending = [(target, "")]
    while pending:
        folder, prefix = pending.pop()
        with os.scandir(folder) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                rel = prefix + entry.name
                if rel == LOCK_NAME or entry.name.endswith(PARTIAL_SUFFIX):
                    continue
                if entry.is_dir(follow_symlinks=False) and rel in folders:
                    pending.append((Path(entry.path), rel + "/"))
                elif entry.is_symlink() or not entry.is_file(follow_symlinks=False) or rel not in names:
                    raise QuantkitError(f"the target folder holds {rel}, which is not part of this model; "
                                        "publish into a new or empty folder", target)


def _publish_local(dst: Path, target: Path, files: list[dict]) -> Path:
    """Copy file by file (exclusive temporary name, then rename); files already there and equal are
    kept, so a re-run resumes."""
    target.mkdir(parents=True, exist_ok=True)
    with folder_lock(target):
        for f in files:
            src, out = dst / f["name"], target / f["name"]
            if out.is_file() and out.stat().st_size == f["bytes"] and sha256_file(out) == sha256_file(src):
                continue
            out.parent.mkdir(parents=True, exist_ok=True)
            copy_file_atomic(src, out)
    (target / LOCK_NAME).unlink(missing_ok=True)
    return target


def _publish_hub(api, repo: str, dst: Path, private: bool, revision: str | None, names: list[str]) -> None:
    """Upload exactly NAMES (the files the gate bound, and the card): each one as a pattern that matches only itself,
    so nothing else in DST (a hidden file in a subfolder, added after the gate) goes along."""
    import glob

    from huggingface_hub import HfApi

    api = api or HfApi()
    api.create_repo(repo, repo_type="model", private=private, exist_ok=True)
    if revision and revision != "main":
        api.create_branch(repo, branch=revision, repo_type="model", exist_ok=True)
    # Resumable: its state lives in DST/.cache/huggingface, so a re-run uploads only what is missing.
    api.upload_large_folder(repo_id=repo, folder_path=str(dst), repo_type="model", revision=revision,
                            private=private, allow_patterns=[glob.escape(name) for name in names])
