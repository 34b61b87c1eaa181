"""The scheme each engine gives each module of the model class it builds, from the config convert writes.

SGLang 0.5.17 on an H200 refused quantkit's MLP-only INT4 SmolLM2 ("Unable to find matching target for
model.layers.0.self_attn.qkv_proj"): it matches its own fused module names against ``targets`` and ``ignore``. Here
the engines' own matching code, compiled from the pinned wheels (SGLang 0.5.23, vLLM 0.33.0), is run on every
Linear and MoE module of every built-in recipe's output, and quantkit's restatement (engines/schemes.py, which
``verify --engine`` runs) must agree with it module by module.
"""

from __future__ import annotations

import json
import types
import typing
from fnmatch import fnmatch

import pytest
from engine_source import engine_definition, engine_module, engine_wheel

from quantkit.checkpoint.reader import open_checkpoint
from quantkit.convert import convert, output_quantization_config
from quantkit.convert.dst import linear_groups
from quantkit.convert.tensor_plan import plan_conversion
from quantkit.engines.loaders import loader_rules
from quantkit.engines.schemes import SchemeError, engine_modules, group_of, scheme_matching
from quantkit.engines.versions import SGLANG_VERSION, VLLM_VERSION
from quantkit.formats.recipe import load_recipe
from quantkit.packaged import recipes_dir
from quantkit.verify import verify

CT = "layers/quantization/compressed_tensors/"
FAMILY = {"glm5": "glm_moe_dsa", "deepseek-v3": "deepseek_v3", "dense": "llama"}
RECIPES = sorted(p.stem for p in recipes_dir().glob("*.yaml"))


@pytest.fixture(scope="module")
def get_scheme_dict():
    """Each engine's own CompressedTensorsConfig.get_scheme_dict, with its own should_ignore_layer and
    find_matched_target (and, for vLLM, the config_utils matchers they call)."""
    sglang = engine_wheel("sglang", SGLANG_VERSION)
    vllm = engine_wheel("vllm", VLLM_VERSION)
    sg = engine_module(sglang, f"sglang/srt/{CT}utils.py", {})
    cu = "vllm/model_executor/layers/quantization/utils/config_utils.py"
    equal = engine_definition(vllm, cu, "is_equal_or_regex_match", {"fnmatch": fnmatch, "re": __import__("re")})
    patterns = engine_definition(vllm, cu, "find_matching_patterns",
                                 {"is_equal_or_regex_match": equal, "MappingProxyType": types.MappingProxyType,
                                  "Iterable": typing.Iterable, "Mapping": typing.Mapping})
    vl = engine_module(vllm, f"vllm/model_executor/{CT}utils.py",
                       {"find_matching_patterns": patterns, "is_equal_or_regex_match": equal})
    method = "CompressedTensorsConfig.get_scheme_dict"
    return {
        "sglang": engine_definition(sglang, f"sglang/srt/{CT}compressed_tensors.py", method,
                                    {k: sg[k] for k in ("should_ignore_layer", "find_matched_target")}),
        "vllm": engine_definition(vllm, f"vllm/model_executor/{CT}compressed_tensors.py", method,
                                  {k: vl[k] for k in ("should_ignore_layer", "find_matched_target")}),
    }


def engines_choice(get_scheme_dict, engine, module, qc, fused) -> str | None:
    """The group the engine's own code gives ``module`` ("refused" where it raises), as get_quant_method asks it:
    a Linear by its name, a MoE layer by its first expert's three projections (SGLang compressed_tensors.py:880-894,
    vLLM compressed_tensors_moe.py:35-57), after _add_fused_moe_to_target_scheme_map."""
    targets = {t: {"group": g} for g, s in qc["config_groups"].items() for t in s["targets"]}
    if "Linear" in targets:
        targets.setdefault("FusedMoE", targets["Linear"])
    config = types.SimpleNamespace(ignore=qc.get("ignore") or [], packed_modules_mapping=fused,
                                   target_scheme_map=targets, quant_format=qc.get("format"))
    layer = type(module.class_name, (), {})()
    names = [f"{module.name}.0.{p}" for p in ("gate_proj", "up_proj", "down_proj")] if module.kind == "moe" \
        else [module.name]
    try:
        chosen = [get_scheme_dict[engine](config, layer, name) for name in names]
    except ValueError:
        return "refused"
    if any(c != chosen[0] for c in chosen):
        return "refused"
    return None if chosen[0] is None else chosen[0]["group"]


def quantkits_choice(matching, module, config) -> str | None:
    try:
        return group_of(config.quantization_config, matching.select(module, config))
    except SchemeError:
        return "refused"


def written(synthetic, smollm2_config, recipe, source="synthetic"):
    """config.json as convert writes it for ``recipe``, and the output's Linears with the group of each."""
    family = next(f for prefix, f in FAMILY.items() if recipe.startswith(prefix))
    path = smollm2_config if source == "smollm2" else synthetic[family]
    ckpt = open_checkpoint(path)
    plan = plan_conversion(ckpt, load_recipe(recipe), 5 * 10**9)
    config = ckpt.config.with_quantization(output_quantization_config(load_recipe(recipe), plan, ckpt.config))
    return config, linear_groups(plan)


