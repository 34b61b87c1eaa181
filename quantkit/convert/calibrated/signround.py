"""SignRound (AutoRound) for a recipe's INT4 weights, streamed one decoder layer at a time from the source.

Each decoder layer is tuned as auto-round tunes a block under llm-compressor's ``AutoRoundModifier`` (its sequential
pipeline): the layer's full-precision outputs on the full-precision model's hidden states are both the tuning's
reference and the next layer's inputs (llm-compressor switches error propagation off for AutoRound), and the tuning
feeds the layer the previous layer's quantized outputs (``q_input``). auto-round's own steps run in quantkit's loop
(convert/calibrated/autoround.py); the INT4 values are then taken from the tuned weights and scales with
compressed-tensors' own ``quantize``, as llm-compressor does when it saves: the result equals llm-compressor's
``oneshot`` with the same recipe and tokens, bit for bit (tests/test_signround.py), except where oneshot loses
AutoRound's work: it rounds an MLP recipe's attention while tuning and drops asymmetric groups' zero points.

A MoE layer whose targets are its routed experts is tuned in groups of experts that fit the GPU memory budget
(convert/calibrated/memory.py): with the attention and the router left alone, the layer's output is its residual, its
shared experts and each routed expert's weighted contribution, so a group's experts are tuned against the layer's
full-precision output with every other expert held at its current weights (the groups before it already quantized,
the ones after it not yet), on the tokens the router sends the group; tokens it does not reach add a constant to the
loss. With one group this is auto-round's own block loss on the layer.

The walk (convert/calibrated/walk.py) keeps one decoder layer in memory and each finished layer's file; beside it
SignRound keeps the quantized outputs the next layer's tuning starts from (``q-input-NNNNN.safetensors``, until the
next layer is recorded), so a killed run resumes at the first unfinished layer with the same bits.
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from quantkit.checkpoint.manifest import CalibratedModuleRecord
from quantkit.checkpoint.names import layer_expert
from quantkit.checkpoint.reader import Checkpoint
from quantkit.checkpoint.writer import write_safetensors
from quantkit.convert.calibrated.autoround import Tuning, mark_for_tuning, tune
from quantkit.convert.calibrated.memory import (
    Budget,
    Run,
    expert_groups,
    forward_bytes,
    layer_does_not_fit,
    layer_inputs_bytes,
    layer_weight_bytes,
)
from quantkit.convert.calibrated.walk import Phases, QuantizedLayer, Target
from quantkit.convert.llmcompressor_import import quiet_llmcompressor
from quantkit.convert.tensor_plan import ConversionPlan
from quantkit.errors import QuantkitError
from quantkit.formats import int4
from quantkit.formats.recipe import Recipe, SignRoundSettings

# what one tuned weight holds on the device per value while a group is tuned: auto-round's FP32 rounding offset,
# its gradient and its best copy, and the autograd intermediates of the fake quantization (measured on an H100:
# docs/int4-methods.md)
TUNING_BYTES_PER_WEIGHT = 34

QInputs = dict[str, list[torch.Tensor]]  # per calibration sequence: the hidden states and what else a layer hands on


def autoround_libraries():
    """auto-round's SignRound pieces and compressed-tensors' ``quantize``, imported quietly: their absence stops a
    SignRound recipe before DST exists."""
    with quiet_llmcompressor("SignRound recipes need llm-compressor and auto-round"):
        from auto_round.wrapper import wrapper_block
        from compressed_tensors.quantization.lifecycle.forward import quantize
    return wrapper_block, quantize


class SignRound:
    """SignRound's part of the calibrated walk: each layer tuned against its full-precision outputs, which go on to
    the next layer; its quantized outputs ride along as the next layer's tuning inputs."""

    method = "signround"
    resumes_started_dtype = False  # always the model's dtype

    @staticmethod
    def walk_dtype(recipe: Recipe, spec: str, device: str, stored: torch.dtype) -> torch.dtype | None:
        """The model's dtype, as llm-compressor's AutoRoundModifier tunes in."""
        from quantkit.compute_dtype import DTYPES, dtype_name

        if spec != "auto" and DTYPES[spec] != stored:
            raise QuantkitError(f"recipe {recipe.name}: SignRound tunes in the model's dtype ({dtype_name(stored)}), "
                                f"as llm-compressor does; --dtype {spec} is for GPTQ recipes")
        return None

    def __init__(self, ckpt: Checkpoint, recipe: Recipe, batches: list[torch.Tensor], devices: list[str], work: Path,
                 dtype: torch.dtype | None = None, budget: Budget | None = None, store: str | None = None):
        from quantkit.layerwise import LayerWalk

        assert dtype is None  # SignRound tunes in the model's dtype (walk_dtype)
        self.recipe, self.work, self.budget = recipe, work, budget
        # llm-compressor calibrates in eager attention
        self.walk = LayerWalk(ckpt, batches, devices[0], attention="eager", store=store)
        assert isinstance(recipe.calibrated, SignRoundSettings)
        self.tuning = Tuning.of(recipe.calibrated, devices[0], self.walk.stored)
        self.tokens = sum(int(b.numel()) for b in batches)
        self.q_input: QInputs | None = None

    @staticmethod
    def check(ckpt: Checkpoint, plan: ConversionPlan, recipe: Recipe) -> None:
        autoround_libraries()

    @staticmethod
    def least_bytes(ckpt: Checkpoint, recipe: Recipe, i: int, targets: list[Target], run: Run) -> int:
        """A MoE layer's experts: the layer's weights, one sequence's forward, the tokens one expert reaches with
        their reference and base outputs, and one expert's tuning state. A whole layer: its weights, the reference
        and quantized inputs and outputs of every sequence, a batch's forward and backward, and the tuning state of
        every target."""
        config, width, seq = ckpt.config, run.width, run.seq_len
        hidden = config.size("hidden_size")
        need = layer_weight_bytes(ckpt, i, width)
        tokens = run.sequences * seq
        if all(layer_expert(t.rel) for t in targets):
            per_expert = 3 * hidden * config.size("moe_intermediate_size")
            reached = tokens * config.size("num_experts_per_tok") // max(1, config.num_experts or 1) + 1
            need += forward_bytes(config, seq, width) + reached * hidden * (2 * width + 4)
            if run.inputs_on_device:  # the captured MoE inputs and residuals, the quantized inputs, the layer's own
                need += tokens * hidden * (width + 4) + 2 * layer_inputs_bytes(config, run.sequences, seq, width)
            return need + TUNING_BYTES_PER_WEIGHT * per_expert
        assert isinstance(recipe.calibrated, SignRoundSettings)
        need += 3 * forward_bytes(config, seq, width) * recipe.calibrated.batch_size + 3 * tokens * hidden * width
        return need + TUNING_BYTES_PER_WEIGHT * sum(_numel(ckpt, t.module) for t in targets)

    @contextmanager
    def running(self) -> Iterator[None]:
        """auto-round's log is quantkit's to report: its info lines are held back while quantkit tunes."""
        logger = logging.getLogger("autoround")
        level = logger.level
        logger.setLevel(logging.WARNING)
        try:
            yield
        finally:
            logger.setLevel(level)

    def quantize(self, i: int, state: dict[str, torch.Tensor], targets: list[Target], phases: Phases
                 ) -> QuantizedLayer:
        self.q_input = _restore_q_input(self.work, i, self.q_input)
        layer = self.walk.load(i, state)
        if _routed_experts_only(layer, targets):
            tuned = _ExpertGroups(self, i, layer, targets, phases).run()
        else:
            tuned = _tune_block(self, i, layer, targets, phases)
        tensors, self.q_input, loss, groups = tuned
        records = {t.module: CalibratedModuleRecord(method="signround", tokens=self.tokens, loss=loss) for t in targets}
        q_input = self.q_input  # written before the layer is recorded: a resume at i + 1 starts from it (GLM-5 at
        # 256 x 2048 tokens: 10.7 GB, so in the writer's thread while the next layer is tuned)
        return QuantizedLayer(tensors, records, advanced=True, expert_groups=groups,  # tuning ran the inputs on
                              first=lambda: _save_q_input(self.work, i, q_input))

    def advance(self, i: int, state: dict[str, torch.Tensor], targets: list[Target], done: Path | None) -> None:
        """The full-precision model's hidden states, as llm-compressor's pipeline feeds AutoRound."""
        self.walk.run(i, self.walk.load(i, state))

    def recorded(self, i: int) -> None:
        _q_input_path(self.work, i - 1).unlink(missing_ok=True)

    def layer_loss(self, records: list[CalibratedModuleRecord]) -> float:
        return records[0].loss or 0.0  # every weight of the layer carries the layer's loss


