"""What an engine does to a Linear's input at run time, emulated in the in-process engine: dynamic per-token FP8.

A checkpoint whose scheme quantizes activations dynamically per token (FP8_DYNAMIC: ``input_activations`` FP8,
``strategy: token``, ``dynamic: true``) is served with each token's input to each such Linear scaled to FP8 at run
time: SGLang 0.5.23's kernel takes the token's absolute maximum over 448 in FP32, multiplies by its reciprocal,
clamps to +-448 and casts (sglang/kernels/jit/csrc/gemm/per_token_quant_fp8.cuh:41-64), then the GEMM runs on FP8
and rescales. The ``hf`` engine dequantizes the weights, so without this it would score the weights' rounding alone;
with it, each such input is quantized and dequantized the same way before the Linear (the GEMM itself stays in the
model's dtype: a difference in the last bits, not in what is rounded). Fused MoE experts' inputs are quantized as they
enter the experts; the input of their down projection, computed inside the fused module, is not (docs/eval.md).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from quantkit.formats.fp8_block import FP8_MAX


def fake_quantize_per_token(x: torch.Tensor) -> torch.Tensor:
    """``x`` quantized to FP8 e4m3 per token (the last dimension) and back, in ``x``'s dtype."""
    values = x.float()  # no copy when x is FP32, as on a CPU without BF16
    scale = values.abs().amax(dim=-1, keepdim=True).div_(FP8_MAX)
    inverse = torch.where(scale == 0, torch.zeros_like(scale), scale.reciprocal())
    q = (values * inverse).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.to(torch.float32).mul_(scale).to(x.dtype)


def dynamic_token_fp8(scheme) -> bool:
    a = scheme.input_activations
    return a is not None and a.type == "float" and a.num_bits == 8 and a.strategy == "token" and a.dynamic is True


@contextmanager
def activation_hooks(model: torch.nn.Module, ckpt) -> Iterator[int]:
    """Quantize, per token, the inputs of every module the checkpoint's scheme says the engine quantizes so; yields
    how many modules are hooked."""
    from quantkit.checkpoint.describe import described_by

    described = described_by(ckpt)
    handles = []
    last: list = [None, None]  # the last input quantized and its result: q/k/v and gate/up share their input

    def quantize_first(_module, args):
        if args[0] is not last[0]:
            last[:] = [args[0], fake_quantize_per_token(args[0])]
        return (last[1], *args[1:])

    if described is not None:
        for name, module in model.named_modules():
            target = _checkpoint_module(name, module)
            match = described.scheme_for(target, True) if target else None
            if match is not None and dynamic_token_fp8(match[1]):
                handles.append(module.register_forward_pre_hook(quantize_first))
    try:
        yield len(handles)
    finally:
        last[:] = [None, None]
        for handle in handles:
            handle.remove()


def _checkpoint_module(name: str, module: torch.nn.Module) -> str | None:
    """The checkpoint's name for a Linear, or for a fused experts module its first expert's gate (all of a layer's
    experts share one scheme)."""
    if isinstance(module, torch.nn.Linear):
        return name
    if hasattr(module, "gate_up_proj") and hasattr(module, "down_proj"):
        return f"{name}.0.gate_proj"
    return None

