"""INT4 experts with FP8 activations (W4A8), the decode pool both engines now serve on Hopper: the recipe converts like
the INT4 ones (the activations are the engine's, at run time), and verify holds each engine's own rules for it at the
planned tensor-parallel size (read in SGLang 0.5.23 and vLLM 0.33.0, engines/kernels.py W4A8_RULES)."""

import json

import pytest
import yaml

from quantkit.convert import convert
from quantkit.examples.synthetic import build_synthetic
from quantkit.packaged import recipes_dir
from quantkit.verify import verify
from quantkit.verify.engine import w4a8_size_problem

RECIPE = "glm5-w4a8-experts-g128"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("w4a8")
    src = build_synthetic("glm_moe_dsa", root / "src", seed=1)
    convert(src, root / "out", RECIPE, device="cpu")
    return src, root / "out"


def test_experts_are_int4_with_fp8_activations_and_nothing_else_is_quantized(converted):
    _, out = converted
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["format"] == "pack-quantized"  # SGLang's W4A8 path reads the config's own format
    (group,) = config["config_groups"].values()
    assert "Linear" in group["targets"]  # where SGLang reads the W4A8 MoE scheme's settings
    assert (group["weights"]["num_bits"], group["weights"]["group_size"], group["weights"]["symmetric"]) == (4, 128, True)
    assert {k: group["input_activations"][k] for k in ("num_bits", "type", "strategy", "dynamic")} == {
        "num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
    weights = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    packed = [n for n in weights if n.endswith(".weight_packed")]
    assert packed and all(".mlp.experts." in n for n in packed)  # attention, shared experts, dense MLP: BF16


@pytest.mark.parametrize("engine, tp, passes", [("sglang", 1, True), ("sglang", 2, False), ("vllm", 1, False)])
def test_verify_holds_each_engines_sizes_at_the_planned_tp(converted, engine, tp, passes):
    """The synthetic GLM-5's experts are 128 wide in a 256-wide model: SGLang's kernel runs them on one rank, not on
    two (64 each), and vLLM asserts multiples of 256 for both: one line says so."""
    _, out = converted
    report = verify(out, engine=engine, tp=tp, smoke=False)
    size = [f for f in report.findings if "expert width" in f.message]
    assert (not size) == passes, size
    if size:
        assert f"{engine} cannot run this checkpoint at tp={tp}" in size[0].message and "\n" not in size[0].message


def test_glm5s_own_sizes_run_on_vllm_up_to_tp_8_and_on_sglang_up_to_tp_16():
    assert w4a8_size_problem("vllm", 6144, 2048, 8) is None
    assert "vllm cannot run this checkpoint at tp=16" in w4a8_size_problem("vllm", 6144, 2048, 16)
    assert w4a8_size_problem("sglang", 6144, 2048, 16) is None
    assert w4a8_size_problem("sglang", 6144, 2048, 32) is not None


def test_what_sglang_needs_of_the_config_is_refused_when_missing(converted, tmp_path):
    """A W4A8 group without the class Linear among its targets, and one holding dense Linears (the shared experts):
    each is an engine finding for SGLang, naming what fails."""
    src, _ = converted
    text = yaml.safe_load((recipes_dir() / f"{RECIPE}.yaml").read_text())
    modifier = text["quant_stage"]["quant_modifiers"]["QuantizationModifier"]
    modifier["config_groups"]["routed_experts"]["targets"] = ["re:.*mlp\\.experts\\.\\d+\\.(gate|up|down)_proj$"]
    modifier["ignore"] = ["lm_head", "re:.*mlp\\.gate$", "re:.*eh_proj$", "re:.*shared_head\\.head$",
                          "re:.*self_attn\\..*"]
    modifier["config_groups"]["shared"] = {
        "targets": ["re:.*mlp\\.shared_experts\\.(gate|up|down)_proj$"],
        "weights": dict(modifier["config_groups"]["routed_experts"]["weights"]),
        "input_activations": dict(modifier["config_groups"]["routed_experts"]["input_activations"]),
        "format": "pack-quantized"}
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(yaml.safe_dump(text))
    convert(src, tmp_path / "out", recipe, device="cpu")
    findings = verify(tmp_path / "out", engine="sglang", smoke=False).findings
    assert any("a W4A8 group targets the class Linear" in f.rule for f in findings)
    dense = [f for f in findings if "no dense Linear in a W4A8 group" in f.rule]
    assert dense and "shared_experts" in dense[0].tensor and "no dense W4A8 scheme" in dense[0].message
