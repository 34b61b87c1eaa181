"""GPTQ, SignRound and a budgeted mixed recipe against round-to-nearest on the real SmolLM2-135M-Instruct:
held-out perplexity per candidate.

    python benchmarks/gptq_quality.py --work /tmp/qk/gptq-quality [--gsm8k ../shared/evaldata/gsm8k]
        [--only "gptq 64x256,signround 64x256"] [--mixed RECIPE.yaml] [--device cpu|cuda] [--source FP8_DIR]

The source is SmolLM2 written as a block-FP8 release (as the demo does); every candidate quantizes
its MLP to INT4 group 32 (dense-mlp-w4a16-g32's targets), the mixed one (a recipe `quantkit budget` wrote) a
part of it. Held-out, two measures no candidate was tuned on: GSM8K *test* question + answer text, and MMLU
*test* questions with their choices (another domain), 128 sequences of 256 tokens each; calibration: GSM8K
*train*. For each candidate and measure: perplexity, and the share of RTN's damage (RTN ppl - source ppl) that
it removes. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from quantkit.calibration_data import model_tokenizer, token_batches
from quantkit.convert import convert
from quantkit.examples.smollm2 import block_fp8_release, smollm2_checkpoint
from quantkit.modeling import load_model
from quantkit.packaged import recipes_dir


def gsm8k_texts(path: Path, chat_tokenizer=None) -> list[str]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if chat_tokenizer is None:
        return [f"{r['question']}\n{r['answer']}" for r in rows]
    return [chat_tokenizer.apply_chat_template([{"role": "user", "content": r["question"]},
                                                {"role": "assistant", "content": r["answer"]}], tokenize=False)
            for r in rows]


def perplexity(model_dir: Path, batches: list[torch.Tensor]) -> float:
    model = load_model(model_dir)
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            logits = model(input_ids=batch, use_cache=False).logits[:, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                                                    reduction="sum")
            total, count = total + float(nll), count + batch[:, 1:].numel()
    return math.exp(total / count)


def mmlu_texts(path: Path) -> list[str]:
    rows = [json.loads(line) for line in path.read_text().split("\n") if line.strip()]  # texts hold U+2028
    return [r["question"] + "\n" + "\n".join(f"{letter}. {c}" for letter, c in zip("ABCD", r["choices"]))
            for r in rows]


def gptq_recipe(work: Path, name: str, base: str = "dense-mlp-w4a16-gptq-g32", **calibration) -> Path:
    text = (recipes_dir() / f"{base}.yaml").read_text()
    head, _, rest = text.partition("quantkit_calibration:\n")
    body = rest[rest.index("quant_stage:"):]
    path = work / f"{name}.yaml"
    path.write_text(head + "quantkit_calibration:\n" + "".join(f"  {k}: {v}\n" for k, v in calibration.items()) + body)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/qk/gptq-quality"))
    parser.add_argument("--gsm8k", type=Path, default=Path(__file__).resolve().parents[2] / "shared/evaldata/gsm8k")
    parser.add_argument("--only", default="", help="comma-separated candidate names to run")
    parser.add_argument("--mixed", type=Path, help="a recipe quantkit budget wrote (the 'mixed' candidate)")
    parser.add_argument("--device", default="cpu", help="where convert (GPTQ, SignRound) runs")
    parser.add_argument("--source", type=Path, help="the block-FP8 SmolLM2 already written (else built in WORK)")
    args = parser.parse_args()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    source = args.source or block_fp8_release(smollm2_checkpoint(work / "bf16"), work / "fp8")
    tokenizer = model_tokenizer(source)
    gsm8k = token_batches(tokenizer, gsm8k_texts(args.gsm8k / "test.jsonl"), 128, 256, 8, args.gsm8k / "test.jsonl",
                          require_all=True)
    mmlu_file = args.gsm8k.parent / "mmlu" / "test.jsonl"
    mmlu = token_batches(tokenizer, mmlu_texts(mmlu_file), 128, 256, 8, mmlu_file, require_all=True)
    train = args.gsm8k / "train.jsonl"
    plain = work / "gsm8k-train.jsonl"
    plain.write_text("".join(json.dumps({"text": t}) + "\n" for t in gsm8k_texts(train)))
    chat = work / "gsm8k-train-chat.jsonl"
    chat.write_text("".join(json.dumps({"text": t}) + "\n" for t in gsm8k_texts(train, tokenizer)))

    candidates = {
        "rtn": "dense-mlp-w4a16-g32",
        "gptq 64x256": gptq_recipe(work, "g64x256", dataset=plain, samples=64, seq_len=256),
        "gptq 64x256 chat": gptq_recipe(work, "g64x256chat", dataset=chat, samples=64, seq_len=256),
        "gptq 256x256": gptq_recipe(work, "g256x256", dataset=plain, samples=256, seq_len=256),
        "gptq 256x256 chat": gptq_recipe(work, "g256x256chat", dataset=chat, samples=256, seq_len=256),
        "gptq 128x1024 chat": gptq_recipe(work, "g128x1024chat", dataset=chat, samples=128, seq_len=1024),
        "signround 64x256": gptq_recipe(work, "s64x256", "dense-mlp-w4a16-signround-g32", dataset=plain, samples=64,
                                        seq_len=256),
    }
    if args.mixed:
        candidates["mixed"] = args.mixed
    only = [c.strip() for c in args.only.split(",") if c.strip()]
    measures = {"GSM8K-test": gsm8k, "MMLU-test": mmlu}
    source_ppl = {m: perplexity(source, batches) for m, batches in measures.items()}
    rows = [("source (block-FP8)", source_ppl, None)]
    rtn_ppl: dict[str, float] = {}
    for name, recipe in candidates.items():
        if only and name not in only and name != "rtn":
            continue
        out = work / name.replace(" ", "-")
        started = time.perf_counter()
        convert(source, out, recipe, device=args.device, force=out.exists())
        seconds = time.perf_counter() - started
        ppl = {m: perplexity(out, batches) for m, batches in measures.items()}
        rtn_ppl = ppl if name == "rtn" else rtn_ppl
        rows.append((name, ppl, seconds))
        print(f"{name}: ppl {ppl} ({seconds:.0f} s)", flush=True)

    def removed(name, ppl, m):
        return "" if name.startswith(("rtn", "source")) else f"{(rtn_ppl[m] - ppl[m]) / (rtn_ppl[m] - source_ppl[m]):.0%}"

    print("\n| candidate | GSM8K-test ppl | RTN damage removed | MMLU-test ppl | RTN damage removed | convert |\n"
          "|---|---|---|---|---|---|")
    for name, ppl, seconds in rows:
        print(f"| {name} | {ppl['GSM8K-test']:.3f} | {removed(name, ppl, 'GSM8K-test')} | {ppl['MMLU-test']:.3f} | "
              f"{removed(name, ppl, 'MMLU-test')} | {'' if seconds is None else f'{seconds:.0f} s'} |")


if __name__ == "__main__":
    main()
