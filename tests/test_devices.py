"""Which devices a command runs on, from what the user typed (quantkit/devices.py)."""

import pytest
import torch

from quantkit.errors import QuantkitError


def test_cuda_without_an_index_becomes_the_current_device(monkeypatch):
    from quantkit.devices import resolve_device, resolve_devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert resolve_devices("cuda") == ["cuda:0"] and resolve_device("auto") == "cuda:0"
    assert resolve_devices("cuda:1, cuda:0") == ["cuda:1", "cuda:0"]
    for bad, message in (("cuda:2", "has 2 GPU"), ("cuda:0,cuda", "named twice"), ("gpu", "unknown device"),
                         ("cuda:" + "1" * 4000, "unknown device")):
        with pytest.raises(QuantkitError, match=message):
            resolve_devices(bad)
