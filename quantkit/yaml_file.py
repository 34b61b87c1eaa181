"""Reading the YAML files users give quantkit (recipes, suites, release configs), safely.

``yaml.safe_load`` constructs no objects, but it still expands aliases: a few kilobytes of
nested anchors (a "billion laughs" file) become a structure that hangs whatever walks or
hashes it. Files are capped in size and in alias uses, and every failure names the file.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from quantkit.errors import QuantkitError

MAX_BYTES = 1 << 20
MAX_ALIASES = 64


class _BoundedLoader(yaml.SafeLoader):
    def __init__(self, stream):
        super().__init__(stream)
        self._aliases = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                raise yaml.YAMLError(f"more than {MAX_ALIASES} alias uses (refused: such files can expand without "
                                     f"bound)")
        return super().compose_node(parent, index)


def load_yaml(path: str | Path, what: str):
    """The parsed document of ``path``; ``what`` names the file's role in errors ("recipe", "suite")."""
    return load_yaml_with_bytes(path, what)[0]


def load_yaml_with_bytes(path: str | Path, what: str):
    """(the parsed document, the bytes it was parsed from): one read, so a hash of the bytes names
    exactly what was parsed."""
    path = Path(path)
    try:
        if not path.is_file():
            raise QuantkitError(f"{what} not found (or not a regular file)", path)
        if path.stat().st_size > MAX_BYTES:
            raise QuantkitError(f"{what} over {MAX_BYTES // 1024} KiB: not a {what}", path)
        text = path.read_bytes()
    except OSError as exc:
        raise QuantkitError(f"cannot read the {what} ({exc.strerror})", path) from exc
    try:
        return yaml.load(text, Loader=_BoundedLoader), text  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise QuantkitError(f"invalid YAML: {' '.join(str(exc).split())[:300]}", path) from exc
