"""``budget``: the most accuracy a size buys. Each group of weights a base recipe quantizes is measured for how much
the model's output moves when that group alone takes each format, then a format is chosen per group to fit a size
budget with the least total damage, and the choice is written as an ordinary recipe a person can review.

Groups are the base recipe's INT4 weights per decoder layer and component (one layer's MLP gate/up/down, its routed
experts, its shared experts, its attention): the engines' kernels want the pieces of one fused module in one scheme.
Options: INT4 group 128 and group 32 (where the group divides every input dimension), block-FP8, BF16.

Sensitivity is measured, not predicted from weight error (the layer with the largest GPTQ loss need not matter, a
late layer with a small one may): for every group and option, the mean per-token KL divergence of the model's
next-token distribution from the source model's, on calibration tokens, with only that group in that option
(one forward pass each, the whole model in memory). The choice is a multiple-choice knapsack, solved greedily on
each group's lower convex hull of (bytes, KL): from every group's smallest option, the upgrade that removes the most
KL per byte goes first, while the budget lasts. Sizes are the conversion plan's own, so the predicted size of the
written recipe is exact.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quantkit.checkpoint.names import LAYER, layer_expert
from quantkit.errors import QuantkitError
from quantkit.settings import BUDGET

OPTIONS = ("int4-g128", "int4-g32", "fp8", "bf16")
MAX_PARAMS = 4_000_000_000  # the whole model is held in memory for the measurement
# (component, whether a name inside its decoder layer is one, the recipe regex for the component's names)
_COMPONENTS = (("experts", layer_expert, r"mlp\.experts\.\d+\.(?:gate|up|down)_proj"),
               ("shared experts", re.compile(r"^mlp\.shared_experts\.(gate|up|down)_proj$").match,
                r"mlp\.shared_experts\.(?:gate|up|down)_proj"),
               ("mlp", re.compile(r"^mlp\.(gate|up|down)_proj$").match, r"mlp\.(?:gate|up|down)_proj"),
               ("attention", re.compile(r"^self_attn\..+$").match, r"self_attn\.[^.]+(?:\.[^.]+)?"))


@dataclass
class Group:
    name: str  # "layer 29 mlp"
    pattern: str  # regex over module names (fullmatch)
    modules: list[str]
    shapes: list[tuple[int, int]]
    kl: dict[str, float] = field(default_factory=dict)  # option -> measured mean per-token KL (nats)
    bytes: dict[str, int] = field(default_factory=dict)  # option -> bytes of its weights in that option
    choice: str = ""


@dataclass
class BudgetResult:
    source: str
    base_recipe: str
    budget_bytes: int
    source_bytes: int
    predicted_bytes: int  # the written recipe's conversion, from the plan
    smallest_bytes: int  # every group in its smallest option
    predicted_kl: float  # the sum over groups of the chosen options' KL (the damage the choice minimizes)
    recipe: str
    samples: int
    seq_len: int
    groups: list[Group] = field(default_factory=list)
    int4_share: float = 0.0  # share of the groups' weights left in INT4


def option_bytes(option: str, shape: tuple[int, int], symmetric: bool = True) -> int | None:
    """Bytes one Linear weight takes on disk in ``option`` (None: the option does not fit its shape)."""
    out, inn = shape
    if option.startswith("int4"):
        group = int(option.removeprefix("int4-g"))
        if inn % group:
            return None
        zero_points = 0 if symmetric else math.ceil(out / 8) * (inn // group) * 4  # int32, 8 to a word
        # packed nibbles, bf16 scales, int64[2] weight_shape
        return out * inn // 2 + out * (inn // group) * 2 + 16 + zero_points
    if option == "fp8":
        if inn % 128:  # SGLang's block-FP8 Linear quantizes its input in groups of 128 (verify's rule): it cannot run
            return None
        return out * inn + math.ceil(out / 128) * math.ceil(inn / 128) * 4  # fp32 scale per 128x128 block
    return out * inn * 2


def parse_budget(text: str, source_bytes: int) -> int:
    """``421GB`` / ``512MiB`` / a byte count, or a fraction of the source's bytes (``0.6``)."""
    from quantkit.sizes import parse_size

    if re.fullmatch(r"\s*(0?\.\d{1,15}|1(\.0*)?)\s*", text):
        return int(float(text) * source_bytes)
    return parse_size(text)  # a byte count or a size with its unit; anything else is refused there


