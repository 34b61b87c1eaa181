"""What every source tensor becomes, decided from headers alone, before any data is read.

The plan fixes each output tensor's name, dtype and shape, and which output shard holds it.
Knowing every size up front lets a shard's safetensors header be written before its tensors
are computed (so a shard streams to disk tensor by tensor), lets ``plan`` predict the output
size exactly, and makes a resumed run lay out the same bytes as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal, NamedTuple

from quantkit.checkpoint.config import FLOAT_CODES
from quantkit.checkpoint.describe import described_by
from quantkit.checkpoint.families import is_linear_weight
from quantkit.checkpoint.reader import DTYPES, Checkpoint, TensorInfo
from quantkit.checkpoint.writer import header_entry_chars, safetensors_header_length
from quantkit.errors import QuantkitError
from quantkit.formats.quant_config import QuantizationScheme
from quantkit.formats.recipe import Recipe
from quantkit.formats.shapes import check_group_size, expected_scale_shape
from quantkit.gc_pause import gc_paused

SHARD_METADATA = {"format": "pt"}  # the __metadata__ of every shard convert writes


class OutputTensor(NamedTuple):
    """One tensor of the converted checkpoint, and what follows from its name, dtype and shape, computed once when
    planned (``output_tensor``): a plan of a 700 GB checkpoint makes 180,000 of these and reads each several
    times, so it is a tuple, which Python builds several times faster than a frozen dataclass."""

    name: str
    dtype: str  # safetensors code
    shape: tuple[int, ...]
    nbytes: int
    header_chars: int  # its entry in the shard's safetensors header, offsets left out


def output_tensor(name: str, dtype: str, shape: tuple[int, ...]) -> OutputTensor:
    nbytes = math.prod(shape) * DTYPES[dtype][0]
    return OutputTensor(name, dtype, shape, nbytes, header_entry_chars(name, dtype, shape))


# How a source stores the tensors an action reads
Encoding = Literal["float", "fp8_block", "int4_packed", "other"]


class ActionKind(str, Enum):
    """What one action does to its source tensors."""

    COPY = "copy"  # a tensor that is not a quantizable weight (norms, biases, router bias)
    KEEP_FLOAT = "keep_float"  # a float weight no group targets, written as it is
    DEQUANTIZE = "dequantize"  # a block-FP8 weight no group targets -> the model dtype
    INT4 = "int4"  # a float or block-FP8 weight -> INT4 pack-quantized
    INT4_KEEP = "int4_keep"  # a compressed-tensors INT4 source whose scheme equals the target's: bytes pass
    INT4_REQUANT = "int4_requant"  # a compressed-tensors INT4 source re-quantized to a different INT4 scheme
    INT4_DEQUANT = "int4_dequant"  # a compressed-tensors INT4 source no group targets -> the model dtype
    FP8_KEEP = "fp8_keep"  # a block-FP8 weight kept block-FP8 (scale renamed weight_scale)
    FP8_QUANTIZE = "fp8_quantize"  # a float weight targeted by a block-FP8 group
    FP8_CHANNEL = "fp8_channel"  # a float or block-FP8 weight -> FP8 with a scale per output row (FP8_DYNAMIC)

    def __str__(self) -> str:
        return self.value


@dataclass
class Action:
    """One unit of conversion: a Linear's weight (with its scales), or one tensor copied as is."""

    kind: ActionKind
    module: str
    sources: tuple[str, ...]
    outputs: tuple[OutputTensor, ...]
    encoding: Encoding  # the source's
    group: str | None = None
    group_size: int | None = None
    source_group_size: int | None = None
    source_bytes: int = 0
    symmetric: bool = True  # INT4 outputs: False adds weight_zero_point (compressed-tensors' asymmetric scheme)


@dataclass
class OutputShard:
    name: str
    actions: list[Action] = field(default_factory=list)

    @property
    def tensors(self) -> list[OutputTensor]:
        return [o for a in self.actions for o in a.outputs]

    @property
    def nbytes(self) -> int:
        return sum(o.nbytes for o in self.tensors)

    @property
    def source_bytes(self) -> int:
        return sum(a.source_bytes for a in self.actions)

    @property
    def file_bytes(self) -> int:
        """The shard file's size as convert writes it: its tensors and its header, exactly."""
        sizes = [(o.header_chars, o.nbytes) for o in self.tensors]
        return safetensors_header_length(sizes, SHARD_METADATA) + sum(n for _, n in sizes)


