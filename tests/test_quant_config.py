"""formats/quant_config.py parses and dumps exactly as compressed-tensors 0.19 does, without importing it."""

import random
import warnings

import pytest
import yaml
from compressed_tensors.quantization import QuantizationArgs as CTArgs
from compressed_tensors.quantization import QuantizationConfig as CTConfig
from compressed_tensors.quantization import QuantizationScheme as CTScheme
from compressed_tensors.quantization import preset_name_to_scheme
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

from quantkit.formats import quant_config as ours
from quantkit.formats.recipe import load_recipe
from quantkit.packaged import recipes_dir

VALUES = dict(
    num_bits=[4, 8, 16, "4", 3, 32], type=["int", "float", "INT", "fp"], symmetric=[True, False],
    group_size=[None, 32, 128, -1, 0, -2], strategy=[None, "group", "channel", "tensor", "block", "token", "TENSOR_GROUP",
                                                     "attn_head", "bogus"],
    block_structure=[None, [128, 128], "64x64", [1], [0, 5], "axb"], dynamic=[False, True, "local", "LOCAL", "true"],
    actorder=[None, "static", "weight", "group", "dynamic", True, False, "Static"], observer=[None, "minmax"],
    scale_dtype=[None, "float16", "torch.bfloat16"], zp_dtype=[None, "int8"], observer_kwargs=[{}, {"averaging_constant": 0.1}],
)