def budget(
    source: str | os.PathLike,
    *,
    recipe: str,
    size: str,
    out: str | os.PathLike,
    data: str | os.PathLike | None = BUDGET.data,
    samples: int = BUDGET.samples,
    seq_len: int = BUDGET.seq_len,
    device: str = BUDGET.device,
    dtype: str = BUDGET.dtype,
) -> BudgetResult:
    """Measure the sensitivity of RECIPE's INT4 groups in SOURCE and write the recipe that fits SIZE with the least
    damage to OUT (a YAML recipe; its measurements in a comment at its top). ``dtype``: what the model computes in
    (compute_dtype.py); each option's weights are quantized from the stored dtype, as convert quantizes them."""
    from quantkit.calibration_data import DEFAULT_DATA, calibration_batches, model_tokenizer
    from quantkit.checkpoint.inspection import inspect_checkpoint
    from quantkit.checkpoint.reader import open_checkpoint
    from quantkit.checkpoint.writer import refuse_inside
    from quantkit.convert.tensor_plan import ActionKind, plan_conversion
    from quantkit.devices import resolve_device
    from quantkit.formats.recipe import load_recipe

    src = Path(source)
    ckpt = open_checkpoint(src)
    base = load_recipe(recipe)
    if base.calibration is not None:
        raise QuantkitError(f"{base.name} is a {base.algorithm} recipe; the budget plans round-to-nearest formats "
                            "(give its round-to-nearest counterpart)")
    params = inspect_checkpoint(src).total_params
    if params > MAX_PARAMS:
        raise QuantkitError(f"{params:,} parameters: the budget measures each group on the whole model in memory, "
                            f"for models up to {MAX_PARAMS:,}", src)
    ckpt.config.check_context(seq_len, "--seq-len")
    out_path = Path(out)
    refuse_inside(src, out_path, "--out")
    if out_path.exists() and not out_path.is_file():
        raise QuantkitError("exists and is not a file", out_path)
    plan = plan_conversion(ckpt, base, 5 * 10**9)
    int4 = [a for s in plan.shards for a in s.actions if a.kind == ActionKind.INT4]
    conventions = {a.symmetric for a in int4}
    if len(conventions) > 1:
        raise QuantkitError(f"recipe {base.name} mixes symmetric and asymmetric INT4 groups; the budget writes one")
    symmetric = conventions.pop() if conventions else True  # the base recipe's: measured and written as it is
    groups = _groups(int4, ckpt, symmetric)
    if not groups:
        raise QuantkitError(f"recipe {base.name} quantizes nothing to INT4 in this model", src)
    budget_bytes = parse_budget(size, ckpt.total_bytes)
    others = plan.file_bytes - sum(o.nbytes for a in int4 for o in a.outputs)  # headers and untouched tensors
    smallest = others + sum(min(g.bytes.values()) for g in groups)
    if budget_bytes < smallest:
        raise QuantkitError(f"--budget {size} is {budget_bytes:,} bytes; the smallest this recipe's groups allow is "
                            f"about {smallest:,} ({smallest / ckpt.total_bytes:.3f} of the source)")
    dev = resolve_device(device)
    data_path = Path(data) if data else DEFAULT_DATA
    batches = calibration_batches(data_path, "text", samples, seq_len, 1, lambda: model_tokenizer(src),
                                  ckpt.config.vocab_size, require_all=True)
    _measure(ckpt, groups, batches, dev, dtype, symmetric)
    room = budget_bytes - others
    while True:  # the headers of the chosen formats differ a little from the base's: shrink the room until it fits
        _choose(groups, room)
        text = _recipe_text(base, groups, ckpt, budget_bytes, symmetric)
        written = plan_conversion(ckpt, _recipe_from_text(text), 5 * 10**9).file_bytes
        if written <= budget_bytes or room <= smallest - others:
            break
        room -= written - budget_bytes
    if written > budget_bytes:  # the smallest choice's headers took it over: nothing fits
        raise QuantkitError(f"--budget {size} is {budget_bytes:,} bytes; the smallest recipe the groups allow converts "
                            f"to {written:,}: nothing written")
    from quantkit.checkpoint.writer import write_bytes_atomic

    out_path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(out_path, text.encode())
    int4_weights = sum(math.prod(s) for g in groups if g.choice.startswith("int4") for s in g.shapes)
    return BudgetResult(
        source=str(src), base_recipe=base.name, budget_bytes=budget_bytes, source_bytes=ckpt.total_bytes,
        predicted_bytes=written, smallest_bytes=smallest,
        predicted_kl=sum(g.kl[g.choice] for g in groups), recipe=str(out_path), samples=samples, seq_len=seq_len,
        groups=groups, int4_share=int4_weights / sum(math.prod(s) for g in groups for s in g.shapes))


