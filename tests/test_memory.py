"""The GPU memory plan of a calibrated layer walk (convert/calibrated/memory.py): a MoE layer's experts in groups
that fit a budget, the layer inputs in host memory when the device has no room for them, and a layer that cannot
fit refused in one line before DST exists. The groups' results are held in tests/test_gptq.py and
tests/test_signround.py; the GPU runs in tests/test_gpu.py."""

import pytest
import torch
from helpers import gptq_recipe

from quantkit.checkpoint.reader import open_checkpoint
from quantkit.convert import calibration_batches, convert
from quantkit.convert.calibrated import preflight
from quantkit.convert.calibrated.memory import GIB, Budget, expert_groups, layer_weight_bytes
from quantkit.convert.tensor_plan import plan_conversion
from quantkit.errors import QuantkitError
from quantkit.formats.recipe import load_recipe


def test_experts_split_into_even_groups_that_fit():
    experts = list(range(256))
    assert expert_groups(experts, 100, 256 * 100) == [experts]
    groups = expert_groups(experts, 100, 100 * 100)  # 100 fit: three groups, as even as three can be
    assert [len(g) for g in groups] == [86, 86, 84] and sum(groups, []) == experts
    assert expert_groups(experts, 100, 99) == []


def test_a_layers_weights_are_counted_from_the_headers_as_the_walk_decodes_them(synthetic):
    ckpt = open_checkpoint(synthetic["glm_moe_dsa"])
    from quantkit.layerwise import LayerWalk

    walk = LayerWalk(ckpt, [torch.randint(2, 512, (1, 8))])
    from quantkit.checkpoint.reader import TensorReader

    with TensorReader(ckpt) as reader:
        state = walk.read_layer(1, reader)
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in state.values()}
    assert layer_weight_bytes(ckpt, 1, 2) == sum(held.values())  # every expert a view into two fused tensors


def _plan(synthetic, limit: int, folder):
    ckpt = open_checkpoint(synthetic["glm_moe_dsa"])
    recipe = load_recipe(gptq_recipe(folder))
    plan = plan_conversion(ckpt, recipe, 5 * 10**9)
    batches = calibration_batches(ckpt, recipe, None)
    return preflight.memory_plan(ckpt, plan, recipe, batches, Budget("cuda:0", limit), None)


def test_layer_inputs_stay_on_the_device_when_there_is_room_and_go_to_the_host_when_not(synthetic, tmp_path):
    assert _plan(synthetic, GIB, tmp_path) is None
    for limit in range(1 << 20, 1 << 24, 1 << 16):  # the smallest budgets that fit at all: inputs on the host first
        try:
            where = _plan(synthetic, limit, tmp_path)
        except QuantkitError:
            continue
        assert where == "cpu", limit
        break
    else:
        pytest.fail("no budget fitted")


def test_a_layer_that_cannot_fit_is_one_line_naming_it_and_what_helps(synthetic, tmp_path):
    with pytest.raises(QuantkitError) as refused:
        _plan(synthetic, 1 << 16, tmp_path)
    text = str(refused.value)
    assert "\n" not in text and "decoder layer" in text and "--gpu-memory" in text and "GiB" in text


def test_a_budget_on_a_cpu_run_is_refused(synthetic, tmp_path):
    with pytest.raises(QuantkitError, match="--gpu-memory is for GPU devices"):
        convert(synthetic["glm_moe_dsa"], tmp_path / "out", gptq_recipe(tmp_path), device="cpu", gpu_memory="1GiB")
    assert not (tmp_path / "out").exists()
