"""A release's config file: one section per stage, each the settings model of its action (quantkit/settings.py), and
which sections each stage reads (its fingerprint, release/state.py)."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import ValidationError

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
    publish: PublishSettings


def load_config(path: str | os.PathLike) -> ReleaseConfig:
    from quantkit.yaml_file import load_yaml

    path = Path(path)
    doc = load_yaml(path, "release config")
    try:
        return ReleaseConfig.model_validate(doc)
    except ValidationError as exc:
        raise QuantkitError(field_error(exc), path) from exc
