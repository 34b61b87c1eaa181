"""quantkit's SignRound beside auto-round itself on the same model, tokens and steps, in one run: seconds to make each.

    python benchmarks/signround_speed.py --work /tmp/qk/sr-speed [--model BF16_SMOLLM2] [--layers 30] [--device cuda]

Without ``--model``, a Llama of SmolLM2-135M's shapes with random weights (``--layers`` of them: hidden 576, MLP
1536, 9 query and 3 KV heads); time does not depend on the weights' values. Both run the shipped recipe's
settings: MLP to INT4 symmetric group 32, 200 steps, batch 8, on 64 x 256 tokens (random ids with the random model,
the shipped calibration text with a real one). quantkit: ``convert`` with ``dense-mlp-w4a16-signround-g32``, output
written; auto-round: ``AutoRound(...).quantize()`` (W4A16, group 32, attention left alone), nothing written. Prints
one JSON object: seconds each, their ratio, and quantkit's per-layer phases.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from helpers import add_word_tokenizer  # noqa: E402

from quantkit.calibration_data import DEFAULT_DATA, calibration_batches, model_tokenizer  # noqa: E402
from quantkit.convert import convert  # noqa: E402
from quantkit.examples.synthetic import build_synthetic  # noqa: E402
from quantkit.formats.recipe import load_recipe  # noqa: E402
from quantkit.packaged import recipes_dir  # noqa: E402

SHIPPED = "dense-mlp-w4a16-signround-g32"
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64)


def rows_for(model: Path, random_ids: bool) -> list[list[int]]:
    cal = load_recipe(SHIPPED).calibration
    if random_ids:
        gen = torch.Generator().manual_seed(0)
        return [torch.randint(2, 512, (cal.seq_len,), generator=gen).tolist() for _ in range(cal.samples)]
    batches = calibration_batches(DEFAULT_DATA, cal.text_field, cal.samples, cal.seq_len, 1,
                                  lambda: model_tokenizer(model), None, require_all=True)
    return [b[0].tolist() for b in batches]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/qk/sr-speed"))
    parser.add_argument("--model", type=Path, help="a BF16 checkpoint (default: SmolLM2's shapes, random weights)")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    model = args.model or add_word_tokenizer(build_synthetic("llama", args.work / "src", seed=1, fp8=False,
                                                             num_hidden_layers=args.layers, **SMOLLM2))
    rows = rows_for(model, args.model is None)
    data = args.work / "calibration.jsonl"
    data.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    text = (recipes_dir() / f"{SHIPPED}.yaml").read_text()
    head, _, rest = text.partition("quantkit_calibration:\n")
    recipe = args.work / "recipe.yaml"
    recipe.write_text(f"{head}quantkit_calibration:\n  dataset: {data}\n  samples: {len(rows)}\n"
                      f"  seq_len: {len(rows[0])}\n" + rest[rest.index("quant_stage:"):])
    layers: list = []
    started = time.perf_counter()
    convert(model, args.work / "quantkit", recipe, device=args.device, force=(args.work / "quantkit").exists(),
            on_layer=lambda r, n: layers.append(r))
    ours = time.perf_counter() - started

    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    started = time.perf_counter()
    tuner = AutoRound(net, model_tokenizer(model), scheme="W4A16", group_size=32, sym=True, iters=200,
                      nsamples=len(rows), seqlen=len(rows[0]), batch_size=8, dataset=[torch.tensor([r]) for r in rows],
                      ignore_layers="self_attn", enable_torch_compile=False, device_map=args.device)
    tuner.quantize()
    theirs = time.perf_counter() - started
    print(json.dumps({
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "model": str(args.model or
                                                                                              "SmolLM2 shapes, random"),
        "layers": len(layers), "quantkit_s": round(ours, 1), "auto_round_s": round(theirs, 1),
        "quantkit_over_auto_round": round(ours / theirs, 3),
        "quantkit_layers": [{"s": round(r.seconds, 2), "phases": {k: round(v, 2) for k, v in r.phases.items()}}
                            for r in layers],
    }))


if __name__ == "__main__":
    main()
