"""One function per action kind: an action's source tensors in, its output tensors out (on the CPU).

On CUDA a tensor costs one wait for the GPU, not one per step: its outputs, its zero-scale count and its finiteness
check come back together at the end (the stage times then count the host's time per step; the GPU's work is counted in
``pack``, where the host waits for it); where many tensors share a computation, its device work is one CUDA graph
replay (convert/cuda_graphs.py).
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from quantkit.checkpoint.reader import DTYPES, PINNED_MAX, Checkpoint
from quantkit.convert.cuda_graphs import GraphCache
from quantkit.convert.tensor_plan import Action, ActionKind, ConversionPlan
from quantkit.errors import QuantkitError


@dataclass
class _Step:
    """One action's inputs and the checks every kind shares."""

    action: Action
    src: dict
    plan: ConversionPlan
    ckpt: Checkpoint
    device: str
    stats: Any
    graphs: GraphCache | None = None  # CUDA: the slot's captured graphs

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

    def signature(self) -> tuple:
        """All that this action's device computation depends on besides its inputs' values: the key of its CUDA
        graph."""
        action, plan, tensors = self.action, self.plan, self.ckpt.tensors
        inputs = tuple((tensors[name].dtype, tensors[name].shape) for name in _device_sources(action))
        return (action.kind, action.encoding, action.symmetric, action.group_size, action.source_group_size,
                plan.model_dtype, plan.block, inputs)

    def computed(self) -> dict:
        """This action's outputs on the CPU: the source weight decoded (formats.weights.decode_weight) and re-encoded
        on the device, on CUDA one graph replay where its signature has a graph (convert/cuda_graphs.py). One
        finiteness check of the decoded weight covers the weight and its scales; only when it fails are the sources
        examined one by one, to name the culprit."""
        import torch

        action = self.action
        # non-blocking: a pinned source is copied on this job's stream while the host moves on
        parts = tuple(self.src[name].to(self.device, non_blocking=True) for name in _device_sources(action))
        compute, suffixes = _computation(action)
        fn = functools.partial(_on_device, self, compute)
        results = fn(*parts) if self.graphs is None else self.graphs.run(self.signature(), fn, parts)
        *outputs, checks = self.to_host(results)
        nonfinite, zero = checks.tolist()
        if nonfinite:
            for name in action.sources:
                self.fp8_finite(name) if self.src[name].dtype == torch.float8_e4m3fn else self.finite(name)
            raise QuantkitError("Inf after dequantization (scale too large)", self.where(action.sources[-1]),
                                action.sources[0])
        if zero and self.stats is not None:
            s_name = action.sources[1]
            self.stats.warn(f"{self.where(s_name)}: tensor {s_name}: {zero} scale block(s) are 0, "
                            "so their weights decode to 0")
        return {f"{action.module}.{suffix}": t for suffix, t in zip(suffixes, outputs, strict=True)}

    def to_host(self, outputs: tuple) -> tuple:
        """The outputs on the CPU, copied back together with one wait (pinned buffers on CUDA)."""
        import torch

        if outputs[0].device.type == "cpu":
            return outputs
        t0 = time.perf_counter()
        host = []
        for t in outputs:
            if t.nbytes > PINNED_MAX:  # an embedding table: the pinned pool would keep gigabytes
                host.append(torch.empty(t.shape, dtype=t.dtype))
            else:
                host.append(torch.empty(t.shape, dtype=t.dtype, pin_memory=True))
            host[-1].copy_(t, non_blocking=True)
        torch.cuda.current_stream(outputs[0].device).synchronize()
        if self.stats is not None:
            self.stats.add("pack", time.perf_counter() - t0)
        return tuple(host)


def _on_device(step: _Step, compute: Callable[..., tuple], *parts) -> tuple:
    """The weight decoded from ``parts`` and ``compute``'s outputs, then the count of non-finite decoded values and
    of zero FP8 scales: device work only, no wait for the device (so that it can be captured in a CUDA graph)."""
    import torch

    from quantkit.formats.weights import decode_weight

    action, plan = step.action, step.plan
    out_dtype = getattr(torch, DTYPES[plan.model_dtype][1])
    if action.encoding == "int4_packed":
        packed, scale = parts
        parts = (packed, scale, (packed.shape[0], scale.shape[1] * action.source_group_size))
        out_dtype = scale.dtype
    w = step.timed("decode", decode_weight, action.encoding, parts, out_dtype, plan.block)
    zeros = (parts[1] == 0).sum() if action.encoding == "fp8_block" else torch.zeros((), dtype=torch.int64,
                                                                                      device=w.device)
    return (*compute(step, w), torch.stack([(~torch.isfinite(w)).sum(), zeros]))


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


def _computed(step: _Step) -> dict:
    return step.computed()


def _decoded(step: _Step, w) -> tuple:
    return (w,)


def _fp8(step: _Step, w) -> tuple:
    from quantkit.formats import fp8_block

    return step.timed("quantize", fp8_block.quantize_fp8_block, w, step.plan.block)


