"""GPTQ for a recipe's INT4 weights, one decoder layer at a time (the walk: convert/calibrated/walk.py).

For each decoder layer: run the calibration hidden states through it while collecting each targeted weight's Hessian,
quantize with llm-compressor's own GPTQ (``quantize_weight``; same-shape weights such as one layer's experts in
batches), put the quantized weights back and run the inputs again to get the next layer's inputs, so errors propagate
as in llm-compressor's sequential pipeline. On a GPU a half-precision input's Hessian is summed on tensor cores and
weights that share one Hessian are quantized against one factorization of it (gptq_shared_hessian.py);
docs/gptq.md states the tolerance both hold against llm-compressor. A resumed run recomputes the next layer's inputs
from a finished layer's quantized weights (a forward pass, no GPTQ), which gives the same bits.

MoE experts: an expert's gate and up share one Hessian (same input), its down has its own. With
``experts: routed`` each expert's Hessian comes from the tokens the router sends it and an expert
that gets fewer than ``min_expert_tokens`` is quantized round-to-nearest; with ``experts: all``
every calibration token goes through every expert for the Hessian (MoE-Quant's choice). The
manifest records, per weight, the method, the routed token count and GPTQ's loss.
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from quantkit.checkpoint.manifest import CalibratedModuleRecord
from quantkit.checkpoint.names import layer_expert
from quantkit.checkpoint.reader import Checkpoint
from quantkit.convert.calibrated.gptq_shared_hessian import quantize_sharing_hessian
from quantkit.convert.calibrated.memory import (
    Budget,
    Run,
    expert_groups,
    forward_bytes,
    layer_does_not_fit,
    layer_weight_bytes,
    weight_shape,
)
from quantkit.convert.calibrated.walk import Phases, QuantizedLayer, Target
from quantkit.convert.llmcompressor_import import quiet_llmcompressor
from quantkit.convert.tensor_plan import ConversionPlan
from quantkit.errors import QuantkitError
from quantkit.formats import int4
from quantkit.formats.recipe import GPTQSettings, Recipe
from quantkit.formats.weights import decode_weight


def _expert(rel: str) -> tuple[int, str]:
    """(expert index, projection) of a routed expert's weight inside a decoder layer."""
    m = layer_expert(rel)
    if m is None:
        raise ValueError(f"{rel} is not a routed expert's projection")
    return int(m["index"]), m["proj"]


def llmcompressor_gptq():
    """llm-compressor's GPTQ primitives (accumulate_hessian, quantize_weight), imported quietly
    (quantkit.convert.llmcompressor_import): what GPTQ did to each weight (its loss, a fallback to
    round-to-nearest) quantkit reports itself."""
    with quiet_llmcompressor("GPTQ recipes need llm-compressor"):
        from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight
        from llmcompressor.modifiers.gptq.helpers import accumulate_hessian
    return accumulate_hessian, quantize_weight


