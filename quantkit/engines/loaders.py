"""Where each serving engine's loader puts every tensor of a checkpoint, read in its own source.

An engine loads a checkpoint by renaming each tensor onto a parameter of its model class: it fuses
``q_a_proj`` and ``kv_a_proj_with_mqa``, ``gate_proj`` and ``up_proj``, every expert of a layer into one
3-D parameter, the DSA indexer's ``wk`` and ``weights_proj``, and it leaves the MTP layer to a separate
draft model. A tensor whose renamed form is not a parameter is skipped - after a log line, silently, or
with an exception, depending on the engine and the branch. The rules below restate each loader, per
engine and model class, with the file and lines read (SGLang 0.5.23 and vLLM 0.33.0, the wheels PyPI
serves); ``verify --engine`` runs them over the whole index, and every tensor no rule places is a
finding that names it. ``tests/test_engine_names.py`` holds one case per rule and runs the engines' own
mapping code, taken from those wheels, over the same names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from quantkit.checkpoint.config import ModelConfig
from quantkit.checkpoint.names import EXPERT
from quantkit.engines.versions import SGLANG_VERSION, VLLM_VERSION

# The suffixes a Linear's parameters carry across the formats quantkit reads and writes: unquantized,
# block-FP8 (weight_scale_inv, or weight_scale in compressed-tensors), pack-quantized INT4 (with weight_zero_point
# when asymmetric).
_LINEAR = r"(?P<p>weight|weight_scale_inv|weight_scale|weight_packed|weight_shape|weight_zero_point|bias)"
_L = r"model\.layers\.(?P<layer>\d+)"
_E = r"(?P<expert>\d+)"


@dataclass(frozen=True)
class Condition:
    """When a rule applies, from the model's config.json and the layer the name belongs to."""

    q_lora: bool | None = None  # MLA with a q_a/q_b low-rank query (q_lora_rank set) or a plain q_proj
    moe: bool | None = None  # the layer's MLP is a routed MoE (layer >= first_k_dense_replace)
    indexer: bool = False  # the model has a DSA indexer
    kv_scheme: bool = False  # config declares a static FP8 kv_cache_scheme (the engine then creates k/v_scale)
    mtp: bool = False  # the layer is an MTP/NextN layer (index >= num_hidden_layers)
    tied: bool | None = None  # config ties lm_head to embed_tokens

    def holds(self, config: ModelConfig, match: re.Match) -> bool:
        groups = match.groupdict()
        layer = int(groups["layer"]) if groups.get("layer") is not None else None
        if (layer is not None and layer >= config.layers) != self.mtp:
            return False
        if self.q_lora is not None and (config.q_lora_rank is not None) != self.q_lora:
            return False
        if self.moe is not None and layer is not None and _is_moe_layer(config, layer) != self.moe:
            return False
        if groups.get("expert") is not None and int(groups["expert"]) >= (config.n_routed_experts or 0):
            return False
        if self.tied is not None and config.tie_word_embeddings != self.tied:
            return False
        if self.indexer and not config.index_topk:
            return False
        return not (self.kv_scheme and not _declares_static_fp8_kv(config))


def _is_moe_layer(config: ModelConfig, layer: int) -> bool:
    if not config.n_routed_experts:
        return False
    types = config.mlp_layer_types
    if types is not None and layer < len(types):
        return types[layer] == "sparse"
    return layer >= (config.first_k_dense_replace or 0)


def _declares_static_fp8_kv(config: ModelConfig) -> bool:
    # sglang/srt/layers/quantization/compressed_tensors/compressed_tensors.py:212-225 and :1276-1285: the
    # k/v_scale parameters exist only for a static, symmetric, per-tensor 8-bit float kv_cache_scheme.
    scheme = config.quantization.kv_cache_scheme
    return (scheme.get("type") == "float" and scheme.get("num_bits") == 8 and scheme.get("strategy") == "tensor"
            and scheme.get("symmetric", True) and not scheme.get("dynamic", False))