def _numel(ckpt: Checkpoint, module: str) -> int:
    from quantkit.convert.calibrated.memory import weight_shape

    rows, cols = weight_shape(ckpt, module)
    return rows * cols


def _routed_experts_only(layer: torch.nn.Module, targets: list[Target]) -> bool:
    """A MoE layer (transformers' fused experts) whose targets are all its routed experts' weights."""
    experts = getattr(getattr(layer, "mlp", None), "experts", None)
    return hasattr(experts, "gate_up_proj") and all(layer_expert(t.rel) for t in targets)


# --- a whole decoder layer tuned at once (dense layers; MoE layers whose targets are not only experts) -------------

def _tune_block(sr: SignRound, i: int, layer: torch.nn.Module, targets: list[Target], phases: Phases):
    """auto-round's block tuning on the whole layer: its reference outputs and its quantized outputs computed in
    batches of ``batch_size`` sequences, as auto-round's block forward computes them."""
    walk, tuning, device = sr.walk, sr.tuning, sr.walk.device
    fp_inputs, kwargs_of = _sequences(walk)  # the layer's inputs, before the walk replaces them by its outputs
    with phases("capture"):
        walk.run(i, layer)  # in the model's dtype, one sequence at a time: the next layer's inputs
    with experts_as_linears(layer, walk.ckpt.config) as block:
        marked = _mark(block, targets)
        block.to(tuning.dtype)  # auto-round tunes a block in its amp dtype: FP32 on a CPU without BF16
        with phases("reference"):
            reference = _forward_batches(block, fp_inputs, kwargs_of, tuning, device)["hidden_states"]
        active = _cast(sr.q_input, tuning.dtype) if sr.q_input is not None else fp_inputs
        del fp_inputs
        count = len(reference)

        def predict(indices: list[int]) -> torch.Tensor:
            return _forward(block, _select(active, kwargs_of, indices, device), tuning, device)[0]

        def expected(indices: list[int]) -> torch.Tensor:
            return torch.cat([reference[k] for k in indices]).to(device)

        with phases("tune"):
            _, loss = tune(block, predict, expected, count, tuning, device)
        with phases("forward"):
            q_next = _forward_batches(block, active, kwargs_of, tuning, device)
        tensors = _packed(marked, walk.stored)
    return tensors, q_next, loss, 0


