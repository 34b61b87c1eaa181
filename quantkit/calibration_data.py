"""Calibration text -> token batches: what calibrate-kv observes and what GPTQ's Hessians are built from.

Texts are concatenated (EOS between) and cut into ``samples`` sequences of ``seq_len`` tokens,
so every sequence is full length and no padding or attention mask enters the statistics.

The file is read as a stream and only as far as the requested tokens need: a 40 MB paragraph
asked for 8 x 64 tokens is tokenized a few kilobytes at a time, not whole. Every row read is
checked (a ``null`` text is not the text "None"; token ids are integers, never booleans, below
2**31) and a bad one is refused with the file and line named.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from quantkit.errors import QuantkitError

DEFAULT_DATA = Path(__file__).resolve().parent / "data" / "calibration.jsonl"  # GSM8K train text
MAX_LINE_BYTES = 64 << 20  # one JSON row (a whole document at most)
MAX_TOKEN_ID = (1 << 31) - 1  # token ids are int32 in every engine and tokenizer quantkit meets
PARAGRAPH_CHARS = 1 << 20  # a text file's paragraph longer than this is handed on in pieces
PIECE_CHARS = 1 << 16  # a text up to this long is tokenized whole (as it always was)
CHARS_PER_TOKEN = 8  # more text than this per missing token is never tokenized at once
_READ = 1 << 20


@dataclass(frozen=True)
class Piece:
    """Part of a text too long to hold at once; ``ends``: the text ends with it (its EOS follows)."""

    text: str
    ends: bool


def read_rows(path: Path, text_field: str = "text") -> Iterator[str | list[int] | Piece]:
    """The rows of a JSON-lines file (one ``text_field`` per line, or ``input_ids``: already tokenized) or the
    paragraphs of a text file, one at a time and each checked; blank texts are skipped."""
    if not path.is_file():
        raise QuantkitError("calibration data not found", path)
    if path.suffix == ".jsonl":
        yield from _jsonl_rows(path, text_field)
    else:
        yield from _paragraphs(path)


def _jsonl_rows(path: Path, text_field: str) -> Iterator[str | list[int]]:
    with open(path, "rb") as f:
        for n, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), 1):
            if len(raw) > MAX_LINE_BYTES:
                raise QuantkitError(f"line {n}: over {MAX_LINE_BYTES >> 20} MiB", path)
            line = raw.decode("utf-8", errors="replace")
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise QuantkitError(f"line {n}: invalid JSON ({exc.msg})", path) from exc
            except RecursionError as exc:
                raise QuantkitError(f"line {n}: nested deeper than JSON is read here", path) from exc
            except ValueError as exc:  # an integer of more digits than Python converts
                raise QuantkitError(f"line {n}: invalid JSON ({' '.join(str(exc).split())[:120]})", path) from exc
            if not isinstance(row, dict):
                raise QuantkitError(f"line {n}: not a JSON object", path)
            if text_field in row:
                text = row[text_field]
                if not isinstance(text, str):
                    raise QuantkitError(f"line {n}: {text_field!r} is {json.dumps(text)[:20]}, not a text", path)
                if text.strip():
                    yield text
            elif "input_ids" in row:
                yield _token_ids(row["input_ids"], n, path)
            else:
                raise QuantkitError(f"line {n}: no field {text_field!r} (use --text-field)", path)


def _token_ids(ids, n: int, path: Path) -> list[int]:
    if not isinstance(ids, list) or not ids or not all(
            type(i) is int and 0 <= i <= MAX_TOKEN_ID for i in ids):  # type(): a bool is no token id
        raise QuantkitError(f"line {n}: input_ids must be a non-empty list of token ids (integers from 0 to "
                            f"{MAX_TOKEN_ID:,})", path)
    return ids


def _paragraphs(path: Path) -> Iterator[str | Piece]:
    """Paragraphs (split at blank lines), decoded as they are read; a paragraph longer than PARAGRAPH_CHARS comes
    as Pieces, so no paragraph is ever held whole."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    buffer, continued = "", False
    with open(path, "rb") as f:
        while block := f.read(_READ):
            buffer += decoder.decode(block)
            while (cut := buffer.find("\n\n")) >= 0:
                yield from _paragraph(buffer[:cut], continued, True)
                buffer, continued = buffer[cut + 2:], False
            if len(buffer) > PARAGRAPH_CHARS:
                keep = 1 if buffer.endswith("\n") else 0  # the first half of a blank line stays to be found
                yield from _paragraph(buffer[:len(buffer) - keep], continued, False)
                buffer, continued = buffer[len(buffer) - keep:], True
        buffer += decoder.decode(b"", final=True)
    yield from _paragraph(buffer, continued, True)


