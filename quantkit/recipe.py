"""Recipes: llm-compressor's YAML format, read into compressed-tensors' own config models.

A recipe is the QuantizationModifier of an llm-compressor recipe (``config_groups`` or
``scheme`` + ``targets``, ``ignore``, ``kv_cache_scheme``), so a user's existing recipe works.
We parse the YAML ourselves rather than import llm-compressor (seconds of import time for a
dictionary walk); a test holds the result equal to llm-compressor's own parsing.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import yaml
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStatus,
    preset_name_to_scheme,
)
from compressed_tensors.utils.match import match_name

from quantkit.errors import QuantkitError

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"
# Modifiers whose algorithm needs calibration data; quantkit's converter is round-to-nearest.
DATA_DEPENDENT = ("GPTQModifier", "AWQModifier", "SmoothQuantModifier", "AutoRoundModifier")


@dataclass(frozen=True)
class Recipe:
    name: str
    sha256: str
    config: QuantizationConfig  # status "initialized": the compressed form is built at save time

    def scheme_for(self, module: str, is_linear: bool) -> tuple[str, QuantizationScheme] | None:
        """The first config group whose targets match ``module`` (the first-match rule of
        compressed-tensors), or None when no group targets it or ``ignore`` does."""
        if any(match_name(module, ign) for ign in self.config.ignore or []):
            return None
        for group_name, scheme in self.config.config_groups.items():
            for target in scheme.targets:
                if (target == "Linear" and is_linear) or match_name(module, target):
                    return group_name, scheme
        return None


def resolve_recipe_path(recipe: str | Path) -> Path:
    """A path, or the name of a built-in recipe (``glm5-int4-experts-g32``)."""
    path = Path(recipe)
    if path.is_file():
        return path
    for candidate in (RECIPES_DIR / f"{recipe}.yaml", RECIPES_DIR / str(recipe)):
        if candidate.is_file():
            return candidate
    known = ", ".join(sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")))
    raise QuantkitError(f"no such recipe (built-in: {known})", recipe)


def load_recipe(recipe: str | Path) -> Recipe:
    path = resolve_recipe_path(recipe)
    raw = path.read_bytes()
    try:
        doc = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise QuantkitError(f"invalid YAML: {exc}".splitlines()[0], path) from exc
    modifier = _find_modifier(doc, path)
    return Recipe(name=path.stem, sha256=hashlib.sha256(raw).hexdigest(), config=_build_config(modifier, path))


def _find_modifier(node, path: Path) -> dict:
    found: list[dict] = []

    def walk(n):
        if isinstance(n, dict):
            for key, value in n.items():
                if key in DATA_DEPENDENT:
                    raise QuantkitError(f"{key} needs calibration data; quantkit convert applies RTN recipes", path)
                if key == "QuantizationModifier" and isinstance(value, dict):
                    found.append(value)
                else:
                    walk(value)

    walk(node)
    if len(found) != 1:
        raise QuantkitError(f"expected exactly one QuantizationModifier, found {len(found)}", path)
    return found[0]


def _build_config(mod: dict, path: Path) -> QuantizationConfig:
    try:
        groups: dict[str, QuantizationScheme] = {}
        if mod.get("config_groups"):
            for name, group in mod["config_groups"].items():
                groups[name] = QuantizationScheme.model_validate(group)
        if mod.get("scheme") is not None:
            targets = mod.get("targets", ["Linear"])
            targets = [targets] if isinstance(targets, str) else list(targets)
            scheme = mod["scheme"]
            if isinstance(scheme, str):
                groups["group_0"] = preset_name_to_scheme(scheme, targets)
            else:
                groups["group_0"] = QuantizationScheme(targets=targets, **scheme)
        if not groups:
            raise QuantkitError("QuantizationModifier has neither config_groups nor scheme", path)
        kv = mod.get("kv_cache_scheme")
        ignore = mod.get("ignore") or []
        return QuantizationConfig(
            config_groups=groups,
            ignore=[ignore] if isinstance(ignore, str) else list(ignore),
            kv_cache_scheme=QuantizationArgs.model_validate(kv) if kv else None,
            quantization_status=QuantizationStatus.INITIALIZED,
        )
    except (ValueError, TypeError, KeyError) as exc:
        first = str(exc).splitlines()[0]
        raise QuantkitError(f"invalid QuantizationModifier: {first}", path) from exc
