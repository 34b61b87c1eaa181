"""SignRound (AutoRound) for a recipe's INT4 weights, streamed one decoder layer at a time from the source.

Each decoder layer is run by llm-compressor's own AutoRoundModifier (which wraps auto-round), exactly as its
sequential pipeline runs it on a whole model in memory: the layer's calibration inputs are captured by the
modifier's hook while the unquantized layer computes the next layer's inputs (llm-compressor switches error
propagation off for AutoRound: each layer sees the full-precision model's hidden states), then the modifier tunes
the layer's rounding and clipping against its full-precision outputs, feeding it the previous layer's quantized
outputs (``q_input``, which the modifier hands from layer to layer). The INT4 values are then taken from the tuned
weights and scales with compressed-tensors' own ``quantize``, as llm-compressor does when it saves: the result
equals llm-compressor's ``oneshot`` with the same recipe and tokens, bit for bit (tests/test_signround.py), except
where oneshot loses AutoRound's work: it rounds an MLP recipe's attention while tuning (``leave_unquantized_alone``)
and drops asymmetric groups' zero points (``_zero_point``).

The walk (convert/calibrated/walk.py) keeps one decoder layer in memory and each finished layer's file; beside it
SignRound keeps the quantized outputs the next layer's tuning starts from (``q-input-NNNNN.safetensors``, hidden
states of every calibration sequence, fp32, until the next layer is recorded), so a killed run resumes at the first
unfinished layer with the same bits. A MoE layer's experts, which transformers fuses into one module, are split
into Linears first (``experts_as_linears``), so AutoRound tunes them inside their layer as it tunes a MoE block.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from quantkit.checkpoint.manifest import CalibratedModuleRecord
from quantkit.checkpoint.reader import Checkpoint
from quantkit.checkpoint.writer import write_safetensors
from quantkit.convert.calibrated.walk import Phases, QuantizedLayer, Target
from quantkit.convert.llmcompressor_import import quiet_llmcompressor
from quantkit.convert.tensor_plan import ConversionPlan
from quantkit.errors import QuantkitError
from quantkit.formats import int4
from quantkit.formats.recipe import Recipe

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.\d+(?:\.|$)")
_LOSS = re.compile(r"loss iter 0: ([0-9.eE+-]+) -> iter \d+: ([0-9.eE+-]+)")


def llmcompressor_autoround():
    """llm-compressor's AutoRoundModifier and the pieces its sequential pipeline drives it with, imported quietly
    (quantkit.convert.llmcompressor_import): quantkit reports per layer itself."""
    with quiet_llmcompressor("SignRound recipes need llm-compressor and auto-round"):
        from compressed_tensors.quantization.lifecycle.forward import quantize
        from llmcompressor.core import State
        from llmcompressor.modifiers.autoround import AutoRoundModifier
        from llmcompressor.utils.helpers import DisableQuantization
    return AutoRoundModifier, State, DisableQuantization, quantize


class SignRound:
    """SignRound's part of the calibrated walk: llm-compressor's AutoRoundModifier tunes the layer while its inputs
    are captured, and the next layer's inputs are the full-precision model's (AutoRound's ``q_input`` rides along)."""

    method = "signround"

    def __init__(self, ckpt: Checkpoint, recipe: Recipe, batches: list[torch.Tensor], devices: list[str], work: Path,
                 dtype: torch.dtype | None = None):
        from quantkit.layerwise import LayerWalk
        from quantkit.modeling import model_config

        assert dtype is None  # SignRound tunes in the model's dtype (calibrated.walk_dtype)
        self.recipe, self.work = recipe, work
        self.walk = LayerWalk(ckpt, batches, devices[0], attention="eager")  # llm-compressor calibrates in eager
        self.tokens = sum(int(b.numel()) for b in batches)
        self.config = model_config(ckpt.config)
        self.q_input = None
        self.losses: list[float] = []

    @staticmethod
    def check(ckpt: Checkpoint, plan: ConversionPlan, recipe: Recipe) -> None:
        llmcompressor_autoround()  # its absence stops the run before DST exists

    @contextmanager
    def running(self) -> Iterator[None]:
        """auto-round's log (its own handler on stderr) is quantkit's to report: its lines are held back and each
        layer's block loss (the best of the tuning) is taken from them. ``experts: all`` runs every token through
        every expert, as llm-compressor's oneshot does by default (its moe_calibration_context)."""
        from llmcompressor.modeling.moe.context import moe_calibration_context

        cal = self.recipe.calibration
        every_expert = cal is not None and cal.experts == "all"
        with _autoround_log(self.losses), _recipe_decides_what_is_quantized(), \
                moe_calibration_context() if every_expert else contextlib.nullcontext():
            yield

    def quantize(self, i: int, state: dict[str, torch.Tensor], targets: list[Target], phases: Phases
                 ) -> QuantizedLayer:
        self.q_input = _restore_q_input(self.work, i, self.q_input)
        with experts_as_linears(self.walk.load(i, state), self.config) as layer:
            tensors, self.q_input = _tune_layer(self.walk, i, layer, targets, self.recipe, self.config, self.q_input,
                                                phases)
        loss = self.losses.pop() if self.losses else None
        _save_q_input(self.work, i, self.q_input)  # before the layer is recorded: a resume at i + 1 starts from it
        records = {t.module: CalibratedModuleRecord(method="signround", tokens=self.tokens, loss=loss) for t in targets}
        return QuantizedLayer(tensors, records, advanced=True)  # tuning ran the layer's inputs on

    def advance(self, i: int, state: dict[str, torch.Tensor], targets: list[Target], done: Path | None) -> None:
        """The full-precision model's hidden states, as llm-compressor's pipeline feeds AutoRound; a MoE layer's
        experts computed as Linears here too, as while tuning, so that a resumed run gets the same inputs."""
        with experts_as_linears(self.walk.load(i, state), self.config) as layer:
            self.walk.run(i, layer)

    def recorded(self, i: int) -> None:
        _q_input_path(self.work, i - 1).unlink(missing_ok=True)

    def layer_loss(self, records: list[CalibratedModuleRecord]) -> float:
        return records[0].loss or 0.0  # every weight of the layer carries the layer's loss


@contextmanager
def _recipe_decides_what_is_quantized() -> Iterator[None]:
    """auto-round adds an ignore list of its own per model family to what it is told (``special_model_handler``: for
    ``glm_moe_dsa`` the MLPs of layers ``0 .. first_k_dense_replace - 1``, a vLLM workaround). llm-compressor hands
    AutoRound each decoder layer alone, named ``model.layers.0``, so a rule that names a layer by its index hits every
    layer: GLM-5's experts were left unquantized in all of them (auto-round 0.15.1 under llm-compressor 0.14, on the
    synthetic GLM-5). Rules that name a layer by index are dropped while quantkit tunes; what the recipe leaves alone
    AutoRound is told by name (``leave_unquantized_alone``)."""
    from auto_round.compressors import base

    real = base.get_predefined_ignore_layers

    def without_layer_indices(model) -> list[str]:
        return [name for name in real(model) if not _LAYER_INDEX.search(name)]

    base.get_predefined_ignore_layers = without_layer_indices
    try:
        yield
    finally:
        base.get_predefined_ignore_layers = real


@contextmanager
def experts_as_linears(layer: torch.nn.Module, config) -> Iterator[torch.nn.Module]:
    """``layer`` with a MoE layer's experts as Linears while in the block. transformers fuses the experts into one
    module of 3-D weights, and AutoRound tunes Linears: each expert becomes a gate/up/down Linear under the
    checkpoint's own names (``mlp.experts.N.gate_proj``) by llm-compressor's linearize (``LinearExperts2D``, what its
    oneshot does to every MoE model), and computes the tokens the router sends it, as auto-round tunes a MoE block.
    The fused module goes back afterwards: the layer walk rebuilds the layer from it."""
    mlp = getattr(layer, "mlp", None)
    experts = getattr(mlp, "experts", None)
    if mlp is None or experts is None or isinstance(experts, torch.nn.ModuleList):
        yield layer
        return
    from llmcompressor.modeling.moe.linear_experts import LinearExperts2D

    mlp.experts = LinearExperts2D.get_linear_experts_cls(type(experts)).from_experts_module(experts, config)
    try:
        yield layer
    finally:
        mlp.experts = experts


def _tune_layer(walk, i, layer, targets, recipe, config, q_input, phases):
    """llm-compressor's AutoRoundModifier on one decoder layer, as its sequential pipeline calls it; returns the
    targets' packed weights and scales and the layer's quantized outputs for the next layer."""
    AutoRoundModifier, State, DisableQuantization, quantize = llmcompressor_autoround()
    settings = recipe.signround
    root = torch.nn.Module()  # the layer under its name in the whole model, which recipe targets and ignores match
    root.model = torch.nn.Module()
    root.model.layers = torch.nn.ModuleDict({str(i): layer})
    root.config, root.name_or_path = config, str(walk.ckpt.root)
    groups = {name: scheme.model_dump(mode="json") for name, scheme in recipe.config.config_groups.items()}
    modifier = AutoRoundModifier(config_groups=groups, ignore=list(recipe.config.ignore or []), iters=settings.iters,
                                 lr=settings.lr, batch_size=settings.batch_size,
                                 enable_torch_compile=settings.enable_torch_compile)
    state = State(model=root)
    with contextlib.redirect_stderr(io.StringIO()):  # the progress bars and warnings of the libraries it drives
        modifier.on_initialize(state, sequential_targets=[type(layer).__name__])
        leave_unquantized_alone(modifier, layer)
        modifier.on_calibration_start(state, None)
        try:
            with DisableQuantization(root):
                with phases("capture"):
                    walk.run(i, layer)  # the hook keeps the inputs; the outputs go on to the next layer
                modifier._q_input = q_input
                with phases("tune"), torch.enable_grad():
                    modifier.on_sequential_epoch_end(state, None, modules=[layer])
                q_input = modifier._q_input
            packed = {}
            for t in targets:
                module = layer.get_submodule(t.rel)
                scale = getattr(module, "weight_scale", None)
                if scale is None:
                    raise QuantkitError("AutoRound left this weight unquantized (its recipe group and quantkit's "
                                        "plan disagree)", walk.ckpt.root, t.module)
                zero = _zero_point(module)
                # on the host: AutoRound leaves scales there and weights on the GPU; one IEEE division either way
                q = quantize(x=module.weight.detach().cpu(), scale=scale.detach().cpu(), zero_point=zero,
                             args=module.quantization_scheme.weights, dtype=torch.int8)
                packed[f"{t.module}.weight_packed"] = int4.pack_int4(q)
                packed[f"{t.module}.weight_scale"] = scale.detach().to(walk.dtype).cpu()
                if zero is not None:
                    packed[f"{t.module}.weight_zero_point"] = int4.pack_zero_point(zero)
        finally:
            modifier.on_calibration_end(state, None)
    return packed, q_input


def _zero_point(module) -> torch.Tensor | None:
    """An asymmetric group's zero points in compressed-tensors' convention (int8, levels -8..7): AutoRound's own,
    tuned with the rounding (``module.zp``, levels 0..15), less 8. llm-compressor 0.14 hands compressed-tensors only
    AutoRound's scales (``AutoRoundModifier._postprocess_qparams``), so oneshot keeps its placeholder zero points of 0
    and clamps every group whose AutoRound zero point is not 8 (tests/test_signround.py)."""
    if module.quantization_scheme.weights.symmetric:
        return None
    return (module.zp.detach().cpu() - 8).round().to(torch.int8)


def leave_unquantized_alone(modifier, layer: torch.nn.Module) -> None:
    """Tell AutoRound every Linear of ``layer`` that the recipe leaves unquantized. AutoRound tunes each Linear of a
    block that its ``ignore_layers`` does not name, with the modifier's default scheme, and llm-compressor 0.14 names
    only targeted Linears without a scheme there (``AutoRoundModifier.get_unquantized_layer_names``): the attention
    of an MLP-only recipe was rounded to INT4 while the MLP was tuned against it, then shipped in BF16 (oneshot saves
    it rounded, as FP32). Measured on SmolLM2's first 2 layers, 200 steps: held-out KL 0.0088 before, 0.0048 after
    (RTN 0.0248; docs/int4-methods.md)."""
    targeted = modifier._match_autoround_targets(layer)
    names = sorted(n for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear) and m not in targeted)
    object.__setattr__(modifier, "get_unquantized_layer_names", lambda _layer: names)  # a pydantic model: no setattr


