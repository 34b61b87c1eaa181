"""Recipes: our YAML reading equals llm-compressor's own, and first-match lookup behaves."""

import pytest

from helpers import INT4_GROUP, int4_group_recipe, one_line_error, quantkit
from quantkit.convert import convert
from quantkit.errors import QuantkitError
from quantkit.formats.recipe import load_recipe
from quantkit.packaged import recipes_dir
import json
from helpers import BILLION_LAUGHS
from safetensors.torch import load_file
from quantkit.verify import verify

BUILT_IN = sorted(p.stem for p in recipes_dir().glob("*.yaml"))


@pytest.mark.parametrize("name", BUILT_IN)
def test_parsing_equals_llm_compressor(name):
    from llmcompressor.recipe import Recipe as LlmcRecipe

    modifier = LlmcRecipe.create_instance(str(recipes_dir() / f"{name}.yaml")).modifiers[0]
    theirs = modifier.resolve_quantization_config()
    recipe = load_recipe(name)
    ours = recipe.config
    assert (recipe.algorithm == "gptq") == (type(modifier).__name__ == "GPTQModifier")
    if recipe.algorithm == "gptq":
        assert recipe.calibrated.block_size == modifier.block_size
        assert recipe.calibrated.dampening_frac == modifier.dampening_frac
        # llm-compressor resolves the modifier's actorder into each group; quantkit keeps it as the
        # modifier's setting and writes the groups without it (the format has no g_idx either way)
        assert all(g.weights.actorder == recipe.calibrated.actorder for g in theirs.config_groups.values())
    assert list(ours.config_groups) == list(theirs.config_groups)
    for group, scheme in ours.config_groups.items():
        other = theirs.config_groups[group]
        assert scheme.targets == other.targets
        assert scheme.format == other.format
        assert scheme.weights.model_dump(exclude={"observer", "actorder"}) == \
            other.weights.model_dump(exclude={"observer", "actorder"})
        assert (scheme.input_activations is None) == (other.input_activations is None)
    assert list(ours.ignore) == list(theirs.ignore)


def test_preset_scheme_form(tmp_path):
    path = tmp_path / "w4a16.yaml"
    path.write_text("QuantizationModifier:\n  targets: Linear\n  scheme: W4A16\n  ignore: [lm_head]\n")
    recipe = load_recipe(path)
    assert recipe.scheme_for("model.layers.0.mlp.up_proj", True)[1].weights.group_size == 128
    assert recipe.scheme_for("lm_head", True) is None
    assert recipe.scheme_for("model.embed_tokens", False) is None


def test_first_matching_group_wins_and_ignore_beats_targets():
    recipe = load_recipe("glm5-int4-experts-g128-fp8")
    assert recipe.scheme_for("model.layers.5.mlp.experts.17.down_proj", True)[0] == "routed_experts"
    assert recipe.scheme_for("model.layers.5.mlp.shared_experts.down_proj", True)[0] == "fp8_block"
    assert recipe.scheme_for("model.layers.5.self_attn.indexer.wk", True)[0] == "fp8_block"
    assert recipe.scheme_for("model.layers.5.self_attn.indexer.weights_proj", True) is None
    assert recipe.scheme_for("model.layers.5.mlp.gate", True) is None