def _fp8_channel(step: _Step, w) -> tuple:
    from quantkit.formats import fp8_channel

    return step.timed("quantize", fp8_channel.quantize_fp8_channel, w)


def _int4_symmetric(step: _Step, w) -> tuple:
    from quantkit.formats import int4

    q, scale = step.timed("quantize", int4.quantize_int4, w, step.action.group_size)
    return step.timed("pack", int4.pack_int4, q), scale


def _int4_asymmetric(step: _Step, w) -> tuple:
    from quantkit.formats import int4

    q, scale, zero = step.timed("quantize", int4.quantize_int4_asym, w, step.action.group_size)
    return step.timed("pack", lambda: (int4.pack_int4(q), scale, int4.pack_zero_point(zero)))


def _computation(action: Action) -> tuple[Callable[..., tuple], tuple[str, ...]]:
    """What a computed action does to the decoded weight, and its outputs' names after the module's."""
    if action.kind in (ActionKind.DEQUANTIZE, ActionKind.INT4_DEQUANT):
        return _decoded, ("weight",)
    if action.kind == ActionKind.FP8_QUANTIZE:
        return _fp8, ("weight", "weight_scale")
    if action.kind == ActionKind.FP8_CHANNEL:
        return _fp8_channel, ("weight", "weight_scale")
    if action.symmetric:
        return _int4_symmetric, ("weight_packed", "weight_scale")
    return _int4_asymmetric, ("weight_packed", "weight_scale", "weight_zero_point")


def _device_sources(action: Action) -> tuple[str, ...]:
    """The sources a computed action takes to the device (an INT4 source's weight_shape stays behind)."""
    return action.sources[:2] if action.encoding == "int4_packed" else action.sources


def _int4(step: _Step) -> dict:
    import torch

    out = step.computed()
    packed = out[f"{step.action.module}.weight_packed"]  # eight columns a word
    out[f"{step.action.module}.weight_shape"] = torch.tensor([packed.shape[0], packed.shape[1] * 8], dtype=torch.int64)
    return {o.name: out[o.name] for o in step.action.outputs}  # in the plan's order, which the shard's header has


RUNNERS: dict[ActionKind, Callable[[_Step], dict]] = {
    ActionKind.COPY: _copy,
    ActionKind.KEEP_FLOAT: _copy,
    ActionKind.INT4_KEEP: _int4_keep,
    ActionKind.FP8_KEEP: _fp8_keep,
    ActionKind.DEQUANTIZE: _computed,
    ActionKind.INT4_DEQUANT: _computed,
    ActionKind.FP8_QUANTIZE: _computed,
    ActionKind.FP8_CHANNEL: _computed,
    ActionKind.INT4: _int4,
    ActionKind.INT4_REQUANT: _int4,
}


def calibrated_outputs(action: Action, quantized: dict) -> dict:
    """A weight GPTQ or SignRound already packed (convert/calibrated/); the shape is the plan's, and so is the
    order."""
    import torch

    out = dict(quantized)
    packed = out[f"{action.module}.weight_packed"]
    out[f"{action.module}.weight_shape"] = torch.tensor([packed.shape[0], packed.shape[1] * 8], dtype=torch.int64)
    return {o.name: out[o.name] for o in action.outputs}


def run_action(action: Action, src: dict, plan: ConversionPlan, ckpt: Checkpoint, device: str, stats=None,
               graphs: GraphCache | None = None) -> dict:
    """Compute one action's output tensors (on CPU) from its source tensors; ``graphs``: replay CUDA graphs from
    this cache (one job's at a time)."""
    return RUNNERS[action.kind](_Step(action, src, plan, ckpt, device, stats, graphs))


GRAPH_MIN_TENSORS = 16  # a computation this many tensors share gets a CUDA graph per slot (GLM-5's experts: 10,000s)


def frequent_computations(actions: list[Action], plan: ConversionPlan, ckpt: Checkpoint) -> list[Action]:
    """One action for each device computation that at least GRAPH_MIN_TENSORS of ``actions`` share."""
    counts: Counter = Counter()
    first: dict[tuple, Action] = {}
    for action in actions:
        if RUNNERS[action.kind] in (_computed, _int4):
            key = _Step(action, {}, plan, ckpt, "cpu", None).signature()
            counts[key] += 1
            first.setdefault(key, action)
    return [first[key] for key, n in counts.items() if n >= GRAPH_MIN_TENSORS]


def capture_graphs(graphs: GraphCache, actions: list[Action], plan: ConversionPlan, ckpt: Checkpoint,
                   device: str) -> None:
    """A graph of each action's computation, on the current stream, from zeros (a graph keeps the launches, not the
    values); only while no other thread uses the device."""
    import torch

    for action in actions:
        step = _Step(action, {}, plan, ckpt, device, None, graphs)
        infos = [ckpt.tensors[name] for name in _device_sources(action)]
        zeros = tuple(torch.zeros(i.nbytes, dtype=torch.uint8, device=device).view(getattr(torch, DTYPES[i.dtype][1]))
                      .reshape(i.shape) for i in infos)
        graphs.capture(step.signature(), functools.partial(_on_device, step, _computation(action)[0]), zeros)