@pytest.fixture(scope="module")
def smollm2_config(smollm2_bf16):
    return smollm2_bf16


# SmolLM2 (576 wide) with every dense recipe whose group divides it; its block-FP8 twin is block_fp8_release's
CASES = [(r, "synthetic") for r in RECIPES] + [(r, "smollm2") for r in RECIPES if r.startswith("dense-")
                                                 and r not in ("dense-fp8-block", "dense-w4a16-g128")]


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize("recipe, source", CASES)
def test_every_engine_module_gets_the_scheme_its_weights_are_stored_in(synthetic, smollm2_config, get_scheme_dict,
                                                                       recipe, source, engine):
    config, groups = written(synthetic, smollm2_config, recipe, source)
    rules, matching = loader_rules(engine, config.model_type), scheme_matching(engine, config.model_type)
    modules = engine_modules(groups, config, rules)
    assert {m.kind for m in modules} >= {"linear"}
    for module in modules:
        theirs = engines_choice(get_scheme_dict, engine, module, config.quantization_config,
                                matching.packed_modules(config))
        assert quantkits_choice(matching, module, config) == theirs, module
        assert {theirs} == {groups[m] for m in module.members}, (module, theirs)


@pytest.mark.parametrize("recipe, refused", [("dense-mlp-w4a16-g32", "model.layers.0.self_attn.qkv_proj"),
                                             ("glm5-int4-experts-g32", "model.layers.0.self_attn.fused_qkv_a_proj"
                                                                       "_with_mqa")])
def test_the_recipes_own_targets_and_ignore_are_refused_by_sglang(synthetic, smollm2_config, get_scheme_dict,
                                                                  recipe, refused):
    """What convert wrote before (the recipe's ignore and targets alone): SGLang's own code refuses to build the
    attention - the error the H200 boot met - and quantkit's restatement says the same."""
    config, groups = written(synthetic, smollm2_config, recipe)
    rec = load_recipe(recipe)
    qc = config.quantization_config
    qc["ignore"] = list(rec.config.ignore or [])
    qc["config_groups"] = {g: dict(s, targets=rec.config.config_groups[g].targets) for g, s in
                           qc["config_groups"].items()}
    matching = scheme_matching("sglang", config.model_type)
    module = next(m for m in engine_modules(groups, config, loader_rules("sglang", config.model_type))
                  if m.name == refused)
    assert engines_choice(get_scheme_dict, "sglang", module, qc, matching.packed_modules(config)) == "refused"
    assert quantkits_choice(matching, module, config) == "refused"


@pytest.fixture(scope="module")
def converted(synthetic, tmp_path_factory):
    out = tmp_path_factory.mktemp("engine-schemes") / "llama"
    convert(synthetic["llama"], out, "dense-w4a16-g128", device="cpu")
    return out


def test_verify_finds_a_config_the_engine_refuses(converted, tmp_path):
    """A converted output whose config lost the engine names: verify --engine sglang names the module and the
    engine's error; vLLM, which leaves an unmatched Linear unquantized, finds the packed weights given no scheme."""
    import shutil

    out = tmp_path / "out"
    shutil.copytree(converted, out)
    config = json.loads((out / "config.json").read_text())
    # the attention and MLP stay INT4 on disk; the config now claims only the MLP's checkpoint names
    config["quantization_config"]["config_groups"]["linears"]["targets"] = ["re:.*mlp\\.(gate|up|down)_proj$"]
    (out / "config.json").write_text(json.dumps(config))
    sglang = [f for f in verify(out, engine="sglang", smoke=False).findings if "scheme its weights" in f.rule]
    assert any("Unable to find matching target for model.layers.0.self_attn.qkv_proj" in f.message for f in sglang)
    assert any("Unable to find matching target for model.layers.0.mlp.gate_up_proj" in f.message for f in sglang)
    vllm = [f for f in verify(out, engine="vllm", smoke=False).findings if "scheme its weights" in f.rule]
    assert any("stored int4, given no scheme" in f.message for f in vllm)
    assert verify(converted, engine="sglang", smoke=False).checked["engine modules given a scheme"] > 0


