"""The names of a checkpoint's modules, one pattern for each family of names.

Releases name a decoder layer's modules ``model.layers.N.<...>`` and a routed expert's Linears
``<...>.experts.E.{gate,up,down}_proj`` (FORMATS.md); conversion, verification, the engines' loaders, the model
loader, the calibrated walk and the FP8 KV cache all ask these questions of a name, here and nowhere else
(tests/test_structure.py holds it).
"""

from __future__ import annotations

import re

# a decoder layer's module or tensor: its index and the rest of its name ("self_attn.q_proj")
LAYER = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?P<rest>.+)$")
# a routed expert's Linear (a module name): the experts' module, the expert's index and its projection
EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<index>\d+)\.(?P<proj>gate|up|down)_proj$")
# an FP8 KV-cache scale: under the projection (what quantkit writes and the engines load) or beside it (older files)
KV_SCALE = re.compile(r"^model\.layers\.(?P<layer>\d+)\.self_attn\.(?:[kv]_proj\.)?(?P<kv>[kv])_scale$")


def layer_expert(rel: str) -> re.Match | None:
    """A routed expert's Linear named inside its decoder layer, where the release layouts keep it
    (``mlp.experts.E.gate_proj``); None for any other name."""
    m = EXPERT.match(rel)
    return m if m and m["prefix"] == "mlp.experts" else None
