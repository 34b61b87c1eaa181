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

    def __reduce__(self):
        # a conversion's worker process sends its error to the parent by pickle; rebuilt without calling __init__,
        # whose arguments differ between subclasses
        return _rebuilt, (self.__class__, self.args, self.__dict__)

    def line(self) -> str:
        where = []
        if self.file:
            where.append(self.file)
        if self.tensor:
            where.append(f"tensor {self.tensor}")
        prefix = ": ".join(where)
        text = f"{prefix}: {self.message}" if prefix else self.message
        return " ".join(text.split())


def _rebuilt(cls: type[QuantkitError], args: tuple, state: dict) -> QuantkitError:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class CannotCompare(QuantkitError):
    """Two runs differ in something other than the model: no verdict either way (exit 2)."""


def field_error(exc) -> str:
    """A pydantic ValidationError as ``field.path: reason`` of its first error: what a one-line error names."""
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "(top)"
    return f"{where}: {first['msg']}"


def describe_os_error(exc: OSError) -> str:
    """An OSError as one line naming the path: 'PATH: permission denied', 'PATH: disk full'."""
    import errno

    reasons = {errno.ENOSPC: "disk full", errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
               errno.EISDIR: "is a folder, not a file", errno.ENOTDIR: "not a folder", errno.ENOENT: "not found"}
    reason = reasons.get(exc.errno or 0, exc.strerror or type(exc).__name__)
    where = [str(p) for p in (exc.filename, exc.filename2) if p is not None]
    return f"{' -> '.join(where)}: {reason}" if where else f"{reason} ({exc})"
