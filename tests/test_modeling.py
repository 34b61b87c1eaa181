"""quantkit's model loader builds the model transformers' own from_pretrained builds from the same files: per-expert
tensors fused as transformers fuses them, every parameter in the dtype transformers gives it."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from quantkit.examples.synthetic import build_synthetic
from quantkit.modeling import load_model


@pytest.mark.parametrize("family", ["deepseek_v3", "glm_moe_dsa"])
def test_loaded_moe_models_equal_transformers_own_loading(family, tmp_path):
    path = build_synthetic(family, tmp_path / family, fp8=False)  # BF16 per-expert tensors, FP32 router biases
    ours = load_model(path).state_dict()
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).state_dict()
    assert sorted(ours) == sorted(theirs)
    differ = [k for k in ours if ours[k].dtype != theirs[k].dtype or not torch.equal(ours[k], theirs[k])]
    assert not differ  # before: the router's e_score_correction_bias was built BF16 (transformers: FP32), and GLM-5's,
    # stored FP32, was rounded
    assert any(".experts.gate_up_proj" in k for k in ours)