def _recipe_from_text(text: str):
    """The recipe a YAML text describes, read as ``convert`` will read it from the file."""
    import tempfile

    from quantkit.formats.recipe import load_recipe

    with tempfile.TemporaryDirectory(prefix="quantkit-budget-") as folder:
        path = Path(folder) / "recipe.yaml"
        path.write_text(text)
        return load_recipe(path)


def _groups(actions, ckpt, symmetric: bool) -> list[Group]:
    """The base recipe's INT4 weights gathered per decoder layer and component, in layer order."""
    groups: dict[str, Group] = {}
    for a in actions:
        m = LAYER.match(a.module)
        name, pattern = a.module, re.escape(a.module)
        if m:
            for component, is_component, rel in _COMPONENTS:
                if is_component(m.group(2)):
                    name, pattern = f"layer {m.group(1)} {component}", rf"model\.layers\.{m.group(1)}\.{rel}"
                    break
        group = groups.setdefault(name, Group(name, pattern, [], []))
        weight = ckpt.tensors.get(f"{a.module}.weight")
        shape = tuple(weight.shape) if weight is not None else a.outputs[0].shape
        group.modules.append(a.module)
        group.shapes.append((int(shape[0]), int(shape[1])))
    for group in groups.values():
        for option in OPTIONS:
            sizes = [option_bytes(option, s, symmetric) for s in group.shapes]
            if all(b is not None for b in sizes):
                group.bytes[option] = sum(b for b in sizes if b is not None)
    return sorted(groups.values(), key=lambda g: _order(g.name))


_GROUP_IN_LAYER = re.compile(r"^layer (\d+) (.+)$")  # a group's name: "layer 29 mlp"


def _order(name: str) -> tuple:
    m = _GROUP_IN_LAYER.match(name)
    return (int(m.group(1)), m.group(2)) if m else (1 << 30, name)