@dataclass(frozen=True)
class NameRule:
    """A checkpoint name pattern and the engine parameter it is loaded into (``None``: the loader drops it
    on purpose, ``note`` says why and who loads it instead; ``skipped``: the loader means to load it but
    ends up with no parameter, ``note`` says how)."""

    pattern: str
    parameter: str | None
    source: str
    when: Condition = Condition()
    note: str = ""
    skipped: bool = False

    def place(self, name: str, config: ModelConfig) -> tuple[bool, str | None]:
        m = re.fullmatch(self.pattern, name)
        if m is None or not self.when.holds(config, m):
            return False, None
        return True, (m.expand(self.parameter) if self.parameter is not None else None)


@dataclass(frozen=True)
class LoaderRules:
    engine: str
    version: str
    model_class: str
    model_types: tuple[str, ...]  # config.json model_type values this loader serves
    on_unknown: str  # what the engine does with a tensor no rule places (follows the engine's name)
    rules: tuple[NameRule, ...]
    renames: tuple[tuple[str, str, str], ...] = ()  # (pattern, replacement, source) applied to every name first

    def place(self, name: str, config: ModelConfig) -> tuple[NameRule | None, str | None]:
        """The first rule that takes ``name`` and the parameter it lands on, or (None, None) when the engine
        has no parameter for it."""
        for pattern, replacement, _ in self.renames:
            name = re.sub(pattern, replacement, name)
        for rule in self.rules:
            taken, parameter = rule.place(name, config)
            if taken:
                return rule, parameter
        return None, None


_SG_DS = "sglang/srt/models/deepseek_common/deepseek_weight_loader.py"
_VL_DS = "vllm/model_executor/models/deepseek_v2.py"
_MTP_NOTE = "the MTP/NextN layer is loaded by the engine's draft model when speculative decoding is on"