def _sequences(walk) -> tuple[QInputs, list[dict]]:
    """The walk's stored layer inputs now: per sequence, the hidden states (and what the layer before handed on) and
    the keyword inputs (copied: the walk replaces its own as it advances)."""
    out: QInputs = {"hidden_states": [args[0] for args, _ in walk.inputs]}
    if walk.inputs and isinstance(walk.inputs[0][1].get("prev_topk_indices"), torch.Tensor):
        out["prev_topk_indices"] = [kwargs["prev_topk_indices"] for _, kwargs in walk.inputs]
    return out, [dict(kwargs) for _, kwargs in walk.inputs]


def _cast(q: QInputs, dtype: torch.dtype) -> QInputs:
    return {k: [t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in v]
            for k, v in q.items()}


def _select(inputs: QInputs, kwargs_of: list[dict], indices: list[int], device: str) -> tuple[torch.Tensor, dict]:
    """A batch of sequences: their hidden states concatenated, the keyword inputs they share (the causal mask, the
    rotary tables: one tensor for all) as they are and those each has (GLM-5's top-k indices) concatenated."""
    hidden = torch.cat([inputs["hidden_states"][k].to(device) for k in indices])
    base = dict(kwargs_of[indices[0]])
    for key in list(base):
        if isinstance(base[key], torch.Tensor) and any(kwargs_of[k][key] is not base[key] for k in indices):
            base[key] = torch.cat([kwargs_of[k][key].to(device) for k in indices])
    if "prev_topk_indices" in inputs:
        base["prev_topk_indices"] = torch.cat([inputs["prev_topk_indices"][k].to(device) for k in indices])
    return hidden, base