def _q_input_path(work: Path, i: int) -> Path:
    return work / f"q-input-{i:05d}.safetensors"


def _save_q_input(work: Path, i: int, q_input) -> None:
    """The quantized outputs of layer ``i`` that layer ``i + 1``'s tuning starts from: what a resumed run needs. A list
    of hidden states per sequence, or (a layer that hands more to the next, as GLM-5's DSA attention hands on its
    top-k indices) a dict of such lists."""
    if q_input is None:
        return
    named = q_input.items() if isinstance(q_input, dict) else [("", q_input)]
    tensors = {f"q_input.{key}.{k}" if key else f"q_input.{k}": t.contiguous()
               for key, seq in named for k, t in enumerate(seq)}
    keys = list(q_input) if isinstance(q_input, dict) else None
    write_safetensors(_q_input_path(work, i), tensors, {"format": "pt", "q_input_keys": json.dumps(keys)})


def _restore_q_input(work: Path, i: int, q_input):
    """On the first layer after a resume, the previous layer's quantized outputs from its file."""
    if q_input is not None or i == 0:
        return q_input
    path = _q_input_path(work, i - 1)
    if not path.is_file():
        return None  # no layer before this one was tuned (they hold no targets)
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        keys = json.loads((f.metadata() or {}).get("q_input_keys", "null"))  # none: a list (an older file)
        stored = {name: f.get_tensor(name) for name in f.keys()}

    def sequences(prefix: str) -> list[torch.Tensor]:
        return [stored[f"{prefix}{k}"] for k in range(sum(n.startswith(prefix) for n in stored))]

    return sequences("q_input.") if keys is None else {key: sequences(f"q_input.{key}.") for key in keys}


@contextmanager
def _autoround_log(losses: list[float]):
    logger = logging.getLogger("autoround")

    class Capture(logging.Handler):
        def emit(self, record):
            m = _LOSS.search(record.getMessage())
            if m:
                losses.append(float(m.group(2)))

    saved, level = logger.handlers[:], logger.level
    logger.handlers = [Capture()]
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.handlers, logger.level = saved, level
