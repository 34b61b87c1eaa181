"""config.json as quantkit reads it: one typed ModelConfig, built once, that gives the file back unchanged."""

import json

import pytest

from quantkit.checkpoint.config import ModelConfig
from quantkit.checkpoint.reader import read_config
from quantkit.errors import QuantkitError
from helpers import one_line_error, quantkit


def test_what_is_written_back_is_the_file_with_only_the_quantization_config_changed(synthetic, tmp_path):
    path = synthetic["glm_moe_dsa"] / "config.json"
    config = read_config(synthetic["glm_moe_dsa"])
    assert config.to_json() == (json.dumps(json.loads(path.read_text()), indent=2) + "\n").encode()
    changed = json.loads(config.with_quantization({"quant_method": "compressed-tensors"}).to_json())
    original = json.loads(path.read_text())
    assert list(changed) == list(original)  # key order kept: quantization_config where it was
    assert {k: v for k, v in changed.items() if k != "quantization_config"} == {
        k: v for k, v in original.items() if k != "quantization_config"}
    assert config.quantization.fp8_release and config.fp8_block == (128, 128)


@pytest.mark.parametrize("raw, experts", [({"n_routed_experts": 256}, 256), ({"num_experts": 128}, 128),
                                          ({"num_local_experts": 8}, 8), ({"n_routed_experts": 0}, None), ({}, None)])
def test_each_spelling_of_the_expert_count_is_read(raw, experts):
    config = ModelConfig.read({"model_type": "x", **raw})
    assert config.num_experts == experts and config.is_moe == (experts is not None)


def test_a_typed_field_of_the_wrong_kind_is_one_line_naming_it(tmp_path):
    with pytest.raises(QuantkitError, match=r"index_topk: Input should be a valid integer") as caught:
        ModelConfig.read({"model_type": "glm_moe_dsa", "index_topk": "many"}, tmp_path / "config.json")
    assert "\n" not in str(caught.value) and "config.json" in str(caught.value)


def test_a_size_quantkit_needs_and_the_config_lacks_is_named():
    with pytest.raises(QuantkitError, match="hidden_size = None"):
        ModelConfig.read({"model_type": "llama"}).size("hidden_size")


def test_the_context_bound_refuses_longer_sequences(tmp_path):
    config = ModelConfig.read({"max_position_embeddings": 256}, tmp_path / "config.json")
    config.check_context(256, "--seq-len")
    with pytest.raises(QuantkitError, match=r"--seq-len 257 exceeds the model's context \(256\)"):
        config.check_context(257, "--seq-len")


@pytest.mark.parametrize("field, value", [("num_hidden_layers", 10**9), ("n_routed_experts", 10**7),
                                          ("num_hidden_layers", "3"), ("num_hidden_layers", -1),
                                          ("kv_lora_rank", "abc"), ("index_head_dim", 2.5), ("q_lora_rank", [1])])
def test_absurd_config_values_are_refused_at_once(tmp_path, field, value):
    folder = tmp_path / "cfg"
    folder.mkdir()
    config = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 64,
              "num_hidden_layers": 2, "n_routed_experts": 4}
    config[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    one_line_error(quantkit("plan", folder), "config.json", field)
    r = quantkit("verify", folder, "--no-smoke")  # verify reports it as a finding of its structure check
    assert r.exit_code == 1 and f"config.json: readable checkpoint: {field} = " in r.output


@pytest.mark.parametrize("field, value, says", [("indexer_types", ["full"] * 3, "has 3 entries for num_hidden_layers = 4"),
                                                ("mlp_layer_types", ["dense", "moe", "sparse", "sparse"], "expected a list"),
                                                ("indexer_types", "full", "expected a list")])
def test_per_layer_lists_of_the_wrong_length_or_kind_are_refused(synthetic, tmp_path, field, value, says):
    """A per-layer list shorter than the layers was an IndexError deep in plan's layout (GLM-5 configs carry two)."""
    folder = tmp_path / "cfg"
    folder.mkdir()
    config = json.loads((synthetic["glm_moe_dsa"] / "config.json").read_text())
    config.update({"num_hidden_layers": 4, "mlp_layer_types": ["dense"] + ["sparse"] * 3,
                   "indexer_types": ["full"] * 4, field: value})
    (folder / "config.json").write_text(json.dumps(config))
    one_line_error(quantkit("plan", folder, "-r", "glm5-int4-experts-g32"), "config.json", field, says)