class GPTQ:
    """GPTQ's part of the calibrated walk: Hessians from the calibration inputs, llm-compressor's quantize_weight,
    and the next layer's inputs through the quantized layer."""

    method = "gptq"
    # --dtype auto picks by a speed probe, which a resumed run could answer the other way: it keeps the started one
    resumes_started_dtype = True

    @staticmethod
    def walk_dtype(recipe: Recipe, spec: str, device: str, stored: torch.dtype) -> torch.dtype | None:
        from quantkit.compute_dtype import compute_dtype

        chosen = compute_dtype(spec, device, stored)
        return None if chosen == stored else chosen

    def __init__(self, ckpt: Checkpoint, recipe: Recipe, batches: list[torch.Tensor], devices: list[str], work: Path,
                 dtype: torch.dtype | None = None, budget: Budget | None = None, store: str | None = None):
        """``dtype``: what the layers compute in (default the model's); the weights GPTQ starts from and the scales
        stay the model's. ``budget``: the GPU memory a layer may take (None on a CPU); ``store``: where the layer
        inputs wait between layers (None: on the device)."""
        from quantkit.layerwise import LayerWalk

        self.recipe, self.devices, self.budget = recipe, devices, budget
        self.walk = LayerWalk(ckpt, batches, devices[0], attention="eager", dtype=dtype, store=store)

    @staticmethod
    def check(ckpt: Checkpoint, plan: ConversionPlan, recipe: Recipe) -> None:
        llmcompressor_gptq()  # its absence stops the run before DST exists

    @staticmethod
    def least_bytes(ckpt: Checkpoint, recipe: Recipe, i: int, targets: list[Target], run: Run) -> int:
        """The layer's weights and one sequence's forward; the dense targets' Hessians, all at once; the routed
        experts' inputs (where the layer inputs are kept) and one expert's Hessians; one weight's quantize work."""
        config = ckpt.config
        need = layer_weight_bytes(ckpt, i, run.width) + forward_bytes(config, run.seq_len, run.width)
        shapes = {t.rel: weight_shape(ckpt, t.module) for t in targets}
        need += sum(4 * shapes[t.rel][1] ** 2 for t in targets if not layer_expert(t.rel))
        need += max(_quantize_bytes(shape) for shape in shapes.values())
        if any(layer_expert(t.rel) for t in targets):
            hidden, inter = config.size("hidden_size"), config.size("moe_intermediate_size")
            need += 4 * inter * inter + 4 * hidden * hidden
            if run.inputs_on_device:
                need += run.sequences * run.seq_len * (hidden * run.width + 8 * config.size("num_experts_per_tok"))
        return need

    def quantize(self, i: int, state: dict[str, torch.Tensor], targets: list[Target], phases: Phases
                 ) -> QuantizedLayer:
        layer = self.walk.load(i, state)
        records, groups = _quantize_layer(self.walk, i, layer, state, targets, self.recipe, self.devices, phases,
                                          self.budget)
        tensors = {}
        for t in targets:
            tensors[f"{t.module}.weight_packed"] = records[t.module].pop("packed")
            tensors[f"{t.module}.weight_scale"] = records[t.module].pop("scale")
        return QuantizedLayer(tensors, {t.module: CalibratedModuleRecord(**records[t.module]) for t in targets},
                              expert_groups=groups)

    def advance(self, i: int, state: dict[str, torch.Tensor], targets: list[Target], done: Path | None) -> None:
        """Through the layer as it will be served: a layer quantized just now already holds these values in state."""
        if done is not None:
            _substitute(done, targets, state)
        self.walk.run(i, self.walk.load(i, state))

    def recorded(self, i: int) -> None:
        pass

    def running(self) -> contextlib.nullcontext:
        return contextlib.nullcontext()

    def layer_loss(self, records: list[CalibratedModuleRecord]) -> float:
        return sum(r.loss or 0.0 for r in records)


