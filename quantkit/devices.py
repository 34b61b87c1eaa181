"""Which devices a command runs on, from what the user typed: ``auto``, ``cpu``, ``cuda``, ``cuda:1``, or a list.

Everything after this point sees a device with an index (``cuda:0``, never a bare ``cuda``): some torch
calls (``torch.cuda.set_device``, which GPTQ's worker threads need) refuse a device without one, and
two spellings of one GPU would count as two devices.
"""

from __future__ import annotations

from quantkit.errors import QuantkitError

SPELLINGS = "auto, cpu, cuda, cuda:N, or a list: cuda:0,cuda:1"


def resolve_devices(spec: str) -> list[str]:
    """The devices ``spec`` names, each with an index; ``auto`` is every GPU, or the CPU without one."""
    import torch

    if spec.strip() == "auto":
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())] or ["cpu"]
    devices = []
    for name in (d.strip() for d in spec.split(",")):
        if not name:
            continue
        if name == "cpu":
            devices.append(name)
            continue
        if name != "cuda" and not (name.startswith("cuda:") and name[5:].isdigit() and len(name) <= 9):
            raise QuantkitError(f"unknown device {name!r} ({SPELLINGS})")
        if not torch.cuda.is_available():
            raise QuantkitError(f"device {name} requested but CUDA is not available")
        index = torch.cuda.current_device() if name == "cuda" else int(name[5:])
        if index >= torch.cuda.device_count():
            raise QuantkitError(f"device {name} requested but this machine has {torch.cuda.device_count()} GPU(s)")
        devices.append(f"cuda:{index}")
    if not devices:
        raise QuantkitError(f"no device named ({SPELLINGS})")
    if len(set(devices)) != len(devices):
        raise QuantkitError(f"a device is named twice in {spec!r}")
    return devices


def resolve_device(spec: str) -> str:
    """The one device ``spec`` names (``auto``: the first GPU, or the CPU without one)."""
    devices = resolve_devices(spec)
    if len(devices) > 1 and spec.strip() != "auto":
        raise QuantkitError(f"this command runs on one device; {spec!r} names {len(devices)}")
    return devices[0]
