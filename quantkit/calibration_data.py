"""Calibration text -> token batches: what calibrate-kv observes and what GPTQ's Hessians are built from.

Texts are concatenated (EOS between) and cut into ``samples`` sequences of ``seq_len`` tokens,
so every sequence is full length and no padding or attention mask enters the statistics.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from quantkit.errors import QuantkitError

DEFAULT_DATA = Path(__file__).resolve().parent / "data" / "calibration.jsonl"  # GSM8K train text


def load_texts(path: Path, text_field: str = "text") -> list[str] | list[list[int]]:
    """The texts of a JSON-lines file (one ``text_field`` per line) or of a text file (paragraphs); a
    JSON-lines file whose rows hold ``input_ids`` instead gives those token ids (already tokenized)."""
    if not path.is_file():
        raise QuantkitError("calibration data not found", path)
    raw = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".jsonl":
        texts = []
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise QuantkitError(f"line {n}: invalid JSON ({exc.msg})", path) from exc
            if isinstance(row, dict) and text_field not in row and "input_ids" in row:
                ids = row["input_ids"]
                if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
                    raise QuantkitError(f"line {n}: input_ids must be a list of token ids", path)
                texts.append(ids)
                continue
            if not isinstance(row, dict) or text_field not in row:
                raise QuantkitError(f"line {n}: no field {text_field!r} (use --text-field)", path)
            texts.append(str(row[text_field]))
        if len({isinstance(t, list) for t in texts}) > 1:
            raise QuantkitError("mixes text and input_ids rows", path)
        if texts and isinstance(texts[0], list):
            return texts
    else:
        texts = [p for p in raw.split("\n\n")]
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise QuantkitError("calibration data is empty", path)
    return texts


def token_batches(tokenizer, texts: list, samples: int, seq_len: int, batch_size: int, source: Path,
                  require_all: bool = False) -> list[torch.Tensor]:
    """``samples`` sequences of ``seq_len`` tokens in batches; with ``require_all`` fewer is an error
    (GPTQ's result depends on exactly the tokens asked for), otherwise what the data holds is used."""
    ids: list[int] = []
    need = samples * seq_len
    for text in texts:
        if isinstance(text, list):  # already token ids: used as given, no EOS added
            ids.extend(text)
        else:
            eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
            ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"] + [eos])
        if len(ids) >= need:
            break
    usable = len(ids) // seq_len
    if usable == 0 or (require_all and usable < samples):
        raise QuantkitError(f"too short: {len(ids)} tokens, asked for {samples} sequence(s) of {seq_len}", source)
    sequences = torch.tensor(ids[: min(usable, samples) * seq_len]).view(-1, seq_len)
    return list(sequences.split(batch_size))


def model_tokenizer(model: Path):
    """The tokenizer in a model folder, or a one-line error naming the folder."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as exc:
        raise QuantkitError(f"no tokenizer in the model folder ({type(exc).__name__})", model) from exc