@pytest.mark.parametrize(
    "text,message",
    [
        ("AWQModifier:\n  scheme: W4A16\n", "AWQModifier is not implemented"),
        ("GPTQModifier:\n  scheme: W4A16\n  actorder: group\n", "actorder 'group': only static or none"),
        ("GPTQModifier:\n  scheme: W8A8\n", "8-bit int is not a format quantkit writes"),
        ("GPTQModifier:\n  scheme: W4A16_ASYM\n", "GPTQ writes symmetric INT4 only"),
        ("quantkit_calibration: {samples: 0}\nGPTQModifier:\n  scheme: W4A16\n", "quantkit_calibration: samples"),
        ("quantkit_calibration: {experts: some}\nGPTQModifier:\n  scheme: W4A16\n", "quantkit_calibration: experts"),
        ("quantkit_calibration: {sample: 3}\nGPTQModifier:\n  scheme: W4A16\n", "quantkit_calibration: sample"),
        ("quantkit_calibration: {}\nQuantizationModifier:\n  scheme: W4A16\n", "only read for a GPTQModifier"),
        ("foo: 1\n", "exactly one QuantizationModifier, GPTQModifier or AutoRoundModifier"),
        ("QuantizationModifier:\n  ignore: []\n", "neither config_groups nor scheme"),
        ("QuantizationModifier:\n  config_groups:\n    g:\n      targets: [Linear]\n      weights: {num_bits: 4, type: banana}\n",
         "invalid QuantizationModifier"),
        ("QuantizationModifier: [\n", "invalid YAML"),
    ],
)
def test_bad_recipes_are_one_line_errors(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(QuantkitError, match=message) as info:
        load_recipe(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_unknown_recipe_lists_the_built_in_ones():
    with pytest.raises(QuantkitError, match="glm5-int4-experts-g32"):
        load_recipe("no-such-recipe")


@pytest.mark.parametrize("kwargs, says", [
    (dict(more=", observer: mse"), "weights.observer 'mse' is not applied"),
    (dict(more=", scale_dtype: float16"), "weights.scale_dtype 'torch.float16' is not applied"),
    (dict(more=", dynamic: true"), "weights.dynamic True is not applied"),
    (dict(fmt="          format: nvfp4-pack-quantized\n"), "format 'nvfp4-pack-quantized': 4-bit int weights are "
                                                            "written pack-quantized"),
    (dict(sym="false", strategy="channel", gs="-1"), "asymmetric INT4 is written group-wise only"),
    (dict(gs='"32"'), "group_size '32' is not an integer"),
    (dict(gs="1e400"), "group_size '1e400' is not an integer"),
])
def test_a_recipe_argument_quantkit_does_not_apply_is_refused_naming_it(synthetic, tmp_path, kwargs, says):
    result = quantkit("convert", synthetic["llama"], tmp_path / "out", "--recipe", int4_group_recipe(tmp_path, **kwargs))
    one_line_error(result, says, code=None)
    assert "internal error" not in result.output and not (tmp_path / "out").exists()


def test_a_group_without_a_format_is_written_in_the_one_its_weights_have(synthetic, tmp_path):
    import json

    from quantkit.verify import verify

    convert(synthetic["llama"], tmp_path / "out", int4_group_recipe(tmp_path), device="cpu")
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert config["format"] == config["config_groups"]["g"]["format"] == "pack-quantized"
    assert verify(tmp_path / "out", source=synthetic["llama"]).passed


def test_a_recipe_whose_aliases_expand_without_bound_is_refused_at_once(synthetic, tmp_path):
    """31 levels of {a: *prev, b: *prev}: 62 alias uses, under the use cap, and two billion nodes expanded; convert
    walked them at 100 % CPU (killed at 60 s)."""
    import time

    levels = ["l0: &l0 [x]"] + [f"l{i}: &l{i} {{a: *l{i - 1}, b: *l{i - 1}}}" for i in range(1, 32)]
    text = "unused:\n" + "".join(f"  {line}\n" for line in levels) + INT4_GROUP.format(
        sym="true", strategy="group", gs="32", more="", fmt="")
    (tmp_path / "bomb.yaml").write_text(text)
    started = time.perf_counter()
    result = quantkit("convert", synthetic["llama"], tmp_path / "out", "--recipe", tmp_path / "bomb.yaml")
    one_line_error(result, "nodes with its aliases expanded", code=None)
    assert time.perf_counter() - started < 10 and not (tmp_path / "out").exists()


def test_a_recipe_alias_bomb_is_refused(synthetic, tmp_path):

    recipe = tmp_path / "bomb.yaml"
    recipe.write_text(BILLION_LAUGHS)
    r = quantkit("convert", synthetic["llama"], tmp_path / "dst", "-r", recipe)
    one_line_error(r, "bomb.yaml", "alias")


RECIPE = """quant_stage:
  quant_modifiers:
    QuantizationModifier:
      ignore: {ignore}
      config_groups:
        group_0:
          targets: {targets}
          weights: {{num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 32}}
{more}"""


@pytest.mark.parametrize("targets, ignore, more, message", [
    (["Linaer"], ["lm_head"], "", "group group_0 (targets ['Linaer']) matches no weight"),
    (["Linear"], ["re:.*"], "", "group group_0 (targets ['Linear']) matches no weight"),
    (["re:.*_proj$"], ["lm_head"], "        group_1:\n          targets: ['re:.*mlp.*']\n"
     "          weights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 32}\n",
     "recipe groups group_0 and group_1 both target this module"),
    (["re:(unclosed"], [], "", "bad regex"),
    (["Linear"], [], "        group_1:\n          targets: [Linear]\n          weights: {num_bits: four}\n",
     "config_groups.group_1.weights.num_bits"),
])
def test_recipes_that_would_convert_silently_wrong_are_refused(synthetic, tmp_path, targets, ignore, more, message):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE.format(targets=json.dumps(targets), ignore=json.dumps(ignore), more=more))
    r = quantkit("convert", synthetic["deepseek_v3"], tmp_path / "dst", "-r", recipe, "--device", "cpu")
    one_line_error(r, message)
    assert not (tmp_path / "dst" / "config.json").exists()


def test_overlapping_groups_are_refused_for_an_int4_source_too(synthetic, tmp_path):
    """The one-group rule lives where every weight's group is looked up, INT4 sources included."""
    int4 = tmp_path / "int4"
    convert(synthetic["llama"], int4, "dense-w4a16-g128", device="cpu")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE.format(targets=json.dumps(["re:.*_proj$"]), ignore=json.dumps(["lm_head"]),
                                    more="        group_1:\n          targets: ['re:.*mlp.*']\n"
                                         "          weights: {num_bits: 4, type: int, symmetric: true, strategy: group, "
                                         "group_size: 32}\n"))
    r = quantkit("convert", int4, tmp_path / "dst", "-r", recipe, "--device", "cpu")
    one_line_error(r, "recipe groups group_0 and group_1 both target this module", "weight_packed")


