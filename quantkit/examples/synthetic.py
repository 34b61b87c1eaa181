"""Synthetic checkpoints with the real on-disk layout of GLM 5.x, DeepSeek-V3 and Llama releases.

Giant MoE checkpoints cannot be downloaded here, so tests, benchmarks and the demo build them:
the family's own transformers config class with tiny dimensions, seeded random weights,
written the way the real release is — per-expert 2-D tensors, block-FP8 weights with
``weight_scale_inv`` where the release has them, BF16 where it keeps BF16, an MTP layer after
the decoder layers, sharded with an index, plus tokenizer-side files to be copied verbatim.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from quantkit.checkpoint.config import ModelConfig
from quantkit.checkpoint.families import mtp_extra_shapes
from quantkit.checkpoint.reader import INDEX_NAME
from quantkit.checkpoint.writer import write_safetensors
from quantkit.errors import QuantkitError
from quantkit.examples.fp8_release import release_encoding
from quantkit.formats.fp8_block import RELEASE_QUANTIZATION_CONFIG
from quantkit.modeling import unfuse_experts

FAMILIES = ("glm_moe_dsa", "deepseek_v3", "llama")



def tiny_config(family: str, **overrides) -> dict:
    """Config kwargs for a tiny model of ``family`` whose every input dim is a multiple of 128."""
    mla_moe: dict[str, object] = dict(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=128, q_lora_rank=128,
        qk_rope_head_dim=32, v_head_dim=64, qk_nope_head_dim=64, first_k_dense_replace=1,
        max_position_embeddings=256,
    )
    base: dict[str, object]
    if family == "glm_moe_dsa":
        base = dict(mla_moe, index_topk=16, index_head_dim=64, index_n_heads=4, head_dim=32)
    elif family == "deepseek_v3":
        # fields of the release's config.json that transformers' class lacks and SGLang's DeepSeek model reads
        release = dict(moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid", ep_size=1)
        base = {**mla_moe, "n_group": 2, "topk_group": 1, **release}
    elif family == "llama":
        base = dict(
            vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
        )
    else:
        raise QuantkitError(f"unknown synthetic family {family!r}; choose from {', '.join(FAMILIES)}")
    base.update(overrides)
    return base


def _model_state(family: str, cfg_kwargs: dict, seed: int) -> tuple[dict, dict[str, torch.Tensor]]:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, **cfg_kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(seed + 1)
    for name, t in state.items():
        # Norms init to ones and router biases to zeros; perturb them so that a loader that
        # drops or swaps one of them changes the logits.
        if t.ndim == 1 and t.is_floating_point():
            noise = torch.randn(t.shape, generator=gen) * 0.1
            state[name] = (t.float() + noise).to(t.dtype)
    config_dict = config.to_dict()
    # the real releases name their class; engines (SGLang, vLLM) pick the model class by it
    config_dict["architectures"] = [type(model).__name__]
    return config_dict, state


def _mtp_layer(family: str, cfg_kwargs: dict, seed: int) -> dict[str, torch.Tensor]:
    """One extra decoder layer (MoE) at index num_hidden_layers, plus the MTP-only tensors."""
    n = cfg_kwargs["num_hidden_layers"]
    bigger = dict(cfg_kwargs, num_hidden_layers=n + 1)
    bigger.pop("mlp_layer_types", None)
    _, state = _model_state(family, bigger, seed + 7)
    prefix = f"model.layers.{n}."
    layer = {k: v for k, v in state.items() if k.startswith(prefix)}
    gen = torch.Generator().manual_seed(seed + 11)
    extra = {}
    for name, shape in mtp_extra_shapes(ModelConfig.read(cfg_kwargs)).items():
        # norms near 1, projections and embeddings at the init scale of the rest
        if len(shape) == 1:
            extra[name] = 1 + torch.randn(shape, generator=gen) * 0.1
        else:
            extra[name] = torch.randn(shape, generator=gen) * 0.02
    layer.update({prefix + k: v.to(torch.bfloat16) for k, v in extra.items()})
    return layer


def _layer_sort_key(name: str):
    return [int(p) if p.isdigit() else p for p in name.split(".")]


def build_synthetic(
    family: str,
    out: str | Path,
    seed: int = 0,
    fp8: bool | None = None,
    shard_size: int = 2_000_000,
    experts: int | None = None,
    layers: int | None = None,
    **overrides,
) -> Path:
    """Write a synthetic checkpoint of ``family`` to ``out``; returns the folder.

    fp8: block-FP8 Linears like the real release (default for MoE families; Llama defaults
    to BF16). shard_size: bytes per shard, small by default so even tiny models have several.
    experts, layers: routed experts per MoE layer and decoder layers; other config fields in ``overrides``.
    """
    if experts is not None:
        overrides["n_routed_experts"] = experts
    if layers is not None:
        overrides["num_hidden_layers"] = layers
    cfg_kwargs = tiny_config(family, **overrides)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    moe = family != "llama"
    fp8 = moe if fp8 is None else fp8
    config, state = _model_state(family, cfg_kwargs, seed)
    state = unfuse_experts(state)
    if moe:
        state.update(unfuse_experts(_mtp_layer(family, cfg_kwargs, seed)))
        config["num_nextn_predict_layers"] = 1

    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(state, key=_layer_sort_key):
        t = state[name].contiguous()
        tensors.update(release_encoding(name, t) if fp8 else {name: t})
    if fp8:
        config["quantization_config"] = dict(RELEASE_QUANTIZATION_CONFIG)
    config["dtype"] = "bfloat16"
    config.pop("torch_dtype", None)
    _write_sharded(out, tensors, shard_size)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    _write_tokenizer_side_files(out, family)
    return out


def _write_sharded(out: Path, tensors: dict[str, torch.Tensor], shard_size: int) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(out / file, shard, {"format": "pt"})
        weight_map.update({name: file for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def _write_tokenizer_side_files(out: Path, family: str) -> None:
    (out / "generation_config.json").write_text(json.dumps({"do_sample": False, "eos_token_id": 1}, indent=2) + "\n")
    (out / "tokenizer_config.json").write_text(
        json.dumps({"model_max_length": 256, "tokenizer_class": "PreTrainedTokenizerFast", "synthetic": family}) + "\n"
    )
    (out / "chat_template.jinja").write_text(
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% endfor %}<|assistant|>\n"
    )
