"""On a CUDA machine: the one rounding rule gives the same bits on every device.

1. quantkit convert on CUDA (one GPU, and two where the machine has them) and on CPU give
   byte-identical checkpoints.
2. llm-compressor's model_free_ptq on CUDA (fp32 division in its Triton kernel) gives the same
   packed experts and scales as quantkit, bit for bit.

    python benchmarks/device_equality.py --workdir /tmp/eq

CI has no GPU; this script is how the GPU path is held to the CPU one (figures in docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from quantkit.convert import convert
from quantkit.examples.synthetic import build_synthetic
from quantkit.formats.recipe import load_recipe


def load_all(folder: Path) -> dict:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def tree(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file() and p.name != "quantkit-manifest.json"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/quantkit-equality"))
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA device"
    work = args.workdir
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    for family, recipe in (("glm_moe_dsa", "glm5-int4-experts-g32"), ("deepseek_v3", "glm5-int4-experts-g128-fp8")):
        src = build_synthetic(family, work / f"{family}-src", seed=5, n_routed_experts=32)
        t0 = time.perf_counter()
        convert(src, work / f"{family}-cuda", recipe, device="cuda")
        convert(src, work / f"{family}-cpu", recipe, device="cpu")
        report[f"{family}/{recipe}: cuda == cpu, byte for byte"] = tree(work / f"{family}-cuda") == tree(work / f"{family}-cpu")
        if torch.cuda.device_count() > 1:
            convert(src, work / f"{family}-2gpu", recipe, device="cuda:0,cuda:1", max_shard_size="2MB")
            convert(src, work / f"{family}-cpu-small", recipe, device="cpu", max_shard_size="2MB")
            report[f"{family}/{recipe}: two GPUs == cpu, byte for byte (2 MB shards)"] = \
                tree(work / f"{family}-2gpu") == tree(work / f"{family}-cpu-small")
        report[f"{family} seconds"] = time.perf_counter() - t0

    from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer
    from llmcompressor import model_free_ptq

    src = work / "glm_moe_dsa-src"
    fp8 = [n.removesuffix(".weight_scale_inv") for n in json.loads((src / "model.safetensors.index.json").read_text())["weight_map"] if n.endswith("_scale_inv")]
    model_free_ptq(src, work / "peer-cuda", config=load_recipe("glm5-int4-experts-g32").config.to_compressed_tensors(), device="cuda:0",
                   converter=FP8BlockDequantizer(targets=fp8))
    ours, peer = load_all(work / "glm_moe_dsa-cuda"), load_all(work / "peer-cuda")
    packed = [n for n in ours if n.endswith("weight_packed")]
    equal_packed = sum(torch.equal(ours[n], peer[n]) for n in packed)
    equal_scales = sum(torch.equal(ours[n.replace("packed", "scale")], peer[n.replace("packed", "scale")]) for n in packed)
    others = [n for n in ours if "weight_packed" not in n and "weight_scale" not in n and "weight_shape" not in n]
    report["model_free_ptq on cuda: packed experts equal"] = f"{equal_packed}/{len(packed)}"
    report["model_free_ptq on cuda: scales equal"] = f"{equal_scales}/{len(packed)}"
    report["model_free_ptq on cuda: other tensors equal"] = f"{sum(torch.equal(ours[n], peer[n]) for n in others)}/{len(others)}"
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