def test_a_name_or_regex_group_wins_over_a_linear_group_as_in_every_engine(synthetic, tmp_path):
    """compressed-tensors (match_targets), SGLang and vLLM (find_matched_target) all give a module the group naming
    it before the group targeting its class: no ambiguity, so no refusal, and the engines read what was written."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE.format(targets=json.dumps(["Linear"]), ignore=json.dumps(["lm_head"]),
                                    more="        group_1:\n          targets: ['re:.*mlp.*']\n"
                                         "          weights: {num_bits: 4, type: int, symmetric: true, strategy: group, "
                                         "group_size: 128}\n").replace("group_size: 32", "group_size: 64"))
    convert(synthetic["llama"], tmp_path / "dst", recipe, device="cpu")
    shapes = {n: t.shape for f in sorted((tmp_path / "dst").glob("*.safetensors")) for n, t in load_file(f).items()
              if n.endswith("weight_scale")}
    hidden = shapes["model.layers.0.self_attn.q_proj.weight_scale"][1] * 64
    assert shapes["model.layers.0.mlp.gate_proj.weight_scale"][1] == hidden // 128  # group_1, by its regex
    assert shapes["model.layers.0.self_attn.o_proj.weight_scale"][1] == hidden // 64  # group_0, by its class
    for engine in ("sglang", "vllm"):
        assert verify(tmp_path / "dst", engine=engine, smoke=False).passed, engine