def test_block_fp8_partitions_the_engines_refuse_are_findings():
    """validate_fp8_block_shape (the same in both engines): a merged Linear's partitions but the last, and at tp>1
    each rank's rows and a row-parallel input slice, are whole blocks."""
    from quantkit.engines.schemes import EngineModule
    from quantkit.verify.engine import fp8_block_problem
    from quantkit.verify.structure import Stored

    stored = {"a.q_proj": Stored("fp8", 576, 576), "a.k_proj": Stored("fp8", 192, 576),
              "a.v_proj": Stored("fp8", 192, 576), "a.o_proj": Stored("fp8", 576, 576)}
    qkv = EngineModule("a.qkv_proj", "linear", ("a.k_proj", "a.q_proj", "a.v_proj"), "QKVParallelLinear")
    o = EngineModule("a.o_proj", "linear", ("a.o_proj",), "RowParallelLinear")
    assert "output partition 576" in fp8_block_problem(qkv, stored, [128, 128], tp=1)
    assert fp8_block_problem(o, stored, [128, 128], tp=1) is None
    assert "input per rank 288" in fp8_block_problem(o, stored, [128, 128], tp=2)
    stored = {k: Stored("fp8", s.out_features * 2 // 3 * 2, 512) for k, s in stored.items()}
    assert fp8_block_problem(qkv, stored, [128, 128], tp=1) is None  # 768, 256, 256


def _marlin_tables(text: str) -> tuple:
    """The kernel's (thread_k, thread_n) tables as written in its source, small-batch then large-batch."""
    import re

    tables = []
    for name in ("small_batch_thread_configs", "large_batch_thread_configs"):
        body = re.search(name + r"\[\] = \{(.*?)\};", text, re.S)[1]
        tables.append(tuple((int(k), int(n)) for k, n, _ in re.findall(r"\{(\d+), (\d+), (\d+)\}", body)))
    return tuple(tables)


def test_sglangs_marlin_tiles_are_restated_from_its_kernels():
    from quantkit.engines.kernels import SGLANG_MARLIN

    wheel = engine_wheel("sglang", SGLANG_VERSION)
    for kind, tables in (("linear", SGLANG_MARLIN.linear), ("moe", SGLANG_MARLIN.moe)):
        path, lines = SGLANG_MARLIN.source[kind].split(":")
        text = wheel.read(path).decode()
        assert _marlin_tables(text) == tables, kind
        first = int(lines.split("-")[0])
        assert "thread_configs[] = {" in text.splitlines()[first - 1], SGLANG_MARLIN.source[kind]
        assert "prob_k % th_config.thread_k != 0" in text.splitlines()[int(lines.split(", ")[1]) - 1]


def test_verify_refuses_for_sglang_the_int4_gemms_its_marlin_cannot_run_as_the_h200_did():
    """On an H200, SGLang 0.5.17 served dense-mlp-w4a16-g32 of a SmolLM2-shaped model and synthetic DeepSeek-V3
    experts, and crashed at the first forward of dense-w4a16-g32 ("Invalid thread config ... MKN = [3, 576, 960]":
    the fused qkv_proj). verify --engine sglang says the same of each, and nothing of vLLM, whose kernels pad."""
    from quantkit.engines.schemes import EngineModule
    from quantkit.verify.engine import marlin_problem
    from quantkit.verify.structure import Stored

    smol = {"a.q_proj": Stored("int4", 576, 576, 32), "a.k_proj": Stored("int4", 192, 576, 32),
            "a.v_proj": Stored("int4", 192, 576, 32), "a.o_proj": Stored("int4", 576, 576, 32),
            "a.gate_proj": Stored("int4", 1536, 576, 32), "a.up_proj": Stored("int4", 1536, 576, 32),
            "a.down_proj": Stored("int4", 576, 1536, 32)}
    qkv = EngineModule("a.qkv_proj", "linear", ("a.q_proj", "a.k_proj", "a.v_proj"), "QKVParallelLinear")
    o = EngineModule("a.o_proj", "linear", ("a.o_proj",), "RowParallelLinear")
    gate_up = EngineModule("a.gate_up_proj", "linear", ("a.gate_proj", "a.up_proj"), "MergedColumnParallelLinear")
    down = EngineModule("a.down_proj", "linear", ("a.down_proj",), "RowParallelLinear")
    assert "K 576 x N 960" in marlin_problem(qkv, smol, tp=1)
    assert "K 576 x N 576" in marlin_problem(o, smol, tp=1)
    assert marlin_problem(gate_up, smol, tp=1) is None and marlin_problem(down, smol, tp=1) is None
    assert "K 192 x N 576" in marlin_problem(down, smol, tp=8)  # 1536 / 8: 64-wide K needs 128-wide N
    experts = {f"m.experts.{e}.{p}": Stored("int4", *shape, 32) for e in range(2)
               for p, shape in (("gate_proj", (128, 256)), ("up_proj", (128, 256)), ("down_proj", (256, 128)))}
    moe = EngineModule("m.experts", "moe", tuple(experts), "FusedMoE")
    assert marlin_problem(moe, experts, tp=1) is None  # the synthetic DeepSeek-V3 SGLang served
    assert marlin_problem(moe, experts, tp=2) is None  # gate_up K 256 x N 128, down K 64 x N 256
    narrow = {k: Stored("int4", *(320 if d == 256 else d for d in (s.out_features, s.in_features)), 32)
              for k, s in experts.items()}
    assert "down: K 128 x N 320" in marlin_problem(moe, narrow, tp=1)  # MoE Marlin has no 64-wide N tile


def test_verify_passes_smollm2s_int4_mlp_for_sglang_as_the_h200_served_it(smollm2_bf16, tmp_path):
    """dense-w4a16-g32, which SGLang crashed on: tests/test_verify.py."""
    convert(smollm2_bf16, tmp_path / "out", "dense-mlp-w4a16-g32", device="cpu")
    assert verify(tmp_path / "out", engine="sglang", smoke=False).passed
