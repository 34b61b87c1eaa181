"""A real SGLang on a GPU serving quantkit's outputs, started by quantkit's own server code.

Needs a CUDA GPU and SGLang importable from ``QUANTKIT_SGLANG_SITE`` (engines/build-sglang-bundle.sh makes that
folder for a machine with no network: SGLang 0.5.17, the newest whose torch pin, 2.11.0, a CUDA 13 machine has), and
``QUANTKIT_SGLANG_MODELS``: SmolLM2-architecture checkpoints (hidden 576, 9 query / 3 KV heads, MLP 1536, random
weights, vocabulary 2,048) converted by quantkit as ``mlp`` (dense-mlp-w4a16-g32), ``all`` (dense-w4a16-g32) and
``mlp-kv`` (``mlp`` with calibrate-kv's scales). ``mlp`` is served and the log-probability SGLang gives every prompt
token is compared with transformers' (compressed-tensors decompressing the same checkpoint) on the same GPU; ``all``,
which ``verify --engine sglang`` refuses (no Marlin tile fits its fused q/k/v), must fail at SGLang's first forward.
Synthetic DeepSeek-V3 and GLM-5 checkpoints (the releases' layout, routed experts INT4) are compared with quantkit's own
decoding of them in the transformers class. Served with ``--kv-cache-dtype fp8_e4m3``, the checkpoint with its
calibrated KV scales multiplied by 16 answers differently from the one with quantkit's scales where the SGLang
version reads compressed-tensors KV scales, and identically (both 1.0) where it does not. The real SmolLM2 (its GGUF in
``QUANTKIT_CACHE/smollm2``, carried where there is no network) and quantkit's releases of it are scored through
``quantkit eval --engine sglang`` beside ``--engine hf`` on the same GPU, item by item; the client needs
engines/eval-client-gpu-wheels.txt's bundle there (docs/verify.md).
"""

from __future__ import annotations

import json
import os
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


def prompts(vocab: int) -> list[list[int]]:
    return [[(7 * i + 13 * j) % vocab for j in range(48)] for i in range(1, 5)]


PROMPTS = prompts(2048)
# BF16 activations on both sides with different kernels (SGLang's Marlin INT4 GEMM against compressed-tensors'
# dequantized weights in torch): per-token log-probabilities of a random-weight model near 8 nats in magnitude
TOLERANCE = 0.15


@pytest.fixture(scope="module")
def sglang_cmd():
    if not SITE or not MODELS.is_dir():
        pytest.skip("QUANTKIT_SGLANG_SITE and QUANTKIT_SGLANG_MODELS name SGLang and the checkpoints (see the "
                    "module docstring)")
    return [sys.executable, "-m", "sglang.launch_server"]


def serve_logprobs(cmd, model: Path, log: Path, kv_cache_dtype: str = "auto", ids_list=PROMPTS,
                   decode: int = 0) -> list[list[float]]:
    """Every prompt token's log-probability as SGLang serves ``model``; with ``decode``, those of the ``decode`` tokens
    it then generates greedily instead: only they read the KV cache (in prefill SGLang's triton backend attends a
    prompt to the K and V it has just computed; seen on 0.5.17: FP8 and BF16 caches, equal prompt log-probabilities
    to the bit)."""
    from quantkit.engines.launch import SGLangLaunch
    from quantkit.evaluation.sglang import EngineServer, free_port

    spec = SGLangLaunch(str(model), kv_cache_dtype=kv_cache_dtype, mem_fraction=0.2, port=free_port(), extra=tuple(FLAGS))
    with EngineServer(cmd, spec, log, health_timeout=600) as url:
        out = []
        for ids in ids_list:
            body = json.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": max(decode, 1), "temperature": 0,
                                                                   "ignore_eos": True},
                               "return_logprob": True, "logprob_start_len": 0}).encode()
            request = urllib.request.Request(f"{url}/generate", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=300) as response:
                meta = json.loads(response.read())["meta_info"]
            got = meta["output_token_logprobs"] if decode else meta["input_token_logprobs"][1:]
            out.append([lp for lp, _, _ in got])
    return out


def prompt_logprobs(net, ids_list: list[list[int]]) -> list[list[float]]:
    """Every prompt token's log-probability under ``net`` on the GPU; frees the GPU memory it held."""
    out = []
    with torch.no_grad():
        for ids in ids_list:
            x = torch.tensor([ids], device="cuda")
            logp = torch.log_softmax(net(x).logits.float(), dim=-1)[0, :-1]
            out.append(logp.gather(1, x[0, 1:, None])[:, 0].tolist())
    del net
    torch.cuda.empty_cache()
    return out


def reference_logprobs(model: Path) -> list[list[float]]:
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).cuda().eval()
    return prompt_logprobs(net, PROMPTS)


