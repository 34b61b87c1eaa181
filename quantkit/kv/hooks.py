"""FP8 (e4m3) KV-cache scales: observing exactly what the engine caches, and emulating FP8 KV.

What is cached, and so what is observed:
  GQA  post-RoPE K and V per KV head (the attention function's key/value, before repeat_kv)
  MLA  one latent per token, [kv_c_normed | k_pe after RoPE]; engines apply ONE scale to it, so
       k_scale = v_scale = max(|kv_c_normed|, |k_pe|) / 448. transformers' MLA attention hands
       both to ``expand_kv`` (DeepSeek-V3 and GLM-5 alike), which is where we look.
The observer keeps a running max over every batch, never only the last.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from quantkit.formats.fp8_block import FP8_MAX

_ATTN_NAME = "quantkit_fp8_kv"


@dataclass
class KVObserver:
    """Running absmax of cached K and V per decoder layer."""

    k: dict[int, float] = field(default_factory=dict)
    v: dict[int, float] = field(default_factory=dict)

    def observe(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        for store, t in ((self.k, k), (self.v, v)):
            m = float(t.detach().abs().amax())
            if m != m or m == float("inf"):
                raise FloatingPointError(f"NaN or Inf in the cached KV of layer {layer}")
            store[layer] = max(store.get(layer, 0.0), m)

    def scales(self) -> dict[int, tuple[float, float]]:
        """layer -> (k_scale, v_scale) = absmax / 448 (fp32)."""
        return {i: (_scale(self.k[i]), _scale(self.v[i])) for i in sorted(self.k)}


def _scale(absmax: float) -> float:
    return float(torch.tensor(absmax, dtype=torch.float32) / FP8_MAX) if absmax > 0 else 1.0


def fake_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What an engine's FP8 cache gives back: x / scale rounded to e4m3 (saturating), times scale."""
    s = torch.tensor(scale, dtype=torch.float32, device=x.device)
    q = (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (q.float() * s).to(x.dtype)


def kv_scales_of(path) -> dict[int, tuple[float, float]]:
    """The k_scale / v_scale tensors of a checkpoint: what an FP8 KV emulation run uses."""
    from quantkit.checkpoint.names import KV_SCALE
    from quantkit.checkpoint.reader import TensorReader, open_checkpoint

    ckpt = open_checkpoint(path)
    found: dict[int, dict[str, float]] = {}
    with TensorReader(ckpt) as reader:
        for name in ckpt.tensors:
            m = KV_SCALE.match(name)
            if m:
                found.setdefault(int(m["layer"]), {})[m["kv"]] = float(reader.read(name))
    return {i: (s["k"], s["v"]) for i, s in sorted(found.items())}


def _layer_of(module) -> int:
    return int(module.layer_idx)


@contextmanager
def kv_hooks(model_or_layers, attention: str, observer: KVObserver | None = None,
             scales: dict[int, tuple[float, float]] | None = None):
    """Observe (``observer``) or emulate FP8 KV with ``scales`` in every attention module found.

    Works on a whole model or on single decoder layers (layer-by-layer calibration).
    """
    modules = model_or_layers if isinstance(model_or_layers, (list, tuple)) else [model_or_layers]
    attns = [m for root in modules for m in root.modules() if hasattr(m, "layer_idx") and hasattr(m, "o_proj")]
    restore = []
    if attention == "mla":
        for attn in attns:
            original = attn.expand_kv

            def expand_kv(kv_nope, k_rot, _attn=attn, _orig=original):
                layer = _layer_of(_attn)
                if observer is not None:
                    both = torch.stack((kv_nope.detach().abs().amax(), k_rot.detach().abs().amax()))
                    observer.observe(layer, both, both)
                if scales is not None:
                    kv_nope, k_rot = fake_fp8(kv_nope, scales[layer][0]), fake_fp8(k_rot, scales[layer][0])
                return _orig(kv_nope, k_rot)

            attn.expand_kv = expand_kv
            restore.append(lambda a=attn: delattr(a, "expand_kv"))
    else:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        def attention_fn(module, query, key, value, *args, **kwargs):
            layer = _layer_of(module)
            if observer is not None:
                observer.observe(layer, key, value)
            if scales is not None:
                key, value = fake_fp8(key, scales[layer][0]), fake_fp8(value, scales[layer][1])
            return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, *args, **kwargs)

        ALL_ATTENTION_FUNCTIONS[_ATTN_NAME] = attention_fn
        # the masks sdpa is given: an attention implementation with no mask function of its own gets no mask at
        # all from transformers, so a padded batch attended to its padding and queries on a cache were masked as
        # if they started at key 0
        ALL_MASK_ATTENTION_FUNCTIONS.register(_ATTN_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
        configs = {id(a.config): a.config for a in attns}
        for cfg in configs.values():
            previous = cfg._attn_implementation
            cfg._attn_implementation = _ATTN_NAME
            restore.append(functools.partial(setattr, cfg, "_attn_implementation", previous))
    try:
        yield
    finally:
        for undo in restore:
            undo()
