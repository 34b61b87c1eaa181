"""What a run in RUN_DIR is: the model's files and family, the engine, the tasks. A run resumes, or is reused, only
when all of these match; the request cache is bound to them, so copied answers never stand for another run's."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from quantkit.checkpoint.writer import sha256_file
from quantkit.errors import QuantkitError
from quantkit.evaluation.run_dir import RunRecord, read_run_record, read_scores
from quantkit.evaluation.tasks import task_configs, task_identities


def model_checksums(path: Path) -> dict[str, str]:
    """sha256 of every file that ships with the model (what publish uploads, less the card it
    writes), so a verdict binds the config, tokenizer and code as well as the weights. Shards
    the manifest records at their recorded size take its sha256 (hours of hashing saved on a
    700 GB model); publish hashes every file again before anything ships."""
    from quantkit.checkpoint.manifest import load_manifest
    from quantkit.checkpoint.reader import CARD_NAME, shipped_files

    manifest = load_manifest(path)
    recorded = manifest.shards if manifest is not None else {}
    sums = {}
    for f in shipped_files(path):
        name = f["name"]
        if name == CARD_NAME:
            continue
        record = recorded.get(name)
        sums[name] = record.sha256 if record is not None and record.size == f["bytes"] else sha256_file(path / name)
    return sums


def model_family(path: Path) -> dict:
    """What makes two checkpoints the same model up to quantization: architecture and tokenizer."""
    from quantkit.checkpoint.reader import open_checkpoint

    config = open_checkpoint(path).config
    tokenizer = path / "tokenizer.json"
    return {"model_type": config.model_type or None, "architectures": config.architectures,
            "tokenizer_sha256": sha256_file(tokenizer) if tokenizer.is_file() else None}


def cache_binding(record: RunRecord, attempt: int) -> str:
    """What the cached answers of a run are bound to: the model's files, the engine and its settings, the
    prompts' template and seeds, and which pass of ``--repeat`` produced them (a copied first pass must not
    stand in for the repeat whose differences measure the engine's noise)."""
    bound = record.model_dump(include={"model_checksums", "engine", "lm_eval_version", "chat_template_sha256",
                                       "chat_template_applied", "seeds"})
    return hashlib.sha256(json.dumps(dict(bound, attempt=attempt), sort_keys=True).encode()).hexdigest()


def finished_run(run_dir: str | os.PathLike, model: str | os.PathLike, engine: str, tasks: list[str],
                 data_dir: str | os.PathLike | None, limit: int | None, settings: dict) -> bool:
    """Whether RUN_DIR already holds this evaluation, complete: same shards, tasks and engine settings.

    Decided without starting an engine, so a 700 GB baseline is not served again to be reused.
    """
    run_dir = Path(run_dir)
    try:
        meta = read_run_record(run_dir)
        scores = read_scores(run_dir)
    except QuantkitError:
        return False
    return (meta.model_checksums == model_checksums(Path(model))
            and meta.tasks == task_identities(task_configs(tasks, data_dir, Path(model)), limit)
            and meta.engine.name == engine
            and meta.engine.args == settings
            and set(scores) == set(tasks)
            and all((run_dir / "samples" / f"{t}.jsonl").is_file() for t in tasks))


def previous_run(run_dir: Path) -> RunRecord | None:
    """The run RUN_DIR already holds, validated (a folder someone else wrote is read as data, strictly)."""
    if not (run_dir / "run.json").exists():
        return None
    try:
        return read_run_record(run_dir)
    except QuantkitError as exc:
        raise QuantkitError(f"{exc.message}; use another --out", exc.file) from exc


def check_same_family(run_dir: Path, previous: RunRecord | None, provenance: dict) -> None:
    old = previous.model_family if previous is not None else None
    if old is not None and old != provenance["model_family"]:
        raise QuantkitError(f"holds a run of another model family ({old.get('model_type')}, tokenizer "
                            f"{str(old.get('tokenizer_sha256'))[:12]}) than {provenance['model']} "
                            f"({provenance['model_family']['model_type']}); use another --out", run_dir)


def check_same_run(run_dir: Path, previous: RunRecord | None, record: RunRecord) -> None:
    """A RUN_DIR resumes only the same run: cached requests of another model or setup would lie. Seeded-order runs of
    the same tasks may differ in how many items they take: a later look of a sequential gate extends an earlier one."""
    if previous is None:
        return
    for key in ("model", "model_checksums", "engine", "tasks"):
        old, new = getattr(previous, key), getattr(record, key)
        if key == "tasks" and set(old) == set(new) and all(
                o.order == n.order == "seeded" for o, n in ((old[t], new[t]) for t in new)):
            old = {t: v.model_copy(update={"limit": None, "items": None}) for t, v in old.items()}
            new = {t: v.model_copy(update={"limit": None, "items": None}) for t, v in new.items()}
        if old != new:
            raise QuantkitError(f"holds a run with a different {key}; use another --out", run_dir)