@pytest.mark.parametrize("name", ["mlp", "all"])
def test_sglang_serves_what_verify_passes_as_transformers_computes_it_and_fails_on_what_it_refuses(
        sglang_cmd, name, tmp_path):
    from quantkit.evaluation.sglang import EngineError
    from quantkit.verify import verify

    marlin = [f for f in verify(MODELS / name, engine="sglang", smoke=False).findings if "Marlin" in f.rule]
    if marlin:  # all: SmolLM2's 576-wide q/k/v fit no Marlin tile
        with pytest.raises(EngineError, match="Invalid thread config"):
            serve_logprobs(sglang_cmd, MODELS / name, tmp_path / "server.log")
        return
    served = serve_logprobs(sglang_cmd, MODELS / name, tmp_path / "server.log")
    log = (tmp_path / "server.log").read_text()
    assert "compressed-tensors" in log
    reference = reference_logprobs(MODELS / name)
    worst = max(abs(a - b) for s, r in zip(served, reference, strict=True) for a, b in zip(s, r, strict=True))
    print(f"{name}: largest |SGLang - transformers| per-token log-probability {worst:.4f}")
    assert worst < TOLERANCE


def quantkit_logprobs(model: Path, ids_list: list[list[int]]) -> list[list[float]]:
    """quantkit's own decoding of the checkpoint into the transformers model class (the hf engine's), on the GPU:
    transformers does not load per-expert INT4 into its fused MoE experts."""
    from quantkit.modeling import load_model

    net = load_model(model, device="cuda").eval()
    return prompt_logprobs(net, ids_list)


@pytest.mark.parametrize("name", ["deepseek_v3", "glm_moe_dsa"])
def test_sglang_serves_quantkits_int4_experts_as_quantkit_decodes_them(sglang_cmd, name, tmp_path):
    import importlib.util

    from quantkit.evaluation.sglang import EngineError

    config = json.loads((MODELS / name / "config.json").read_text())
    ids_list = prompts(config["vocab_size"])
    if name == "glm_moe_dsa" and importlib.util.find_spec("deep_gemm") is None:
        # SGLang builds GLM-5's DSA indexer with deep_gemm (sglang/srt/layers/attention/dsa/dsa_indexer.py:104, 250
        # in 0.5.17), which the bundle does not carry: the kernel missing is named, the model never built
        with pytest.raises(EngineError, match="get_num_sms"):
            serve_logprobs(sglang_cmd, MODELS / name, tmp_path / "server.log", ids_list=ids_list)
        return
    served = serve_logprobs(sglang_cmd, MODELS / name, tmp_path / "server.log", ids_list=ids_list)
    assert "compressed-tensors" in (tmp_path / "server.log").read_text()
    reference = quantkit_logprobs(MODELS / name, ids_list)
    gaps = sorted(abs(a - b) for s, r in zip(served, reference, strict=True) for a, b in zip(s, r, strict=True))
    print(f"{name}: |SGLang - quantkit's decoding| per-token log-probability: median {gaps[len(gaps) // 2]:.4f}, "
          f"largest {gaps[-1]:.4f}")
    assert gaps[-1] < TOLERANCE


def sglang_loads_compressed_tensors_kv_scales() -> bool:
    """SGLang 0.5.23 builds a KV-cache quant method from a compressed-tensors ``kv_cache_scheme``
    (compressed_tensors.py, ``CompressedTensorsKVCacheMethod``); 0.5.17 has none and serves FP8 KV with scale 1.0."""
    source = Path(SITE) / "sglang/srt/layers/quantization/compressed_tensors/compressed_tensors.py"
    return "CompressedTensorsKVCacheMethod" in source.read_text()


DECODE = 16  # generated tokens per prompt, each attending to its prompt through the FP8 cache


def test_sglang_reads_the_calibrated_kv_scales_where_its_version_does(sglang_cmd, tmp_path):
    from safetensors.torch import load_file, save_file

    scaled = tmp_path / "scaled"
    shutil.copytree(MODELS / "mlp-kv", scaled)
    for shard in scaled.glob("*.safetensors"):
        tensors = load_file(shard)
        if any(k.endswith(("k_scale", "v_scale")) for k in tensors):
            save_file({k: v * 16 if k.endswith(("k_scale", "v_scale")) else v for k, v in tensors.items()}, shard,
                      metadata={"format": "pt"})
    ours = serve_logprobs(sglang_cmd, MODELS / "mlp-kv", tmp_path / "ours.log", "fp8_e4m3", decode=DECODE)
    wrong = serve_logprobs(sglang_cmd, scaled, tmp_path / "scaled.log", "fp8_e4m3", decode=DECODE)
    bf16 = serve_logprobs(sglang_cmd, MODELS / "mlp-kv", tmp_path / "bf16.log", decode=DECODE)
    far = lambda a, b: max(abs(x - y) for s, r in zip(a, b, strict=True) for x, y in zip(s, r, strict=True))  # noqa: E731
    log = (tmp_path / "ours.log").read_text()
    print(f"kv: fp8 with quantkit's scales vs bf16 KV {far(ours, bf16):.4f}; x16 scales vs quantkit's "
          f"{far(wrong, ours):.4f}; engine: {'reads' if sglang_loads_compressed_tensors_kv_scales() else 'ignores'}")
    if sglang_loads_compressed_tensors_kv_scales():
        # a server that fell back to scale 1.0 would decode both the same, to the bit
        assert far(wrong, ours) > 0.01
        assert "Defaulting to scaling factors of 1.0" not in log
    else:
        # what docs/verify.md says of SGLang 0.5.17: the scales are found and dropped, the cache uses 1.0
        assert ".k_scale is not loaded" in log and "Defaulting to scaling factors of 1.0" in log
        assert far(wrong, ours) == 0.0
    assert far(ours, bf16) > 0  # the decoded tokens did read an FP8 cache


