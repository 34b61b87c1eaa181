"""Sizes as users write them: ``5GB``, ``512MiB``, ``70GiB``, or a plain number of bytes."""

from __future__ import annotations

import re

from quantkit.errors import QuantkitError


def parse_size(text: str | int) -> int:
    """'5GB' -> 5e9, '512MiB' -> 512 * 2**20, plain numbers are bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d{1,15}(?:\.\d{1,15})?)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)  # bounded
    if not m:
        raise QuantkitError(f"cannot read size {text!r} (examples: 5GB, 512MiB, 1000000)")
    number, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    power = " KMGT".index(unit or " ")
    return int(number * (1024 if binary else 1000) ** power)
