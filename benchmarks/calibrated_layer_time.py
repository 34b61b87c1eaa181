"""Seconds per decoder layer of GPTQ and SignRound on one device, on a model of SmolLM2-135M's shapes.

    python benchmarks/calibrated_layer_time.py --work /tmp/qk/layer-time --device cuda [--layers 4] [--iters 200]

A synthetic BF16 Llama with SmolLM2-135M's dimensions (hidden 576, MLP 1536, 9 query / 3 KV heads, vocabulary
49,152) and ``--layers`` decoder layers, calibrated on 64 random sequences of 256 tokens, MLP to INT4 group 32:
the built-in GPTQ and SignRound recipes' settings (SignRound: ``--iters`` steps, batch 8). Timing needs no real
weights; quality is measured on the real model (gptq_quality.py). Prints a Markdown table: per algorithm, the
median seconds per layer and each phase's share.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from quantkit.convert import convert
from quantkit.examples.synthetic import build_synthetic
from quantkit.packaged import recipes_dir

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
               vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=True)


def recipe(work: Path, base: str, data: Path, iters: int) -> Path:
    head, _, rest = (recipes_dir() / f"{base}.yaml").read_text().partition("quantkit_calibration:\n")
    body = rest[rest.index("quant_stage:"):].replace("iters: 200", f"iters: {iters}")
    path = work / f"{base}.yaml"
    path.write_text(f"{head}quantkit_calibration:\n  dataset: {data}\n  samples: 64\n  seq_len: 256\n{body}")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/qk/layer-time"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    src = work / "src"
    if not (src / "config.json").is_file():
        build_synthetic("llama", src, seed=0, fp8=False, num_hidden_layers=args.layers, **SMOLLM2)
    data = work / "tokens.jsonl"
    gen = torch.Generator().manual_seed(0)
    data.write_text("".join(json.dumps({"input_ids": torch.randint(2, 49152, (256,), generator=gen).tolist()}) + "\n"
                            for _ in range(64)))
    print("| algorithm | device | seconds per layer (median) | phases |\n|---|---|---|---|")
    for name, base in (("GPTQ", "dense-mlp-w4a16-gptq-g32"), ("SignRound", "dense-mlp-w4a16-signround-g32")):
        result = convert(src, work / name, recipe(work, base, data, args.iters), device=args.device, force=True)
        layers = result.calibrated["layers"]
        seconds = statistics.median(r["seconds"] for r in layers)
        phases = {k: statistics.median(r["phases"].get(k, 0.0) for r in layers) for k in layers[0]["phases"]}
        shown = ", ".join(f"{k} {v:.2f}s" for k, v in phases.items())
        print(f"| {name} ({args.iters} iters) | {result.devices[0]} | {seconds:.2f} | {shown} |" if name == "SignRound"
              else f"| {name} | {result.devices[0]} | {seconds:.2f} | {shown} |", flush=True)


if __name__ == "__main__":
    main()