_SGLANG_DEEPSEEK = LoaderRules(
    "sglang", SGLANG_VERSION, "DeepseekV2ForCausalLM (DeepSeek-V3, Kimi K2; GlmMoeDsaForCausalLM subclasses it, "
    "sglang/srt/models/glm4_moe.py:1284)", ("deepseek_v3", "kimi_k2", "glm_moe_dsa"),
    f"logged as 'not found in params_dict' and skipped ({_SG_DS}:528-533); an expert tensor without a "
    f"parameter is skipped without a word ({_SG_DS}:408-409)",
    (
        NameRule(rf"{_L}\..+", None, f"{_SG_DS}:336-346", Condition(mtp=True), _MTP_NOTE),
        NameRule(r"(model\.embed_tokens|model\.norm|lm_head)\.weight", r"\g<0>", f"{_SG_DS}:528-545"),
        NameRule(rf"{_L}\.(input_layernorm|post_attention_layernorm)\.weight", r"\g<0>", f"{_SG_DS}:528-545"),
        NameRule(rf"{_L}\.self_attn\.rotary_emb\.inv_freq", None, f"{_SG_DS}:351-352", note="computed, not loaded"),
        NameRule(rf"{_L}\.self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.{_LINEAR}",
                 r"model.layers.\g<layer>.self_attn.fused_qkv_a_proj_with_mqa.\g<p>", f"{_SG_DS}:280-283, 438-505",
                 Condition(q_lora=True)),
        NameRule(rf"{_L}\.self_attn\.q_proj\.{_LINEAR}", r"\g<0>", f"{_SG_DS}:528-545", Condition(q_lora=False)),
        NameRule(rf"{_L}\.self_attn\.(q_b_proj|kv_b_proj|o_proj)\.{_LINEAR}", r"\g<0>", f"{_SG_DS}:528-545"),
        NameRule(rf"{_L}\.self_attn\.(q_a_layernorm|kv_a_layernorm)\.weight", r"\g<0>", f"{_SG_DS}:528-545"),
        NameRule(rf"{_L}\.self_attn\.(?P<kv>[kv])_proj\.(?P=kv)_scale",
                 r"model.layers.\g<layer>.self_attn.attn_mqa.\g<kv>_scale",
                 f"{_SG_DS}:515-523; attn_mqa is a RadixAttention (sglang/srt/models/deepseek_v2.py:2183) whose "
                 "k/v_scale exist only with a static FP8 kv_cache_scheme "
                 "(sglang/srt/layers/quantization/compressed_tensors/compressed_tensors.py:212-225)",
                 Condition(kv_scheme=True)),
        # The indexer's wk and weights_proj fill the two row blocks of one bf16 parameter; a block-FP8 tensor is
        # dequantized first, an INT4 one has no path in (it would be copied in as raw int32 words).
        NameRule(rf"{_L}\.self_attn\.indexer\.(wk|weights_proj)\.(?P<p>weight|weight_scale_inv|weight_scale)",
                 r"model.layers.\g<layer>.self_attn.indexer.wk_weights_proj.weight", f"{_SG_DS}:115-177, 361-370",
                 Condition(indexer=True)),
        NameRule(rf"{_L}\.self_attn\.indexer\.wq_b\.{_LINEAR}", r"\g<0>", f"{_SG_DS}:528-545", Condition(indexer=True)),
        NameRule(rf"{_L}\.self_attn\.indexer\.k_norm\.(weight|bias)", r"\g<0>", f"{_SG_DS}:528-545",
                 Condition(indexer=True)),
        NameRule(rf"{_L}\.mlp\.experts\.{_E}\.(gate_proj|up_proj)\.{_LINEAR}",
                 r"model.layers.\g<layer>.mlp.experts.w13_\g<p>",
                 f"{_SG_DS}:265-270, 401-425; sglang/srt/layers/moe/fused_moe_triton/layer.py:1797-1822",
                 Condition(moe=True)),
        NameRule(rf"{_L}\.mlp\.experts\.{_E}\.down_proj\.{_LINEAR}", r"model.layers.\g<layer>.mlp.experts.w2_\g<p>",
                 f"{_SG_DS}:265-270, 401-425; sglang/srt/layers/moe/fused_moe_triton/layer.py:1797-1822",
                 Condition(moe=True)),
        NameRule(rf"{_L}\.mlp\.gate\.(weight|e_score_correction_bias)", r"\g<0>", f"{_SG_DS}:528-545",
                 Condition(moe=True)),
        NameRule(rf"{_L}\.mlp\.shared_experts\.(gate_proj|up_proj)\.{_LINEAR}",
                 r"model.layers.\g<layer>.mlp.shared_experts.gate_up_proj.\g<p>", f"{_SG_DS}:257-261, 372-399",
                 Condition(moe=True)),
        NameRule(rf"{_L}\.mlp\.shared_experts\.down_proj\.{_LINEAR}", r"\g<0>", f"{_SG_DS}:528-545",
                 Condition(moe=True)),
        NameRule(rf"{_L}\.mlp\.(gate_proj|up_proj)\.{_LINEAR}", r"model.layers.\g<layer>.mlp.gate_up_proj.\g<p>",
                 f"{_SG_DS}:257-261, 372-399", Condition(moe=False)),
        NameRule(rf"{_L}\.mlp\.down_proj\.{_LINEAR}", r"\g<0>", f"{_SG_DS}:528-545", Condition(moe=False)),
    ),
)