def _substitute(path: Path, targets: list[Target], state: dict[str, torch.Tensor]) -> None:
    """Replace the targets' source weights in ``state`` by their quantized values (as the engine will see them)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        for t in targets:
            name = f"{t.module}.weight"
            parts = (f.get_tensor(f"{t.module}.weight_packed"), f.get_tensor(f"{t.module}.weight_scale"),
                     torch.tensor(state[name].shape))
            state[name].copy_(decode_weight("int4_packed", parts, state[name].dtype))  # in place: experts are views


class _Hessians:
    """Running sums of X^T X per key, with llm-compressor's accumulate_hessian and its sample counts."""

    def __init__(self, device: str):
        self.device = device
        self.sums: dict = {}
        self.counts: dict = {}
        self.tokens: dict = {}
        self.fixed: dict = {}
        self._linear = torch.nn.Linear(1, 1, device="meta")  # accumulate_hessian reshapes by module type
        self._accumulate, _ = llmcompressor_gptq()  # once: add() runs per batch and per expert

    def add(self, key, inp: torch.Tensor, module: torch.nn.Module | None = None, tokens: int | None = None) -> None:
        if key not in self.sums:
            self.sums[key] = torch.zeros((inp.shape[-1], inp.shape[-1]), device=self.device, dtype=torch.float32)
            self.counts[key] = torch.zeros((), device=self.device)
            self.tokens[key] = 0
        module = module or self._linear
        if _on_tensor_cores(inp, module, self.device):
            self.sums[key], self.counts[key] = _accumulate_on_tensor_cores(inp, self.sums[key], self.counts[key])
        else:
            self.sums[key], self.counts[key] = self._accumulate(inp, module, self.sums[key], self.counts[key])
        self.tokens[key] += tokens if tokens is not None else inp.numel() // inp.shape[-1]

    def normalized(self, key) -> torch.Tensor:
        if key in self.fixed:
            return self.fixed[key]
        return self.sums.pop(key) / self.counts.pop(key)  # llm-compressor's prepare_batch

    def fix(self, key) -> None:
        """Normalize ``key``'s sum now and keep it for users in later calls (a Hessian several groups share)."""
        self.fixed[key] = self.sums.pop(key) / self.counts.pop(key)

    def drop_unused(self) -> None:
        """Free the sums no job asked for (an expert quantized round-to-nearest)."""
        self.sums.clear()
        self.counts.clear()


def _on_tensor_cores(inp: torch.Tensor, module: torch.nn.Module, device: str) -> bool:
    return (inp.dtype in (torch.bfloat16, torch.float16) and inp.is_cuda and device.startswith("cuda")
            and isinstance(module, torch.nn.Linear))


def _accumulate_on_tensor_cores(inp: torch.Tensor, hessian: torch.Tensor, num_samples: torch.Tensor):
    """llm-compressor's accumulate_hessian for a Linear's half-precision input on a GPU: the same sum 2 X^T X, its
    products on tensor cores. A product of two bf16 (or fp16) values is exact in fp32 and the GEMM sums in fp32, so
    this differs from llm-compressor's fp32 GEMM of sqrt(2) X by the rounding of fp32 sums alone: on one H200 a
    GLM-5 layer's Hessian phase takes 19 s instead of 39 s, and the result is 1.13x as far from the exact (fp64)
    Hessian as llm-compressor's (tests/test_gpu.py holds the tolerance; docs/gptq.md)."""
    # torch.mm's out_dtype exists from torch 2.8; llm-compressor 0.14, which GPTQ needs, requires torch >= 2.10
    num_samples += inp.shape[0] if inp.ndim > 2 else 1  # accumulate_hessian counts a 2-D input as one sample
    x = inp.reshape(-1, inp.shape[-1]).to(hessian.device)
    hessian.add_(torch.mm(x.t(), x, out_dtype=torch.float32), alpha=2)
    return hessian, num_samples


