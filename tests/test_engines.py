"""The server engines: SGLang as a child process (tested against a stand-in that is started the
same way and speaks the same HTTP), and any OpenAI-compatible server at a URL."""

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import evaldata

from quantkit.evaluation import evaluate
from quantkit.engines.launch import SGLangLaunch
from quantkit.evaluation.sglang import (
    EngineError,
    EngineServer,
    free_port,
)
from quantkit.release.gate import CannotCompare, gate

pytestmark = pytest.mark.slow  # real-model end-to-end: `pytest -m "not slow"` skips it in the edit loop

DATA = evaldata("arc_easy", "gsm8k")
STANDIN = Path(__file__).resolve().parent / "standin" / "sglang_standin.py"
REPO = Path(__file__).resolve().parents[1]


def standin(mode: str | None, pids: Path | None = None) -> str:
    """The stand-in's command; ``mode`` None: the STANDIN_MODE environment variable's (one command, several modes)."""
    cmd = [sys.executable, str(STANDIN)] + (["--standin-mode", mode] if mode else [])
    if pids is not None:
        cmd += ["--standin-pids", str(pids)]
    return shlex.join(cmd)


def running(pids_file: Path) -> list[int]:
    """The stand-in's processes (server and its scheduler) that still run."""
    alive = []
    for pid in map(int, pids_file.read_text().split()):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X"):
            alive.append(pid)
    return alive


def test_launch_arguments_are_sglangs_own():
    """quantkit's launch arguments, parsed by the real sglang.launch_server parser."""
    python = os.environ.get("QUANTKIT_SGLANG_PYTHON", sys.executable)
    probe = subprocess.run([python, "-c", "import sglang.srt.server_args"], capture_output=True, check=False)
    if probe.returncode != 0:
        pytest.skip("sglang is not importable here (it lives in its own environment; "
                    "set QUANTKIT_SGLANG_PYTHON to that environment's python to run this check)")
    spec = SGLangLaunch("/models/glm-5.2-int4", tp=8, ep=8, kv_cache_dtype="fp8_e4m3", mem_fraction=0.88,
                        host="127.0.0.1", port=31234, seed=0)
    code = ("import json, sys; from sglang.srt.server_args import prepare_server_args; a = prepare_server_args(sys.argv[1:]); "
            "print(json.dumps([a.model_path, a.host, a.port, a.tp_size, a.ep_size, a.kv_cache_dtype, a.mem_fraction_static, a.random_seed]))")
    parsed = subprocess.run([python, "-c", code, *spec.args()], capture_output=True, text=True, check=True)
    assert json.loads(parsed.stdout.splitlines()[-1]) == ["/models/glm-5.2-int4", "127.0.0.1", 31234, 8, 8, "fp8_e4m3", 0.88, 0]


def test_sglang_engine_scores_like_the_in_process_engine(smollm2_bf16, tmp_path):
    pids = tmp_path / "pids"
    seen = []
    served = evaluate(smollm2_bf16, engine="sglang", tasks=["arc_easy"], data_dir=DATA, limit=6, out=tmp_path / "sglang",
                      engine_cmd=standin("model", pids), on_progress=lambda *a: seen.append(a))
    local = evaluate(smollm2_bf16, engine="hf", tasks=["arc_easy"], data_dir=DATA, limit=6, out=tmp_path / "hf")
    rows = {}
    for name in ("sglang", "hf"):
        rows[name] = [json.loads(x) for x in (tmp_path / name / "samples" / "arc_easy.jsonl").read_text().splitlines()]
    assert [r["correct"] for r in rows["sglang"]] == [r["correct"] for r in rows["hf"]]
    for a, b in zip(rows["sglang"], rows["hf"]):  # the hf engine reports bf16 log-probabilities
        assert a["prompt_hash"] == b["prompt_hash"]
        assert a["choice_logprobs"] == pytest.approx(b["choice_logprobs"], abs=0.5)
    assert served.scores["arc_easy"]["score"] == local.scores["arc_easy"]["score"]
    assert seen[0] == ("arc_easy", 0, 6) and seen[-1] == ("arc_easy", 6, 6)
    meta = json.loads((tmp_path / "sglang" / "run.json").read_text())
    assert meta["engine"]["name"] == "sglang" and meta["engine"]["version"] == "0.0-standin"
    assert meta["engine"]["args"]["kv_cache_dtype"] == "auto" and meta["engine"]["args"]["tp"] == 1
    log = (tmp_path / "sglang" / "server.log").read_text()
    assert "--model-path" in log.splitlines()[0] and "POST /v1/completions" in log
    assert running(pids) == []
    with pytest.raises(CannotCompare, match="engine.name"):
        gate(served.run_dir, local.run_dir, margin=1.0)