_VLLM_DEEPSEEK = LoaderRules(
    "vllm", VLLM_VERSION, "DeepseekV2ForCausalLM (DeepseekV3ForCausalLM and GlmMoeDsaForCausalLM subclass it, "
    f"{_VL_DS}:2005-2010; its AutoWeightsLoader, 1996-1998, renames and hands model.* to DeepseekV2Model.load_weights, "
    "1594-1828)", ("deepseek_v3", "kimi_k2", "glm_moe_dsa"),
    f"raises KeyError at load (params_dict[name], {_VL_DS}:1708, 1820); a KV scale without a parameter is "
    "skipped with a warning (vllm/model_executor/model_loader/weight_utils.py:1722-1795)",
    (
        NameRule(rf"{_L}\..+", None, f"{_VL_DS}:1653-1655; vllm/model_executor/models/utils.py:575-597",
                 Condition(mtp=True), _MTP_NOTE),
        NameRule(r"(model\.embed_tokens|model\.norm|lm_head)\.weight", r"\g<0>", f"{_VL_DS}:1800-1826"),
        NameRule(rf"{_L}\.(input_layernorm|post_attention_layernorm)\.weight", r"\g<0>", f"{_VL_DS}:1800-1826"),
        NameRule(rf"{_L}\.self_attn\.rotary_emb\.inv_freq", None, f"{_VL_DS}:1650-1651", note="computed, not loaded"),
        NameRule(rf"{_L}\.self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.{_LINEAR}",
                 r"model.layers.\g<layer>.self_attn.fused_qkv_a_proj.\g<p>", f"{_VL_DS}:1600-1603, 1676-1711",
                 Condition(q_lora=True)),
        NameRule(rf"{_L}\.self_attn\.q_proj\.{_LINEAR}", r"\g<0>", f"{_VL_DS}:1800-1826", Condition(q_lora=False)),
        NameRule(rf"{_L}\.self_attn\.(q_b_proj|kv_b_proj|o_proj)\.{_LINEAR}", r"\g<0>", f"{_VL_DS}:1800-1826"),
        NameRule(rf"{_L}\.self_attn\.(q_a_layernorm|kv_a_layernorm)\.weight", r"\g<0>", f"{_VL_DS}:1800-1826"),
        # The scale parameter is self_attn.mla_attn.mla_attn.{k,v}_scale (deepseek_v2.py:1215, layers/mla.py:122),
        # and no checkpoint name reaches it: AutoWeightsLoader first applies the quantization config's cache-scale
        # mapper, which turns every *.{k,v}_scale name into *.attn.{k,v}_scale, and then the model's own
        # maybe_remap_kv_scale_name finds no such parameter and appends another ".attn".
        NameRule(rf"{_L}\.self_attn\.(.+\.)?(?P<kv>[kv])_scale", None,
                 f"vllm/model_executor/models/utils.py:463-475; vllm/model_executor/layers/quantization/base_config.py:"
                 f"219-251; {_VL_DS}:1810-1816; vllm/model_executor/model_loader/weight_utils.py:1741-1830",
                 Condition(kv_scheme=True), skipped=True,
                 note="vLLM renames it twice - the quantization config's cache-scale mapper makes it "
                      "self_attn.attn.{k,v}_scale, then maybe_remap_kv_scale_name appends another .attn - and the "
                      "result is not a parameter: logged 'is not loaded' and FP8 KV is served with scale 1.0 (no "
                      "checkpoint name loads an MLA scale in this version)"),
        # A block-FP8 wk (weight + scale) is dequantized into the fused bf16 weight; otherwise wk and weights_proj
        # are the two shards of one merged linear.
        NameRule(rf"{_L}\.self_attn\.indexer\.wk\.(weight|weight_scale_inv|weight_scale)",
                 r"model.layers.\g<layer>.self_attn.indexer.wk_weights_proj.weight", f"{_VL_DS}:857-913, 1666-1675",
                 Condition(indexer=True)),
        NameRule(rf"{_L}\.self_attn\.indexer\.(wk|weights_proj)\.{_LINEAR}",
                 r"model.layers.\g<layer>.self_attn.indexer.wk_weights_proj.\g<p>", f"{_VL_DS}:1614-1618, 1676-1711",
                 Condition(indexer=True)),
        NameRule(rf"{_L}\.self_attn\.indexer\.wq_b\.{_LINEAR}", r"\g<0>", f"{_VL_DS}:1800-1826",
                 Condition(indexer=True)),
        NameRule(rf"{_L}\.self_attn\.indexer\.k_norm\.(weight|bias)", r"\g<0>", f"{_VL_DS}:1800-1826",
                 Condition(indexer=True)),
        NameRule(rf"{_L}\.mlp\.experts\.{_E}\.(gate_proj|up_proj)\.{_LINEAR}",
                 r"model.layers.\g<layer>.mlp.experts.routed_experts.w13_\g<p>",
                 f"{_VL_DS}:1627-1638, 1763-1799; vllm/model_executor/layers/fused_moe/routed_experts.py:1219-1225",
                 Condition(moe=True)),
        NameRule(rf"{_L}\.mlp\.experts\.{_E}\.down_proj\.{_LINEAR}",
                 r"model.layers.\g<layer>.mlp.experts.routed_experts.w2_\g<p>",
                 f"{_VL_DS}:1627-1638, 1763-1799; vllm/model_executor/layers/fused_moe/routed_experts.py:1219-1225",
                 Condition(moe=True)),
        NameRule(rf"{_L}\.mlp\.gate\.(weight|e_score_correction_bias)", r"\g<0>", f"{_VL_DS}:1800-1826",
                 Condition(moe=True)),
        NameRule(rf"{_L}\.mlp\.shared_experts\.(gate_proj|up_proj)\.{_LINEAR}",
                 r"model.layers.\g<layer>.mlp.shared_experts.gate_up_proj.\g<p>", f"{_VL_DS}:1595-1598, 1676-1711",
                 Condition(moe=True)),
        NameRule(rf"{_L}\.mlp\.shared_experts\.down_proj\.{_LINEAR}", r"\g<0>", f"{_VL_DS}:1800-1826",
                 Condition(moe=True)),
        NameRule(rf"{_L}\.mlp\.(gate_proj|up_proj)\.{_LINEAR}", r"model.layers.\g<layer>.mlp.gate_up_proj.\g<p>",
                 f"{_VL_DS}:1595-1598, 1676-1711", Condition(moe=False)),
        NameRule(rf"{_L}\.mlp\.down_proj\.{_LINEAR}", r"\g<0>", f"{_VL_DS}:1800-1826", Condition(moe=False)),
    ),
)

