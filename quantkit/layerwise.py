"""Running calibration tokens through a checkpoint one decoder layer at a time.

The model is built on the meta device; the calibration batches run up to decoder layer 0 once
(embeddings and rotary tables are the only weights loaded for that), and then each decoder
layer in turn is loaded from the checkpoint (decoded from whatever encoding it has), run on
every batch's hidden states and dropped. Peak memory is one layer's weights plus the hidden
states, so calibrate-kv and GPTQ work on models far larger than memory.

A layer's weights are held once: each decoded tensor becomes the layer's parameter itself (``assign``), and a MoE
layer's experts are decoded straight into the fused 3-D parameters transformers computes with, the per-expert names
of the checkpoint being views into them (a GLM-5 layer is 19.8 GB in BF16; a copy for the module, and another while
fusing, took 40 GB more of an 80 GB card). What every batch shares (the causal mask, the rotary tables) is kept
once, and the hidden states can wait in host memory between layers (``store="cpu"``), each batch moved to the
device as it runs.
"""

from __future__ import annotations

import torch

from quantkit.checkpoint.families import is_mtp
from quantkit.checkpoint.names import EXPERT
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
                 dtype: torch.dtype | None = None, store: str | None = None):
        """``attention``: transformers' attention implementation; GPTQ uses ``eager``, the one
        llm-compressor forces during calibration, so both see the same activations to the bit. ``dtype``: what the
        layers compute in (default the model's); weights are decoded in the model's dtype and widened to it.
        ``store``: where the hidden states wait between layers (default the device; ``cpu`` keeps them in host
        memory, pinned when the device is a GPU)."""
        from transformers import AutoModelForCausalLM

        from quantkit.modeling import keep_in_fp32, model_config, model_dtype

        self.ckpt, self.device = ckpt, device
        self.store = store or device
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
        self.inputs: list[tuple[list, dict]] = []  # per batch: the next layer's (args, kwargs), on the store
        self._fused: dict[int, _ExpertBuffers] = {}  # per layer read: its experts' fused parameters
        with torch.no_grad():
            for batch in batches:
                try:
                    base(input_ids=batch.to(device), use_cache=False)
                except _Captured as c:
                    self.inputs.append(_shared_with(self.inputs, (list(c.args), dict(c.kwargs)), self.kept))
        base.embed_tokens.to("meta")  # only the hidden states are needed from here on

    def kept(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor on the store (pinned host memory for a GPU's: copies to and from it run at full speed)."""
        if self.store == self.device or t.device.type == "meta":
            return t
        return t.to(self.store).pin_memory() if self.device.startswith("cuda") else t.to(self.store)

    def keep_on(self, store: str) -> None:
        """Move the stored layer inputs to ``store`` (``cpu``: host memory, when the device's is needed for the
        layer's own work)."""
        self.store = store
        kept: dict[int, object] = {}  # a tensor the batches share stays shared

        def move(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in kept:
                kept[id(t)] = self.kept(t)
            return kept[id(t)]  # type: ignore[return-value]

        self.inputs = [(_map_tensors(args, move), {k: _map_tensors(v, move) for k, v in kwargs.items()})
                       for args, kwargs in self.inputs]

    def batch(self, index: int) -> tuple[list, dict]:
        """Batch ``index``'s layer inputs on the device."""
        args, kwargs = self.inputs[index]
        return _on(args, self.device), _on(kwargs, self.device)

    def activation_bytes(self, batches: int | None = None) -> int:
        """What the stored layer inputs of the first ``batches`` batches (default all) hold, each shared tensor
        counted once."""
        seen: dict[int, int] = {}
        for args, kwargs in self.inputs[:batches]:
            for t in _tensors((args, kwargs)):
                seen[id(t)] = t.numel() * t.element_size()
        return sum(seen.values())

    def device_activation_bytes(self) -> int:
        """What the stored layer inputs hold on the device: all of them, or one batch at a time from the host."""
        return self.activation_bytes(None if self.store == self.device else 1)

    def read_layer(self, i: int, reader: TensorReader) -> dict[str, torch.Tensor]:
        """Layer ``i``'s tensors in on-disk names on the walk's device, every Linear weight decoded there
        to the model dtype (a GPU decodes a GLM-5 layer's 10 G FP8 values far faster than the CPU), as the engines
        decode it, then widened to the dtype the walk computes in. A routed expert's weight is a view into its
        layer's fused parameter (``load`` uses those): write it with ``copy_``."""
        from quantkit.modeling import read_weight

        prefix = f"model.layers.{i}."
        state: dict[str, torch.Tensor] = {}
        experts = _ExpertBuffers(self.ckpt, self.dtype, self.device)
        for name in self.ckpt.tensors:
            if not name.startswith(prefix):
                continue
            module, _, param = name.rpartition(".")
            if param in _NOT_WEIGHTS:
                continue
            if param in ("weight", "weight_packed"):
                weight = read_weight(self.ckpt, reader, module, self.stored, self.device)
                slot = experts.slot(module, weight)
                if slot is not None:
                    slot.copy_(weight)  # widened to the walk's dtype as it is copied
                    state[f"{module}.weight"] = slot
                else:
                    state[f"{module}.weight"] = weight.to(self.dtype)
            else:
                state[name] = reader.read(name).to(self.device)
        self._fused[i] = experts
        return state

    def load(self, i: int, state: dict[str, torch.Tensor]) -> torch.nn.Module:
        """Decoder layer ``i`` holding the tensors of ``state`` themselves (on-disk names, experts fused), strictly."""
        prefix = f"model.layers.{i}."
        layer = self.layers[i]
        current = dict(layer.state_dict(keep_vars=True))
        experts = self._fused.get(i)
        fused = experts.fused(prefix) if experts else {}
        for name, t in state.items():
            if experts and name in experts.views:
                continue  # a view into the fused parameters
            key = name.removeprefix(prefix)
            want = current.get(key)
            fused[key] = t if want is None or want.dtype == t.dtype else t.to(want.dtype)  # a kept-FP32 router bias
        layer.load_state_dict(fused, strict=True, assign=True)
        return layer.requires_grad_(False)  # calibration never trains the weights themselves

    def run(self, i: int, layer: torch.nn.Module, advance: bool = True) -> None:
        """Every batch through ``layer``; with ``advance`` its outputs become the next layer's inputs."""
        with torch.no_grad():
            for b in range(len(self.inputs)):
                args, kwargs = self.batch(b)
                try:
                    output = layer(*args, **kwargs)
                except FloatingPointError as exc:
                    raise QuantkitError(str(exc), self.ckpt.root, f"model.layers.{i}") from exc
                hidden = output[0] if isinstance(output, tuple) else output
                if not bool(torch.isfinite(hidden).all()):
                    raise QuantkitError(f"NaN or Inf activations after decoder layer {i}", self.ckpt.root,
                                        f"model.layers.{i}")
                if advance:
                    stored_args, stored_kwargs = self.inputs[b]
                    stored_args[0] = self.kept(hidden)
                    if isinstance(output, tuple) and "prev_topk_indices" in stored_kwargs:
                        # GLM-5 DSA: shared-indexer layers reuse it
                        stored_kwargs["prev_topk_indices"] = self.kept(output[1])

    def unload(self, i: int) -> None:
        self.layers[i].to("meta")
        self._fused.pop(i, None)


class _ExpertBuffers:
    """A MoE layer's fused expert parameters (transformers 5.x: ``gate_up_proj`` [E, 2I, H] holding each expert's gate
    then up, ``down_proj`` [E, H, I]), allocated at the first expert weight read and filled in place."""

    def __init__(self, ckpt: Checkpoint, dtype: torch.dtype, device: str):
        self.ckpt, self.dtype, self.device = ckpt, dtype, device
        self.buffers: dict[str, dict[str, torch.Tensor]] = {}
        self.views: set[str] = set()  # the per-expert weights (on-disk names) that are views into the buffers

    def slot(self, module: str, weight: torch.Tensor) -> torch.Tensor | None:
        m = EXPERT.match(module)
        if m is None or is_mtp(module, self.ckpt.config):
            return None
        count = self.ckpt.config.num_experts
        if count is None:
            return None
        e, proj = int(m["index"]), m["proj"]
        self.views.add(f"{module}.weight")
        bufs = self.buffers.setdefault(m["prefix"], {})
        if proj == "down":
            if "down_proj" not in bufs:
                bufs["down_proj"] = torch.empty((count, *weight.shape), dtype=self.dtype, device=self.device)
            return bufs["down_proj"][e]
        rows = weight.shape[0]
        if "gate_up_proj" not in bufs:
            bufs["gate_up_proj"] = torch.empty((count, 2 * rows, weight.shape[1]), dtype=self.dtype,
                                               device=self.device)
        return bufs["gate_up_proj"][e, :rows] if proj == "gate" else bufs["gate_up_proj"][e, rows:]

    def fused(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{p.removeprefix(prefix)}.{name}": t for p, bufs in self.buffers.items() for name, t in bufs.items()}


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _tensors(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _tensors(item)


def _on(tree, device: str):
    """``tree`` (a batch's args or kwargs) with every tensor on ``device``."""
    if isinstance(tree, torch.Tensor):
        return tree.to(device, non_blocking=True) if tree.device.type != "meta" else tree
    if isinstance(tree, list):
        return [_on(item, device) for item in tree]
    if isinstance(tree, tuple):
        return tuple(_on(item, device) for item in tree)
    if isinstance(tree, dict):
        return {k: _on(v, device) for k, v in tree.items()}
    return tree


def _shared_with(earlier: list[tuple[list, dict]], captured: tuple[list, dict], kept) -> tuple[list, dict]:
    """A batch's captured layer inputs, each keyword tensor that equals the first batch's (the causal mask, the
    rotary tables: the same for every batch of one length) replaced by that one, the rest moved to the store."""
    args, kwargs = captured
    first = earlier[0][1] if earlier else {}

    def same(a, b) -> bool:
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a.to(b.device), b))
        if isinstance(a, tuple) and isinstance(b, tuple):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
        return False

    shared = {k: first[k] if k in first and same(v, first[k]) else _map_tensors(v, kept) for k, v in kwargs.items()}
    return [_map_tensors(a, kept) for a in args], shared


def _map_tensors(tree, fn):
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, tuple):
        return tuple(_map_tensors(item, fn) for item in tree)
    if isinstance(tree, list):
        return [_map_tensors(item, fn) for item in tree]
    return tree


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
