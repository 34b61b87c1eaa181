"""Benchmark data files checked row by row before lm-eval sees them.

lm-eval renders each row through the task's Jinja templates; a row without its answer, a gold label that is
not among the choices or a file with no rows ends deep inside lm-eval as an internal error, or worse, as a
score. Each task's rows are checked against the hub schema its template reads (shared/evaldata/README.md),
and the first bad row is refused with the file and line named.
"""

from __future__ import annotations

import json
from pathlib import Path

from quantkit.errors import QuantkitError

MAX_DATA_BYTES = 1 << 30  # MMLU's test set, the largest, is 7 MB


def _text(row: dict, key: str) -> str | None:
    return None if isinstance(row.get(key), str) and row[key].strip() else f"{key!r} must be a non-empty text"


def _texts(value, least: int) -> bool:
    return isinstance(value, list) and len(value) >= least and all(isinstance(v, str) for v in value)


def _index(value, size: int) -> bool:
    return type(value) is int and 0 <= value < size


def _arc(row: dict) -> str | None:
    choices = row.get("choices")
    if not isinstance(choices, dict) or not _texts(choices.get("text"), 2) or not _texts(choices.get("label"), 2) \
            or len(choices["text"]) != len(choices["label"]):
        return "'choices' must hold 'text' and 'label', lists of the same length (two or more)"
    if row.get("answerKey") not in choices["label"]:
        return f"'answerKey' {row.get('answerKey')!r} is not one of the labels {choices['label']}"
    return _text(row, "question")


def _mmlu(row: dict) -> str | None:
    if not _texts(row.get("choices"), 4) or len(row["choices"]) != 4:
        return "'choices' must be a list of four texts"
    if not _index(row.get("answer"), 4):
        return f"'answer' {row.get('answer')!r} must be 0, 1, 2 or 3"
    return _text(row, "question")


def _mmlu_pro(row: dict) -> str | None:
    if not _texts(row.get("options"), 2):
        return "'options' must be a list of two or more texts"
    if not _index(row.get("answer_index"), len(row["options"])):
        return f"'answer_index' {row.get('answer_index')!r} is not an index of the {len(row['options'])} options"
    return _text(row, "question")


def _gsm8k(row: dict) -> str | None:
    if not isinstance(row.get("answer"), str) or "####" not in row["answer"]:
        return "'answer' must be a text ending in '#### <number>'"
    return _text(row, "question")


CHECKS = {"arc_easy": _arc, "arc_challenge": _arc, "mmlu": _mmlu, "mmlu_pro": _mmlu_pro, "gsm8k": _gsm8k}


def check_task_data(task: str, raw: bytes, path: Path) -> int:
    """The number of items in a task's JSON-lines data; the first row that the task cannot read is refused."""
    check = CHECKS[task]
    items = 0
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise QuantkitError(f"line {n}: not JSON ({exc})", path) from exc
        problem = check(row) if isinstance(row, dict) else "not a JSON object"
        if problem:
            raise QuantkitError(f"line {n}: {problem} (task {task})", path)
        items += 1
    if not items:
        raise QuantkitError(f"no items: the data of task {task} is empty", path)
    return items
