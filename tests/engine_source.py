"""The serving engines' own source, from the wheels PyPI serves for the pinned versions, to run in tests.

SGLang and vLLM cannot be imported here (they need CUDA builds and pins of their own), but their
weight-name mapping is plain Python. These helpers compile one file, class, function or class attribute
of a wheel without its imports of the engine itself: every such name is either given by the test (a real
function taken from another file of the same wheel, or a stand-in for GPU-only plumbing) or a
``Missing`` object that fails the test the moment the engine's code touches it, so nothing the engine
does is silently replaced.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import os
import subprocess
import sys
import textwrap
import types
import zipfile
from email.parser import Parser
from pathlib import Path

CACHE = Path(os.environ.get("QUANTKIT_ENGINE_WHEELS", Path.home() / ".cache" / "quantkit" / "engine-wheels"))
ENGINE_PACKAGES = {"sglang", "vllm", "sgl_kernel", "flashinfer", "triton", "vllm_flash_attn"}


def engine_wheel(name: str, version: str) -> zipfile.ZipFile:
    """The engine's wheel for exactly this version, downloaded once (package registries are reachable in CI)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    found = sorted(CACHE.glob(f"{name}-{version}-*.whl"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"{name}=={version}", "-d", str(CACHE)],
                       check=True)
        found = sorted(CACHE.glob(f"{name}-{version}-*.whl"))
    return zipfile.ZipFile(found[0])


def wheel_version(wheel: zipfile.ZipFile) -> str:
    meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    return Parser().parsestr(wheel.read(meta).decode())["Version"]


def source(wheel: zipfile.ZipFile, path: str) -> str:
    return wheel.read(path).decode()


def sha256(wheel: zipfile.ZipFile, path: str) -> str:
    return hashlib.sha256(wheel.read(path)).hexdigest()


def lines(wheel: zipfile.ZipFile, path: str, first: int, last: int) -> str:
    return "\n".join(source(wheel, path).splitlines()[first - 1 : last])


class Missing:
    """An imported name the test did not provide: any use of it is a test failure naming it."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr):
        raise AssertionError(f"engine code used {self._name}.{attr}, which the test does not provide")

    def __call__(self, *args, **kwargs):
        raise AssertionError(f"engine code called {self._name}, which the test does not provide")

    def __bool__(self):
        raise AssertionError(f"engine code tested {self._name}, which the test does not provide")


def engine_module(wheel: zipfile.ZipFile, path: str, provide: dict) -> dict:
    """Execute a whole source file of the wheel; returns its namespace."""
    return _run(ast.parse(source(wheel, path)), path, provide)


def engine_definition(wheel: zipfile.ZipFile, path: str, qualname: str, provide: dict):
    """One function, method, class (``Class`` or ``Class.method``) or class attribute (``Class.name``) of a
    source file, compiled on its own with its decorators; a method comes back as a plain function."""
    text = source(wheel, path)
    node = _find(ast.parse(text).body, qualname.split("."))
    if isinstance(node, ast.Assign):
        expression = ast.get_source_segment(text, node.value)
        return _run(ast.parse(f"_value = ({expression})"), f"{path}:{qualname}", provide)["_value"]
    segment = textwrap.dedent(ast.get_source_segment(text, node, padded=True))
    decorators = [ast.get_source_segment(text, d) for d in node.decorator_list] if isinstance(node, ast.ClassDef) else []
    tree = ast.parse("".join(f"@{d}\n" for d in decorators) + segment)
    return _run(tree, f"{path}:{qualname}", provide)[node.name]


def _run(tree: ast.Module, name: str, provide: dict) -> dict:
    stripped: set[str] = set()

    class Strip(ast.NodeTransformer):
        def _strip(self, node, module):
            if module.split(".")[0] in ENGINE_PACKAGES or not _importable(module):
                stripped.update((a.asname or a.name).split(".")[0] for a in node.names)
                return ast.Pass()
            return node

        def visit_Import(self, node):
            return self._strip(node, node.names[0].name)

        def visit_ImportFrom(self, node):
            return self._strip(node, node.module or "")

    tree = ast.fix_missing_locations(Strip().visit(tree))
    # A module object of its own, registered while the code runs: dataclasses look their module up by name.
    key = f"engine_source:{name}"
    module = types.ModuleType(key)
    module.__dict__.update({n: Missing(n) for n in stripped})
    module.__dict__.update({k: v for k, v in provide.items() if not k.startswith("__")})
    sys.modules[key] = module
    try:
        exec(compile(tree, name, "exec"), module.__dict__)
    finally:
        del sys.modules[key]
    return module.__dict__


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module.split(".")[0]) is not None
    except (ImportError, ValueError):
        return False


def _find(body, parts):
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == parts[0]:
            return node if len(parts) == 1 else _find(node.body, parts[1:])
        if (isinstance(node, ast.Assign) and len(parts) == 1
                and any(isinstance(t, ast.Name) and t.id == parts[0] for t in node.targets)):
            return node
        if isinstance(node, ast.AnnAssign) and len(parts) == 1 and getattr(node.target, "id", None) == parts[0]:
            return ast.Assign(targets=[node.target], value=node.value)
    raise KeyError(".".join(parts))