def parsed(model, data):
    """("ok", the JSON dump) or ("refused", None): what each library makes of ``data``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return "ok", model.model_validate(data).model_dump(mode="json")
        except (ValueError, TypeError, NotImplementedError):  # pydantic's ValidationError is a ValueError
            return "refused", None


def test_to_compressed_tensors_gives_their_models():
    config = load_recipe("glm5-int4-experts-g128-fp8").config
    theirs = config.to_compressed_tensors()
    assert isinstance(theirs, CTConfig) and theirs.model_dump(mode="json") == config.model_dump(mode="json")
    args = config.config_groups["routed_experts"].weights
    assert isinstance(args.to_compressed_tensors(), CTArgs)
    assert args.to_compressed_tensors().model_dump(mode="json") == args.model_dump(mode="json")


def test_args_over_a_generated_grid():
    rng = random.Random(0)
    outcomes = {"ok": 0, "refused": 0}
    for _ in range(3000):
        data = {k: rng.choice(v) for k, v in VALUES.items() if rng.random() < 0.5}
        theirs = parsed(CTArgs, data)
        assert parsed(ours.QuantizationArgs, data) == theirs, data
        outcomes[theirs[0]] += 1
    assert min(outcomes.values()) > 300  # the grid exercises both acceptance and every kind of refusal


@pytest.mark.parametrize("recipe", sorted(recipes_dir().glob("*.yaml")), ids=lambda p: p.stem)
def test_every_built_in_recipe_reads_as_compressed_tensors_reads_it(recipe):
    doc = yaml.safe_load(recipe.read_text())
    doc.pop("quantkit_calibration", None)
    modifier = next(mod for stage in doc.values() for mods in stage.values() for mod in mods.values())
    expected = {name: parsed(CTScheme, group) for name, group in modifier["config_groups"].items()}
    assert {name: parsed(ours.QuantizationScheme, group) for name, group in modifier["config_groups"].items()} == expected
    config = load_recipe(recipe).config.model_dump(mode="json")
    assert {name: ("ok", group) for name, group in config["config_groups"].items()} == expected
    assert config == CTConfig.model_validate(config).model_dump(mode="json")


@pytest.mark.parametrize("name", sorted(PRESET_SCHEMES))
def test_presets(name):
    theirs = preset_name_to_scheme(name, ["Linear"]).model_dump(mode="json")
    assert ours.preset_scheme(name, ["Linear"]).model_dump(mode="json") == theirs
    as_group = {"config_groups": {name: ["Linear"]}}
    assert parsed(ours.QuantizationConfig, as_group) == parsed(CTConfig, as_group)


@pytest.mark.parametrize("scheme", [
    {"targets": ["Linear"], "weights": {"num_bits": 4, "group_size": 32}, "input_activations": {"strategy": "channel"}},
    {"targets": ["Linear"], "input_activations": {"num_bits": 8, "dynamic": True, "strategy": "token", "actorder": "weight"}},
    {"targets": ["Linear"], "output_activations": {"num_bits": 8, "actorder": "static"}},
    {"targets": ["Linear"], "format": "mixed-precision"},
    {"targets": ["Linear"], "format": "pack-quantized", "weights": {"num_bits": 4, "group_size": 128}},
    {"targets": "Linear"},
    {"targets": ["Linear"], "weights": {"num_bits": 4}, "extra": 1},
])
def test_scheme_checks(scheme):
    assert parsed(ours.QuantizationScheme, scheme) == parsed(CTScheme, scheme)


def test_match_name_is_compressed_tensors_own():
    from compressed_tensors.utils.match import match_name

    names = ["model.layers.3.mlp.experts.7.gate_proj", "lm_head", "model.layers.10.self_attn.o_proj"]
    targets = ["lm_head", "re:.*experts.*", "re:model\\.layers\\.1", "re:.*proj$", "model.layers.10.self_attn.o_proj"]
    assert [[ours.match_name(n, t) for t in targets] for n in names] == [[match_name(n, t) for t in targets] for n in names]
    # the compiled form a plan uses, for one target and for several at once
    for n in names:
        assert [bool(ours.any_matcher([t])(n)) for t in targets] == [match_name(n, t) for t in targets]
        for k in range(len(targets) + 1):
            assert bool(ours.any_matcher(targets[:k])(n)) == any(match_name(n, t) for t in targets[:k])


FAMILY_OF = {"glm5": "glm_moe_dsa", "deepseek": "deepseek_v3", "dense": "llama"}
EXPECTED_FORMAT = {"glm5-int4-experts-g128-fp8": "mixed-precision", "dense-fp8-block": "float-quantized",
                   "dense-mlp-fp8-block": "float-quantized", "dense-fp8-dynamic": "float-quantized",
                   "glm5-fp8-dynamic": "float-quantized", "deepseek-v3-fp8-dynamic": "float-quantized"}  # else INT4


@pytest.mark.parametrize("recipe", sorted(p.stem for p in recipes_dir().glob("*.yaml")))
def test_the_written_quantization_config_is_compressed_tensors_own(synthetic, recipe):
    from compressed_tensors import __version__
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import QuantizationStatus

    from quantkit.checkpoint.reader import open_checkpoint
    from quantkit.convert import output_quantization_config
    from quantkit.convert.tensor_plan import plan_conversion

    family = next(f for prefix, f in FAMILY_OF.items() if recipe.startswith(prefix))
    from quantkit.convert.dst import engine_names, linear_groups

    rec = load_recipe(recipe)
    ckpt = open_checkpoint(synthetic[family])
    plan = plan_conversion(ckpt, rec, 5 * 10**9)
    written = output_quantization_config(rec, plan, ckpt.config)
    # the engines' module names added to ignore and targets (tests/test_engine_schemes.py holds what they mean)
    ignore, extra = engine_names(rec, ckpt.config, linear_groups(plan))
    groups = {name: CTScheme.model_validate(dict(s.model_dump(mode="json"), targets=extra.get(name, []) + s.targets))
              for name, s in rec.config.config_groups.items() if name in plan.weights_by_group}
    block = next((n for n, s in groups.items() if s.weights and s.weights.block_structure), None)
    if block:  # SGLang reads the block size of fused Linears' FP8 scales from the group targeting Linear
        groups[block] = groups[block].model_copy(update={"targets": [*groups[block].targets, "Linear"]})
    kv = rec.config.kv_cache_scheme
    # the checkpoint's format: the one its groups use, or mixed-precision (compressed-tensors' name) when they differ
    formats = {scheme.format for scheme in groups.values()}
    fmt = formats.pop() if len(formats) == 1 else CompressionFormat.mixed_precision.value
    assert fmt == EXPECTED_FORMAT.get(recipe, "pack-quantized")
    theirs = CTConfig(config_groups=groups, ignore=ignore,
                      kv_cache_scheme=CTArgs.model_validate(kv.model_dump(mode="json")) if kv else None,
                      quantization_status=QuantizationStatus.COMPRESSED, format=fmt)
    expected = {"version": __version__, "quant_method": "compressed-tensors", **theirs.model_dump(mode="json")}
    assert written == expected
    assert list(written) == list(expected)  # the key order too: config.json's bytes depend on it


def test_the_kv_cache_scheme_calibrate_kv_writes_is_compressed_tensors_own():
    from compressed_tensors.quantization import QuantizationStatus

    from quantkit.checkpoint.config import Quantization
    from quantkit.kv.calibrate import KV_CACHE_SCHEME, _with_kv_scheme

    theirs = CTArgs.model_validate(KV_CACHE_SCHEME)
    assert _with_kv_scheme(Quantization({})) == CTConfig(config_groups={}, kv_cache_scheme=theirs, format="dense",
                                             quantization_status=QuantizationStatus.COMPRESSED).model_dump(mode="json")
    converted = {"quant_method": "compressed-tensors", "config_groups": {}, "format": "dense"}
    assert _with_kv_scheme(Quantization(converted)) == dict(converted, kv_cache_scheme=theirs.model_dump(mode="json"))