@dataclass
class ConversionPlan:
    model_dtype: str  # safetensors code of the model dtype (FP8 dequantizes to it)
    block: tuple[int, int]
    shards: list[OutputShard]

    @property
    def output_bytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

    @property
    def file_bytes(self) -> int:
        """The converted checkpoint's shard files, headers included, to the byte."""
        return sum(s.file_bytes for s in self.shards)

    @property
    def weights_by_group(self) -> Counter[str]:
        """Recipe group -> how many weights it took."""
        return Counter(a.group for s in self.shards for a in s.actions if a.group is not None)

    def digest(self) -> str:
        """Identifies the layout; a resumed run must lay out exactly the same shards."""
        h = hashlib.sha256()
        for shard in self.shards:
            h.update(shard.name.encode())
            for a in shard.actions:
                h.update(json.dumps([a.kind, a.sources, [(o.name, o.dtype, o.shape) for o in a.outputs]]).encode())
        return h.hexdigest()


@gc_paused
def plan_conversion(ckpt: Checkpoint, recipe: Recipe, max_shard_size: int) -> ConversionPlan:
    dtype, block = ckpt.config.dtype_code, ckpt.config.fp8_block
    source_ct = described_by(ckpt)
    tensors = ckpt.tensors

    modules: dict[str, dict[str, TensorInfo]] = {}
    for name, info in tensors.items():
        module, _, param = name.rpartition(".")
        modules.setdefault(module, {})[param] = info

    claimed: set[str] = set()
    actions: list[Action] = []
    for module, params in modules.items():
        if "weight" in params or "weight_packed" in params:
            action = _weight_action(module, params, ckpt, recipe, source_ct, dtype, block)
            claimed.update(action.sources)
            actions.append(action)
        elif "weight_scale_inv" in params:
            info = params["weight_scale_inv"]
            raise QuantkitError("weight_scale_inv without its FP8 weight", ckpt.root / info.file, info.name)
    for name, info in tensors.items():
        if name not in claimed:
            actions.append(
                Action(ActionKind.COPY, name.rpartition(".")[0], (name,), (output_tensor(name, info.dtype,
                                                                                        info.shape),), "other")
            )

    # Source order: by file, then position in it, so reads stay sequential.
    def order(a: Action):
        first = tensors[a.sources[0]]
        return (first.file, first.start)

    actions.sort(key=order)
    for a in actions:
        for s in a.sources:
            a.source_bytes += tensors[s].nbytes
    plan = ConversionPlan(dtype, block, _assign_shards(actions, max_shard_size))
    taken = plan.weights_by_group
    for group, scheme in recipe.config.config_groups.items():
        if group not in taken:  # a typo in a target, or an ignore that swallows it: never a silent no-op
            raise QuantkitError(f"recipe {recipe.name}: group {group} (targets {scheme.targets}) matches no weight "
                                "of this checkpoint", ckpt.root)
    return plan


def _header_bound(o: OutputTensor) -> int:
    """An upper bound on this tensor's share of a safetensors header (offsets up to 20 digits): the
    length of ``json.dumps({name: {"dtype": .., "shape": [..], "data_offsets": [0, 0]}})`` + 40, which
    is the compact entry (``header_chars``) with the two zeros, the braces, ``json.dumps``' seven spaces
    after its colons and commas and one more per comma in the shape, and 40. It cuts the shards: changing
    it moves tensors between shards of every checkpoint."""
    return o.header_chars + max(len(o.shape) - 1, 0) + 51


def _assign_shards(actions: list[Action], max_shard_size: int) -> list[OutputShard]:
    """Cut the ordered actions into shards whose whole files (header included) stay under the cap;
    a module's tensors never straddle two shards."""
    groups: list[list[Action]] = [[]]
    size = 64  # header length, braces, metadata, padding
    for a in actions:
        n = 0
        for o in a.outputs:
            n += o.nbytes + _header_bound(o)
        if groups[-1] and size + n > max_shard_size:
            groups.append([])
            size = 64
        groups[-1].append(a)
        size += n
    total = len(groups)
    return [OutputShard(f"model-{i + 1:05d}-of-{total:05d}.safetensors", g) for i, g in enumerate(groups)]


