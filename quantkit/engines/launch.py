"""The engine command lines quantkit writes, built in one place: the SGLang server an eval starts, the prefill and
decode pools ``plan --deploy`` prints, and the serving commands of a model card. Flag names are SGLang 0.5.23's
and vLLM 0.33.0's (``--tp-size``, ``--kv-cache-dtype``; ``vllm serve --tensor-parallel-size``)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

SGLANG_PROGRAM = "python -m sglang.launch_server"


@dataclass(frozen=True)
class SGLangLaunch:
    """One SGLang server: what is given becomes a flag, in a fixed order; what is None is left to SGLang."""

    model: str
    tp: int = 1
    ep: int = 1
    kv_cache_dtype: str = "auto"
    mem_fraction: float | None = None
    host: str | None = None
    port: int | None = None
    seed: int | None = None
    context_length: int | None = None
    page_size: int | None = None
    disaggregation_mode: str | None = None  # prefill | decode
    attention_backend: str | None = None
    extra: tuple[str, ...] = field(default_factory=tuple)

    def args(self) -> list[str]:
        flags = [("--model-path", self.model), ("--host", self.host), ("--port", self.port), ("--tp-size", self.tp),
                 ("--ep-size", self.ep if self.ep > 1 else None), ("--kv-cache-dtype", self.kv_cache_dtype),
                 ("--random-seed", self.seed), ("--mem-fraction-static", self.mem_fraction),
                 ("--context-length", self.context_length), ("--page-size", self.page_size),
                 ("--disaggregation-mode", self.disaggregation_mode), ("--attention-backend", self.attention_backend)]
        return [part for flag, value in flags if value is not None for part in (flag, str(value))] + list(self.extra)

    def command(self) -> str:
        return f"{SGLANG_PROGRAM} {shlex.join(self.args())}"

    def settings(self) -> dict:
        """What a run's provenance records of the launch: the settings that change results (not the model's path, the
        host or the port)."""
        return {"tp": self.tp, "ep": self.ep, "kv_cache_dtype": self.kv_cache_dtype,
                "mem_fraction": self.mem_fraction, "seed": self.seed, "extra": list(self.extra)}


def vllm_serve(model: str, tp: int, fp8_kv: bool) -> str:
    return shlex.join(["vllm", "serve", model, "--tensor-parallel-size", str(tp)]
                      + (["--kv-cache-dtype", "fp8"] if fp8_kv else []))
