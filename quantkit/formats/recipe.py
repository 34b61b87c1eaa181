"""Recipes: llm-compressor's YAML format, read into compressed-tensors' config models.

A recipe is the QuantizationModifier, GPTQModifier or AutoRoundModifier of an llm-compressor recipe
(``config_groups`` or ``scheme`` + ``targets``, ``ignore``, ``kv_cache_scheme``; GPTQ adds
``block_size``, ``dampening_frac``, ``actorder``; AutoRound (SignRound) ``iters``, ``lr``,
``batch_size``, ``enable_torch_compile``), so a user's existing recipe works. Both need calibration
data, which llm-compressor takes from ``oneshot``'s arguments; a quantkit recipe carries it in a
top-level ``quantkit_calibration`` mapping, a key llm-compressor's recipe loader passes over. We parse the
YAML ourselves rather than import llm-compressor (seconds of import time for a dictionary walk), into
formats/quant_config.py's models, which parse as compressed-tensors does without importing it; tests hold the
result equal to llm-compressor's and compressed-tensors' own.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Annotated, Callable, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from quantkit.errors import QuantkitError, field_error
from quantkit.formats.quant_config import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    any_matcher,
    preset_scheme,
    zero_point_dtype,
)
from quantkit.packaged import recipe_path
from quantkit.yaml_file import load_yaml_with_bytes

MODIFIERS = ("QuantizationModifier", "GPTQModifier", "AutoRoundModifier")
# Modifiers quantkit does not implement: refused by name rather than silently read as RTN.
UNSUPPORTED = ("AWQModifier", "SmoothQuantModifier", "SparseGPTModifier")
CALIBRATION_KEY = "quantkit_calibration"
# GPTQModifier's algorithm fields quantkit reads (llm-compressor 0.14 modifiers/gptq/base.py); its
# batched_quantization is accepted and ignored: quantkit sizes its own batches (convert/calibrated/gptq.py).
_GPTQ_FIELDS = ("block_size", "dampening_frac", "actorder")


class Calibration(BaseModel):
    """Where GPTQ's calibration tokens come from and how experts that few tokens reach are treated."""

    model_config = ConfigDict(extra="forbid")

    dataset: str | None = None  # JSON-lines or text file; None: quantkit's built-in GSM8K-train text
    text_field: str = "text"
    samples: int = Field(64, ge=1, le=1_000_000)
    seq_len: int = Field(256, ge=8, le=1_048_576)
    # all: every calibration token goes through every expert for the Hessian, so no expert goes
    # uncalibrated (llm-compressor 0.14's default, moe_calibrate_all_experts=True; MoE-Quant's choice).
    # routed: each expert's Hessian from the tokens the router sends it; an expert that gets fewer
    # than min_expert_tokens falls back to round-to-nearest.
    experts: str = Field("all", pattern="^(routed|all)$")
    min_expert_tokens: int = Field(16, ge=1)


class GPTQSettings(BaseModel):
    """GPTQModifier's algorithm settings; ``actorder`` is off or static, so outputs carry no g_idx."""

    model_config = ConfigDict(extra="forbid")

    # the discriminator; left out of dumps, so the calibration digests of runs started before it still match
    algorithm: Literal["gptq"] = Field("gptq", exclude=True)
    block_size: int = Field(128, ge=1)
    dampening_frac: float = Field(0.01, gt=0, lt=1)
    actorder: str | None = "static"  # llm-compressor's default
    calibration: Calibration = Field(default_factory=Calibration)


class SignRoundSettings(BaseModel):
    """AutoRoundModifier's settings (llm-compressor 0.14 modifiers/autoround/base.py, its defaults): SignRound's
    signed-gradient tuning of each weight's rounding and clipping on a decoder layer's output error."""

    model_config = ConfigDict(extra="forbid")

    algorithm: Literal["signround"] = Field("signround", exclude=True)
    iters: int = Field(200, ge=0)
    lr: float | None = Field(None, gt=0)
    batch_size: int = Field(8, ge=1)
    enable_torch_compile: bool = True
    calibration: Calibration = Field(default_factory=Calibration)


# A calibrated algorithm's settings, told apart by ``algorithm``; the next algorithm is one more model here, its
# modifier's entry in CALIBRATED_MODIFIERS and its quantizer's in convert/calibrated's QUANTIZERS.
CalibratedSettings = Annotated[Union[GPTQSettings, SignRoundSettings], Field(discriminator="algorithm")]
RTN = "rtn"  # the algorithm of a recipe without calibrated settings


