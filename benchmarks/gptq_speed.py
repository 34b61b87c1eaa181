"""GPTQ speed and memory against the peer: quantkit convert vs llm-compressor oneshot(GPTQModifier).

    python benchmarks/gptq_speed.py --work /tmp/qk/gptq-speed [--samples 64 --seq-len 256]

Same model (the real SmolLM2-135M-Instruct in BF16), same recipe (dense-mlp-w4a16-gptq-g32), same
calibration tokens in the same order, each tool in its own process under /usr/bin/time: wall
seconds and peak resident memory. The outputs are compared tensor by tensor (they are equal: see
tests/test_gptq.py). Prints a Markdown row per tool and the ratio.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path


def timed(code: str, cwd: Path) -> tuple[float, float]:
    """(wall seconds, peak RSS GiB) of ``python -c code``."""
    run = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(run.stderr[-3000:])
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (?:(\d+):)?(\d+):([\d.]+)", run.stderr)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", run.stderr)
    seconds = int(wall.group(1) or 0) * 3600 + int(wall.group(2)) * 60 + float(wall.group(3))
    return seconds, int(rss.group(1)) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/qk/gptq-speed"))
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    from quantkit.examples.smollm2 import smollm2_checkpoint
    from quantkit.packaged import recipes_dir

    src = smollm2_checkpoint(work / "bf16")
    text = (recipes_dir() / "dense-mlp-w4a16-gptq-g32.yaml").read_text()
    text = text.replace("samples: 64", f"samples: {args.samples}").replace("seq_len: 256", f"seq_len: {args.seq_len}")
    recipe = work / "recipe.yaml"
    recipe.write_text(text)
    ours = f"""
        from quantkit.convert import convert
        convert({str(src)!r}, {str(work / 'ours')!r}, {str(recipe)!r}, device="cpu", force=True)
    """
    # the peer gets quantkit's tokens, laid out so its length-aware sampler visits them in quantkit's order
    peer = f"""
        import torch
        from datasets import Dataset
        from llmcompressor import oneshot
        from transformers import AutoModelForCausalLM
        from quantkit.checkpoint.reader import open_checkpoint
        from quantkit.convert import calibration_batches
        from quantkit.formats.recipe import load_recipe
        n, L = {args.samples}, {args.seq_len}
        batches = calibration_batches(open_checkpoint({str(src)!r}), load_recipe({str(recipe)!r}), None)
        order = torch.argsort(torch.tensor([L] * n), descending=True).tolist()
        rows = [None] * n
        for k, j in enumerate(order):
            rows[j] = batches[k][0].tolist()
        model = AutoModelForCausalLM.from_pretrained({str(src)!r}, dtype=torch.bfloat16)
        oneshot(model=model, dataset=Dataset.from_dict({{"input_ids": rows, "attention_mask": [[1] * L] * n}}),
                recipe={str(recipe)!r}, num_calibration_samples=n, max_seq_length=L,
                shuffle_calibration_samples=False, batch_size=1, pipeline="sequential")
        model.save_pretrained({str(work / 'peer')!r}, save_compressed=True)
    """
    results = {"quantkit": timed(textwrap.dedent(ours), work), "llm-compressor": timed(textwrap.dedent(peer), work)}
    from safetensors.torch import load_file

    a = {k: v for f in sorted((work / "ours").glob("*.safetensors")) for k, v in load_file(f).items()}
    b = {k: v for f in sorted((work / "peer").glob("*.safetensors")) for k, v in load_file(f).items()}
    equal = set(a) == set(b) and all(a[k].equal(b[k]) for k in a)
    print(json.dumps({"samples": args.samples, "seq_len": args.seq_len, "outputs_equal": equal,
                      **{k: {"seconds": round(s, 1), "peak_rss_gib": round(m, 2)} for k, (s, m) in results.items()}}))
    q, p = results["quantkit"], results["llm-compressor"]
    print("\n| tool | wall | peak RSS |\n|---|---|---|")
    for name, (s, m) in results.items():
        print(f"| {name} | {s:.1f} s | {m:.2f} GiB |")
    print(f"\nquantkit / llm-compressor: time x{q[0] / p[0]:.2f}, memory x{q[1] / p[1]:.2f}; outputs equal: {equal}")


if __name__ == "__main__":
    main()
