"""Loading checkpoints into transformers models for quantkit's in-process engine.

transformers 5.x fuses each MoE layer's experts into 3-D ``gate_up_proj`` / ``down_proj``
parameters; per-expert compressed-tensors tensors on disk match no module there, so a plain
``from_pretrained`` drops them as unexpected keys and leaves the experts randomly initialised:
it runs and is silently wrong. This loader dequantizes every tensor itself, fuses experts
into the model's layout and loads with ``strict=True``, so a missing or stray tensor is an
error, never a random weight.
"""

from __future__ import annotations

from pathlib import Path

import torch

from quantkit.checkpoint.config import ModelConfig
from quantkit.checkpoint.families import is_mtp
from quantkit.checkpoint.names import EXPERT
from quantkit.checkpoint.reader import Checkpoint, TensorReader, open_checkpoint
from quantkit.errors import QuantkitError
from quantkit.formats.weights import decode_weight


def model_dtype(config: ModelConfig) -> torch.dtype:
    return getattr(torch, {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}[config.dtype_code])


def read_weight(ckpt: Checkpoint, reader: TensorReader, module: str, dtype: torch.dtype | None = None,
                device: str = "cpu") -> torch.Tensor:
    """One Linear's weight, read and decoded (formats.weights.decode_weight) on ``device`` whatever its
    encoding on disk: pack-quantized INT4, block-FP8 (``weight_scale_inv`` of a source or ``weight_scale``
    of a float-quantized output) in the model dtype, or a float weight as stored."""
    dtype = dtype or model_dtype(ckpt.config)
    names = ckpt.tensors
    if f"{module}.weight_packed" in names:
        parts: tuple = (reader.read(f"{module}.weight_packed").to(device),
                        reader.read(f"{module}.weight_scale").to(device),
                        reader.read(f"{module}.weight_shape").tolist())
        if f"{module}.weight_zero_point" in names:
            parts += (reader.read(f"{module}.weight_zero_point").to(device),)
        return decode_weight("int4_packed", parts, dtype)
    name = f"{module}.weight"
    t = reader.read(name).to(device)
    if t.dtype != torch.float8_e4m3fn:
        return t
    scale_name = next((s for s in (f"{module}.weight_scale_inv", f"{module}.weight_scale") if s in names), None)
    if scale_name is None:
        raise QuantkitError("FP8 weight without its scale", ckpt.root / names[name].file, name)
    scale = reader.read(scale_name).to(device)
    if is_channel_scale(tuple(scale.shape), tuple(t.shape), ckpt.config.fp8_block):
        return decode_weight("fp8_channel", (t, scale), dtype)
    return decode_weight("fp8_block", (t, scale), dtype, ckpt.config.fp8_block)


def is_channel_scale(scale: tuple[int, ...], weight: tuple[int, ...], block: tuple[int, int]) -> bool:
    """An FP8 weight's scale is one per output row ([out, 1], FP8_DYNAMIC), not one per block: the two shapes differ
    for every weight but a single row of at most one block."""
    from quantkit.formats.shapes import expected_scale_shape

    return len(weight) == 2 and scale == (weight[0], 1) and scale != tuple(expected_scale_shape(weight, block))