@dataclass(frozen=True)
class Recipe:
    name: str
    sha256: str
    config: QuantizationConfig  # status "initialized": the compressed form is built at save time
    path: Path | None = None
    calibrated: CalibratedSettings | None = None  # a GPTQModifier's or AutoRoundModifier's; None: round-to-nearest

    @property
    def calibration(self) -> Calibration | None:
        """The calibration of a recipe that needs data (GPTQ, SignRound); None for round-to-nearest."""
        return self.calibrated.calibration if self.calibrated is not None else None

    @property
    def algorithm(self) -> str:
        return self.calibrated.algorithm if self.calibrated is not None else RTN

    def calibration_data(self) -> Path | None:
        """The calibration file: a relative path reads from the recipe's folder."""
        if self.calibration is None or self.calibration.dataset is None:
            return None
        data = Path(self.calibration.dataset).expanduser()
        return data if data.is_absolute() or self.path is None else self.path.parent / data

    def groups_for(self, module: str, is_linear: bool) -> list[tuple[str, QuantizationScheme]]:
        """Every config group that targets ``module`` at the first level that matches it (none when ``ignore``
        does): a name or regex before the class ``Linear``, as compressed-tensors (``match_targets``), SGLang and
        vLLM (``find_matched_target``) all match. A recipe is only unambiguous when this has at most one entry."""
        ignored, groups = self._matchers
        if ignored(module):
            return []
        named = [(name, scheme) for name, scheme, _, targeted in groups if targeted(module)]
        return named or [(name, scheme) for name, scheme, linear, _ in groups if linear and is_linear]

    @cached_property
    def _matchers(self) -> tuple[Callable[[str], object], list[tuple[str, QuantizationScheme, bool, Callable]]]:
        """``ignore`` and each group's targets as one compiled matcher each (formats.quant_config.any_matcher),
        and whether the group targets ``Linear``: a plan asks this of every module of a 700 GB checkpoint."""
        return (any_matcher(self.config.ignore or []),
                [(name, scheme, "Linear" in scheme.targets, any_matcher(scheme.targets))
                 for name, scheme in self.config.config_groups.items()])

    def scheme_for(self, module: str, is_linear: bool) -> tuple[str, QuantizationScheme] | None:
        """The first config group whose targets match ``module`` (the first-match rule of
        compressed-tensors), or None when no group targets it or ``ignore`` does."""
        return next(iter(self.groups_for(module, is_linear)), None)


def load_recipe(recipe: str | Path) -> Recipe:
    """A recipe file, or a built-in recipe by name, as compressed-tensors' config (every target regex checked)."""
    path = recipe_path(recipe)
    doc, raw = load_yaml_with_bytes(path, "recipe")
    calibration = doc.pop(CALIBRATION_KEY, None) if isinstance(doc, dict) else None
    kind, modifier = _find_modifier(doc, path)
    config = _build_config(modifier, path)
    _check_applied(config, path)
    settings = None
    if kind in CALIBRATED_MODIFIERS:
        settings = CALIBRATED_MODIFIERS[kind](modifier, calibration, path)
        _check_calibrated_schemes(kind, config, path)
    elif calibration is not None:
        raise QuantkitError(f"{CALIBRATION_KEY} is only read for a GPTQModifier or AutoRoundModifier recipe", path)
    return Recipe(name=path.stem, sha256=hashlib.sha256(raw).hexdigest(), config=config, path=path,
                  calibrated=settings)


def _find_modifier(node, path: Path) -> tuple[str, dict]:
    found: list[tuple[str, dict]] = []

    def walk(n):
        if isinstance(n, dict):
            for key, value in n.items():
                if key in UNSUPPORTED:
                    raise QuantkitError(f"{key} is not implemented by quantkit (it applies QuantizationModifier, "
                                        "GPTQModifier and AutoRoundModifier recipes)", path)
                if key in MODIFIERS and isinstance(value, dict):
                    found.append((key, value))
                else:
                    walk(value)

    walk(node)
    if len(found) != 1:
        raise QuantkitError(f"expected exactly one QuantizationModifier, GPTQModifier or AutoRoundModifier, found "
                            f"{len(found)}", path)
    return found[0]


def _gptq_settings(modifier: dict, calibration, path: Path) -> GPTQSettings:
    fields = {k: modifier[k] for k in _GPTQ_FIELDS if k in modifier}
    if modifier.get("dampening_frac", 0.01) is None:
        raise QuantkitError("invalid GPTQModifier: dampening_frac must be a number (GPTQ needs dampening)", path)
    actorder = fields.get("actorder", "static")
    if actorder not in (None, False, "static"):
        raise QuantkitError(f"GPTQModifier actorder {actorder!r}: only static or none; 'group' and 'weight' orders "
                            "need a g_idx, which the format quantkit writes does not carry", path)
    fields["actorder"] = actorder or None
    try:
        settings = Calibration.model_validate(calibration or {})
    except ValidationError as exc:
        raise QuantkitError(f"invalid {CALIBRATION_KEY}: {field_error(exc)}", path) from exc
    try:
        return GPTQSettings(**fields, calibration=settings)
    except ValidationError as exc:
        raise QuantkitError(f"invalid GPTQModifier: {field_error(exc)}", path) from exc


