"""Text that came from files, folders or servers, made inert before it reaches a terminal, a log or a card.

A tensor name, a path or a server's version string is data: a newline in it must not start a fake line
(a ``PASS`` inside a FAIL report), an ANSI escape must not move the terminal's cursor, and Markdown in it
must not add a heading or a shell block to a model card. Control characters (and the invisible ones
that reorder or hide text) are shown as escapes instead: ``\\x1b``, ``\\n``, ``\\u202e``.
"""

from __future__ import annotations

import re

# C0 and C1 controls, DEL, zero-width characters, line/paragraph separators, bidirectional overrides, BOM
_HIDDEN = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# Markdown that can start markup anywhere in a line (line starts are never user text in quantkit's cards); an
# underscore only at a word's edge (inside a word, as in arc_easy, it is literal)
_MARKDOWN = re.compile(r"([\\`*\[\]<>]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9]))")


def _escape(match: re.Match) -> str:
    char = match.group(0)
    code = ord(char)
    return _NAMED.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def visible(text: object) -> str:
    """``text`` with every control or invisible character written as an escape."""
    return _HIDDEN.sub(_escape, str(text))


def markdown_text(text: object) -> str:
    """``text`` as literal Markdown: visible, and with the characters that start markup escaped."""
    return _MARKDOWN.sub(r"\\\1", visible(text))


def markdown_cell(text: object) -> str:
    """``text`` as literal Markdown inside a table cell, where ``|`` would end the cell."""
    return markdown_text(text).replace("|", "\\|")


def markdown_code(text: object) -> str:
    """``text`` as a Markdown code span, whatever backticks it holds (CommonMark's longer fence)."""
    body = visible(text)
    runs = [len(r) for r in re.findall("`+", body)]
    fence = "`" * (max(runs, default=0) + 1)
    pad = " " if body.startswith("`") or body.endswith("`") else ""
    return f"{fence}{pad}{body}{pad}{fence}"
