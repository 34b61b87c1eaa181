"""Where the serving engines' loaders put a checkpoint's KV-scale tensors, read in their own source.

A scale the loader does not map onto a parameter of its model is logged and skipped, and the
engine then serves FP8 KV with its default scale of 1.0: nothing fails, nobody notices. Each rule
below restates one engine's renaming for one attention type, with the file and lines it was read
from (SGLang 0.5.23 and vLLM 0.33.0, the wheels from PyPI), and the parameter the renamed tensor
must land on. quantkit writes the one name all three rules load: the ModelOpt layout
``model.layers.N.self_attn.k_proj.k_scale`` / ``v_proj.v_scale``. Not traced yet: vLLM's GQA models
(Llama loads through ``AutoWeightsLoader`` and the quantization config's ``get_cache_scale_mapper``,
vllm/model_executor/models/utils.py:467, which was not read), so no rule claims anything there.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

SGLANG_VERSION = "0.5.23"
VLLM_VERSION = "0.33.0"


def scale_names(layer: int) -> tuple[str, str]:
    """The k_scale and v_scale names quantkit writes for a decoder layer."""
    return f"model.layers.{layer}.self_attn.k_proj.k_scale", f"model.layers.{layer}.self_attn.v_proj.v_scale"


def _sglang_generic(name: str) -> str:
    # sglang/srt/model_loader/weight_utils.py, maybe_remap_kv_scale_name (lines 1816-1835):
    # ".self_attn.{k,v}_proj.{k,v}_scale" -> ".self_attn.attn.{k,v}_scale", else ".{k,v}_scale" -> ".attn.{k,v}_scale"
    m = re.search(r"\.self_attn\.([kv])_proj\.([kv])_scale$", name)
    if m and m.group(1) == m.group(2):
        return name[: m.start()] + f".self_attn.attn.{m.group(2)}_scale"
    return re.sub(r"\.([kv])_scale$", r".attn.\1_scale", name)


def _sglang_deepseek(name: str) -> str:
    # sglang/srt/models/deepseek_common/deepseek_weight_loader.py, lines 515-523: a scale name that is not a
    # parameter has "k_proj" / "v_proj" replaced by "attn_mqa"; any other name is looked up as it is.
    for scale in ("k_scale", "v_scale"):
        if scale in name:
            return name.replace(f"{scale[0]}_proj", "attn_mqa")
    return name


def _vllm(attn: str) -> Callable[[str], str]:
    # vllm/model_executor/model_loader/weight_utils.py, maybe_remap_kv_scale_name (lines 1764-1795): with an MLA
    # model ("mla_attn" among the parameters) the ModelOpt pattern maps to ".self_attn.mla_attn.mla_attn";
    # the default pattern ".{k,v}_scale" -> ".attn.{k,v}_scale" applies to every other name.
    def remap(name: str) -> str:
        m = re.search(r"\.self_attn\.([kv])_proj\.([kv])_scale$", name)
        if m:
            return name[: m.start()] + f".self_attn.{attn}.{m.group(2)}_scale"
        return re.sub(r"\.([kv])_scale$", r".attn.\1_scale", name)

    return remap


@dataclass(frozen=True)
class KVScaleRule:
    engine: str
    version: str
    attention: str  # gqa | mla
    models: str
    remap: Callable[[str], str]
    parameter: str  # the model's scale parameter, {layer} and {kv} to fill in
    source: str

    def lands(self, name: str) -> str | None:
        """The engine parameter a checkpoint tensor named ``name`` is loaded into, or None when it is skipped."""
        m = re.match(r"^model\.layers\.(\d+)\.", name)
        target = self.remap(name)
        if m is None:
            return None
        expected = {self.parameter.format(layer=m.group(1), kv=kv) for kv in "kv"}
        return target if target in expected else None


RULES = (
    KVScaleRule("sglang", SGLANG_VERSION, "gqa", "Llama, Qwen and other loaders calling maybe_remap_kv_scale_name",
                _sglang_generic, "model.layers.{layer}.self_attn.attn.{kv}_scale",
                "sglang/srt/model_loader/weight_utils.py:1779-1840 (called from sglang/srt/models/llama.py:748)"),
    KVScaleRule("sglang", SGLANG_VERSION, "mla", "DeepSeek-V3, Kimi K2, GLM 5.x (GlmMoeDsaForCausalLM subclasses "
                "DeepseekV2ForCausalLM, sglang/srt/models/glm4_moe.py:1284)",
                _sglang_deepseek, "model.layers.{layer}.self_attn.attn_mqa.{kv}_scale",
                "sglang/srt/models/deepseek_common/deepseek_weight_loader.py:515-533; "
                "attn_mqa is a RadixAttention, sglang/srt/models/deepseek_v2.py:2183"),
    KVScaleRule("vllm", VLLM_VERSION, "mla", "DeepSeek-V3, GLM 5.x (deepseek_v2.py:2009) through deepseek_v2.py:1812",
                _vllm("mla_attn.mla_attn"), "model.layers.{layer}.self_attn.mla_attn.mla_attn.{kv}_scale",
                "vllm/model_executor/model_loader/weight_utils.py:1764-1779; the wrapper's MLAAttention, "
                "vllm/model_executor/layers/mla.py:122"),
)


def rules_for(engine: str, attention: str) -> list[KVScaleRule]:
    return [r for r in RULES if r.engine == engine and r.attention == attention]


def engine_usage(attention: str, sparse: bool = False) -> dict[str, str]:
    """Per engine, what it does with the scales quantkit writes for a model of this attention type
    (``sparse``: a DSA/NSA model, whose sparse-attention backends never read them)."""
    usage = {f"{e} {v}": "not traced in its source: unknown" for e, v in (("sglang", SGLANG_VERSION), ("vllm", VLLM_VERSION))}
    for rule in RULES:
        if rule.attention == attention:
            key = f"{rule.engine} {rule.version}"
            usage[key] = (f"loaded into {rule.parameter.format(layer='N', kv='k|v')} ({rule.source})"
                          if rule.lands(scale_names(0)[0]) else "not loaded: served with scale 1.0")
    if sparse:
        usage["note"] = ("sparse-attention (DSA/NSA) FP8 KV backends compute per-tile scales at run time and "
                         "do not use checkpoint scales")
    return usage


def is_kv_scale(name: str) -> bool:
    return bool(re.match(r"^model\.layers\.\d+\.self_attn\.(?:[kv]_proj\.)?[kv]_scale$", name))