def test_crash_mid_run_fails_with_the_log_tail_and_leaves_no_process(smollm2_bf16, tmp_path):
    pids = tmp_path / "pids"
    with pytest.raises(EngineError, match="exited with code 9 during task arc_easy") as info:
        evaluate(smollm2_bf16, engine="sglang", tasks=["arc_easy"], data_dir=DATA, limit=6, out=tmp_path / "run",
                 engine_cmd=standin("crash-after=2", pids), batch_size=1)
    assert "Fatal: stand-in scheduler died" in str(info.value)
    assert running(pids) == []


def test_a_rerun_after_a_crash_resumes_from_the_answers_already_given(smollm2_bf16, tmp_path, monkeypatch):
    monkeypatch.setenv("STANDIN_MODE", "crash-after=10")  # the same server command both times, as a user re-runs it
    with pytest.raises(EngineError):
        evaluate(smollm2_bf16, engine="sglang", tasks=["arc_easy"], data_dir=DATA, limit=6, out=tmp_path / "run",
                 engine_cmd=standin(None), batch_size=1)
    monkeypatch.setenv("STANDIN_MODE", "hash")
    result = evaluate(smollm2_bf16, engine="sglang", tasks=["arc_easy"], data_dir=DATA, limit=6, out=tmp_path / "run",
                      engine_cmd=standin(None), batch_size=1)
    assert result.scores["arc_easy"]["n"] == 6
    posts = (tmp_path / "run" / "server.log").read_text().split("ready to roll! (hash)")[1].count("POST /v1/completions")
    assert posts == 24 - 10  # 6 items x 4 choices, of which the first server answered 10


def test_a_server_that_never_becomes_healthy_times_out(smollm2_bf16, tmp_path):
    pids = tmp_path / "pids"
    started = time.monotonic()
    with pytest.raises(EngineError, match="did not become healthy .* within 3s") as info:
        evaluate(smollm2_bf16, engine="sglang", tasks=["arc_easy"], data_dir=DATA, limit=2, out=tmp_path / "run",
                 engine_cmd=standin("never-healthy", pids), health_timeout=3)
    assert "ready to roll" in str(info.value)  # the log's tail
    assert time.monotonic() - started < 60
    assert running(pids) == []


def test_a_server_that_exits_at_start_says_why(smollm2_bf16, tmp_path):
    with pytest.raises(EngineError, match="exited with code 3 before becoming healthy(.|\n)*told to fail at start"):
        evaluate(smollm2_bf16, engine="sglang", tasks=["arc_easy"], data_dir=DATA, limit=2, out=tmp_path / "run",
                 engine_cmd=standin("exit-at-start"))
    with pytest.raises(EngineError, match="cannot start the engine command '/nonexistent/python'"):
        evaluate(smollm2_bf16, engine="sglang", tasks=["arc_easy"], data_dir=DATA, limit=2, out=tmp_path / "run2",
                 engine_cmd="/nonexistent/python -m sglang.launch_server")


