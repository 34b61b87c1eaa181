"""The shape of the code, measured (docs/design.md): short functions, thin package faces, no import circles, and
imports that only run down the layers. Read from the source with ``ast``; nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "quantkit"
MAX_FUNCTION_LINES = 80
MAX_INIT_LINES = 250

# Lowest first; a module may import its own layer's and lower layers' modules, never a higher layer's.
LAYERS = [
    {"quantkit", "errors", "inert", "settings", "sizes", "yaml_file", "devices", "compute_dtype", "packaged", "calibration_data",
     "gc_pause"},
    {"formats"},
    {"checkpoint"},
    {"engines", "modeling", "layerwise", "charts"},
    {"convert", "kv", "verify", "evaluation", "plan", "budget"},
    {"release"},
    {"examples", "cli", "commands", "__main__"},
]


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = modules()


def _module_of(name: str) -> str:
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def imports(path: Path) -> set[str]:
    """The quantkit modules a module imports, at its top or inside its functions (both run)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {_module_of(a.name) for a in node.names if a.name.split(".")[0] == "quantkit"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "quantkit":
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in MODULES else _module_of(node.module))
    return found


GRAPH = {name: imports(path) - {name} for name, path in MODULES.items()}


def layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else module
    return next(i for i, names in enumerate(LAYERS) if top in names)


def circles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return found


def test_no_function_is_longer_than_80_lines():
    long = [f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})"
            for path in MODULES.values() for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long


def test_package_faces_are_thin():
    fat = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("__init__.py")
           if (n := len(p.read_text().splitlines())) > MAX_INIT_LINES}
    assert not fat


def test_no_import_circles():
    assert circles() == []


def test_imports_only_run_down_the_layers():
    assert set().union(*LAYERS) >= {m.split(".")[1] if "." in m else m for m in MODULES}, "a module without a layer"
    upward = sorted(f"{a} -> {b}" for a, targets in GRAPH.items() for b in targets if layer(b) > layer(a))
    assert not upward


@pytest.mark.parametrize("planted", ["circle", "upward"])
def test_the_checks_catch_what_they_look_for(planted, monkeypatch):
    """The measures themselves can fail: a planted circle and a planted upward import are found."""
    graph = {k: set(v) for k, v in GRAPH.items()}
    if planted == "circle":
        graph["quantkit.errors"].add("quantkit.inert")
        graph["quantkit.inert"].add("quantkit.errors")
        monkeypatch.setattr(__import__(__name__), "GRAPH", graph)
        assert ["quantkit.errors", "quantkit.inert"] in circles()
    else:
        graph["quantkit.checkpoint.reader"].add("quantkit.release.gate")
        assert any(layer(b) > layer(a) for a, targets in graph.items() for b in targets)


def face_facts(modules: dict[str, Path]) -> list[str]:
    """``module -> package.NAME`` for each import of a value that a package's ``__init__.py`` assigns (a constant,
    not a function, a class or something it imports) by a module outside that package: a package face offers
    entry points and the types they take; a fact other packages share lives in a module named for it."""
    packages = {name: path for name, path in modules.items() if path.name == "__init__.py"}
    assigned = {}
    for name, path in packages.items():
        tree = ast.parse(path.read_text())
        assigned[name] = {t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
                          for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                          if isinstance(t, ast.Name)}
    found = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in packages:
                inside = name == node.module or name.startswith(node.module + ".")
                found += [f"{name} -> {node.module}.{a.name}" for a in node.names
                          if not inside and a.name in assigned[node.module]]
    return sorted(found)


def test_no_module_imports_a_fact_from_another_packages_face():
    assert face_facts(MODULES) == []


def test_a_planted_import_of_a_face_fact_is_found(tmp_path):
    (tmp_path / "quantkit" / "a").mkdir(parents=True)
    (tmp_path / "quantkit" / "a" / "__init__.py").write_text("from quantkit.a.b import f\nLIMIT = 3\ndef g(): pass\n")
    (tmp_path / "quantkit" / "a" / "b.py").write_text("from quantkit.a import LIMIT\ndef f(): return LIMIT\n")
    (tmp_path / "quantkit" / "c.py").write_text("from quantkit.a import LIMIT, f, g\n")
    planted = {"quantkit.a": tmp_path / "quantkit" / "a" / "__init__.py", "quantkit.a.b": tmp_path / "quantkit" / "a" / "b.py",
               "quantkit.c": tmp_path / "quantkit" / "c.py"}
    assert face_facts(planted) == ["quantkit.c -> quantkit.a.LIMIT"]  # its own package may; f, g are entry points


