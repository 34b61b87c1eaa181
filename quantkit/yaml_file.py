"""Reading the YAML files users give quantkit (recipes, suites, release configs), safely.

``yaml.safe_load`` constructs no objects, but it still expands aliases: a few kilobytes of
nested anchors (a "billion laughs" file) become a structure that hangs whatever walks or
hashes it. Files are capped in size, in alias uses and in the size of the document with every alias
expanded (31 levels of ``{a: *prev, b: *prev}`` are 62 uses and two billion nodes), and every failure
names the file.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from quantkit.errors import QuantkitError

MAX_BYTES = 1 << 20
MAX_ALIASES = 64
MAX_NODES = 100_000  # of the document with its aliases expanded; a recipe has a few hundred


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

    def get_single_node(self):
        node = super().get_single_node()
        if node is not None and _expanded_nodes(node, {}) > MAX_NODES:
            raise yaml.YAMLError(f"over {MAX_NODES:,} nodes with its aliases expanded (refused: such files expand "
                                 "without bound)")
        return node


    def construct_mapping(self, node, deep=False):
        """A mapping that names a key twice is refused (PyYAML keeps the later value without a word); keys a merge
        (``<<: *base``) brings in may be overridden, as YAML means them to be."""
        if isinstance(node, yaml.MappingNode):
            seen: set = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    if key in seen:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"duplicate key {key!r} (the later value would win without a word)",
                            key_node.start_mark)
                    seen.add(key)
                except TypeError:  # an unhashable key: SafeConstructor refuses it with its own message
                    break
        return super().construct_mapping(node, deep=deep)


def _expanded_nodes(node, seen: dict[int, int]) -> int:
    """How many nodes ``node`` is with every alias expanded; each distinct node is sized once (an alias is the
    same node object as its anchor), so this runs in the size of the file, not of the expansion."""
    if id(node) in seen:
        return seen[id(node)]
    seen[id(node)] = MAX_NODES + 1  # a node inside itself (a recursive alias) expands without end
    children = node.value if isinstance(node, yaml.SequenceNode) else (
        [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else [])
    size = 1 + sum(_expanded_nodes(child, seen) for child in children)
    seen[id(node)] = size
    return size


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
    except yaml.MarkedYAMLError as exc:  # where in the file, said once
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = " ".join(str(exc.problem or exc.context or exc).split())[:300]
        raise QuantkitError(f"invalid YAML{where}: {problem}", path) from exc
    except yaml.YAMLError as exc:
        raise QuantkitError(f"invalid YAML: {' '.join(str(exc).split())[:300]}", path) from exc