def test_malformed_json_is_named(smollm2_bf16, tmp_path):
    pids = tmp_path / "pids"
    with pytest.raises(EngineError, match="failed during task arc_easy: malformed JSON"):
        evaluate(smollm2_bf16, engine="sglang", tasks=["arc_easy"], data_dir=DATA, limit=2, out=tmp_path / "run",
                 engine_cmd=standin("malformed", pids), batch_size=1)
    assert running(pids) == []


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_stopping_quantkit_stops_the_server(smollm2_bf16, tmp_path, how):
    """Ctrl-C and SIGTERM unwind through the engine's cleanup; after SIGKILL the parent-death signal does it."""
    pids = tmp_path / "pids"
    cmd = [sys.executable, "-c", "from quantkit.cli import main; main()", "eval", str(smollm2_bf16), "--engine", "sglang",
           "--tasks", "arc_easy", "--data-dir", str(DATA), "--out", str(tmp_path / "run"),
           "--engine-cmd", standin("never-healthy", pids), "--health-timeout", "120"]
    # A shell that started the tests in the background may have left SIGINT ignored; Ctrl-C reaches a foreground quantkit.
    quantkit = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while not (pids.is_file() and len(pids.read_text().split()) == 2 and "ready" in _log(tmp_path)):
        assert quantkit.poll() is None and time.monotonic() < deadline, quantkit.communicate()
        time.sleep(0.2)
    assert len(running(pids)) == 2
    quantkit.send_signal(how)
    _, stderr = quantkit.communicate(timeout=60)
    assert quantkit.returncode != 0
    if how != signal.SIGKILL:
        assert "interrupted" in stderr
        assert "starting the engine: " in stderr and "never-healthy" in stderr  # executable config is shown first
    deadline = time.monotonic() + 20
    while running(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert running(pids) == []


def _log(tmp_path: Path) -> str:
    log = tmp_path / "run" / "server.log"
    return log.read_text() if log.is_file() else ""


def test_openai_engine_talks_to_a_running_server(smollm2_bf16, tmp_path):
    spec = SGLangLaunch(str(smollm2_bf16), port=free_port())
    with EngineServer(shlex.split(standin("hash")), spec, tmp_path / "server.log", health_timeout=60) as url:
        result = evaluate(smollm2_bf16, engine="openai", url=url + "/v1", tasks=["arc_easy", "gsm8k"], data_dir=DATA,
                          limit=3, out=tmp_path / "run")
    assert {t: s["n"] for t, s in result.scores.items()} == {"arc_easy": 3, "gsm8k": 3}
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    assert meta["server"] == {"url": url, "served_model": smollm2_bf16.name}
    assert meta["engine"]["name"] == "openai"
    gsm = [json.loads(x) for x in (tmp_path / "run" / "samples" / "gsm8k.jsonl").read_text().splitlines()]
    assert all(r["response"].rstrip(".").isdigit() for r in gsm), gsm  # the number in "The answer is N."
    with pytest.raises(EngineError, match="cannot reach"):
        evaluate(smollm2_bf16, engine="openai", url=url, tasks=["arc_easy"], data_dir=DATA, limit=1, out=tmp_path / "r2")
    with pytest.raises(Exception, match="needs --url"):
        evaluate(smollm2_bf16, engine="openai", tasks=["arc_easy"], data_dir=DATA, out=tmp_path / "r3")
    with pytest.raises(Exception, match="unknown engine 'trtllm'"):
        evaluate(smollm2_bf16, engine="trtllm", tasks=["arc_easy"], data_dir=DATA, out=tmp_path / "r4")


def test_a_run_dir_from_another_model_family_is_refused(smollm2_bf16, synthetic, tmp_path):
    glm = tmp_path / "glm"
    shutil.copytree(synthetic["glm_moe_dsa"], glm)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_bf16 / name, glm / name)
    glm_run = evaluate(glm, engine="sglang", tasks=["arc_easy"], data_dir=DATA, limit=2, out=tmp_path / "run",
                       engine_cmd=standin("hash"))
    with pytest.raises(Exception, match="holds a run of another model family \\(glm_moe_dsa"):
        evaluate(smollm2_bf16, engine="sglang", tasks=["arc_easy"], data_dir=DATA, limit=2, out=tmp_path / "run",
                 engine_cmd=standin("hash"))
    smol_run = evaluate(smollm2_bf16, engine="sglang", tasks=["arc_easy"], data_dir=DATA, limit=2, out=tmp_path / "smol",
                        engine_cmd=standin("hash"))
    with pytest.raises(CannotCompare, match="model_family.model_type: 'glm_moe_dsa' vs 'llama'"):
        gate(glm_run.run_dir, smol_run.run_dir, margin=1.0)


