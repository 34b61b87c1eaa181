"""The dtype a forward pass computes in: what each spelling means, and auto's probe on a CPU."""

import pytest
import torch

from quantkit import compute_dtype as cd
from quantkit.errors import QuantkitError


@pytest.fixture(autouse=True)
def fresh_probe():
    cd.faster_on_cpu.cache_clear()
    yield
    cd.faster_on_cpu.cache_clear()


@pytest.mark.parametrize("spec, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)])
def test_a_named_dtype_is_used_on_any_device(spec, dtype):
    for device in ("cpu", "cuda:0"):
        assert cd.compute_dtype(spec, device, torch.bfloat16) == dtype


def test_auto_is_the_models_own_dtype_on_a_gpu_and_for_an_fp32_model():
    assert cd.compute_dtype("auto", "cuda:0", torch.bfloat16) == torch.bfloat16
    assert cd.compute_dtype("auto", "cpu", torch.float32) == torch.float32


@pytest.mark.parametrize("bf16_seconds, expected", [(0.2, torch.float32), (1e-6, torch.bfloat16)])
def test_auto_on_a_cpu_takes_whichever_the_probe_measures_faster(monkeypatch, bf16_seconds, expected):
    seconds = {torch.bfloat16: bf16_seconds, torch.float32: 5e-4}
    monkeypatch.setattr(cd, "_linear_seconds", lambda dtype: seconds[dtype])
    assert cd.compute_dtype("auto", "cpu", torch.bfloat16) == expected


def test_the_probe_measures_this_cpu():
    assert cd._linear_seconds(torch.float32) > 0
    assert cd.faster_on_cpu(torch.bfloat16) in (torch.bfloat16, torch.float32)


def test_an_unknown_spelling_is_refused_in_one_line():
    with pytest.raises(QuantkitError, match=r"unknown compute dtype 'float8' \(auto, bf16, fp16, fp32\)"):
        cd.compute_dtype("float8", "cpu", torch.bfloat16)


def test_names_as_run_json_writes_them():
    assert cd.dtype_name(torch.bfloat16) == "bfloat16" and cd.dtype_name(torch.float32) == "float32"
