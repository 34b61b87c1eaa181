"""The one exception quantkit raises for bad input: it names the file and the tensor."""

from __future__ import annotations

from pathlib import Path


class QuantkitError(Exception):
    """A user-facing failure. ``str()`` is the one line the CLI prints."""

    def __init__(self, message: str, file: str | Path | None = None, tensor: str | None = None):
        self.message = message
        self.file = str(file) if file is not None else None
        self.tensor = tensor
        super().__init__(self.line())

    def line(self) -> str:
        where = []
        if self.file:
            where.append(self.file)
        if self.tensor:
            where.append(f"tensor {self.tensor}")
        prefix = ": ".join(where)
        text = f"{prefix}: {self.message}" if prefix else self.message
        return " ".join(text.split())
