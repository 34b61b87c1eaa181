"""Recipes: llm-compressor's YAML format, read into compressed-tensors' own config models.

A recipe is the QuantizationModifier of an llm-compressor recipe (``config_groups`` or
``scheme`` + ``targets``, ``ignore``, ``kv_cache_scheme``), so a user's existing recipe works.
We parse the YAML ourselves rather than import llm-compressor (seconds of import time for a
dictionary walk); a test holds the result equal to llm-compressor's own parsing.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStatus,
    preset_name_to_scheme,
)
from compressed_tensors.utils.match import match_name
from pydantic import ValidationError

from quantkit.errors import QuantkitError, field_error
from quantkit.packaged import recipe_path
from quantkit.yaml_file import load_yaml_with_bytes

# Modifiers whose algorithm needs calibration data; quantkit's converter is round-to-nearest.
DATA_DEPENDENT = ("GPTQModifier", "AWQModifier", "SmoothQuantModifier", "AutoRoundModifier")


@dataclass(frozen=True)
class Recipe:
    name: str
    sha256: str
    config: QuantizationConfig  # status "initialized": the compressed form is built at save time

    def groups_for(self, module: str, is_linear: bool) -> list[tuple[str, QuantizationScheme]]:
        """Every config group that targets ``module`` (none when ``ignore`` does): a recipe is
        only unambiguous when this has at most one entry."""
        if any(match_name(module, ign) for ign in self.config.ignore or []):
            return []
        return [(name, scheme) for name, scheme in self.config.config_groups.items()
                if any((t == "Linear" and is_linear) or match_name(module, t) for t in scheme.targets)]

    def scheme_for(self, module: str, is_linear: bool) -> tuple[str, QuantizationScheme] | None:
        """The first config group whose targets match ``module`` (the first-match rule of
        compressed-tensors), or None when no group targets it or ``ignore`` does."""
        return next(iter(self.groups_for(module, is_linear)), None)


def load_recipe(recipe: str | Path) -> Recipe:
    """A recipe file, or a built-in recipe by name, as compressed-tensors' config (every target regex checked)."""
    path = recipe_path(recipe)
    doc, raw = load_yaml_with_bytes(path, "recipe")
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
    context = ""
    try:
        groups: dict[str, QuantizationScheme] = {}
        if mod.get("config_groups"):
            for name, group in mod["config_groups"].items():
                context = f"config_groups.{name}."
                groups[name] = QuantizationScheme.model_validate(group)
        context = ""
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
        config = QuantizationConfig(
            config_groups=groups,
            ignore=[ignore] if isinstance(ignore, str) else list(ignore),
            kv_cache_scheme=QuantizationArgs.model_validate(kv) if kv else None,
            quantization_status=QuantizationStatus.INITIALIZED,
        )
    except ValidationError as exc:
        raise QuantkitError(f"invalid QuantizationModifier: {context}{field_error(exc)}", path) from exc
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise QuantkitError(f"invalid QuantizationModifier: {' '.join(str(exc).split())[:300]}", path) from exc
    _check_patterns(config, path)
    return config


def _check_patterns(config: QuantizationConfig, path: Path) -> None:
    """Every ``re:`` target and ignore entry must compile: a typo is an error now, not a silent non-match later."""
    entries = [t for scheme in config.config_groups.values() for t in scheme.targets] + list(config.ignore or [])
    for entry in entries:
        if not isinstance(entry, str):
            raise QuantkitError(f"invalid QuantizationModifier: target {entry!r} is not a string", path)
        if entry.startswith("re:"):
            try:
                re.compile(entry[3:])
            except re.error as exc:
                raise QuantkitError(f"invalid QuantizationModifier: target {entry!r}: bad regex ({exc})", path) from exc
