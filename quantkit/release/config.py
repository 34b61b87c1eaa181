"""A release's config file: one section per stage, each the settings model of its action (quantkit/settings.py), and
which sections each stage reads (its fingerprint, release/state.py)."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import ValidationError, model_validator

from quantkit.errors import QuantkitError, field_error
from quantkit.settings import CalibrateSettings, ConvertSettings, EvalSettings, Section, VerifySettings


class ReleaseEvalSettings(EvalSettings):
    tasks: list[str] = ["gsm8k", "arc_easy", "arc_challenge", "mmlu", "mmlu_pro", "needle_8k",
                               "needle_32k"]  # the release suite's
    candidate_kv_cache_dtype: str | None = None  # default: fp8_e4m3 when calibrate_kv is set, else as the baseline
    baseline_run: str | None = None  # default WORK/runs/baseline; point at another release's to reuse it

    def common(self) -> EvalSettings:
        """The settings every evaluation of the release shares."""
        return EvalSettings.model_validate(self.model_dump(include=set(EvalSettings.model_fields)))


def config_relative(config_path: Path, p: str) -> Path:
    """A path a release config names: a relative one starts from the config's folder."""
    return Path(p) if Path(p).is_absolute() else (config_path.parent / p).resolve()


def work_dir_of(config_path: Path, work_dir: str | None) -> Path:
    """A release's work folder: ``work_dir``, or <config name>-work beside the config."""
    return config_relative(config_path, work_dir) if work_dir else config_path.parent / f"{config_path.stem}-work"


def publish_repo(config_path: Path, repo: str) -> str:
    """The repo publish is given: a ``file://`` target made absolute (relative to the config), a hub id as it is."""
    return "file://" + str(config_relative(config_path, repo.removeprefix("file://"))) if repo.startswith("file://") \
        else repo


class PublishSettings(Section):
    repo: str  # ORG/NAME on the hub, or file://DIR
    private: bool = False
    revision: str | None = None
    base_model: str | None = None


class ReleaseConfig(Section):
    source: str
    recipe: str
    work_dir: str | None = None  # default: <config name>-work beside the config
    convert: ConvertSettings = ConvertSettings()
    calibrate_kv: CalibrateSettings | None = None
    verify: VerifySettings = VerifySettings()
    eval: ReleaseEvalSettings = ReleaseEvalSettings()
    suite: str | None = None
    margin: float | None = None
    publish: PublishSettings | None  # required; null: gated, not published

    @property
    def candidate_kv(self) -> str:
        """The KV-cache dtype the candidate is evaluated (and served) with."""
        ev = self.eval
        return ev.candidate_kv_cache_dtype or ("fp8_e4m3" if self.calibrate_kv else ev.kv_cache_dtype)


class PoolSettings(Section):
    """One GPU pool's artifact: a recipe applied to the release's source, or (no recipe) the source as released, as
    GLM 5.x's own block-FP8 serves its prefill pool."""

    recipe: str | None = None
    calibrate_kv: CalibrateSettings | None = None  # an FP8 KV cache with calibrated scales; else the baseline's


class Pools(Section):
    """The recipe's two pools: prefill (FP8 weights, BF16 KV) and decode (INT4 weights, FP8 KV)."""

    prefill: PoolSettings
    decode: PoolSettings

    @model_validator(mode="after")
    def _made(self) -> Pools:
        if self.decode.recipe is None:
            raise ValueError("pools.decode needs a recipe: the decode pool serves a converted checkpoint")
        if self.prefill.recipe is None and self.prefill.calibrate_kv is not None:
            raise ValueError("pools.prefill.calibrate_kv needs a recipe: the source as released is not written to")
        return self

    def items(self) -> list[tuple[str, PoolSettings]]:
        return [("prefill", self.prefill), ("decode", self.decode)]


class PoolsConfig(Section):
    """The recipe's pools as one release: each pool's artifact from the same source, verified, gated against one
    baseline run of the source, and published together (release/pools.py)."""

    source: str
    pools: Pools
    work_dir: str | None = None
    convert: ConvertSettings = ConvertSettings()
    verify: VerifySettings = VerifySettings()
    eval: ReleaseEvalSettings = ReleaseEvalSettings()
    suite: str | None = None
    margin: float | None = None
    publish: PublishSettings | None  # required; null: gated, not published

    def pool(self, name: str, work: Path) -> ReleaseConfig:
        """The release of one pool with a recipe: the shared sections, the shared baseline run, and no publish of
        its own (the pools are published together)."""
        settings = dict(self.pools.items())[name]
        shared = self.model_dump(include={"source", "convert", "verify", "suite", "margin"})
        return ReleaseConfig.model_validate(
            dict(shared, recipe=settings.recipe, work_dir=str(work / name), publish=None,
                 calibrate_kv=settings.calibrate_kv.model_dump() if settings.calibrate_kv else None,
                 eval=dict(self.eval.model_dump(), baseline_run=str(work / "runs" / "baseline"))))


def load_config(path: str | os.PathLike) -> ReleaseConfig | PoolsConfig:
    """A release config; one with ``pools:`` releases several artifacts of one source together."""
    from quantkit.yaml_file import load_yaml

    path = Path(path)
    doc = load_yaml(path, "release config")
    try:
        if isinstance(doc, dict) and "pools" in doc:
            return PoolsConfig.model_validate(doc)
        return ReleaseConfig.model_validate(doc)
    except ValidationError as exc:
        raise QuantkitError(field_error(exc), path) from exc