def _weight_action(module, params, ckpt, recipe, source_ct, dtype, block) -> Action:
    where = lambda info: ckpt.root / info.file  # noqa: E731  (built for an error only: planning is per weight)
    if "weight_packed" in params:
        return _int4_source_action(module, params, ckpt, recipe, source_ct, dtype)

    weight = params["weight"]
    scale_inv = params.get("weight_scale_inv")
    if weight.dtype == "F8_E5M2":
        raise QuantkitError("FP8 e5m2 weight: only e4m3 block-FP8 sources are supported", where(weight), weight.name)
    if weight.dtype == "F8_E4M3":
        if scale_inv is None:
            raise QuantkitError("FP8 weight without its scale (weight_scale_inv)", where(weight), weight.name)
        expected = expected_scale_shape(weight.shape, block) if len(weight.shape) == 2 else None
        if scale_inv.shape != expected:
            raise QuantkitError(
                f"scale of the wrong shape: {list(scale_inv.shape)}, expected {list(expected or ())} for "
                f"weight {list(weight.shape)} in {block[0]}x{block[1]} blocks",
                where(scale_inv),
                scale_inv.name,
            )
        if scale_inv.dtype not in FLOAT_CODES:
            raise QuantkitError(f"scale dtype {scale_inv.dtype} is not a float", where(scale_inv), scale_inv.name)
        encoding, sources = "fp8_block", (weight.name, scale_inv.name)  # type: tuple[Encoding, tuple[str, ...]]
    elif weight.dtype in FLOAT_CODES:
        if scale_inv is not None:
            raise QuantkitError(f"weight_scale_inv beside a {weight.dtype} weight", where(scale_inv), scale_inv.name)
        encoding, sources = "float", (weight.name,)
    else:
        return Action(ActionKind.COPY, module, (weight.name,), (output_tensor(weight.name, weight.dtype,
                                                                             weight.shape),), "other")

    match = _recipe_group(recipe, module, is_linear_weight(weight.name, len(weight.shape)), ckpt, weight)
    if match is None:
        out_dtype = dtype if encoding == "fp8_block" else weight.dtype
        kind = ActionKind.DEQUANTIZE if encoding == "fp8_block" else ActionKind.KEEP_FLOAT
        return Action(kind, module, sources, (output_tensor(weight.name, out_dtype, weight.shape),), encoding)

    group, scheme = match
    _check_linear(weight, ckpt)
    weights = scheme.weights
    if weights is not None and _is_int4_group(scheme):
        gs = _group_size(scheme, weight, ckpt, recipe)
        sym = weights.symmetric
        return Action(ActionKind.INT4, module, sources, _int4_outputs(module, weight.shape, gs, dtype, sym), encoding,
                      group, gs, symmetric=sym)
    if weights is not None and _is_fp8_block(scheme):
        if tuple(weights.block_structure or ()) != tuple(block):
            raise QuantkitError(
                f"recipe group {group} asks blocks {weights.block_structure}, source has {list(block)}",
                where(weight),
                weight.name,
            )
        rows, cols = expected_scale_shape(weight.shape, block)
        outputs = (
            output_tensor(weight.name, "F8_E4M3", weight.shape),
            output_tensor(f"{module}.weight_scale", "F32", (rows, cols)),
        )
        kind = ActionKind.FP8_KEEP if encoding == "fp8_block" else ActionKind.FP8_QUANTIZE
        return Action(kind, module, sources, outputs, encoding, group)
    if weights is not None and _is_fp8_channel(scheme):
        outputs = (output_tensor(weight.name, "F8_E4M3", weight.shape),
                   output_tensor(f"{module}.weight_scale", dtype, (weight.shape[0], 1)))
        return Action(ActionKind.FP8_CHANNEL, module, sources, outputs, encoding, group)
    raise QuantkitError(
        f"recipe group {group}: only INT4 group/channel, FP8 block and FP8 channel (with dynamic per-token FP8 "
        "activations or none) schemes are supported",
        where(weight),
        weight.name,
    )


def _int4_source_action(module, params, ckpt, recipe, source_ct, dtype) -> Action:
    packed = params["weight_packed"]
    where = lambda: ckpt.root / packed.file  # noqa: E731  (built for an error only: planning is per weight)
    for needed in ("weight_scale", "weight_shape"):
        if needed not in params:
            raise QuantkitError(f"packed INT4 weight without its {needed}", where(), packed.name)
    if "weight_zero_point" in params:
        raise QuantkitError("asymmetric INT4 source (weight_zero_point) is not supported", where(), packed.name)
    scale = params["weight_scale"]
    sources = (packed.name, scale.name, params["weight_shape"].name)
    src = source_ct.scheme_for(module, True) if source_ct else None
    if src is None or not _is_int4_group(src[1]):
        raise QuantkitError("packed INT4 weight that the source's quantization_config does not "
                            "describe", where(), packed.name)
    src_scheme = src[1]
    if src_scheme.weights.strategy == "group":
        out_shape = (packed.shape[0], scale.shape[1] * src_scheme.weights.group_size)
    else:
        out_shape = (packed.shape[0], packed.shape[1] * 8)
    src_gs = out_shape[1] // scale.shape[1]
    match = _recipe_group(recipe, module, True, ckpt, packed)
    weight_name = f"{module}.weight"
    if match is None:
        return Action(ActionKind.INT4_DEQUANT, module, sources, (output_tensor(weight_name, scale.dtype, out_shape),),
                      "int4_packed",
            source_group_size=src_gs,
        )
    group, scheme = match
    weights = scheme.weights
    if weights is None or not _is_int4_group(scheme):
        raise QuantkitError(f"recipe group {group} re-quantizes an INT4 source to a non-INT4 scheme", where(),
                            packed.name)
    if weights.model_dump() == src_scheme.weights.model_dump():
        outputs = tuple(
            output_tensor(params[p].name, params[p].dtype, params[p].shape)
            for p in ("weight_packed", "weight_scale", "weight_shape")
        )
        return Action(ActionKind.INT4_KEEP, module, sources, outputs, "int4_packed", group, src_gs, src_gs)
    gs = weights.group_size or out_shape[1]
    problem = check_group_size(out_shape[1], gs)
    if problem:
        raise QuantkitError(problem, where(), packed.name)
    sym = weights.symmetric
    return Action(ActionKind.INT4_REQUANT, module, sources, _int4_outputs(module, out_shape, gs, scale.dtype, sym),
                  "int4_packed", group, gs, src_gs, symmetric=sym)


