"""Which quantization scheme each serving engine gives each module of the model it builds, restated from its source.

An engine does not quantize the checkpoint's modules: it builds its own model class, whose Linears are often fused
(SGLang's Llama has one ``qkv_proj`` and one ``gate_up_proj`` per layer, its DeepSeek family a
``fused_qkv_a_proj_with_mqa``), and asks the compressed-tensors config, module by module under the engine's names,
whether the module is ignored and which target it matches. A fused name is unfused back into the checkpoint's names
only where the model class lists it in ``packed_modules_mapping``. SGLang refuses to build the model when a Linear
matches neither ``ignore`` nor a target; vLLM leaves it unquantized (and then finds no parameter for the packed
weights). ``engine_modules`` derives the engine's modules from the loader rules of engines/loaders.py,
``select_group`` restates each engine's matching, and tests/test_engine_schemes.py holds both equal to the
engines' own functions, run from their wheels on every module of every built-in recipe's output.

Read in SGLang 0.5.23 (sglang/srt/layers/quantization/compressed_tensors/compressed_tensors.py:182-255, 864-894,
1145-1182; compressed_tensors/utils.py:24-215; model_loader/loader.py:174-180) and vLLM 0.33.0
(vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py:159-219, 998-1031;
compressed_tensors/utils.py:60-175; compressed_tensors_moe/compressed_tensors_moe.py:28-57;
vllm/model_executor/layers/quantization/utils/config_utils.py:384-452).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from quantkit.checkpoint.config import ModelConfig
from quantkit.checkpoint.names import EXPERT
from quantkit.engines.kernels import ROW_PARALLEL
from quantkit.engines.loaders import LoaderRules
from quantkit.engines.versions import SGLANG_VERSION, VLLM_VERSION

# Engine modules built without the quantization config, which never ask it: the DSA indexer's fused wk and
# weights_proj, always bf16 (SGLang 0.5.23 sglang/srt/layers/attention/dsa/dsa_indexer.py:352-359; vLLM 0.33.0
# vllm/model_executor/models/deepseek_v2.py:709-718, quant_config=None).
_UNQUANTIZED_BY_CLASS = (".indexer.wk_weights_proj",)


@dataclass(frozen=True)
class EngineModule:
    """A module of the engine's model class that asks the quantization config for its scheme."""

    name: str
    kind: str  # "linear" | "moe"
    members: tuple[str, ...]  # the checkpoint modules whose weights it loads
    class_name: str  # the engine's module class, which targets such as "Linear" are matched against


def engine_modules(linears: Iterable[str], config: ModelConfig, rules: LoaderRules) -> list[EngineModule]:
    """The engine's Linear and MoE modules that load the checkpoint's Linear modules ``linears``, each with its
    members; a Linear the loader places nowhere (the MTP layer, left to the draft model) asks nothing."""
    fused: dict[str, list[str]] = {}
    experts: dict[str, list[str]] = {}
    for module in linears:
        moe = EXPERT.match(module)
        if moe:
            experts.setdefault(moe["prefix"], []).append(module)
            continue
        rule, parameter = rules.place(f"{module}.weight", config)
        if rule is None or parameter is None:
            continue
        fused.setdefault(parameter.rpartition(".")[0], []).append(module)
    out = [EngineModule(name, "linear", tuple(members), _linear_class(name, members))
           for name, members in fused.items() if not name.endswith(_UNQUANTIZED_BY_CLASS)]
    return out + [EngineModule(name, "moe", tuple(members), "FusedMoE") for name, members in experts.items()]


def _linear_class(name: str, members: list[str]) -> str:
    if name.endswith(".qkv_proj"):
        return "QKVParallelLinear"
    if len(members) > 1:
        return "MergedColumnParallelLinear"
    return "RowParallelLinear" if ROW_PARALLEL.search(name) else "ColumnParallelLinear"


class SchemeError(ValueError):
    """The engine refuses to build the module (its message, restated)."""


@dataclass(frozen=True)
class SchemeMatching:
    engine: str
    version: str
    model_types: tuple[str, ...]
    packed_modules: Callable[[ModelConfig], dict[str, list[str]]]  # the model class's packed_modules_mapping
    source: str

    def select(self, module: EngineModule, config: ModelConfig) -> str | None:
        """The target of config.json's quantization_config that gives ``module`` its scheme, or None for
        unquantized; raises SchemeError where the engine refuses to build the module."""
        return select_target(self.engine, module, config.quantization.raw, self.packed_modules(config))


def select_target(engine: str, module: EngineModule, quantization_config: dict,
                  fused: Mapping[str, list[str]]) -> str | None:
    ignore = list(quantization_config.get("ignore") or [])
    targets = [t for group in (quantization_config.get("config_groups") or {}).values()
               for t in (group.get("targets") or [])]
    if "Linear" in targets and "FusedMoE" not in targets:
        targets.append("FusedMoE")  # _add_fused_moe_to_target_scheme_map
    if module.kind == "moe":
        chosen = [_scheme_target(engine, f"{module.name}.0.{p}", "FusedMoE", ignore, targets, fused)
                  for p in ("gate_proj", "up_proj", "down_proj")]
        schemes = {group_of(quantization_config, t) for t in chosen}
        if len(schemes) > 1:
            raise SchemeError("All MoE projections need to have same quantization scheme but found multiple")
        return chosen[0]
    return _scheme_target(engine, module.name, module.class_name, ignore, targets, fused)