def _quantize_layer(walk, i, layer, state, targets, recipe, devices, phases, budget: Budget | None
                    ) -> tuple[dict[str, dict], int]:
    """Collect the layer's Hessians on the calibration inputs, then GPTQ every target; returns per module
    the packed weight, scale and record, and leaves the quantized weights in ``state``. The forward pass sums the
    dense targets' Hessians and keeps the routed experts' inputs; the experts are then worked in groups that fit
    ``budget``, each group's Hessians summed from those inputs, quantized and freed before the next. Also returns
    the number of expert groups."""
    cal = recipe.calibration
    assert cal is not None  # a GPTQ recipe calibrates
    hessians = _Hessians(walk.device)
    handles = []
    dense = [t for t in targets if not layer_expert(t.rel)]
    experts = [t for t in targets if layer_expert(t.rel)]
    for t in dense:
        module = layer.get_submodule(t.rel)
        if not isinstance(module, torch.nn.Linear):
            raise QuantkitError(f"GPTQ target is a {type(module).__name__} in the transformers model, not a Linear",
                                walk.ckpt.root, t.module)
        handles.append(module.register_forward_hook(lambda mod, args, _out, key=t.rel: hessians.add(key, args[0], mod)))
    inputs = ExpertInputs(walk.store)
    if experts:
        handles.append(layer.get_submodule("mlp.experts").register_forward_pre_hook(inputs.keep))
    try:
        with phases("hessians"):
            walk.run(i, layer, advance=False)
    finally:
        for h in handles:
            h.remove()
    jobs: list[tuple[Target, object, int, str | None]] = []
    for t in dense:
        tokens = hessians.tokens.get(t.rel, 0)
        jobs.append((t, t.rel, tokens, None) if tokens else (t, None, 0, "not reached by the calibration forward"))
    with phases("quantize"):
        out = _quantize_jobs(jobs, hessians, state, recipe, devices, walk.stored, budget)
    if not experts:
        return out, 0
    mod = layer.get_submodule("mlp.experts")
    by_expert: dict[int, list[Target]] = {}
    for t in experts:
        by_expert.setdefault(_expert(t.rel)[0], []).append(t)
    wanted = sorted(by_expert)
    routed: dict[int, int] = {}
    groups = _expert_groups(walk, i, mod, wanted, cal, budget,
                            max(_quantize_bytes(state[f"{t.module}.weight"].shape) for t in experts))
    for group in groups:
        first = group[0] == wanted[0]
        with phases("hessians"), torch.no_grad():
            for x, top_k in inputs.batches(walk.device):
                _expert_hessians(mod, x, top_k, group, cal, hessians, routed, first)
            if cal.experts == "all" and first:
                hessians.fix("all_tokens")  # every group's gate and up share it: normalized once, kept to the end
        jobs = [_expert_job(t, routed, cal) for e in group for t in by_expert[e]]
        with phases("quantize"):
            out.update(_quantize_jobs(jobs, hessians, state, recipe, devices, walk.stored, budget))
        hessians.drop_unused()  # an expert quantized round-to-nearest leaves its sums behind
    return out, len(groups)


def _expert_job(t: Target, routed: dict[int, int], cal) -> tuple[Target, object, int, str | None]:
    """(target, Hessian key, tokens, reason) of a routed expert's weight."""
    e, proj = _expert(t.rel)
    tokens = routed.get(e, 0)
    if cal.experts == "all":
        return (t, "all_tokens" if proj != "down" else (e, "down"), tokens,
                "Hessian from every calibration token (experts: all)")
    if tokens < cal.min_expert_tokens:
        return (t, None, tokens, f"{tokens} routed token(s) < min_expert_tokens {cal.min_expert_tokens}")
    return (t, (e, "gate_up") if proj != "down" else (e, "down"), tokens, None)


def _expert_groups(walk, i: int, mod, wanted: list[int], cal, budget: Budget | None, quantize: int
                   ) -> list[list[int]]:
    """The layer's routed experts in groups whose Hessians fit what the budget leaves beside ``quantize`` bytes of
    quantize work (one group without a budget)."""
    if budget is None:
        return [wanted]
    hidden, inter = mod.gate_up_proj.shape[-1], mod.down_proj.shape[-1]
    per_expert = 4 * inter * inter + (0 if cal.experts == "all" else 4 * hidden * hidden)
    fixed = (4 * hidden * hidden if cal.experts == "all" else 0) + quantize
    groups = expert_groups(wanted, per_expert, budget.room() - fixed)
    if not groups:
        raise layer_does_not_fit(walk.ckpt.root, i, budget.used() + fixed + per_expert, budget,
                                 "its weights, its inputs and one expert's Hessians")
    return groups


class ExpertInputs:
    """A MoE layer's routed-expert inputs as its forward computes them (per batch: the hidden states and the router's
    top-k choice), kept on ``store`` so that each group of experts sums its Hessians from them later."""

    def __init__(self, store: str):
        self.store = store
        self.kept: list[tuple[torch.Tensor, torch.Tensor]] = []

    def keep(self, _mod, args) -> None:
        """Forward pre-hook on a fused experts module (hidden_states [T, H], top_k_index [T, k], weights)."""
        x, top_k = args[0], args[1]
        if x.device != torch.device(self.store):
            x, top_k = x.to(self.store).pin_memory(), top_k.to(self.store).pin_memory()
        self.kept.append((x, top_k))

    def batches(self, device: str):
        for x, top_k in self.kept:
            yield x.to(device, non_blocking=True), top_k.to(device, non_blocking=True)


