"""What the serving engines' INT4 kernels accept (FORMATS.md §2).

A checkpoint that breaks one of these rules loads fine and then fails, or serves garbage, at
serve time; ``verify`` checks them before the GPU hours are spent.

A ``mixed-precision`` checkpoint (INT4 groups beside block-FP8 ones) is no rule of its own: both engines take a
Linear's scheme from its config group's own format (SGLang 0.5.23 compressed_tensors.py:373-381 and 725-745, run in
tests/test_engine_names.py) and a MoE layer's from its weights' arguments alone.

No rule asks a rank's input to be a multiple of 128 (Marlin's thread tile): vLLM 0.33.0 picks among several WNA16
kernels (vllm/model_executor/kernels/linear/__init__.py:539-548, 887-940) and its Marlin zero-pads a misaligned tile
(kernels/linear/mixed_precision/marlin.py:37-71); SGLang 0.5.23 calls check_marlin_supports_shape and drops its
answer (sglang/srt/layers/quantization/compressed_tensors/schemes/compressed_tensors_wNa16.py:221-226), so such a
shape loads there too.
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


ENGINES = {
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


def engine_rules(name: str) -> EngineRules:
    if name not in ENGINES:
        raise QuantkitError(f"unknown engine {name!r} (known: {', '.join(ENGINES)})")
    return ENGINES[name]
