"""quantkit's SignRound beside llm-compressor's own ``oneshot`` with the same recipe and tokens, at the recipe's own
settings, on the first layers of a real model: where do they part?

    python benchmarks/signround_vs_oneshot.py --model BF16_SMOLLM2 --work /tmp/qk/sr [--layers 2] [--device cpu]
        [--iters 200] [--samples 64] [--seq-len 256] [--base dense-mlp-w4a16-signround-asym-g32]

The model is cut to its first ``--layers`` decoder layers. Both runs take the same token sequences (the recipe's
default calibration text, tokenized once by quantkit and handed to both as ``input_ids``) and the built-in
``dense-mlp-w4a16-signround-g32`` recipe (or ``--base``) with only its data and sizes changed; RTN is the base's
round-to-nearest twin. Prints, per quantized weight, the
share of packed words equal to oneshot's and each one's relative weight error against the source, and for the cut
model the mean per-token KL to the source on held-out GSM8K test text: quantkit's, oneshot's and round-to-nearest's.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from quantkit.calibration_data import DEFAULT_DATA, calibration_batches, model_tokenizer
from quantkit.convert import convert
from quantkit.formats import int4
from quantkit.packaged import evaldata_dir, recipes_dir

BASE = "dense-mlp-w4a16-signround-g32"


def cut(model: Path, out: Path, layers: int) -> Path:
    """The model with its first ``layers`` decoder layers (everything else kept)."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for f in model.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, out / f.name)
    keep = {n: t for shard in sorted(model.glob("*.safetensors")) for n, t in load_file(shard).items()
            if not n.startswith("model.layers.") or int(n.split(".")[2]) < layers}
    save_file(keep, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((model / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=layers), indent=2))
    return out


def recipe(work: Path, model: Path, samples: int, seq_len: int, iters: int, base: str = BASE
           ) -> tuple[Path, list[list[int]]]:
    """The built-in recipe on token sequences written as input_ids (what both runs read)."""
    batches = calibration_batches(DEFAULT_DATA, "text", samples, seq_len, 1, lambda: model_tokenizer(model), None)
    rows = [b[0].tolist() for b in batches]
    data = work / "tokens.jsonl"
    data.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    head, _, rest = (recipes_dir() / f"{base}.yaml").read_text().partition("quantkit_calibration:\n")
    body = rest[rest.index("quant_stage:"):].replace("iters: 200", f"iters: {iters}")
    path = work / f"{base}.yaml"
    path.write_text(f"{head}quantkit_calibration:\n  dataset: {data}\n  samples: {samples}\n  seq_len: {seq_len}\n"
                    f"{body}")
    return path, rows


def oneshot_run(model: Path, recipe_path: Path, rows: list[list[int]], out: Path, device: str) -> None:
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).to(device)
    data = Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]})
    oneshot(model=net, dataset=data, recipe=str(recipe_path), num_calibration_samples=len(rows),
            max_seq_length=len(rows[0]), shuffle_calibration_samples=False, batch_size=1, pipeline="sequential")
    net.save_pretrained(out, save_compressed=True)
    model_tokenizer(model).save_pretrained(out)


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def dequantized(t: dict[str, torch.Tensor], module: str) -> torch.Tensor:
    q = int4.unpack_int4(t[f"{module}.weight_packed"], tuple(t[f"{module}.weight_shape"].tolist()))
    scale = t[f"{module}.weight_scale"].float()
    zero = t.get(f"{module}.weight_zero_point")
    zero = None if zero is None else int4.unpack_zero_point(zero, q.shape[0])
    return int4.dequantize_int4(q, scale, q.shape[1] // scale.shape[1], zero)


def held_out_ids(tokenizer, n: int = 32) -> list[torch.Tensor]:
    """The first ``n`` GSM8K test questions with their answers, at most 256 tokens each."""
    rows = [json.loads(line) for line in (evaldata_dir() / "gsm8k" / "test.jsonl").read_text().splitlines()[:n]]
    return [torch.tensor([tokenizer(r["question"] + " " + r["answer"])["input_ids"][:256]]) for r in rows]


def log_probs(folder: Path, ids: list[torch.Tensor], device: str) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        return [torch.log_softmax(net(x.to(device)).logits.float(), -1) for x in ids]


def mean_kl(reference: list[torch.Tensor], candidate: list[torch.Tensor]) -> float:
    """Mean per-token KL(reference || candidate)."""
    total = sum(float((p.exp() * (p - q)).sum()) for p, q in zip(reference, candidate, strict=True))
    return total / sum(p.shape[1] for p in reference)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/qk/sr"))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--base", default=BASE, help="a built-in SignRound recipe")
    args = parser.parse_args()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    src = cut(args.model, work / "src", args.layers)
    path, rows = recipe(work, src, args.samples, args.seq_len, args.iters, args.base)
    convert(src, work / "ours", path, device=args.device, force=True)
    oneshot_run(src, path, rows, work / "oneshot", args.device)
    convert(src, work / "rtn", args.base.replace("-signround", ""), device="cpu", force=True)
    source = tensors(src)
    runs = {name: tensors(work / name) for name in ("ours", "oneshot", "rtn")}
    print("| weight | packed words equal to oneshot's | rel. error: quantkit | oneshot | RTN |\n|---|---|---|---|---|")
    for name in sorted(n for n in runs["ours"] if n.endswith(".weight_packed")):
        module = name.removesuffix(".weight_packed")
        same = float((runs["ours"][name] == runs["oneshot"][name]).float().mean())
        w = source[f"{module}.weight"].float()
        errors = [float((dequantized(runs[r], module) - w).norm() / w.norm()) for r in ("ours", "oneshot", "rtn")]
        print(f"| {module} | {same:.3f} | " + " | ".join(f"{e:.4f}" for e in errors) + " |")
    ids = held_out_ids(model_tokenizer(src))
    reference = log_probs(src, ids, args.device)  # once, for the three candidates
    kl = {r: mean_kl(reference, log_probs(work / r, ids, args.device)) for r in ("ours", "oneshot", "rtn")}
    print(f"\nheld-out KL to the source, per token: quantkit {kl['ours']:.5f}, oneshot {kl['oneshot']:.5f}, "
          f"RTN {kl['rtn']:.5f} ({args.base}, {args.layers} layers, {args.samples} x {args.seq_len} tokens, "
          f"{args.iters} iters, {args.device})")


if __name__ == "__main__":
    main()