_SG_LL = "sglang/srt/models/llama.py"
_VL_LL = "vllm/model_executor/models/llama.py"
# ModelOpt's self_attn.{k,v}_proj.{k,v}_scale and the older self_attn.{k,v}_scale both land on attn.{k,v}_scale.
_LLAMA_SCALE = rf"{_L}\.self_attn\.(?:(?P<kv>[kv])_proj\.(?P=kv)|(?P<bare>[kv]))_scale"

_SGLANG_LLAMA = LoaderRules(
    "sglang", SGLANG_VERSION, "LlamaForCausalLM (legacy loader, the default: SGLANG_ENABLE_WEIGHT_LOADER_V2 is off, "
    "sglang/srt/environ.py:315)", ("llama",),
    f"logged as 'Parameter ... not found in params_dict' ({_SG_LL}:773-780); a q/k/v or gate/up tensor without a "
    f"parameter is skipped without a word ({_SG_LL}:759-760)",
    (
        NameRule(r"lm_head\.weight", None, f"{_SG_LL}:744-745", Condition(tied=True),
                 note="tied to embed_tokens (tie_word_embeddings)"),
        NameRule(r"(model\.embed_tokens|model\.norm|lm_head)\.weight", r"\g<0>", f"{_SG_LL}:764-778"),
        NameRule(rf"{_L}\.(input_layernorm|post_attention_layernorm)\.weight", r"\g<0>", f"{_SG_LL}:764-778"),
        NameRule(rf"{_L}\.self_attn\.rotary_emb\.inv_freq", None, f"{_SG_LL}:735-736", note="computed, not loaded"),
        NameRule(rf"{_L}\.self_attn\.(q_proj|k_proj|v_proj)\.{_LINEAR}",
                 r"model.layers.\g<layer>.self_attn.qkv_proj.\g<p>",
                 f"{_SG_LL}:709-714, 751-763"),
        NameRule(rf"{_L}\.self_attn\.o_proj\.{_LINEAR}", r"\g<0>", f"{_SG_LL}:764-778"),
        NameRule(_LLAMA_SCALE, r"model.layers.\g<layer>.self_attn.attn.\g<kv>\g<bare>_scale",
                 "sglang/srt/model_loader/weight_utils.py:1779-1840 (called from sglang/srt/models/llama.py:746-750)",
                 Condition(kv_scheme=True)),
        NameRule(rf"{_L}\.mlp\.(gate_proj|up_proj)\.{_LINEAR}", r"model.layers.\g<layer>.mlp.gate_up_proj.\g<p>",
                 f"{_SG_LL}:709-714, 751-763"),
        NameRule(rf"{_L}\.mlp\.down_proj\.{_LINEAR}", r"\g<0>", f"{_SG_LL}:764-778"),
    ),
    renames=((r"\.weight_scale_inv$", ".weight_scale", f"{_SG_LL}:723-724"),
             (r"\.activation_scale$", ".input_scale", f"{_SG_LL}:721-722")),
)