def _paragraph(text: str, continued: bool, ends: bool) -> Iterator[str | Piece]:
    if continued or not ends:
        yield Piece(text, ends)
    elif text.strip():
        yield text


def token_batches(tokenizer, texts: Iterable[str | list[int] | Piece], samples: int, seq_len: int, batch_size: int,
                  source: Path, require_all: bool = False) -> list[torch.Tensor]:
    """``samples`` sequences of ``seq_len`` tokens in batches; with ``require_all`` fewer is an error
    (GPTQ's result depends on exactly the tokens asked for), otherwise what the data holds is used.
    ``tokenizer`` may be a function that loads it: it is called only when a row is text."""
    ids: list[int] = []
    need = samples * seq_len
    kinds: set[str] = set()
    for row in texts:
        kinds.add("ids" if isinstance(row, list) else "text")
        if len(kinds) > 1:
            raise QuantkitError("mixes text and input_ids rows", source)
        if isinstance(row, list):  # already token ids: used as given, no EOS added
            ids.extend(row)
        else:
            if not hasattr(tokenizer, "encode"):  # a loader: the first text row needs the tokenizer itself
                tokenizer = tokenizer()
            piece = row if isinstance(row, Piece) else Piece(row, True)
            done = _tokenize(tokenizer, piece.text, need - len(ids), ids)
            if done and piece.ends:
                ids.append(tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0)
        if len(ids) >= need:
            break
    if not kinds:
        raise QuantkitError("calibration data is empty", source)
    usable = len(ids) // seq_len
    if usable == 0 or (require_all and usable < samples):
        raise QuantkitError(f"too short: {len(ids)} tokens, asked for {samples} sequence(s) of {seq_len}", source)
    sequences = torch.tensor(ids[: min(usable, samples) * seq_len]).view(-1, seq_len)
    return list(sequences.split(batch_size))


def _tokenize(tokenizer, text: str, missing: int, ids: list[int]) -> bool:
    """Append ``text``'s tokens to ``ids``, a piece at a time once it is long, stopping when ``missing`` tokens were
    added; whether all of ``text`` was tokenized. A text up to PIECE_CHARS is tokenized whole."""
    start = len(ids)
    while text:
        size = max(PIECE_CHARS, (missing - (len(ids) - start)) * CHARS_PER_TOKEN)
        piece, text = _cut(text, size)
        ids.extend(tokenizer(piece, add_special_tokens=False)["input_ids"])
        if text and len(ids) - start >= missing:
            return False
    return True


def _cut(text: str, size: int) -> tuple[str, str]:
    """``text`` split near ``size`` characters, before a space where one is close (so no word is cut)."""
    if len(text) <= size:
        return text, ""
    space = text.rfind(" ", size - 256, size)
    at = space if space > 0 else size
    return text[:at], text[at:]


def calibration_batches(data: Path, text_field: str, samples: int, seq_len: int, batch_size: int,
                        tokenizer: Callable, vocab_size: int | None, require_all: bool = False) -> list[torch.Tensor]:
    """The token batches of a calibration file, every id inside the model's vocabulary (an id outside it would
    index past the embedding table)."""
    batches = token_batches(tokenizer, read_rows(data, text_field), samples, seq_len, batch_size, data, require_all)
    highest = max(int(b.max()) for b in batches)
    if vocab_size and highest >= vocab_size:
        raise QuantkitError(f"token id {highest} is outside the model's vocabulary ({vocab_size})", data)
    return batches


def model_tokenizer(model: Path):
    """The tokenizer in a model folder, or a one-line error naming the folder."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as exc:
        raise QuantkitError(f"no tokenizer in the model folder ({type(exc).__name__})", model) from exc
