"""How much of a GPU one calibrated layer may hold, and how a MoE layer's experts are split to fit it.

A GLM-5 MoE layer at the shipped recipes' 256 x 2048 tokens does not fit an 80 GB card if all 256 experts are worked
at once: GPTQ's routed Hessians alone are 43 GB, and SignRound keeps about 30 bytes of tuning state per weight (value,
gradient, best value, the autograd intermediates of its fake quantization), 290 GB for 9.7 G expert weights. The walk
plans each layer against a budget: the layer's weights and what the layer walk keeps on the device are fixed, and
the experts are worked in groups of as many as fit in what is left. A layer that cannot fit even one expert is
refused before any work, in one line that names it, what it needs and what helps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from quantkit.checkpoint.reader import DTYPES
from quantkit.errors import QuantkitError

GIB = 2**30
MARGIN = 2 * GIB  # left to the CUDA context, cuBLAS workspaces and the allocator's fragments
HELP = ("set --gpu-memory higher (the default is what the device has free), calibrate on fewer samples or shorter "
        "sequences, or spread the layer over more GPUs (--device cuda:0,cuda:1)")


def gib(n: int | float) -> str:
    return f"{n / GIB:.1f} GiB"


@dataclass(frozen=True)
class Budget:
    """The bytes a calibrated layer walk may hold on ``device`` at once."""

    device: str
    limit: int

    @classmethod
    def of(cls, device: str, spec: str | int | None = None) -> Budget | None:
        """None on a CPU (host memory is not planned). ``spec``: a size (``70GiB``) or None, the memory the device
        has free now, less a margin."""
        if not device.startswith("cuda"):
            return None
        import torch

        free, total = torch.cuda.mem_get_info(torch.device(device))
        # what this process's caching allocator holds but no tensor uses (an earlier conversion's blocks) is free to
        # the walk too: mem_get_info counts it as taken
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        if spec is None:
            return cls(device, max(0, free - max(MARGIN, total // 20)))
        from quantkit.sizes import parse_size

        limit = parse_size(spec)
        if limit <= 0:
            raise QuantkitError(f"--gpu-memory must be a positive size (got {spec!r})")
        if limit > total:
            raise QuantkitError(f"--gpu-memory {spec} is more than {device} holds ({gib(total)})")
        return cls(device, limit)

    def used(self) -> int:
        """What the walk holds on the device now (not tracked on a CPU, where a budget only sizes expert groups)."""
        if not self.device.startswith("cuda"):
            return 0
        import torch

        return int(torch.cuda.memory_allocated(self.device))

    def room(self) -> int:
        return max(0, self.limit - self.used())


@dataclass(frozen=True)
class Run:
    """What a layer's memory plan needs to know of the calibration run."""

    sequences: int
    seq_len: int
    width: int  # bytes of one value in the dtype the walk computes in
    inputs_on_device: bool = True  # the walk keeps the layer inputs on the device (else in host memory)


def expert_groups(experts: list[int], per_expert: int, room: int) -> list[list[int]]:
    """``experts`` in consecutive groups of equal size (the last may be smaller), each group's ``per_expert`` bytes
    within ``room``; empty when not even one expert fits."""
    if not experts:
        return []
    size = len(experts) if per_expert <= 0 else min(len(experts), room // per_expert)
    if size <= 0:
        return []
    count = math.ceil(len(experts) / size)
    size = math.ceil(len(experts) / count)  # as even as the count allows
    return [experts[k:k + size] for k in range(0, len(experts), size)]


def layer_does_not_fit(root, layer: int, need: int, budget: Budget, what: str) -> QuantkitError:
    """The one line a layer that cannot fit gets."""
    return QuantkitError(f"decoder layer {layer} needs at least {gib(need)} of GPU memory ({what}); {budget.device} "
                         f"has a budget of {gib(budget.limit)}: {HELP}", root, f"model.layers.{layer}")


def layer_weight_bytes(ckpt, layer: int, dtype_bytes: int) -> int:
    """Layer ``layer``'s tensors decoded, as the layer walk holds them (every weight in the walk's dtype), read from
    the checkpoint's headers."""
    prefix = f"model.layers.{layer}."
    total = 0
    for name, info in ckpt.tensors.items():
        if not name.startswith(prefix):
            continue
        param = name.rpartition(".")[2]
        if param == "weight_packed":
            total += info.shape[0] * info.shape[1] * 8 * dtype_bytes  # eight INT4 values a word
        elif param not in ("weight_scale", "weight_scale_inv", "weight_shape", "weight_zero_point", "k_scale",
                           "v_scale"):
            total += info.numel * max(dtype_bytes, DTYPES[info.dtype][0])
    return total


def forward_bytes(config, seq_len: int, dtype_bytes: int) -> int:
    """What one sequence's forward through a decoder layer allocates beyond its inputs: eager attention's scores
    (in the layer's dtype, softmaxed in FP32, then cast back) and a few hidden- and MLP-wide temporaries."""
    heads = config.size("num_attention_heads")
    hidden = config.size("hidden_size")
    inter = max(config.raw.get("intermediate_size") or 0, config.raw.get("moe_intermediate_size") or 0, hidden)
    return heads * seq_len * seq_len * (2 * dtype_bytes + 4) + seq_len * (8 * hidden + 6 * inter) * 4


def weight_shape(ckpt, module: str) -> tuple[int, int]:
    """A Linear's (out, in) from the checkpoint's headers, whatever its encoding."""
    info = ckpt.tensors.get(f"{module}.weight")
    if info is not None:
        return info.shape[0], info.shape[1]
    packed = ckpt.tensors[f"{module}.weight_packed"]
    return packed.shape[0], packed.shape[1] * 8


def layer_inputs_bytes(config, sequences: int, seq_len: int, width: int) -> int:
    """What the layer walk keeps between layers: every sequence's hidden states (and, for GLM-5's DSA attention, the
    top-k indices each layer hands the next), and the causal mask they share."""
    topk = min(config.raw.get("index_topk") or 0, seq_len) * 4  # int32 indices
    return sequences * seq_len * (config.size("hidden_size") * width + topk) + seq_len * seq_len * width


def where_inputs_wait(root, budget: Budget, least: tuple[int, int], inputs: int, one: int) -> str | None:
    """``None`` (on the device) when the largest layer's least need ``least`` (bytes, layer) leaves room for the
    stored layer inputs ``inputs``, ``cpu`` when only one batch of them (``one``) fits beside it; a layer that fits
    neither way is refused."""
    need, layer = least
    if need + inputs <= budget.limit:
        return None
    if need + one <= budget.limit:
        return "cpu"
    raise layer_does_not_fit(root, layer, need + one, budget,
                             "its weights, one batch of its inputs and the least work its algorithm does")