def _recipe_group(recipe: Recipe, module: str, is_linear: bool, ckpt: Checkpoint,
                  weight: TensorInfo) -> tuple[str, QuantizationScheme] | None:
    """The one recipe group that targets ``module``, or None. A group naming it (exact name or regex) wins over one
    targeting its class, as in compressed-tensors, SGLang and vLLM; two groups claiming it at the same level are
    refused (the engines take the first in different orders: compressed-tensors sorts targets, SGLang keeps the
    config's)."""
    matches = recipe.groups_for(module, is_linear)
    if len(matches) > 1:
        raise QuantkitError(f"recipe groups {matches[0][0]} and {matches[1][0]} both target this module; "
                            "give each module one group", ckpt.root / weight.file, weight.name)
    return matches[0] if matches else None


def _int4_outputs(module: str, shape, gs: int, dtype: str, symmetric: bool = True) -> tuple[OutputTensor, ...]:
    out, inn = shape
    zero_point = () if symmetric else (output_tensor(f"{module}.weight_zero_point", "I32",
                                                     ((out + 7) // 8, inn // gs)),)
    return (
        output_tensor(f"{module}.weight_packed", "I32", (out, inn // 8)),
        output_tensor(f"{module}.weight_scale", dtype, (out, inn // gs)),
        output_tensor(f"{module}.weight_shape", "I64", (2,)),
    ) + zero_point


def _check_linear(weight: TensorInfo, ckpt: Checkpoint) -> None:
    if len(weight.shape) != 2:
        raise QuantkitError(
            f"recipe targets a {len(weight.shape)}-D tensor {list(weight.shape)}; only 2-D Linear weights quantize",
            ckpt.root / weight.file,
            weight.name,
        )


def _is_int4_group(scheme: QuantizationScheme) -> bool:
    """INT4 group or channel weights, their activations left alone (W4A16) or quantized to FP8 per token by the engine
    at run time (W4A8: the weights are stored the same way)."""
    w = scheme.weights
    return (
        w is not None
        and w.type == "int"
        and w.num_bits == 4
        and w.strategy in ("group", "channel")
        and not w.actorder
        and (scheme.input_activations is None or is_w4a8(scheme))
    )


def is_w4a8(scheme: QuantizationScheme) -> bool:
    """INT4 weights with FP8 activations quantized dynamically per token (both engines' compressed-tensors W4A8 MoE
    schemes; docs/formats.md)."""
    a = scheme.input_activations
    return (scheme.weights is not None and scheme.weights.type == "int" and scheme.weights.num_bits == 4
            and a is not None and a.type == "float" and a.num_bits == 8 and a.strategy == "token"
            and a.dynamic is True and a.symmetric)


def _is_fp8_block(scheme: QuantizationScheme) -> bool:
    w = scheme.weights
    return w is not None and w.type == "float" and w.num_bits == 8 and w.strategy == "block"


def _is_fp8_channel(scheme: QuantizationScheme) -> bool:
    """FP8 weights with a scale per output row, their activations quantized by the engine per token at run time (the
    W8A8-FP8 schemes both engines run) or not at all."""
    w, a = scheme.weights, scheme.input_activations
    weights = w is not None and w.type == "float" and w.num_bits == 8 and w.strategy == "channel" and w.symmetric
    return weights and (a is None or (a.type == "float" and a.num_bits == 8 and a.strategy == "token"
                                      and a.dynamic is True and a.symmetric))


def _group_size(scheme, weight: TensorInfo, ckpt: Checkpoint, recipe: Recipe) -> int:
    in_features = weight.shape[1]
    gs = scheme.weights.group_size if scheme.weights.strategy == "group" else in_features
    problem = check_group_size(in_features, gs)
    if problem:
        raise QuantkitError(f"recipe {recipe.name}: {problem}", ckpt.root / weight.file, weight.name)
    return gs
