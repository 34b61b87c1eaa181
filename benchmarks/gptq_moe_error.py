"""GPTQ against RTN on synthetic MoE checkpoints: each MoE layer's output error on held-out tokens.

    python benchmarks/gptq_moe_error.py --family glm_moe_dsa --experts all --samples 128 [--min-expert-tokens 16]

A block-FP8 synthetic checkpoint of the family (8 experts, top 2, hidden 256; layer 1's router kept
away from expert 5), converted RTN and GPTQ on random calibration token ids (``samples`` x 64). For
each decoder layer: the squared error of the converted layer's output against the source layer's on
8 held-out sequences, both fed the source model's own inputs to that layer.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from quantkit.checkpoint.reader import open_checkpoint
from quantkit.convert import convert
from quantkit.examples.synthetic import build_synthetic
from quantkit.layerwise import layer_output_errors
from quantkit.packaged import recipes_dir

RECIPES = {"glm_moe_dsa": "glm5-int4-experts", "deepseek_v3": "deepseek-v3-int4-experts"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="glm_moe_dsa", choices=list(RECIPES))
    parser.add_argument("--experts", default="all", choices=("all", "routed"))
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--min-expert-tokens", type=int, default=16)
    parser.add_argument("--work", type=Path, default=Path("/tmp/qk/gptq-moe"))
    args = parser.parse_args()
    root = args.work / args.family
    shutil.rmtree(root, ignore_errors=True)
    src = build_synthetic(args.family, root / "src", seed=3)
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    shard = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(src / shard)
    tensors[name][5] = -1e4
    save_file(tensors, src / shard, {"format": "pt"})
    gen = torch.Generator().manual_seed(0)
    data = root / "calibration.jsonl"
    data.write_text("".join(json.dumps({"input_ids": torch.randint(2, 512, (64,), generator=gen).tolist()}) + "\n"
                            for _ in range(args.samples)))
    text = (recipes_dir() / f"{RECIPES[args.family]}-gptq-g32.yaml").read_text()
    head, _, rest = text.partition("quantkit_calibration:\n")
    recipe = root / "recipe.yaml"
    recipe.write_text(f"{head}quantkit_calibration:\n  dataset: {data}\n  samples: {args.samples}\n  seq_len: 64\n"
                      f"  experts: {args.experts}\n  min_expert_tokens: {args.min_expert_tokens}\n"
                      + rest[rest.index("quant_stage:"):])
    result = convert(src, root / "gptq", recipe, device="cpu")
    convert(src, root / "rtn", f"{RECIPES[args.family]}-g32", device="cpu")
    held = torch.Generator().manual_seed(99)  # not the calibration tokens
    held_out = [torch.randint(2, 512, (1, 64), generator=held) for _ in range(8)]
    source = open_checkpoint(src)

    def errors(out: Path) -> list[float]:
        return layer_output_errors(source, open_checkpoint(out), held_out)

    print(json.dumps({"family": args.family, "experts": args.experts, "samples": args.samples,
                      "min_expert_tokens": args.min_expert_tokens,
                      "weights_by_method": result.calibrated["weights_by_method"],
                      "expert_tokens": result.calibrated["expert_tokens"],
                      **{name: [round(e, 3) for e in errors(root / name)] for name in ("rtn", "gptq")}}))


if __name__ == "__main__":
    main()
