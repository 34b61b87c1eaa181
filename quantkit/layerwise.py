"""Running calibration tokens through a checkpoint one decoder layer at a time.

The model is built on the meta device; the calibration batches run up to decoder layer 0 once
(embeddings and rotary tables are the only weights loaded for that), and then each decoder
layer in turn is loaded from the checkpoint (decoded from whatever encoding it has), run on
every batch's hidden states and dropped. Peak memory is one layer's weights plus the hidden
states, so calibrate-kv and GPTQ work on models far larger than memory.
"""

from __future__ import annotations

import torch

from quantkit.checkpoint.reader import Checkpoint, TensorReader
from quantkit.errors import QuantkitError

_NOT_WEIGHTS = ("weight_scale_inv", "weight_scale", "weight_shape", "weight_zero_point", "k_scale", "v_scale")


class _Captured(Exception):
    def __init__(self, args, kwargs):
        self.args, self.kwargs = args, kwargs


class _Catcher(torch.nn.Module):
    """Stands in for decoder layer 0 and stops the forward with the inputs it was given."""

    def forward(self, *args, **kwargs):
        raise _Captured(args, kwargs)


class LayerWalk:
    """The decoder layers of ``ckpt`` and the hidden states of ``batches`` in front of the next one."""

    def __init__(self, ckpt: Checkpoint, batches: list[torch.Tensor], device: str = "cpu", attention: str = "sdpa",
                 dtype: torch.dtype | None = None):
        """``attention``: transformers' attention implementation; GPTQ uses ``eager``, the one
        llm-compressor forces during calibration, so both see the same activations to the bit. ``dtype``: what the
        layers compute in (default the model's); weights are decoded in the model's dtype and widened to it."""
        from transformers import AutoModelForCausalLM

        from quantkit.modeling import keep_in_fp32, model_config, model_dtype

        self.ckpt, self.device = ckpt, device
        self.stored = model_dtype(ckpt.config)
        self.dtype = dtype or self.stored
        cfg = model_config(ckpt.config)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=self.dtype, attn_implementation=attention)
        keep_in_fp32(model, self.dtype)  # a router's bias stays FP32, as from_pretrained and the engines keep it
        base = model.model
        with TensorReader(ckpt) as reader:
            base.embed_tokens.to_empty(device=device)
            base.embed_tokens.weight.data.copy_(reader.read("model.embed_tokens.weight"))  # copy_ widens it
        base.rotary_emb = type(base.rotary_emb)(config=cfg).to(device)
        self.layers = list(base.layers)
        base.layers[0] = _Catcher()
        self.inputs: list[tuple[list, dict]] = []  # per batch: the next layer's (args, kwargs)
        with torch.no_grad():
            for batch in batches:
                try:
                    base(input_ids=batch.to(device), use_cache=False)
                except _Captured as c:
                    self.inputs.append((list(c.args), dict(c.kwargs)))
        base.embed_tokens.to("meta")  # only the hidden states are needed from here on

    def read_layer(self, i: int, reader: TensorReader) -> dict[str, torch.Tensor]:
        """Layer ``i``'s tensors in on-disk names on the walk's device, every Linear weight decoded there
        to the model dtype (a GPU decodes a GLM-5 layer's 10 G FP8 values far faster than the CPU), as the engines
        decode it, then widened to the dtype the walk computes in."""
        from quantkit.modeling import read_weight

        prefix = f"model.layers.{i}."
        state = {}
        for name in self.ckpt.tensors:
            if not name.startswith(prefix):
                continue
            module, _, param = name.rpartition(".")
            if param in _NOT_WEIGHTS:
                continue
            if param in ("weight", "weight_packed"):
                weight = read_weight(self.ckpt, reader, module, self.stored, self.device)
                state[f"{module}.weight"] = weight.to(self.dtype)
            else:
                state[name] = reader.read(name).to(self.device)
        return state

    def load(self, i: int, state: dict[str, torch.Tensor]) -> torch.nn.Module:
        """Decoder layer ``i`` on the device holding ``state`` (on-disk names, experts fused here), strictly."""
        from quantkit.modeling import fuse_experts

        prefix = f"model.layers.{i}."
        fused = {k.removeprefix(prefix): v for k, v in fuse_experts(state, self.ckpt.config).items()}
        layer = self.layers[i]
        layer.to_empty(device=self.device)
        layer.load_state_dict(fused, strict=True)
        return layer

    def run(self, i: int, layer: torch.nn.Module, advance: bool = True) -> None:
        """Every batch through ``layer``; with ``advance`` its outputs become the next layer's inputs."""
        with torch.no_grad():
            for args, kwargs in self.inputs:
                try:
                    output = layer(*args, **kwargs)
                except FloatingPointError as exc:
                    raise QuantkitError(str(exc), self.ckpt.root, f"model.layers.{i}") from exc
                hidden = output[0] if isinstance(output, tuple) else output
                if not bool(torch.isfinite(hidden).all()):
                    raise QuantkitError(f"NaN or Inf activations after decoder layer {i}", self.ckpt.root,
                                        f"model.layers.{i}")
                if advance:
                    args[0] = hidden
                    if isinstance(output, tuple) and "prev_topk_indices" in kwargs:
                        kwargs["prev_topk_indices"] = output[1]  # GLM-5 DSA: shared-indexer layers reuse it

    def unload(self, i: int) -> None:
        self.layers[i].to("meta")


def layer_output_errors(source: Checkpoint, converted: Checkpoint, tokens: list[torch.Tensor]) -> list[float]:
    """Per decoder layer: the squared error of ``converted``'s layer output against ``source``'s, both
    fed the source model's own inputs to that layer (so earlier layers' errors do not enter)."""
    ref, conv = LayerWalk(source, tokens, "cpu", "eager"), LayerWalk(converted, tokens, "cpu", "eager")
    errors = []
    with TensorReader(source) as r_src, TensorReader(converted) as r_out:
        for i in range(len(ref.layers)):
            outputs: dict[str, list] = {}
            for key, walk, reader in (("ref", ref, r_src), ("out", conv, r_out)):
                layer = walk.load(i, walk.read_layer(i, reader))
                got = outputs.setdefault(key, [])
                hook = layer.register_forward_hook(
                    lambda m, a, o, got=got: got.append(o[0] if isinstance(o, tuple) else o))
                walk.inputs = ref.inputs
                walk.run(i, layer, advance=False)
                hook.remove()
            errors.append(sum(float((a.float() - b.float()).pow(2).sum())
                              for a, b in zip(outputs["ref"], outputs["out"], strict=False)))
            ref.run(i, ref.load(i, ref.read_layer(i, r_src)))
            ref.unload(i)
            conv.unload(i)
    return errors
