"""The data quantkit ships inside its package: built-in recipes, gate suites and two benchmarks' test sets.

The files live in the repository's top-level ``recipes/`` and ``eval/suites/`` folders (where
users look for them) and are installed as the packages ``quantkit.recipes`` and
``quantkit.suites`` (pyproject's package-dir), so a wheel finds them as an editable install does.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from quantkit.errors import QuantkitError


def _folder(package: str) -> Path:
    return Path(str(resources.files(package)))


def recipes_dir() -> Path:
    return _folder("quantkit.recipes")


def suites_dir() -> Path:
    return _folder("quantkit.suites")


def evaldata_dir() -> Path:
    """ARC-Easy and GSM8K test sets in the hub's schema (data/README.md says where they come from)."""
    return Path(__file__).resolve().parent / "data" / "evaldata"


def _resolve(what: str, folder: Path, name: str | os.PathLike) -> Path:
    path = Path(name)
    if path.is_file():
        return path
    for candidate in (folder / f"{name}.yaml", folder / str(name)):
        if candidate.is_file():
            return candidate
    known = ", ".join(sorted(p.stem for p in folder.glob("*.yaml")))
    raise QuantkitError(f"no such {what} (built-in: {known})", path)


def recipe_path(name: str | os.PathLike) -> Path:
    """A recipe file, or the file of a built-in recipe (``glm5-int4-experts-g32``)."""
    return _resolve("recipe", recipes_dir(), name)


def suite_path(name: str | os.PathLike) -> Path:
    """A suite file, or the file of a built-in suite (``release``, ``small-model``)."""
    return _resolve("suite", suites_dir(), name)
