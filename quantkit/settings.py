"""The settings of each action, with their defaults written once.

The library's entry points take these as keyword arguments whose defaults come from here, the CLI's options show the
same defaults, and a release config's sections are these models (release/config.py): a default changed here changes
everywhere.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ConvertSettings(Section):
    device: str = "auto"  # auto, cpu, cuda or cuda:0,cuda:1
    workers: int | None = None  # concurrent shard jobs (default 4 per GPU, or up to 4 on CPU)
    max_shard_size: str = "5GB"
    calibration_data: str | None = None  # GPTQ and SignRound recipes: instead of the recipe's own calibration file
    dtype: str = "auto"  # what a GPTQ recipe's layer walk computes in: auto, bf16, fp16 or fp32
    gpu_memory: str | None = None  # what a calibrated layer may hold on each GPU (default: what it has free)


class CalibrateSettings(Section):
    data: str | None = None  # default: quantkit's bundled GSM8K-train text
    text_field: str = "text"
    samples: int = 512
    seq_len: int = 2048
    batch_size: int = 4
    device: str = "auto"
    dtype: str = "auto"  # what the layers compute in (compute_dtype.py)


class VerifySettings(Section):
    engine: str = "sglang"
    tp: int = 1
    smoke: bool = True


class EvalSettings(Section):
    engine: str = "hf"  # hf in-process, sglang or vllm started for the run, openai a running server
    engine_cmd: str | None = None
    url: str | None = None
    tasks: list[str] | None = None  # default: every task evaluation/tasks.py knows
    data_dir: str | None = None
    limit: int | None = None
    kv_cache_dtype: str = "auto"
    batch_size: int = 8
    tp: int = 1
    ep: int = 1
    mem_fraction: float | None = None
    health_timeout: float = 1800
    device: str = "auto"  # hf: where the model runs (auto: the first GPU, else the CPU)
    dtype: str = "auto"  # hf: what the model computes in (compute_dtype.py: auto, bf16, fp16, fp32)
    repeat: int = Field(default=1, ge=1, le=2)  # 2: everything runs twice, the gate's engine-noise floor


class PlanSettings(Section):
    tp: int = 1
    gpu: str | None = "h200"  # h100, h200 or b200 (memory as the GPU reports it)
    gpu_mem_gib: float | None = None  # overrides gpu
    kv_dtype: str = "bf16"  # bf16 or fp8_e4m3
    mem_fraction: float = 0.88  # SGLang's --mem-fraction-static
    context_len: int = 32768
    page_size: int = 64
    max_shard_size: str = ConvertSettings().max_shard_size


class BudgetSettings(Section):
    data: str | None = None  # default: quantkit's bundled GSM8K-train text
    samples: int = 8
    seq_len: int = 256
    device: str = "auto"
    dtype: str = "auto"


CONVERT = ConvertSettings()
CALIBRATE = CalibrateSettings()
VERIFY = VerifySettings()
EVAL = EvalSettings()
PLAN = PlanSettings()
BUDGET = BudgetSettings()
