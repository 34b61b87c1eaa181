"""A real SGLang on a GPU serving quantkit's outputs, started by quantkit's own server code.

Needs a CUDA GPU and SGLang importable from ``QUANTKIT_SGLANG_SITE`` (engines/build-sglang-bundle.sh makes that
folder for a machine with no network: SGLang 0.5.17, the newest whose torch pin, 2.11.0, a CUDA 13 machine has), and
``QUANTKIT_SGLANG_MODELS``: SmolLM2-architecture checkpoints (hidden 576, 9 query / 3 KV heads, MLP 1536, random
weights, vocabulary 2,048) converted by quantkit as ``mlp`` (dense-mlp-w4a16-g32), ``all`` (dense-w4a16-g32) and
``mlp-kv`` (``mlp`` with calibrate-kv's scales). Each is served; the log-probability SGLang gives every prompt token
is compared with transformers' (compressed-tensors decompressing the same checkpoint) on the same GPU; and the
calibrated KV scales are shown to be read by SGLang: served with ``--kv-cache-dtype fp8_e4m3``, the checkpoint with
its scales multiplied by 16 answers differently from the one with quantkit's scales.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import urllib.request
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SITE = os.environ.get("QUANTKIT_SGLANG_SITE")
MODELS = Path(os.environ.get("QUANTKIT_SGLANG_MODELS", "/nonexistent"))
# the flags SGLang 0.5.17 booted with on an H200 from the bundle (no FlashAttention 3, no grammar library)
FLAGS = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
         "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled",
         "--mm-feature-transport", "cpu", "--skip-tokenizer-init"]
PROMPTS = [[(7 * i + 13 * j) % 2048 for j in range(48)] for i in range(1, 5)]
# BF16 activations on both sides with different kernels (SGLang's Marlin INT4 GEMM against compressed-tensors'
# dequantized weights in torch): per-token log-probabilities of a random-weight model near 8 nats in magnitude
TOLERANCE = 0.15


@pytest.fixture(scope="module")
def sglang_cmd():
    if not SITE or not MODELS.is_dir():
        pytest.skip("QUANTKIT_SGLANG_SITE and QUANTKIT_SGLANG_MODELS name SGLang and the checkpoints (see the "
                    "module docstring)")
    return [sys.executable, "-m", "sglang.launch_server"]


def serve_logprobs(cmd, model: Path, log: Path, kv_cache_dtype: str = "auto") -> list[list[float]]:
    from quantkit.evaluation.sglang import EngineServer, LaunchSpec, free_port

    spec = LaunchSpec(str(model), kv_cache_dtype=kv_cache_dtype, mem_fraction=0.2, port=free_port(), extra=FLAGS)
    with EngineServer(cmd, spec, log, health_timeout=600) as url:
        out = []
        for ids in PROMPTS:
            body = json.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                               "return_logprob": True, "logprob_start_len": 0}).encode()
            request = urllib.request.Request(f"{url}/generate", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=300) as response:
                meta = json.loads(response.read())["meta_info"]
            out.append([lp for lp, _, _ in meta["input_token_logprobs"][1:]])
    return out


def reference_logprobs(model: Path) -> list[list[float]]:
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).cuda().eval()
    out = []
    with torch.no_grad():
        for ids in PROMPTS:
            x = torch.tensor([ids], device="cuda")
            logp = torch.log_softmax(net(x).logits.float(), dim=-1)[0, :-1]
            out.append(logp.gather(1, x[0, 1:, None])[:, 0].tolist())
    del net
    torch.cuda.empty_cache()
    return out


@pytest.mark.parametrize("name", ["mlp", "all"])
def test_sglang_builds_and_serves_quantkits_int4_as_transformers_computes_it(sglang_cmd, name, tmp_path):
    served = serve_logprobs(sglang_cmd, MODELS / name, tmp_path / "server.log")
    log = (tmp_path / "server.log").read_text()
    assert "compressed-tensors" in log
    reference = reference_logprobs(MODELS / name)
    worst = max(abs(a - b) for s, r in zip(served, reference, strict=True) for a, b in zip(s, r, strict=True))
    print(f"{name}: largest |SGLang - transformers| per-token log-probability {worst:.4f}")
    assert worst < TOLERANCE


def test_sglang_reads_the_calibrated_kv_scales(sglang_cmd, tmp_path):
    from safetensors.torch import load_file, save_file

    scaled = tmp_path / "scaled"
    shutil.copytree(MODELS / "mlp-kv", scaled)
    for shard in scaled.glob("*.safetensors"):
        tensors = load_file(shard)
        if any(k.endswith(("k_scale", "v_scale")) for k in tensors):
            save_file({k: v * 16 if k.endswith(("k_scale", "v_scale")) else v for k, v in tensors.items()}, shard,
                      metadata={"format": "pt"})
    ours = serve_logprobs(sglang_cmd, MODELS / "mlp-kv", tmp_path / "ours.log", "fp8_e4m3")
    wrong = serve_logprobs(sglang_cmd, scaled, tmp_path / "scaled.log", "fp8_e4m3")
    bf16 = serve_logprobs(sglang_cmd, MODELS / "mlp-kv", tmp_path / "bf16.log")
    far = lambda a, b: max(abs(x - y) for s, r in zip(a, b, strict=True) for x, y in zip(s, r, strict=True))  # noqa: E731
    print(f"kv: fp8 with quantkit's scales vs bf16 KV {far(ours, bf16):.4f}; x16 scales vs quantkit's "
          f"{far(wrong, ours):.4f}")
    print("launch:", shlex.join(sglang_cmd))
    # a server that fell back to scale 1.0 would answer both the same, to the bit
    assert far(wrong, ours) > 0.01