def _forward(block, batch: tuple[torch.Tensor, dict], tuning: Tuning, device: str) -> tuple:
    hidden, kwargs = batch
    kwargs = {k: _on(v, device, tuning.dtype) for k, v in kwargs.items()}
    with tuning.autocast(device):
        output = block(hidden.to(device, tuning.dtype), **kwargs)
    return output if isinstance(output, tuple) else (output,)


def _on(value, device: str, dtype: torch.dtype):
    """A keyword input on the device; a half-precision one in the tuning dtype, as auto-round casts them."""
    if isinstance(value, torch.Tensor):
        value = value.to(device)
        return value.to(dtype) if value.dtype in (torch.float16, torch.bfloat16) else value
    if isinstance(value, tuple):
        return tuple(_on(v, device, dtype) for v in value)
    return value


def _forward_batches(block, inputs: QInputs, kwargs_of: list[dict], tuning: Tuning, device: str) -> QInputs:
    """``block`` on every sequence, ``batch_size`` at a time, split back into sequences (auto-round's block forward);
    a layer that hands the next one its top-k indices (GLM-5) hands them on here too."""
    count = len(inputs["hidden_states"])
    out: QInputs = {"hidden_states": []}
    with torch.no_grad():
        for start in range(0, count, tuning.batch_size):
            indices = list(range(start, min(start + tuning.batch_size, count)))
            result = _forward(block, _select(inputs, kwargs_of, indices, device), tuning, device)
            out["hidden_states"] += list(torch.split(result[0], 1))
            if "prev_topk_indices" in inputs and len(result) > 1 and result[1] is not None:
                out.setdefault("prev_topk_indices", []).extend(torch.split(result[1], 1))
    return out


def _mark(block: torch.nn.Module, targets: list[Target]) -> list[tuple[Target, Any]]:
    """Mark each target Linear for auto-round's tuning; the Linears, by target."""
    marked = []
    for t in targets:
        module = block.get_submodule(t.rel)
        if not isinstance(module, torch.nn.Linear):
            raise QuantkitError(f"SignRound target is a {type(module).__name__} in the transformers model, not a "
                                "Linear", None, t.module)
        mark_for_tuning(module, t.args)
        marked.append((t, module))
    return marked


def _packed(marked: list[tuple[Target, Any]], stored: torch.dtype) -> dict[str, torch.Tensor]:
    """Each tuned Linear's INT4 values from its quantized-dequantized weight and auto-round's scales (held in the
    model's dtype, as llm-compressor registers them), by compressed-tensors' ``quantize``."""
    _, quantize = autoround_libraries()
    tensors = {}
    for t, module in marked:
        weight = module.weight.detach()
        scale = module.scale.detach().to(weight.device, stored).reshape(weight.shape[0], -1)
        zero = _zero_point(module, t)
        # where the weight is (a GLM-5 layer's 768 expert weights took half a minute on the host): one correctly
        # rounded IEEE division, rounding and clamping, the same bits on either
        q = quantize(x=weight, scale=scale, zero_point=None if zero is None else zero.to(weight.device),
                     args=t.args.to_compressed_tensors(), dtype=torch.int8)
        tensors[f"{t.module}.weight_packed"] = int4.pack_int4(q).cpu()
        tensors[f"{t.module}.weight_scale"] = scale.cpu()
        if zero is not None:
            tensors[f"{t.module}.weight_zero_point"] = int4.pack_zero_point(zero)
        for name in ("scale", "zp"):  # auto-round's, left on the Linear by its unwrapper
            if hasattr(module, name):
                delattr(module, name)
    return tensors


def _zero_point(module, target: Target) -> torch.Tensor | None:
    """An asymmetric group's zero points in compressed-tensors' convention (int8, levels -8..7): AutoRound's own,
    tuned with the rounding (``module.zp``, levels 0..15), less 8. llm-compressor 0.14 hands compressed-tensors only
    AutoRound's scales (``AutoRoundModifier._postprocess_qparams``), so oneshot keeps its placeholder zero points of 0
    and clamps every group whose AutoRound zero point is not 8 (tests/test_signround.py)."""
    if target.args.symmetric:
        return None
    return (module.zp.detach().reshape(module.weight.shape[0], -1).cpu() - 8).round().to(torch.int8)