def test_the_server_command_is_part_of_the_runs_setup(smollm2_bf16, tmp_path):
    """Recorded in run.json and so in the request cache's binding: a run folder is not evaluated again with another
    server command (before, every cached answer of the first was reused), and two commands do not gate as one
    setup."""
    from quantkit.errors import CannotCompare, QuantkitError
    from quantkit.release.gate import gate

    first = evaluate(smollm2_bf16, engine="sglang", tasks=["arc_easy"], data_dir=DATA, limit=4, out=tmp_path / "a",
                     engine_cmd=standin("hash"), batch_size=1)
    record = json.loads((Path(first.run_dir) / "run.json").read_text())
    assert record["engine"]["args"]["command"] == standin("hash")
    with pytest.raises(QuantkitError, match="holds a run with a different engine"):
        evaluate(smollm2_bf16, engine="sglang", tasks=["arc_easy"], data_dir=DATA, limit=4, out=tmp_path / "a",
                 engine_cmd=standin("hash") + " --random-seed 0", batch_size=1)
    other = evaluate(smollm2_bf16, engine="sglang", tasks=["arc_easy"], data_dir=DATA, limit=4, out=tmp_path / "b",
                     engine_cmd=standin("hash") + " --random-seed 0", batch_size=1)
    with pytest.raises(CannotCompare, match="engine.args.command"):
        gate(first.run_dir, other.run_dir)


def test_an_engine_that_serves_the_checkpoint_unquantized_is_caught_after_boot(smollm2_bf16, tmp_path):
    """The served model must be the gated one: the probe's answers nearer quantkit's decoding of the INT4 checkpoint
    than of its source pass; an engine that dropped the quantization (the stand-in serving the manifest's source
    under the checkpoint's name) fails, run.json says so, and the gate refuses the run."""
    from quantkit.convert import convert

    int4 = tmp_path / "int4"
    convert(smollm2_bf16, int4, "dense-mlp-w4a16-g32", device="cpu")
    runs = {}
    for mode in ("model", "unquantized"):
        runs[mode] = tmp_path / mode
        evaluate(int4, engine="sglang", tasks=["arc_easy"], data_dir=DATA, limit=2, out=runs[mode],
                 engine_cmd=standin(mode))
    probes = {mode: json.loads((run / "run.json").read_text())["probe"] for mode, run in runs.items()}
    assert probes["model"]["status"] == "pass", probes["model"]
    assert probes["unquantized"]["status"] == "fail", probes["unquantized"]
    assert probes["model"]["converted"] == probes["unquantized"]["converted"]  # quantkit's own decoding: the same
    with pytest.raises(CannotCompare, match="did not serve the checkpoint it was given"):
        gate(runs["model"], runs["unquantized"], margin=100)
    # the source itself, served: no manifest, nothing to tell apart
    evaluate(smollm2_bf16, engine="sglang", tasks=["arc_easy"], data_dir=DATA, limit=2, out=tmp_path / "source",
             engine_cmd=standin("model"))
    assert json.loads((tmp_path / "source" / "run.json").read_text())["probe"]["status"] == "not checked"