def _expert_hessians(mod, x: torch.Tensor, top_k: torch.Tensor, wanted: list[int], cal, hessians: _Hessians,
                     routed: dict[int, int], first: bool) -> None:
    """One batch's Hessians of the ``wanted`` experts of a fused experts module (hidden_states [T, H], top_k_index
    [T, k]); ``first``: the layer's first group, which sums the Hessian every expert shares under ``experts: all``."""
    everyone = cal.experts == "all"
    counts = torch.bincount(top_k.flatten(), minlength=mod.gate_up_proj.shape[0]).tolist()  # one device sync
    if everyone and first:
        hessians.add("all_tokens", x)
    for e in wanted:
        routed[e] = routed.get(e, 0) + counts[e]
        if everyone:
            xe = x
        elif counts[e]:
            xe = x[(top_k == e).any(dim=-1)]
            hessians.add((e, "gate_up"), xe)
        else:
            continue
        # the down projection's input exactly as the experts' forward computes it
        gate, up = torch.nn.functional.linear(xe, mod.gate_up_proj[e]).chunk(2, dim=-1)
        hessians.add((e, "down"), mod.act_fn(gate) * up, tokens=xe.shape[0])


def _quantize_jobs(jobs, hessians: _Hessians, state, recipe, devices, stored: torch.dtype, budget: Budget | None
                   ) -> dict[str, dict]:
    """GPTQ (or RTN, where a job has no Hessian) on the weights as decoded in the model's dtype ``stored``, whatever
    the walk computes in: the same scales and rounding as a walk in the model's dtype; the dequantized weights go
    back into ``state`` in its dtype."""
    settings = recipe.calibrated
    assert isinstance(settings, GPTQSettings)
    out: dict[str, dict] = {}
    shared = {}  # a Hessian several weights use (gate and up of one expert, every expert under experts: all)
    users: dict = {}
    for _, key, _, _ in jobs:
        if key is not None:
            users[key] = users.get(key, 0) + 1
    batches: dict[tuple, list] = {}
    for job in jobs:
        t, key, tokens, reason = job
        w = state[f"{t.module}.weight"]
        if key is None:
            q, scale = int4.quantize_int4(w.to(stored), t.group_size)
            out[t.module] = _record(int4.pack_int4(q).cpu(), scale.cpu(), "rtn", tokens, None, reason)
            w.copy_(int4.dequantize_int4(q, scale, t.group_size))  # in place: a routed expert's is a view
            continue
        batches.setdefault((tuple(w.shape), t.group_size, t.args.model_dump_json()), []).append(job)

    lock = threading.Lock()

    def hessians_for(chunk) -> torch.Tensor:
        """The chunk's normalized Hessians: stacked [B, n, n], or the one [n, n] all its B > 1 weights share; each is
        normalized once and dropped after its last user (stacking every batch up front would hold a copy of a
        shared Hessian per weight)."""
        with lock:
            for _, key, _, _ in chunk:
                if key not in shared:
                    shared[key] = hessians.normalized(key)
            keys = [key for _, key, _, _ in chunk]
            found = shared[keys[0]] if len(keys) > 1 and len(set(keys)) == 1 else torch.stack([shared[k] for k in keys])
            for key in keys:
                users[key] -= 1
                if users[key] == 0:
                    del shared[key]
            return found

    work = []
    for group in batches.values():
        cap = _batch_cap(group[0], state, devices, budget)
        work += [group[start:start + cap] for start in range(0, len(group), cap)]

    def run(index: int):
        device = devices[index % len(devices)]
        if device.startswith("cuda"):
            # a thread starts on cuda:0; Triton launches on the current device, whatever the tensors' device
            torch.cuda.set_device(torch.device(device))
        chunk = work[index]
        t0 = chunk[0][0]
        ws = torch.stack([state[f"{t.module}.weight"] for t, _, _, _ in chunk]).to(device, stored)
        q, scale, losses, fallback = _gptq(ws, hessians_for(chunk).to(device), t0, settings)
        del ws
        # packed and dequantized where they were computed: only the packed bytes travel to the host
        return [(job, int4.pack_int4(q[k]).cpu(), scale[k].cpu(), int4.dequantize_int4(q[k], scale[k], t0.group_size),
                 float(losses[k]), bool(fallback[k])) for k, job in enumerate(chunk)]

    def finished():
        if len(devices) == 1:  # in this thread: on CPU a worker thread ran quantize_weight at half speed
            yield from map(run, range(len(work)))
            return
        with ThreadPoolExecutor(max_workers=len(devices)) as pool:
            yield from pool.map(run, range(len(work)))

    for results in finished():
        for (t, _, tokens, reason), packed, scale, weight, loss, fallback in results:
            method = "rtn" if fallback else "gptq"
            if fallback:
                reason = "Hessian not positive definite after dampening (llm-compressor's RTN fallback)"
            out[t.module] = _record(packed, scale, method, tokens, loss, reason)
            name = f"{t.module}.weight"
            state[name].copy_(weight)
    return out


