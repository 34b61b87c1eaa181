"""One function per action kind: an action's source tensors in, its output tensors out (on the CPU).

On CUDA a tensor costs two waits for the GPU, not one per step: the zero-scale count and the finiteness check come
back in one read, and the outputs come back together at the end (the stage times then count the host's time per step;
the GPU's work is counted in ``pack``, where the host waits for it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from quantkit.checkpoint.reader import DTYPES, PINNED_MAX, Checkpoint
from quantkit.convert.tensor_plan import Action, ActionKind, ConversionPlan
from quantkit.errors import QuantkitError

GPTQ_DONE = "quantkit.gptq"  # a read-ahead item holding a weight GPTQ already quantized


@dataclass
class _Step:
    """One action's inputs and the checks every kind shares."""

    action: Action
    src: dict
    plan: ConversionPlan
    ckpt: Checkpoint
    device: str
    stats: Any

    @property
    def weight(self) -> str:
        return f"{self.action.module}.weight"

    def timed(self, stage: str, fn: Callable, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        if self.stats is not None:
            self.stats.add(stage, time.perf_counter() - t0)
        return out

    def where(self, name: str) -> Path:
        return self.ckpt.root / self.ckpt.tensors[name].file

    def finite(self, name: str):
        import torch

        t = self.src[name]
        if t.is_floating_point() and t.dtype.itemsize > 1 and not bool(torch.isfinite(t).all()):
            raise QuantkitError("NaN or Inf values", self.where(name), name)
        return t

    def fp8_finite(self, name: str):
        # e4m3fn has no Inf; NaN is every exponent-and-mantissa bit set (0x7F / 0xFF)
        import torch

        t = self.src[name]
        if bool(((t.view(torch.uint8) & 0x7F) == 0x7F).any()):
            raise QuantkitError("NaN values in FP8 weight", self.where(name), name)
        return t

    def decode(self):
        """The source weight on the device (formats.weights.decode_weight): the model dtype, or for an INT4 source
        the scale's dtype, which the plan gives its outputs. One finiteness check of the decoded weight covers the
        weight and its scales; only when it fails are the sources examined one by one, to name the culprit."""
        import torch

        from quantkit.formats.weights import decode_weight

        action = self.action
        # non-blocking: a pinned source is copied on this job's stream while the host moves on
        parts = tuple(self.src[name].to(self.device, non_blocking=True) for name in action.sources)
        out_dtype = getattr(torch, DTYPES[self.plan.model_dtype][1])
        if action.encoding == "int4_packed":
            packed, scale, _ = parts
            parts = (packed, scale, (packed.shape[0], scale.shape[1] * action.source_group_size))
            out_dtype = scale.dtype
        w = self.timed("decode", decode_weight, action.encoding, parts, out_dtype, self.plan.block)
        zeros = (parts[1] == 0).sum() if action.encoding == "fp8_block" else torch.zeros((), dtype=torch.int64,
                                                                                          device=w.device)
        nonfinite, zero = torch.stack([(~torch.isfinite(w)).sum(), zeros]).tolist()
        if nonfinite:
            for name in action.sources:
                self.fp8_finite(name) if self.src[name].dtype == torch.float8_e4m3fn else self.finite(name)
            raise QuantkitError("Inf after dequantization (scale too large)", self.where(action.sources[-1]),
                                action.sources[0])
        if zero and self.stats is not None:
            s_name = action.sources[1]
            self.stats.warn(f"{self.where(s_name)}: tensor {s_name}: {zero} scale block(s) are 0, "
                            "so their weights decode to 0")
        return w

    def to_host(self, outputs: dict) -> dict:
        """The outputs on the CPU, copied back together with one wait (pinned buffers on CUDA)."""
        import torch

        first = next(iter(outputs.values()))
        if first.device.type == "cpu":
            return outputs
        t0 = time.perf_counter()
        host = {}
        for name, t in outputs.items():
            if t.nbytes > PINNED_MAX:  # an embedding table: the pinned pool would keep gigabytes
                host[name] = t.cpu()
                continue
            host[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host[name].copy_(t, non_blocking=True)
        torch.cuda.current_stream(first.device).synchronize()
        if self.stats is not None:
            self.stats.add("pack", time.perf_counter() - t0)
        return host


def _copy(step: _Step) -> dict:
    (name,) = step.action.sources
    return {name: step.finite(name)}


def _int4_keep(step: _Step) -> dict:
    step.finite(step.action.sources[1])
    return {name: step.src[name] for name in step.action.sources}


def _fp8_keep(step: _Step) -> dict:
    import torch

    w_name, s_name = step.action.sources
    return {step.weight: step.fp8_finite(w_name),
            f"{step.action.module}.weight_scale": step.finite(s_name).to(torch.float32)}


def _dequantize(step: _Step) -> dict:
    return step.to_host({step.weight: step.decode()})


def _fp8_quantize(step: _Step) -> dict:
    from quantkit.formats import fp8_block

    q, s = step.timed("quantize", fp8_block.quantize_fp8_block, step.decode(), step.plan.block)
    return step.to_host({step.weight: q, f"{step.action.module}.weight_scale": s})


def _int4(step: _Step) -> dict:
    import torch

    from quantkit.formats import int4

    m, w = step.action.module, step.decode()
    shape = {f"{m}.weight_shape": torch.tensor(list(w.shape), dtype=torch.int64)}
    if step.action.symmetric:
        q, scale = step.timed("quantize", int4.quantize_int4, w, step.action.group_size)
        packed = step.timed("pack", int4.pack_int4, q)
        return {**step.to_host({f"{m}.weight_packed": packed, f"{m}.weight_scale": scale}), **shape}
    q, scale, zero = step.timed("quantize", int4.quantize_int4_asym, w, step.action.group_size)
    packed, zero = step.timed("pack", lambda: (int4.pack_int4(q), int4.pack_zero_point(zero)))
    return {**step.to_host({f"{m}.weight_packed": packed, f"{m}.weight_scale": scale}), **shape,
            **step.to_host({f"{m}.weight_zero_point": zero})}


RUNNERS: dict[ActionKind, Callable[[_Step], dict]] = {
    ActionKind.COPY: _copy,
    ActionKind.KEEP_FLOAT: _copy,
    ActionKind.INT4_KEEP: _int4_keep,
    ActionKind.FP8_KEEP: _fp8_keep,
    ActionKind.DEQUANTIZE: _dequantize,
    ActionKind.INT4_DEQUANT: _dequantize,
    ActionKind.FP8_QUANTIZE: _fp8_quantize,
    ActionKind.INT4: _int4,
    ActionKind.INT4_REQUANT: _int4,
}


def _calibrated(action: Action, quantized: dict) -> dict:
    """A weight GPTQ or SignRound already packed (convert/gptq.py); the shape is the plan's."""
    import torch

    out = dict(quantized)
    packed = out[f"{action.module}.weight_packed"]
    out[f"{action.module}.weight_shape"] = torch.tensor([packed.shape[0], packed.shape[1] * 8], dtype=torch.int64)
    return out


def run_action(action: Action, src: dict, plan: ConversionPlan, ckpt: Checkpoint, device: str, stats=None) -> dict:
    """Compute one action's output tensors (on CPU) from its source tensors."""
    if GPTQ_DONE in src:
        return _calibrated(action, src[GPTQ_DONE])
    return RUNNERS[action.kind](_Step(action, src, plan, ckpt, device, stats))