@contextmanager
def experts_as_linears(layer: torch.nn.Module, config) -> Iterator[torch.nn.Module]:
    """``layer`` with a MoE layer's experts as Linears while in the block (a recipe that tunes more than the routed
    experts of a MoE layer tunes the whole layer at once): each expert becomes a gate/up/down Linear under the
    checkpoint's own names by llm-compressor's linearize (``LinearExperts2D``, what its oneshot does to every MoE
    model). The fused module goes back afterwards, holding the tuned weights."""
    mlp = getattr(layer, "mlp", None)
    experts = getattr(mlp, "experts", None)
    if mlp is None or experts is None or isinstance(experts, torch.nn.ModuleList):
        yield layer
        return
    from llmcompressor.modeling.moe.linear_experts import LinearExperts2D

    from quantkit.modeling import model_config

    linear = LinearExperts2D.get_linear_experts_cls(type(experts)).from_experts_module(experts, model_config(config))
    mlp.experts = linear
    try:
        yield layer
    finally:
        mlp.experts = experts


# --- a MoE layer's routed experts, tuned in groups ---------------------------------------------------------------

class _ExpertGroups:
    """A MoE layer's routed experts tuned group by group against the layer's full-precision outputs."""

    def __init__(self, sr: SignRound, i: int, layer: Any, targets: list[Target], phases: Phases):
        self.sr, self.i, self.layer, self.targets, self.phases = sr, i, layer, targets, phases
        self.walk, self.tuning, self.device = sr.walk, sr.tuning, sr.walk.device
        self.experts: Any = layer.mlp.experts  # transformers' fused experts: gate_up_proj, down_proj, act_fn
        self.by_expert: dict[int, list[Target]] = {}
        for t in targets:
            m = layer_expert(t.rel)
            assert m is not None
            self.by_expert.setdefault(int(m["index"]), []).append(t)

    def run(self):
        walk = self.walk
        fp_inputs, self.kwargs_of = _sequences(walk)
        with self.phases("capture"):
            walk.run(self.i, self.layer)  # the full-precision outputs: the reference and the next layer's inputs
            reference = [args[0] for args, _ in walk.inputs]
            active = self.sr.q_input if self.sr.q_input is not None else fp_inputs
            parts = self._capture(active)
        del fp_inputs
        losses = []
        todo = self._groups(parts)
        tensors: dict[str, torch.Tensor] = {}
        done = 0
        while todo:
            group, short = todo.pop(0), False
            try:
                with self.phases("tune"):
                    loss, marked = self._tune_group(group, parts, reference)
            except torch.cuda.OutOfMemoryError:
                if len(group) == 1:
                    raise
                short = True  # the plan's estimate was short: the group again, in halves
            if short:
                # out of the except clause, whose traceback held the failed group's tensors: now the cache can give
                # their blocks back, and the halves' other shapes do not fragment what is left
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                todo[:0] = [group[:len(group) // 2], group[len(group) // 2:]]
                continue
            done += 1
            losses.append(loss)
            tensors.update(_packed(marked, walk.stored))
        with self.phases("forward"):
            q_next = self._outputs(active)
        return tensors, q_next, sum(losses), done

    def _capture(self, active: QInputs) -> list[dict[str, torch.Tensor]]:
        """Per sequence, through the full-precision layer on its tuning inputs: the MoE block's input ``x``, the
        router's choice (``index``, ``weight``), and what the output holds besides the routed experts (``rest``: the
        residual plus the shared experts, in FP32), kept where the walk keeps its layer inputs."""
        mlp, seen = self.layer.mlp, {}
        keep = self.walk.kept

        def residual(_mod, args):
            seen["h"] = args[0]

        def routed(_mod, args):
            seen["x"], seen["index"], seen["weight"] = args[0], args[1], args[2]

        def shared(_mod, _args, output):
            seen["shared"] = output

        handles = [self.layer.post_attention_layernorm.register_forward_pre_hook(residual),
                   mlp.experts.register_forward_pre_hook(routed),
                   mlp.shared_experts.register_forward_hook(shared)]
        parts = []
        try:
            with torch.no_grad():
                for k in range(len(active["hidden_states"])):
                    hidden, kwargs = _select(active, self.kwargs_of, [k], self.device)
                    self.layer(hidden.to(self.walk.dtype), **kwargs)
                    h = seen["h"].reshape(-1, seen["h"].shape[-1])
                    rest = h.float() + seen["shared"].reshape(h.shape).float()
                    parts.append({"x": keep(seen["x"]), "index": keep(seen["index"]), "weight": keep(seen["weight"]),
                                  "rest": keep(rest)})
        finally:
            for handle in handles:
                handle.remove()
        return parts

    def _groups(self, parts) -> list[list[int]]:
        """The experts in groups that fit the budget: each expert's tuning state and the rows of the tokens it may
        reach (its input, base and reference outputs; a group of G of E experts reaches at most G * top-k / E of the
        tokens)."""
        wanted = sorted(self.by_expert)
        budget = self.sr.budget
        if budget is None:
            return [wanted]
        hidden, inter = self.experts.gate_up_proj.shape[-1], self.experts.down_proj.shape[-1]
        count, top_k = self.experts.gate_up_proj.shape[0], parts[0]["index"].shape[-1]
        tokens = sum(p["x"].shape[0] for p in parts)
        width = self.experts.gate_up_proj.element_size()
        per_expert = TUNING_BYTES_PER_WEIGHT * 3 * hidden * inter + tokens * top_k * hidden * (2 * width + 4) // count
        groups = expert_groups(wanted, per_expert, budget.room())
        if not groups:
            raise layer_does_not_fit(self.walk.ckpt.root, self.i, budget.used() + per_expert, budget,
                                     "its weights, its inputs and one expert's tuning state")
        return groups

    def _linears(self, group: list[int]) -> tuple[torch.nn.Module, list[tuple[Target, Any]]]:
        """The group's experts as gate/up/down Linears in the tuning dtype (the fused weights themselves where that is
        the layer's dtype), each target marked for tuning."""
        block = torch.nn.Module()
        inter = self.experts.down_proj.shape[-1]
        marked = []
        for e in group:
            gate_up, down = self.experts.gate_up_proj[e], self.experts.down_proj[e]
            expert = torch.nn.Module()
            for name, weight in (("gate_proj", gate_up[:inter]), ("up_proj", gate_up[inter:]), ("down_proj", down)):
                linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
                linear.weight = torch.nn.Parameter(weight.to(self.tuning.dtype), requires_grad=False)
                setattr(expert, name, linear)
            block.add_module(str(e), expert)
            for t in self.by_expert[e]:
                proj = layer_expert(t.rel)["proj"]  # type: ignore[index]
                module = getattr(expert, f"{proj}_proj")
                mark_for_tuning(module, t.args)
                marked.append((t, module))
        return block, marked

    def _tune_group(self, group: list[int], parts, reference) -> tuple[float, list[tuple[Target, Any]]]:
        device, tuning = self.device, self.tuning
        chosen = torch.tensor(group, device=device)
        others = [e for e in range(self.experts.gate_up_proj.shape[0]) if e not in set(group)]
        with torch.no_grad():  # per sequence, the rows of the tokens the group reaches
            picked = []
            for part, ref in zip(parts, reference, strict=True):
                index = part["index"].to(device)
                hit = torch.isin(index, chosen).any(dim=-1).nonzero().flatten()
                picked.append((part["x"].to(device)[hit], index[hit], part["weight"].to(device)[hit],
                               part["rest"].to(device)[hit], ref.to(device).reshape(-1, ref.shape[-1])[hit]))
            x, index, weight, rest, target = (torch.cat(column) for column in zip(*picked, strict=True))
            counts = [len(p[0]) for p in picked]
            del picked
            base = rest + self._contributions(x, index, weight, others)  # every other expert, in one pass
            del rest
            rows = list(zip(*(torch.split(t, counts) for t in (x.to(tuning.dtype), index, weight, base, target)),
                            strict=True))
            del x, index, weight, base, target
        block, marked = self._linears(group)
        act = self.experts.act_fn

        def predict(indices: list[int]) -> torch.Tensor:
            x = torch.cat([rows[k][0] for k in indices])
            index = torch.cat([rows[k][1] for k in indices])
            weight = torch.cat([rows[k][2] for k in indices])
            out = torch.cat([rows[k][3] for k in indices])
            with tuning.autocast(device):
                for e in group:
                    token, slot = torch.where(index == e)
                    if token.numel() == 0:
                        continue
                    expert: Any = block.get_submodule(str(e))
                    xe = x[token]
                    y = expert.down_proj(act(expert.gate_proj(xe)) * expert.up_proj(xe))
                    out = out.index_add(0, token, y.float() * weight[token, slot, None].float())
            return out

        def expected(indices: list[int]) -> torch.Tensor:
            return torch.cat([rows[k][4] for k in indices])

        _, loss = tune(block, predict, expected, len(rows), tuning, device)
        with torch.no_grad():  # the tuned weights into the layer, for the groups after this one and the outputs
            inter = self.experts.down_proj.shape[-1]
            for e in group:
                tuned: Any = block.get_submodule(str(e))
                expert = tuned
                self.experts.gate_up_proj[e, :inter].copy_(expert.gate_proj.weight)
                self.experts.gate_up_proj[e, inter:].copy_(expert.up_proj.weight)
                self.experts.down_proj[e].copy_(expert.down_proj.weight)
        return loss, marked

    def _contributions(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, experts: list[int]
                       ) -> torch.Tensor:
        """The weighted outputs of ``experts`` (the fused module's current weights) on the tokens routed to them,
        summed per token in FP32."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        mod = self.experts
        for e in torch.unique(index).tolist():
            if e not in experts:
                continue
            token, slot = torch.where(index == e)
            gate, up = torch.nn.functional.linear(x[token], mod.gate_up_proj[e]).chunk(2, dim=-1)
            y = torch.nn.functional.linear(mod.act_fn(gate) * up, mod.down_proj[e])
            out.index_add_(0, token, y.float() * weight[token, slot, None].float())
        return out

    def _outputs(self, active: QInputs) -> QInputs:
        """The layer with its tuned experts on the tuning inputs, one sequence at a time: the next layer's."""
        out: QInputs = {"hidden_states": []}
        with torch.no_grad():
            for k in range(len(active["hidden_states"])):
                hidden, kwargs = _select(active, self.kwargs_of, [k], self.device)
                result = self.layer(hidden.to(self.walk.dtype), **kwargs)
                result = result if isinstance(result, tuple) else (result,)
                out["hidden_states"].append(self.walk.kept(result[0]))
                if "prev_topk_indices" in active and len(result) > 1 and result[1] is not None:
                    out.setdefault("prev_topk_indices", []).append(self.walk.kept(result[1]))
        return out


# --- what a resumed run starts from ------------------------------------------------------------------------------

def _q_input_path(work: Path, i: int) -> Path:
    return work / f"q-input-{i:05d}.safetensors"


def _save_q_input(work: Path, i: int, q_input: QInputs | None) -> None:
    """The quantized outputs of layer ``i`` that layer ``i + 1``'s tuning starts from: what a resumed run needs, per
    name (the hidden states; GLM-5's DSA attention also hands on its top-k indices) a list of sequences."""
    if q_input is None:
        return
    tensors = {f"q_input.{key}.{k}": t.contiguous().cpu() for key, seq in q_input.items() for k, t in enumerate(seq)}
    write_safetensors(_q_input_path(work, i), tensors, {"format": "pt", "q_input_keys": json.dumps(list(q_input))})


def _restore_q_input(work: Path, i: int, q_input: QInputs | None) -> QInputs | None:
    """On the first layer after a resume, the previous layer's quantized outputs from its file."""
    if q_input is not None or i == 0:
        return q_input
    path = _q_input_path(work, i - 1)
    if not path.is_file():
        return None  # no layer before this one was tuned (they hold no targets)
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        keys = json.loads((f.metadata() or {}).get("q_input_keys", "null")) or ["hidden_states"]
        stored = {name: f.get_tensor(name) for name in f.keys()}

    def sequences(prefix: str) -> list[torch.Tensor]:
        return [stored[f"{prefix}{k}"] for k in range(sum(n.startswith(prefix) for n in stored))]

    return {key: sequences(f"q_input.{key}.") for key in keys}