def _scheme_target(engine, name, class_name, ignore, targets, fused) -> str | None:
    ignored = _sglang_ignored(name, ignore, fused) if engine == "sglang" else _vllm_ignored(name, ignore, fused)
    if ignored or not targets:
        return None
    if engine == "sglang":
        found = (_first(name, targets) or _first(class_name, targets, contains=True)
                 or _fused_match(name, targets, fused))
        if found is None:
            raise SchemeError(f"Unable to find matching target for {name} in the compressed-tensors config.")
        return found
    return _first(name, targets) or _fused_match(name, targets, fused) or _first(class_name, targets, contains=True)


def _matches(value: str, target: str, contains: bool = False) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], value) is not None
    return target.lower() in value.lower() if contains else target == value


def _first(value: str, targets: list[str], contains: bool = False) -> str | None:
    return next((t for t in targets if _matches(value, t, contains)), None)


def _fused_match(name: str, targets: list[str], fused: Mapping[str, list[str]]) -> str | None:
    key = next((k for k in fused if name.endswith(k)), None)
    if key is None:
        return None
    found = [_first(name.replace(key, part), targets) for part in fused[key]]
    return found[0] if all(found) else None


def _sglang_suffix_match(name: str, ignore: list[str]) -> bool:
    # check_equal_or_regex_match: a plain entry also matches a dotted suffix of the name
    return any(_matches(name, t) if t.startswith("re:") else (t == name or name.endswith("." + t)) for t in ignore)


def _sglang_ignored(name: str, ignore: list[str], fused: Mapping[str, list[str]]) -> bool:
    proj = name.split(".")[-1]
    if proj in fused and name not in ignore:
        shards = {_sglang_suffix_match(name.replace(proj, part), ignore) for part in fused[proj]}
        if len(shards) > 1:
            raise SchemeError(f"Found different quantization schemes for {fused[proj]} in {name}. SGLang requires "
                              "all to use the same scheme.")
        return shards.pop()
    return _sglang_suffix_match(name, ignore)


def _vllm_ignored(name: str, ignore: list[str], fused: Mapping[str, list[str]]) -> bool:
    if any(_matches(name, t) for t in ignore):
        return True
    proj = name.split(".")[-1]
    if proj not in fused:
        return False
    shards = {any(_matches(name.replace(proj, part), t) for t in ignore) for part in fused[proj]}
    if len(shards) > 1:
        raise SchemeError(f"Found different quantization schemes for the shards of {name}. vLLM requires all to "
                          "use the same scheme.")
    return shards.pop()


def group_of(quantization_config: dict, target: str | None) -> str | None:
    """The config group a target belongs to (the engines key their scheme map by target: the last group wins)."""
    group = None
    for name, scheme in (quantization_config.get("config_groups") or {}).items():
        if target in (scheme.get("targets") or []) or (target == "FusedMoE" and "Linear" in (scheme.get("targets")
                                                                                          or [])):
            group = name
    return group


def _no_mapping(config: ModelConfig) -> dict[str, list[str]]:
    return {}


def _sglang_deepseek(config: ModelConfig) -> dict[str, list[str]]:
    # sglang/srt/models/deepseek_v2.py:3250-3275: only the fused q_a/kv_a projection, and only with q_lora_rank
    return {"fused_qkv_a_proj_with_mqa": ["q_a_proj", "kv_a_proj_with_mqa"]} if config.q_lora_rank else {}


def _vllm_llama(config: ModelConfig) -> dict[str, list[str]]:
    # vllm/model_executor/models/llama.py:475-478
    return {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def _vllm_deepseek(config: ModelConfig) -> dict[str, list[str]]:
    # vllm/model_executor/models/deepseek_v2.py:1880-1912
    mapping = {"gate_up_proj": ["gate_proj", "up_proj"]}
    if config.q_lora_rank is not None:
        mapping["fused_qkv_a_proj"] = ["q_a_proj", "kv_a_proj_with_mqa"]
    return mapping


MATCHING = (
    SchemeMatching("sglang", SGLANG_VERSION, ("llama",), _no_mapping,
                   "sglang/srt/models/llama.py:535 (LlamaForCausalLM declares no packed_modules_mapping)"),
    SchemeMatching("sglang", SGLANG_VERSION, ("deepseek_v3", "kimi_k2", "glm_moe_dsa"), _sglang_deepseek,
                   "sglang/srt/models/deepseek_v2.py:3250-3275"),
    SchemeMatching("vllm", VLLM_VERSION, ("llama",), _vllm_llama, "vllm/model_executor/models/llama.py:475-478"),
    SchemeMatching("vllm", VLLM_VERSION, ("deepseek_v3", "kimi_k2", "glm_moe_dsa"), _vllm_deepseek,
                   "vllm/model_executor/models/deepseek_v2.py:1880-1912"),
)


def scheme_matching(engine: str, model_type: str | None) -> SchemeMatching | None:
    return next((m for m in MATCHING if m.engine == engine and model_type in m.model_types), None)