def dequantized_state_dict(path: str | Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint in on-disk names, quantized weights decoded to the model dtype."""
    ckpt = open_checkpoint(path)
    dtype = dtype or model_dtype(ckpt.config)
    out: dict[str, torch.Tensor] = {}
    with TensorReader(ckpt) as reader:
        for name in ckpt.tensors:
            module, _, param = name.rpartition(".")
            if param in ("weight_scale_inv", "weight_scale", "weight_shape", "weight_zero_point"):
                continue
            if param in ("weight", "weight_packed"):
                out[f"{module}.weight"] = read_weight(ckpt, reader, module, dtype)
            else:
                out[name] = reader.read(name)
    return out


def meta_structure_mismatches(ckpt: Checkpoint) -> list[str]:
    """Compare a checkpoint's tensors (from headers) with its model class built on the meta
    device: the structure check for models too large to load."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config(ckpt.config))
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    shapes: dict[str, tuple[int, ...]] = {}
    for name, info in ckpt.tensors.items():
        module, _, param = name.rpartition(".")
        if param in ("weight_scale_inv", "weight_scale", "weight_shape", "weight_zero_point") or is_mtp(name,
                                                                                                        ckpt.config):
            continue
        if param == "weight_packed":
            shapes[f"{module}.weight"] = (info.shape[0], info.shape[1] * 8)
        else:
            shapes[name] = tuple(info.shape)
    state = fuse_experts({k: torch.empty(v, device="meta") for k, v in shapes.items()}, ckpt.config)
    got: dict[str, tuple[int, ...] | None] = {k: tuple(v.shape) for k, v in state.items()}
    if getattr(model.config, "tie_word_embeddings", False):
        got.setdefault("lm_head.weight", got.get("model.embed_tokens.weight"))
    problems = [f"missing {k}" for k in sorted(set(expected) - set(got))]
    problems += [f"unexpected {k}" for k in sorted(set(got) - set(expected))]
    problems += [f"{k}: shape {list(got[k] or ())}, model wants "
                 f"{list(v)}" for k, v in expected.items() if k in got and got[k] != v]
    return problems


def fuse_experts(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """On-disk names -> transformers 5.x names: experts stacked into gate_up_proj / down_proj,
    MTP layers dropped (transformers does not build them)."""
    fused: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in state.items():
        if is_mtp(name, config):
            continue
        module, _, param = name.rpartition(".")
        m = EXPERT.match(module) if param == "weight" else None
        if m:
            experts.setdefault(m["prefix"], {}).setdefault(int(m["index"]), {})[m["proj"]] = t
        else:
            fused[name] = t
    for prefix, by_index in experts.items():
        count = len(by_index)
        if sorted(by_index) != list(range(count)) or any(len(p) != 3 for p in by_index.values()):
            raise QuantkitError(f"incomplete experts under {prefix}: each expert needs gate, up and down")
        fused[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([by_index[e]["gate"],
                                                                  by_index[e]["up"]]) for e in range(count)])
        fused[f"{prefix}.down_proj"] = torch.stack([by_index[e]["down"] for e in range(count)])
    return fused


def unfuse_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers names -> on-disk per-expert 2-D tensors (what releases ship)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith(".experts.gate_up_proj"):
            prefix = name.removesuffix(".gate_up_proj")
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = gate[e].contiguous()
                out[f"{prefix}.{e}.up_proj.weight"] = up[e].contiguous()
        elif name.endswith(".experts.down_proj"):
            prefix = name.removesuffix(".down_proj")
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t
    return out


def model_config(config: ModelConfig):
    """A transformers config object without quantization_config (weights arrive dequantized)."""
    from transformers import AutoConfig

    data = {k: v for k, v in config.raw.items() if k != "quantization_config"}
    model_type = data.pop("model_type")
    return AutoConfig.for_model(model_type, **data)


def keep_in_fp32(model, dtype: torch.dtype) -> None:
    """Widen to FP32 what transformers' own loading keeps in FP32 whatever the model's dtype (DeepSeek-V3's and
    GLM-5's router bias ``e_score_correction_bias``): ``from_config`` builds it in ``dtype``, ``from_pretrained``
    casts it by the model's dtype plan (transformers 5.17 ``PreTrainedModel._get_dtype_plan``), and the engines keep it
    FP32 (SGLang 0.5.23 ``srt/models/deepseek_v2.py:520-535``, whose comment says GLM-5.2's bias spreads over a few
    BF16 steps, so BF16 reorders its top-k routing; vLLM 0.33.0 ``model_executor/models/deepseek_v2.py:328-330``).
    quantkit built it BF16 and rounded a stored FP32 bias into it."""
    from transformers.core_model_loading import build_glob_alternation

    plan = model._get_dtype_plan(dtype)
    if not plan:
        return
    pattern = build_glob_alternation(list(plan))[0]
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if pattern.search(name):
            tensor.data = tensor.data.float()


def load_model(path: str | Path, dtype: torch.dtype | None = None, device: str = "cpu"):
    """A transformers model with every weight of ``path`` dequantized into it, strictly, computing in ``dtype``
    (default: the model's). Weights are decoded in the model's dtype first, as the engines decode them, so a wider
    ``dtype`` changes the arithmetic and not the weights."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    ckpt = open_checkpoint(path)
    dtype = dtype or model_dtype(ckpt.config)
    # FP8 KV-cache scales belong to the engine's cache, not to the model's parameters. Each tensor takes its
    # parameter's dtype as it loads: one the model keeps in FP32 (a router's e_score_correction_bias) keeps the FP32
    # values the checkpoint stores, as transformers' own loading and the engines keep them
    weights = {k: v for k, v in dequantized_state_dict(path).items() if not k.endswith((".k_scale", ".v_scale"))}
    state = fuse_experts(weights, ckpt.config)
    cfg = model_config(ckpt.config)
    with no_init_weights():  # every parameter is loaded below, strictly: a random init was 2 s of each load on a CPU
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    keep_in_fp32(model, dtype)
    expected = set(model.state_dict())
    if getattr(cfg, "tie_word_embeddings", False) and "lm_head.weight" in expected and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing = sorted(expected - set(state))
    unexpected = sorted(set(state) - expected)
    if missing or unexpected:
        first = (missing or unexpected)[0]
        raise QuantkitError(
            f"checkpoint does not fit {type(model).__name__}: {len(missing)} missing, {len(unexpected)} unexpected "
            f"(first: {first}); refusing to run with randomly initialised weights",
            path,
            first,
        )
    model.load_state_dict(state, strict=True)
    return model.to(device).eval()