def _signround_settings(modifier: dict, calibration, path: Path) -> SignRoundSettings:
    fields = {k: modifier[k] for k in ("iters", "lr", "batch_size", "enable_torch_compile") if k in modifier}
    try:
        settings = Calibration.model_validate(calibration or {})
    except ValidationError as exc:
        raise QuantkitError(f"invalid {CALIBRATION_KEY}: {field_error(exc)}", path) from exc
    try:
        return SignRoundSettings(**fields, calibration=settings)
    except ValidationError as exc:
        raise QuantkitError(f"invalid AutoRoundModifier: {field_error(exc)}", path) from exc


# a calibrated modifier -> its settings from the modifier's fields and the recipe's calibration mapping
CALIBRATED_MODIFIERS: dict[str, Callable[[dict, object, Path], CalibratedSettings]] = {
    "GPTQModifier": _gptq_settings, "AutoRoundModifier": _signround_settings}


def _check_calibrated_schemes(kind: str, config: QuantizationConfig, path: Path) -> None:
    """GPTQ and SignRound here produce the INT4 pack-quantized format, GPTQ symmetric only (SignRound takes its zero
    points from AutoRound); an activation order in a group is refused like the modifier's."""
    for name, scheme in config.config_groups.items():
        w = scheme.weights
        if w is None or w.type != "int" or w.num_bits != 4 or w.strategy not in ("group", "channel"):
            raise QuantkitError(f"{kind} group {name}: quantkit's GPTQ and SignRound write INT4 group/channel weights "
                                "only", path)
        if not w.symmetric and kind == "GPTQModifier":
            raise QuantkitError(f"{kind} group {name}: quantkit's GPTQ writes symmetric INT4 only (asymmetric: a "
                                "SignRound or round-to-nearest recipe)", path)
        if w.actorder not in (None, "static"):
            raise QuantkitError(f"{kind} group {name}: actorder {w.actorder!r} is refused (it needs a g_idx)", path)
        # The order is the modifier's processing detail (GPTQSettings.actorder); the written format is the
        # RTN path's, whose config carries no actorder.
        w.actorder = None


# The weight formats convert writes (convert/tensor_plan.py) and the format name each is stored under.
WRITTEN_FORMAT = {("int", 4): "pack-quantized", ("float", 8): "float-quantized"}
# Observers that take a weight's own min and max, which is what quantkit's RTN and GPTQ scales are.
_OBSERVERS = (None, "minmax", "memoryless_minmax", "static_minmax")


def _check_applied(config: QuantizationConfig, path: Path) -> None:
    """Every argument of a group is one quantkit applies, or the recipe is refused naming it: an argument written into
    config.json and not applied (observer: mse, scale_dtype, dynamic weights) describes tensors that are not there.
    A group without a format gets the one its weights are written in."""
    for name, scheme in config.config_groups.items():
        w, at = scheme.weights, f"config_groups.{name}"
        if w is None:
            raise QuantkitError(f"invalid QuantizationModifier: {at} quantizes no weights", path)
        written = WRITTEN_FORMAT.get((w.type, w.num_bits))
        if written is None:
            raise QuantkitError(f"invalid QuantizationModifier: {at}.weights: {w.num_bits}-bit {w.type} is not a "
                                "format quantkit writes (INT4, FP8)", path)
        if scheme.format is None:
            scheme.format = written
        elif scheme.format != written:
            raise QuantkitError(f"invalid QuantizationModifier: {at}.format {scheme.format!r}: {w.num_bits}-bit "
                                f"{w.type} weights are written {written}", path)
        for field, value, applied in (("observer", w.observer, _OBSERVERS), ("scale_dtype", w.scale_dtype, (None,)),
                                      ("zp_dtype", w.zp_dtype, (None, zero_point_dtype(w.type, w.num_bits))),
                                      ("dynamic", w.dynamic, (False,))):
            if value not in applied:
                raise QuantkitError(f"invalid QuantizationModifier: {at}.weights.{field} {value!r} is not applied by "
                                    "quantkit (scales from each group's own min and max, in the model's dtype); "
                                    "remove it", path)
        if w.observer_kwargs:
            raise QuantkitError(f"invalid QuantizationModifier: {at}.weights.observer_kwargs is not applied by "
                                "quantkit; remove it", path)
        if w.type == "int" and not w.symmetric and w.strategy == "channel":
            raise QuantkitError(f"invalid QuantizationModifier: {at}.weights: asymmetric INT4 is written group-wise "
                                "only (strategy: group)", path)
        if scheme.output_activations is not None:
            raise QuantkitError(f"invalid QuantizationModifier: {at}.output_activations is not applied by quantkit",
                                path)


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
                groups["group_0"] = preset_scheme(scheme, targets)
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
            quantization_status="initialized",
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
