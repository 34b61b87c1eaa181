"""AutoRound's SignRound tuning, driven by quantkit on data it already holds on the device.

auto-round owns the algorithm: the wrapped Linears (``WrapperLinear``: a rounding offset per weight, a clipping scale
per group, the fake quantization), the signed-gradient optimizer (``SignSGD``), the sampler of calibration
sequences (``IndexSampler``) and the best-step bookkeeping (``collect_best_params``, ``unwrapper_block``). quantkit
runs their loop itself, step for step as auto-round 0.15.1's ``SignRoundQuantizer.quantize_block`` runs it under
llm-compressor's ``AutoRoundModifier``, for two reasons measured on one H100 (docs/int4-methods.md):

- speed: through the modifier, each SmolLM2 layer built an ``AutoRound`` (0.6 s), kept the calibration inputs, the
  reference outputs and every improvement of the tuned parameters in host memory (``low_gpu_mem_usage`` is forced
  on), and ran ``gc.collect`` seven times (2 s): 5.3 s a layer against auto-round's own 3.3 s;
- size: the loop runs on any module and any way of computing a prediction, which is what lets a MoE layer's experts
  be tuned in groups that fit a GPU (convert/calibrated/signround.py).

``tests/test_signround.py`` holds the result equal to llm-compressor's oneshot, bit for bit, where they agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from quantkit.formats.quant_config import QuantizationArgs

SEED = 42  # auto-round's default seed, set again for every block (llm-compressor builds an AutoRound per layer)
SCALE_DTYPE = torch.float16  # auto-round's default scale_dtype: its scales are rounded to FP16 while tuning


@dataclass(frozen=True)
class Tuning:
    """One block's tuning settings, resolved as auto-round resolves them."""

    iters: int
    lr: float
    minmax_lr: float
    batch_size: int
    enable_torch_compile: bool
    amp: bool  # forward passes under autocast in ``dtype``
    dtype: torch.dtype  # what the block computes in while it is tuned

    @classmethod
    def of(cls, settings, device: str, model_dtype: torch.dtype) -> Tuning:
        """``settings``: a recipe's SignRound settings. The learning rate defaults to 1 / iters (auto-round's for 4
        bits and up); a device without BF16 tunes in FP32, as auto-round's ``ModelContext`` decides."""
        from auto_round.utils.device_manager import get_ar_device

        lr = settings.lr if settings.lr is not None else 1.0 / settings.iters if settings.iters > 0 else 0.0
        dtype = model_dtype if model_dtype != torch.float32 else torch.bfloat16
        ar_device = get_ar_device(device.split(":")[0])
        if ar_device.prefers_bf16():
            dtype = torch.bfloat16
        amp = True
        if dtype == torch.bfloat16 and not ar_device.supports_bf16():
            amp, dtype = False, torch.float32
        return cls(settings.iters, lr, lr, settings.batch_size, settings.enable_torch_compile, amp, dtype)

    def autocast(self, device: str):
        """The context a forward pass of the block runs in (auto-round's ``block_forward``)."""
        from contextlib import nullcontext

        return torch.autocast(device_type=device.split(":")[0], dtype=self.dtype) if self.amp else nullcontext()


def mark_for_tuning(linear: torch.nn.Module, args: QuantizationArgs) -> None:
    """The attributes auto-round's layer configuration sets on a Linear it tunes to ``args`` (an INT group scheme,
    weights only), which its ``wrapper_block`` reads."""
    for name, value in {"bits": args.num_bits, "group_size": args.group_size, "sym": args.symmetric,
                        "data_type": "int", "act_bits": 16, "act_group_size": args.group_size, "act_sym": True,
                        "act_data_type": "float", "act_dynamic": True, "super_bits": None, "super_group_size": None,
                        "scale_dtype": SCALE_DTYPE}.items():
        setattr(linear, name, value)


def tune(block: torch.nn.Module, predict: Callable[[list[int]], torch.Tensor],
         reference: Callable[[list[int]], torch.Tensor], samples: int, tuning: Tuning, device: str,
         best_on: str | None = None) -> tuple[float, float]:
    """Tune every Linear of ``block`` marked by ``mark_for_tuning``: ``predict(indices)`` computes the block's output
    for those calibration samples through the wrapped Linears, ``reference(indices)`` what it should be. Leaves each
    Linear holding its best quantized-dequantized weight and auto-round's ``scale`` (and ``zp``); returns the loss at
    the first step and the best one. ``best_on``: where the best parameters wait (default the device)."""
    from auto_round.algorithms.quantization.sign_round.sign_sgd import SignSGD
    from auto_round.compressors.utils import IndexSampler, collect_best_params
    from auto_round.wrapper import unwrapper_block, wrapper_block
    from transformers import set_seed

    wrapper_block(block, True, False, enable_torch_compile=tuning.enable_torch_compile, device=device)
    rounding: list[torch.Tensor] = []
    minmax: list[torch.Tensor] = []
    module: Any
    for module in block.modules():
        if hasattr(module, "orig_layer"):
            for key, param in module.params.items():
                (minmax if "min" in key or "max" in key else rounding).append(param)
    if not rounding and not minmax:
        unwrapper_block(block, {})
        return 0.0, 0.0
    groups = [{"params": rounding, "lr": torch.tensor(tuning.lr)},
              {"params": minmax, "lr": torch.tensor(tuning.minmax_lr)}]
    optimizer = SignSGD(groups, lr=torch.tensor(tuning.lr), weight_decay=0, momentum=0.0)
    schedule = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.0, total_iters=tuning.iters)
    mse = torch.nn.MSELoss(reduction="mean")
    set_seed(SEED)
    sampler = IndexSampler(samples, min(samples, tuning.batch_size))
    best_loss, best, first = torch.finfo(torch.float).max, {}, 0.0
    for step in range(tuning.iters):
        indices = sampler.next_batch()
        with torch.enable_grad():
            loss = mse(predict(indices).to(torch.float32), reference(indices).to(torch.float32))
            total = loss.item()
            if loss.requires_grad:  # a group of experts the sampled sequences never reach has nothing to learn
                (loss * 1000).backward()
        if step == 0:
            first = total
        if total < best_loss:
            best_loss = total
            best = collect_best_params(block, best_on or device)
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
    with torch.no_grad():
        unwrapper_block(block, best)
    return first, best_loss if tuning.iters else 0.0