def _measure(ckpt, groups: list[Group], batches, device: str, dtype: str, symmetric: bool) -> None:
    """Every group's KL in every option that fits it, with the rest of the model as the source holds it."""
    from quantkit.compute_dtype import compute_dtype
    from quantkit.formats import fp8_block, int4
    from quantkit.modeling import load_model, model_dtype

    stored = model_dtype(ckpt.config)
    model = load_model(ckpt.root, compute_dtype(dtype, device, stored), device=device)
    block = ckpt.config.fp8_block
    layers = model.model.layers
    with torch.no_grad(), _recorded_outputs(layers) as outputs:
        reference = [torch.log_softmax(model(input_ids=b.to(device), use_cache=False).logits.float(), -1)
                     for b in batches]

    def kl(start: int) -> float:
        """The KL over the batches, the model run from decoder layer ``start`` on (the source's states before it)."""
        total, tokens = 0.0, 0
        with torch.no_grad(), _replayed(layers, outputs, start) as replay:
            for i, (b, ref) in enumerate(zip(batches, reference, strict=True)):
                if replay:
                    replay.batch = i
                logq = torch.log_softmax(model(input_ids=b.to(device), use_cache=False).logits.float(), -1)
                total += float((ref.exp() * (ref - logq)).sum())
                tokens += b.numel()
        return total / tokens

    with torch.no_grad():
        for group in groups:
            try:
                modules = [model.get_submodule(m) for m in group.modules]
            except AttributeError:  # transformers fuses MoE experts into one module: no per-expert Linear
                modules = []
            if not modules or not all(isinstance(m, torch.nn.Linear) for m in modules):
                raise QuantkitError(f"{group.name}: the budget measures Linear weights; this model keeps them fused "
                                    "(MoE experts): not measured yet", ckpt.root, group.modules[0])
            saved = [m.weight.data.clone() for m in modules]
            stored_fp8 = tuple(block) == (128, 128) and all(
                ckpt.tensors[f"{m}.weight"].dtype == "F8_E4M3" for m in group.modules if f"{m}.weight" in ckpt.tensors)
            for option in group.bytes:
                if option == "bf16" or (option == "fp8" and stored_fp8):
                    group.kl[option] = 0.0  # the source's own values (block-FP8 kept as it is stored)
                    continue
                for m, w in zip(modules, saved, strict=True):
                    if option == "fp8":
                        q, s = fp8_block.quantize_fp8_block(w.to(stored), block)
                        m.weight.data = fp8_block.dequantize_fp8_block(q, s, block, stored).to(w.dtype)
                    else:
                        m.weight.data = int4.fake_quantize_int4(w.to(stored), int(option.removeprefix("int4-g")),
                                                                symmetric)
                        m.weight.data = m.weight.data.to(w.dtype)
                group.kl[option] = max(kl(_first_layer(group)), 0.0)
            for m, w in zip(modules, saved, strict=True):
                m.weight.data = w


def _first_layer(group: Group) -> int:
    """The first decoder layer a group's weights change: 0 for a group outside the layers (embeddings, head)."""
    m = _GROUP_IN_LAYER.match(group.name)
    return int(m.group(1)) if m else 0


@contextmanager
def _recorded_outputs(layers) -> Iterator[list[list]]:
    """Each decoder layer's output on each batch of the forwards inside, by layer."""
    outputs: list[list] = [[] for _ in layers]
    hooks = [layer.register_forward_hook(lambda _m, _a, out, i=i: outputs[i].append(out))
             for i, layer in enumerate(layers)]
    try:
        yield outputs
    finally:
        for hook in hooks:
            hook.remove()


class _Replayed(torch.nn.Module):
    """Stands in for a decoder layer before ``start``: it passes its input on, or (the last one) returns the source's
    recorded output for the current batch. A group in layer ``start`` leaves every state before it as the source
    computes it, so its KL needs only the layers from ``start`` on: half the model on average, the same numbers."""

    def __init__(self, layer: torch.nn.Module, outputs: list | None):
        super().__init__()
        self.outputs, self.batch = outputs, 0
        object.__setattr__(self, "original", layer)  # not a submodule: the model's own stays where it is

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states if self.outputs is None else self.outputs[self.batch]

    def __getattr__(self, name: str):  # what a model's forward reads of its layers (attention_type, ...)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.original, name)


@contextmanager
def _replayed(layers, outputs: list[list], start: int) -> Iterator[_Replayed | None]:
    """Layers ``0 .. start - 1`` replaced by their recorded result while inside; the last stand-in, or None."""
    originals = list(layers)
    stand_ins = [_Replayed(layer, outputs[i] if i == start - 1 else None) for i, layer in enumerate(originals[:start])]
    try:
        for i, stand_in in enumerate(stand_ins):
            layers[i] = stand_in
        yield stand_ins[-1] if stand_ins else None
    finally:
        for i, layer in enumerate(originals):
            layers[i] = layer