@pytest.fixture(scope="module")
def smollm2_gpu(tmp_path_factory):
    """The real SmolLM2-135M (BF16, rebuilt from the GGUF of the PyPI wheel: carry it into QUANTKIT_CACHE/smollm2 where
    there is no network), quantkit's MLP INT4 of it, and the demo's other releases made from its block-FP8 form as the
    demo makes them (the MLP kept block-FP8; budget's mix of INT4 and FP8 MLPs), all converted on the GPU."""
    from quantkit.budget import budget
    from quantkit.convert import convert
    from quantkit.examples.demo import BUDGET
    from quantkit.examples.smollm2 import block_fp8_release, smollm2_checkpoint

    root = tmp_path_factory.mktemp("smollm2")
    source = smollm2_checkpoint(root / "bf16")
    convert(source, root / "mlp", "dense-mlp-w4a16-g32", device="cuda")
    fp8 = block_fp8_release(source, root / "fp8-release")
    convert(fp8, root / "demo-fp8", "dense-mlp-fp8-block", device="cuda")
    budget(fp8, recipe="dense-mlp-w4a16-g32", size=BUDGET, out=root / "budget.yaml", samples=4, seq_len=256,
           device="cuda")
    convert(fp8, root / "demo-budget", root / "budget.yaml", device="cuda")
    return {"source": source, "dense-mlp-w4a16-g32": root / "mlp", "demo-fp8": root / "demo-fp8",
            "demo-budget": root / "demo-budget"}


@pytest.mark.parametrize("model", ["source", "dense-mlp-w4a16-g32", "demo-fp8", "demo-budget"])
def test_quantkit_eval_on_sglang_scores_as_the_hf_engine_on_the_gpu(sglang_cmd, smollm2_gpu, model, tmp_path):
    """What a user runs: ``quantkit eval --engine sglang`` (lm-eval's completions client; log-likelihoods through
    ``echo`` + ``logprobs``) on SmolLM2 and its INT4 release, beside ``--engine hf`` on the same GPU, item by item."""
    from helpers import compare_runs, samples

    from quantkit.evaluation import evaluate
    from quantkit.packaged import evaldata_dir

    tasks, limit = ["arc_easy", "gsm8k"], 16  # log-likelihoods; greedy generation
    options = dict(tasks=tasks, data_dir=evaldata_dir(), limit=limit, batch_size=8)
    flags = [f for f in FLAGS if f != "--skip-tokenizer-init"]  # the completions API detokenizes
    served = evaluate(smollm2_gpu[model], engine="sglang", engine_cmd=" ".join(sglang_cmd + flags), mem_fraction=0.3,
                      health_timeout=600, out=tmp_path / "sglang", **options)
    hf = evaluate(smollm2_gpu[model], engine="hf", device="cuda", out=tmp_path / "hf", **options)
    assert served.engine == "sglang"
    if model != "source":
        assert "compressed-tensors" in (tmp_path / "sglang" / "server.log").read_text()
    # SGLang's triton attention and Marlin INT4 GEMM against torch's kernels on dequantized weights, BF16 both: on an
    # H200 (0.5.17) the ARC-Easy sums (-15 to -40 nats) parted by at most 2.5 % (source) and 2.6 % (INT4), median
    # 0.06 and 0.12 nats, and by 0.005 and 0.0002 nats on average: noise, no drift one way
    compare_runs(Path(hf.run_dir), Path(served.run_dir), dict.fromkeys(tasks, limit), rel=0.04)
    hf_arc, served_arc = samples(Path(hf.run_dir), "arc_easy"), samples(Path(served.run_dir), "arc_easy")
    drift = [b - a for item, r in hf_arc.items()
             for a, b in zip(r.choice_logprobs or [], served_arc[item].choice_logprobs or [], strict=True)]
    print(f"{model}: SGLang - hf engine per ARC-Easy choice: mean {sum(drift) / len(drift):+.4f}, largest "
          f"{max(map(abs, drift)):.4f} nats")
    assert abs(sum(drift) / len(drift)) < 0.05