_VLLM_LLAMA = LoaderRules(
    "vllm", VLLM_VERSION, "LlamaForCausalLM (AutoWeightsLoader)", ("llama",),
    "raises ValueError 'There is no module or parameter named ...' (vllm/model_executor/models/utils.py:430-448)",
    (
        NameRule(r"(model\.embed_tokens|model\.norm|lm_head)\.weight", r"\g<0>",
                 "vllm/model_executor/models/utils.py:450-475"),
        NameRule(rf"{_L}\.(input_layernorm|post_attention_layernorm)\.weight", r"\g<0>",
                 "vllm/model_executor/models/utils.py:450-475"),
        NameRule(rf"{_L}\.self_attn\.rotary_emb\.inv_freq", None, "vllm/model_executor/models/utils.py:471",
                 note="computed, not loaded"),
        NameRule(rf"{_L}\.self_attn\.(q_proj|k_proj|v_proj)\.{_LINEAR}",
                 r"model.layers.\g<layer>.self_attn.qkv_proj.\g<p>",
                 f"{_VL_LL}:348-357"),
        NameRule(rf"{_L}\.self_attn\.o_proj\.{_LINEAR}", r"\g<0>", "vllm/model_executor/models/utils.py:450-475"),
        NameRule(_LLAMA_SCALE, r"model.layers.\g<layer>.self_attn.attn.\g<kv>\g<bare>_scale",
                 "vllm/model_executor/layers/quantization/base_config.py:219-251 (the quantization config's "
                 "cache-scale mapper, applied by AutoWeightsLoader, vllm/model_executor/models/utils.py:465-468); "
                 "the parameter is created for every Attention by compressed-tensors' KV method "
                 "(vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py:213-214)",
                 Condition(kv_scheme=True)),
        NameRule(rf"{_L}\.mlp\.(gate_proj|up_proj)\.{_LINEAR}", r"model.layers.\g<layer>.mlp.gate_up_proj.\g<p>",
                 f"{_VL_LL}:348-357"),
        NameRule(rf"{_L}\.mlp\.down_proj\.{_LINEAR}", r"\g<0>", "vllm/model_executor/models/utils.py:450-475"),
    ),
)

LOADERS = (_SGLANG_DEEPSEEK, _VLLM_DEEPSEEK, _SGLANG_LLAMA, _VLLM_LLAMA)


def loader_rules(engine: str, model_type: str | None) -> LoaderRules | None:
    """The traced loader of ``engine`` for a config.json ``model_type``, or None when it was not read."""
    return next((r for r in LOADERS if r.engine == engine and model_type in r.model_types), None)


@dataclass(frozen=True)
class Unplaced:
    name: str
    reason: str


def unplaced_tensors(names: list[str], config: ModelConfig, rules: LoaderRules) -> list[Unplaced]:
    """The tensors of a checkpoint that the engine's loader puts on no parameter of its model."""
    out = []
    for name in names:
        rule, _ = rules.place(name, config)
        if rule is None:
            out.append(Unplaced(name, f"{_why_unplaced(name, config)}; {rules.engine} {rules.on_unknown}"))
        elif rule.skipped:
            out.append(Unplaced(name, rule.note))
    return out


def _why_unplaced(name: str, config: ModelConfig) -> str:
    if name.endswith((".k_scale", ".v_scale")):
        if not _declares_static_fp8_kv(config):
            return "config.json declares no static FP8 kv_cache_scheme, so the engine creates no k/v_scale parameter"
        return "not a name the engine renames onto its attention's k/v_scale"
    if ".indexer." in name and re.search(r"\.(wk|weights_proj)\.weight_(packed|shape)$", name):
        return "the indexer's wk/weights_proj are fused into one bf16 parameter that takes bf16 or block-FP8 only"
    m = EXPERT.match(name.rpartition(".")[0])
    if m and int(m["index"]) >= (config.n_routed_experts or 0):
        return f"expert {m['index']} is outside n_routed_experts={config.n_routed_experts}"
    return "the engine's model class has no parameter for this name"