def _choose(groups: list[Group], room: int) -> None:
    """A format per group within ``room`` bytes, least total KL: each group starts at its smallest option and climbs
    its lower convex hull of (bytes, KL); the steepest step (KL removed per byte) of any group goes first."""
    hulls = {id(g): _hull(g) for g in groups}
    position = {id(g): 0 for g in groups}
    spent = sum(hulls[id(g)][0][1] for g in groups)
    while True:
        best = None
        for g in groups:
            hull, at = hulls[id(g)], position[id(g)]
            if at + 1 < len(hull):
                (_, b0, k0), (_, b1, k1) = hull[at], hull[at + 1]
                gain = (k0 - k1) / (b1 - b0)
                if spent + b1 - b0 <= room and (best is None or gain > best[0]):
                    best = (gain, g, b1 - b0)
        if best is None or best[0] <= 0:
            break
        _, g, extra = best
        position[id(g)] += 1
        spent += extra
    for g in groups:
        g.choice = hulls[id(g)][position[id(g)]][0]


def _hull(group: Group) -> list[tuple[str, int, float]]:
    """The options on the lower convex hull of (bytes, KL), smallest first: an option that costs more bytes for no
    less KL than a cheaper mix is never worth buying."""
    points = sorted(((o, group.bytes[o], group.kl[o]) for o in group.bytes), key=lambda p: (p[1], p[2]))
    hull: list[tuple[str, int, float]] = []
    for p in points:
        if hull and p[2] >= hull[-1][2]:
            continue  # more bytes, no less damage
        while len(hull) >= 2:
            (_, b0, k0), (_, b1, k1) = hull[-2], hull[-1]
            if (k0 - k1) * (p[1] - b1) <= (k1 - p[2]) * (b1 - b0):  # the middle point is above the chord
                hull.pop()
            else:
                break
        hull.append(p)
    return hull


_FP8_GROUP = {"weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block",
                          "block_structure": [128, 128], "dynamic": False},
              "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group",
                                    "group_size": 128, "dynamic": True},
              "output_activations": None, "format": "float-quantized"}


def _int4_group(size: int, symmetric: bool) -> dict:
    return {"weights": {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group", "group_size": size,
                        "dynamic": False}, "input_activations": None, "output_activations": None,
            "format": "pack-quantized"}


def _recipe_text(base, groups: list[Group], ckpt, budget_bytes: int, symmetric: bool) -> str:
    """The chosen formats as a QuantizationModifier recipe (llm-compressor's format), the measurements on top; what the
    base recipe says besides its INT4 groups (its other groups, ignore, kv_cache_scheme) is carried over."""
    import yaml

    from quantkit.inert import visible

    config_groups = {f"base_{name}": scheme.model_dump(mode="json", exclude_none=True)
                     for name, scheme in base.config.config_groups.items() if scheme.weights.num_bits != 4}
    for option, spec in (("int4-g32", _int4_group(32, symmetric)), ("int4-g128", _int4_group(128, symmetric)),
                         ("fp8", _FP8_GROUP)):
        chosen = [g.pattern for g in groups if g.choice == option]
        if chosen:
            config_groups[option.replace("-", "_")] = {"targets": [f"re:^(?:{'|'.join(chosen)})$"], **spec}
    modifier = {"ignore": list(base.config.ignore or []), "config_groups": config_groups}
    if base.config.kv_cache_scheme is not None:
        modifier["kv_cache_scheme"] = base.config.kv_cache_scheme.model_dump(mode="json", exclude_none=True)
    doc = {"quant_stage": {"quant_modifiers": {"QuantizationModifier": modifier}}}
    # names from the file system and the checkpoint go into YAML comments: a newline in one would start YAML keys
    lines = [f"# written by quantkit budget from {visible(base.name)} for {visible(ckpt.root.name)}: fits "
             f"{budget_bytes:,} bytes",
             "# group: chosen format; mean per-token KL (nats) with only this group in each format"]
    for g in groups:
        measured = ", ".join(f"{o} {g.kl[o]:.5f}" for o in g.bytes)
        lines.append(f"#   {visible(g.name)}: {g.choice} ({measured})")
    return "\n".join(lines) + "\n" + yaml.safe_dump(doc, sort_keys=False, width=1 << 16)