def _record(packed, scale, method, tokens, loss, reason) -> dict:
    return {"packed": packed, "scale": scale, "method": method, "tokens": int(tokens), "loss": loss, "reason": reason}


def _batch_cap(job, state, devices: list[str], budget: Budget | None) -> int:
    """How many same-shape weights one quantize_weight call takes: one on CPU (as llm-compressor does,
    and the order of the arithmetic then matches it), as many as fit in a quarter of the budget's room on a GPU."""
    if budget is None or not devices[0].startswith("cuda"):
        return 1
    return max(1, min(64, budget.room() // 4 // _quantize_bytes(state[f"{job[0].module}.weight"].shape)))


def _quantize_bytes(shape) -> int:
    """What quantize_weight holds for one weight of ``shape``: its fp32 Hessian, the weight and its work copies, and
    the group scales."""
    rows, cols = shape
    return 4 * (cols * cols + 3 * rows * cols + 4 * rows * 128)


def _gptq(ws: torch.Tensor, hs: torch.Tensor, target: Target, settings):
    """llm-compressor's quantize_weight on a batch, with quantkit's INT4 scales (compressed-tensors'
    symmetric rule, equal to llm-compressor's observer) -> (q int8, scale, losses, RTN-fallback flags)."""
    _, quantize_weight = llmcompressor_gptq()
    gs = target.group_size
    scale = torch.stack([int4.quantize_int4(w, gs)[1] for w in ws])  # from the weights as decoded (model dtype)
    args = target.args.model_copy(update={"actorder": settings.actorder}).to_compressed_tensors()
    zero_point = torch.zeros_like(scale, dtype=torch.int8)
    # fp32 in, as llm-compressor's prepare_batch stacks them: the result comes back in fp32 too
    if hs.ndim == 2:  # one Hessian for the whole batch: factorized once
        fq, losses, fallback = quantize_sharing_hessian(ws.to(torch.float32), hs, scale, zero_point, args,
                                                        blocksize=settings.block_size, percdamp=settings.dampening_frac)
    else:
        fq, losses, fallback = quantize_weight(ws.to(torch.float32), hs, scale, zero_point, None, args,
                                               blocksize=settings.block_size, percdamp=settings.dampening_frac)
    # fq holds q * scale exactly in fp32, so dividing by the same scale gives q back exactly
    q = fq.div_(scale.float().repeat_interleave(gs, dim=-1)).round_().clamp_(int4.QMIN, int4.QMAX).to(torch.int8)
    return q, scale, losses, fallback
