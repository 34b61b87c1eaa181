"""Multiple-choice log-likelihoods with each context once (quantkit's hf engine) beside lm-eval's HFLM, on the same
requests in the same process, and how far their answers are apart.

    python benchmarks/shared_context_time.py --model BF16_SMOLLM2 [--items 200] [--batch-size 16] [--dtype fp32]

The requests are ARC-Easy's first ITEMS questions as lm-eval's `arc_easy` task words them, one per choice. Prints
each scorer's seconds (the faster of two runs each), the ratio, and the largest gap between their log-likelihoods. Figures in docs/eval.md.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from transformers import AutoTokenizer

from quantkit.evaluation.shared_context import SharedContextHFLM
from quantkit.modeling import load_model
from quantkit.packaged import evaldata_dir


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--items", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    a = p.parse_args()
    rows = [json.loads(line) for line in (evaldata_dir() / "arc_easy" / "test.jsonl").read_text().splitlines()]
    requests = [Instance("loglikelihood", {}, (f"Question: {r['question']}\nAnswer:", " " + choice), i)
                for i, r in enumerate(rows[:a.items]) for choice in r["choices"]["text"]]
    model = load_model(a.model, {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]).eval()
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    answers, seconds = {}, {}
    for _ in range(2):  # each twice, alternating; the faster of its two runs (the first warms the allocator up)
        for name, cls in (("HFLM", HFLM), ("shared context", SharedContextHFLM)):
            lm = cls(pretrained=model, tokenizer=tokenizer, batch_size=a.batch_size)
            started = time.perf_counter()
            answers[name] = lm.loglikelihood(requests, disable_tqdm=True)
            seconds[name] = min(seconds.get(name, float("inf")), time.perf_counter() - started)
    gaps = [abs(x[0] - y[0]) for x, y in zip(answers["HFLM"], answers["shared context"], strict=True)]
    flags = sum(x[1] != y[1] for x, y in zip(answers["HFLM"], answers["shared context"], strict=True))
    print(f"{len(requests)} requests ({a.items} questions), batch {a.batch_size}, {a.dtype}, "
          f"{torch.get_num_threads()} threads")
    print(f"HFLM {seconds['HFLM']:.1f} s, shared context {seconds['shared context']:.1f} s: "
          f"{seconds['HFLM'] / seconds['shared context']:.2f}x; largest gap {max(gaps):.2e} nats, "
          f"greedy flags differing {flags}")


if __name__ == "__main__":
    main()
