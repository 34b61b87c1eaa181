"""Real candidates through the gate, fixed and sequential: verdicts, and the candidate items a sequential gate spares.

    python benchmarks/sequential_savings.py --work /tmp/qk/seq --source /tmp/qk/quality/fp8 \
        --candidate int4=/tmp/qk/quality/rtn --candidate fp8kv=/tmp/qk/fp8kv ... \
        [--tasks arc_easy,mmlu] [--mmlu-items 2000] [--margin 4] [--data ../shared/evaldata] [--device cuda]

Every model is evaluated once on all the items (the hf engine, file order; a candidate whose folder holds k/v scales
with its FP8 KV cache emulated, the baseline with BF16 KV). The fixed gate uses all of them; the sequential gate's
looks (25 %, 50 %, 100 % of the items in the seeded order, O'Brien-Fleming-like and Pocock-like spending) are the
seeded-order prefixes of the same per-item outcomes, which is what ``eval --order seeded --fraction`` evaluates.
Prints, per candidate and task: the fixed verdict and, per spending, the look the sequential verdict came at and the
share of the candidate's items it needed; then the mean share over the candidates (the savings).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from quantkit.evaluation import evaluate
from quantkit.evaluation.run_dir import seeded_order
from quantkit.release.stats import look_alphas, paired_binary_interval, z_of

LOOKS = [0.25, 0.5, 1.0]


def outcomes(run: Path, task: str) -> dict[int, int]:
    rows = [json.loads(line) for line in (run / "samples" / f"{task}.jsonl").read_text().split("\n") if line.strip()]
    return {int(r["item_id"].rsplit("-", 1)[1]): r["correct"] for r in rows}


def sequential(base: dict[int, int], cand: dict[int, int], margin: float, alpha: float, spending: str):
    """(decision, look, share of items) of the looks over seeded-order prefixes."""
    order = seeded_order(len(base))
    for k, (t, a) in enumerate(zip(LOOKS, look_alphas(alpha, LOOKS, spending))):
        m = math.ceil(t * len(order))
        ids = order[:m]
        _, low, high = paired_binary_interval([base[i] for i in ids], [cand[i] for i in ids], z_of(a))
        if low > -margin:
            return "pass", k + 1, m / len(order)
        if high < -margin or k == len(LOOKS) - 1:
            return "fail", k + 1, m / len(order)
    raise AssertionError


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/qk/seq"))
    parser.add_argument("--source", type=Path, required=True)
    parser.add_argument("--candidate", action="append", default=[], help="NAME=FOLDER")
    parser.add_argument("--tasks", default="arc_easy,mmlu")
    parser.add_argument("--mmlu-items", type=int, default=2000)
    parser.add_argument("--margin", type=float, default=4.0)
    parser.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[2] / "shared/evaldata")
    parser.add_argument("--device", default="cpu", help="where the hf engine runs the models")
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    data = args.work / "data"
    for task in tasks:  # MMLU: its first N test items (a subset the CPU can afford)
        (data / task).mkdir(parents=True, exist_ok=True)
        lines = (args.data / task / "test.jsonl").read_text().split("\n")
        keep = args.mmlu_items if task == "mmlu" else len(lines)
        (data / task / "test.jsonl").write_text("".join(line + "\n" for line in lines[:keep] if line.strip()))
    runs = args.work / "runs"

    def run(name: str, model: Path) -> Path:
        kv = "fp8_e4m3" if any(model.glob("kv-scales.safetensors")) else "auto"
        evaluate(model, tasks=tasks, data_dir=data, out=runs / name, batch_size=args.batch_size, device=args.device,
                 kv_cache_dtype=kv)
        return runs / name

    baseline = run("baseline", args.source)
    alpha = 0.05 / 2 / len(tasks)  # the release suites' rule: two-sided 0.05, Bonferroni over the tasks, one side
    print("| candidate | task | n | delta | fixed interval | fixed verdict | O'Brien-Fleming: look, items | "
          "Pocock: look, items |\n|---|---|---|---|---|---|---|---|")
    shares: dict[str, list[float]] = {"obrien-fleming": [], "pocock": []}
    for spec in args.candidate:
        name, folder = spec.split("=", 1)
        cand_run = run(name, Path(folder))
        for task in tasks:
            b, c = outcomes(baseline, task), outcomes(cand_run, task)
            ids = sorted(b)
            delta, low, high = paired_binary_interval([b[i] for i in ids], [c[i] for i in ids], z_of(alpha))
            fixed = "pass" if low > -args.margin else "fail"
            cells = []
            for spending in shares:
                decision, look, share = sequential(b, c, args.margin, alpha, spending)
                shares[spending].append(share)
                cells.append(f"{decision} at {look}, {share:.0%}")
            print(f"| {name} | {task} | {len(ids)} | {delta:+.2f} | [{low:+.2f}, {high:+.2f}] | {fixed} | "
                  f"{cells[0]} | {cells[1]} |", flush=True)
    for spending, values in shares.items():
        print(f"{spending}: mean share of candidate items {sum(values) / len(values):.0%} "
              f"({1 - sum(values) / len(values):.0%} saved) over {len(values)} candidate-task pairs")


if __name__ == "__main__":
    main()