# A family of names has one compiled pattern, in checkpoint/names.py: the regex source text that spells each family
NAME_FAMILIES = {"a decoder layer's": r"model\\.layers\\.", "a routed expert's": r"(?<![a-z_])experts\)?\\.(\(|\\d)",
                 "an FP8 KV-cache scale's": r"\[kv\]\)?_scale"}
NAMES_MODULE = "quantkit.checkpoint.names"


def name_patterns(source: str) -> list[tuple[str, str]]:
    """(family, pattern) for each ``re.compile`` (or ``re.match``, ``re.search``, ``re.fullmatch``) of a string
    literal in ``source`` that spells a name family."""
    import re

    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("compile", "match", "search", "fullmatch")
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found += [(family, node.args[0].value) for family, spelling in NAME_FAMILIES.items()
                      if re.search(spelling, node.args[0].value)]
    return found


def test_each_family_of_names_is_one_pattern_in_one_place():
    copies = {name: found for name, path in MODULES.items() if name != NAMES_MODULE
              and (found := name_patterns(path.read_text()))}
    assert not copies
    assert {family for family, _ in name_patterns(MODULES[NAMES_MODULE].read_text())} == set(NAME_FAMILIES)


def test_a_planted_copy_of_a_name_pattern_is_found():
    planted = 'import re\n_LAYER = re.compile(r"^model\\.layers\\.(\\d+)\\.")\nE = re.compile(r"^mlp\\.experts\\.(\\d+)")\n'
    assert [family for family, _ in name_patterns(planted)] == ["a decoder layer's", "a routed expert's"]
    kv = 'import re\ndef f(n):\n    return re.match(r"^model\\.layers\\.\\d+\\.self_attn\\.[kv]_scale$", n)\n'
    assert [family for family, _ in name_patterns(kv)] == ["a decoder layer's", "an FP8 KV-cache scale's"]


# read_config: the one read of config.json, into checkpoint/config.py's ModelConfig
CONFIG_READER = "quantkit.checkpoint.reader"


def raw_config_reads(source: str) -> int:
    """Calls that read config.json's text or JSON themselves (``(p / "config.json").read_text()``, ``json.loads(...)``
    or ``open(...)`` of it) instead of asking ``read_config`` for the checked, typed ModelConfig."""
    readers = {"read_text", "read_bytes", "open", "load", "loads"}
    lines = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        if name in readers and any(isinstance(n, ast.Constant) and n.value == "config.json" for n in ast.walk(node)):
            lines.add(node.lineno)
    return len(lines)


def test_config_json_is_read_in_one_place():
    reads = {name: n for name, path in MODULES.items() if (n := raw_config_reads(path.read_text()))}
    assert not set(reads) - {CONFIG_READER}, reads


def test_a_planted_raw_config_read_is_found():
    planted = ('import json\ndef f(p):\n    c = json.loads((p / "config.json").read_text())\n'
               '    with open(p / "config.json") as fh:\n        return c, fh.read()\n')
    assert raw_config_reads(planted) == 2


def test_the_design_card_names_every_settings_model():
    """docs/design.md's line on settings.py lists each model the module defines (it once listed 4 of 6)."""
    tree = ast.parse(MODULES["quantkit.settings"].read_text())
    models = {node.name for node in tree.body if isinstance(node, ast.ClassDef) and node.name.endswith("Settings")}
    card = (PACKAGE.parent / "docs" / "design.md").read_text()
    assert models and {m for m in models if m not in card} == set()


def imported_test_modules(source: str) -> set[str]:
    """The test modules (``test_*``) that ``source`` imports, at its top or inside its functions."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("test_")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("test_"):
            found.add(node.module)
    return found


def test_no_test_module_imports_another():
    """What tests share lives in tests/helpers/, never in a test module another imports."""
    tests = PACKAGE.parent / "tests"
    imported = {p.name: found for p in sorted(tests.glob("test_*.py")) if (found := imported_test_modules(p.read_text()))}
    assert imported == {}


def test_a_planted_import_of_a_test_module_is_found():
    planted = "from helpers import suite\nfrom test_gate import write_run\ndef f():\n    import test_stats\n"
    assert imported_test_modules(planted) == {"test_gate", "test_stats"}
