"""What the serving engines' INT4 kernels accept (FORMATS.md §2).

A checkpoint that breaks one of these rules loads fine and then fails, or serves garbage, at
serve time; ``verify`` checks them before the GPU hours are spent.

A ``mixed-precision`` checkpoint (INT4 groups beside block-FP8 ones) is no rule of its own: both engines take a
Linear's scheme from its config group's own format (SGLang 0.5.23 compressed_tensors.py:373-381 and 725-745, run in
tests/test_engine_names.py) and a MoE layer's from its weights' arguments alone.

vLLM 0.33.0 picks among several WNA16 kernels (vllm/model_executor/kernels/linear/__init__.py:539-548, 887-940) and
its Marlin zero-pads a misaligned tile (kernels/linear/mixed_precision/marlin.py:37-71): no tile rule there. SGLang
runs every INT4 Linear and MoE layer through Marlin on CUDA; it calls check_marlin_supports_shape and drops its
answer (sglang/srt/layers/quantization/compressed_tensors/schemes/compressed_tensors_wNa16.py:221-226), so a shape no
Marlin thread tile divides loads and then fails at the first forward (``SGLANG_MARLIN``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from quantkit.errors import QuantkitError

# Fused at load time by the engines: members of one group must share one scheme.
FUSED_GROUPS = (
    ("gate_proj", "up_proj"),
    ("q_a_proj", "kv_a_proj_with_mqa"),
    ("q_proj", "k_proj", "v_proj"),
)
# Tensor-parallel layers whose input dimension is split across ranks.
ROW_PARALLEL = re.compile(r"\.(down_proj|o_proj)$")


@dataclass(frozen=True)
class EngineRules:
    name: str
    group_sizes: frozenset[int]  # accepted INT4 group sizes; -1 means channel-wise
    asymmetric: str  # how its INT4 kernels take weight_zero_point (asymmetric groups), read in its source


# the serving engines' INT4 kernel rules, by engine (evaluation.engines.ENGINES is another thing: what eval runs on)
KERNEL_RULES = {
    "sglang": EngineRules(
        "sglang", frozenset({-1, 32, 64, 128}),
        asymmetric="SGLang 0.5.23 loads weight_zero_point for dense INT4 Linears (sglang/srt/layers/quantization/"
                   "compressed_tensors/schemes/compressed_tensors_wNa16.py:165-196) and for MoE experts on its "
                   "Marlin MoE path (compressed_tensors_wNa16_moe.py:192-216, 386-401, 440-441, 488-489), the CUDA "
                   "default; --moe-runner-backend triton refuses asymmetric experts at load "
                   "(compressed_tensors/compressed_tensors.py:931-936), and on ROCm only the Triton MoE path exists"),
    "vllm": EngineRules(
        "vllm", frozenset({-1, 32, 64, 128}),
        asymmetric="vLLM 0.33.0 loads weight_zero_point for dense INT4 Linears as uint4 with zero points (vllm/"
                   "model_executor/layers/quantization/compressed_tensors/schemes/compressed_tensors_wNa16.py:50-56, "
                   "98-110, 212-243) and for MoE experts (compressed_tensors_moe/compressed_tensors_moe_wna16.py:"
                   "257-343)"),
}


@dataclass(frozen=True)
class MarlinTiles:
    """The (thread_k, thread_n) tiles a Marlin GEMM picks from, one set per batch regime (one token per sequence;
    more): in every regime some tile must divide the GEMM's K (input) and N (output) per rank, or the kernel
    raises "Invalid thread config" at the first forward, after the model loaded."""

    linear: tuple[tuple[tuple[int, int], ...], ...]
    moe: tuple[tuple[tuple[int, int], ...], ...]
    source: dict[str, str]  # by module kind

    def fits(self, kind: str, k: int, n: int) -> bool:
        regimes = self.moe if kind == "moe" else self.linear
        return all(any(k % tk == 0 and n % tn == 0 for tk, tn in tiles) for tiles in regimes)


# Read in SGLang 0.5.23; the same tables in 0.5.17, whose server loaded dense-w4a16-g32 on a SmolLM2-shaped model
# on an H200 and then failed: "Invalid thread config ... for MKN = [3, 576, 960]" (its fused qkv_proj).
SGLANG_MARLIN = MarlinTiles(
    linear=(((128, 128), (64, 128), (128, 64)), ((64, 256), (64, 128), (128, 64))),
    moe=(((128, 128), (64, 128)), ((64, 256), (64, 128))),
    source={"linear": "sglang/kernels/jit/csrc/gemm/marlin/gptq_marlin.cuh:117-131, 231",
            "moe": "sglang/kernels/jit/csrc/gemm/marlin_moe/moe_wna16_marlin.cuh:140-152, 265"})


def engine_rules(name: str) -> EngineRules:
    if name not in KERNEL_RULES:
        raise QuantkitError(f"unknown engine {name!r} (known: {', '.join(KERNEL_RULES)})")
    return KERNEL_RULES[name]


@dataclass(frozen=True)
class W4A8Rules:
    """What an engine's compressed-tensors W4A8 MoE scheme (INT4 experts, FP8 activations) takes, read in its source."""

    group_size: int  # the one group size the kernel runs
    multiple: int  # the hidden size and each rank's expert width must be multiples of it
    needs_linear_target: bool  # a config group must target the class "Linear" (the scheme reads it there)
    needs_pack_quantized: bool  # the config's own format must be pack-quantized (not mixed-precision)
    dense: str | None  # why a dense Linear in a W4A8 group does not run, or None where it does
    source: str


W4A8_RULES = {
    "sglang": W4A8Rules(
        128, 128, needs_linear_target=True, needs_pack_quantized=True,
        dense="SGLang 0.5.23 has no dense W4A8 scheme (compressed_tensors.py:862, \"No compressed-tensors compatible "
              "scheme was found\")",
        source="SGLang 0.5.23 sglang/srt/layers/quantization/compressed_tensors/compressed_tensors.py:453-466 "
               "(_is_wint4afp8: the config's format pack-quantized), schemes/compressed_tensors_w4a8_fp8_moe.py:87 "
               "(target_scheme_map[\"Linear\"]), 94-99, 301 (group size 128 hard-coded in the kernel)"),
    "vllm": W4A8Rules(
        128, 256, needs_linear_target=False, needs_pack_quantized=False,
        dense="vLLM 0.33.0 runs a dense W4A8 Linear only on SM90 with its input and output multiples of 128 "
              "(compressed_tensors.py:647-653, 817-823; kernels/linear/mixed_precision/cutlass.py:31-68)",
        source="vLLM 0.33.0 vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors_moe/"
               "compressed_tensors_moe_w4a8_fp8.py:47-50 (symmetric, group 128), 69-73 (hidden and per-rank "
               "intermediate sizes multiples of 256)"),
}
