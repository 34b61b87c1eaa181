"""How long `quantkit plan` takes on a GLM-5-sized config.json alone, against an earlier revision in the same run.

The config has GLM 5.x's shapes (78 layers + 1 MTP layer, 256 routed experts of 2048 x 6144, block-FP8): about
120,000 source tensors and 180,000 output tensors to plan, with no weights to read. Each command runs as its own
process, revisions alternating, ``--reps`` times; the fastest run of each counts (the others show the noise), and
the JSON reports must be equal. ``quantkit --version`` is the start-up floor every command pays.

    python benchmarks/plan_speed.py --work /tmp/plan-bench --baseline 74418f2 --reps 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYERS, DENSE = 78, 3
GLM5 = {
    "model_type": "glm_moe_dsa", "architectures": ["GlmMoeDsaForCausalLM"], "dtype": "bfloat16",
    "vocab_size": 154880, "hidden_size": 6144, "intermediate_size": 12288, "moe_intermediate_size": 2048,
    "num_hidden_layers": LAYERS, "num_nextn_predict_layers": 1, "num_attention_heads": 64,
    "num_key_value_heads": 64, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "q_lora_rank": 2048, "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256,
    "index_head_dim": 128, "index_n_heads": 32, "index_topk": 2048, "head_dim": 64, "first_k_dense_replace": DENSE,
    "mlp_layer_types": ["dense"] * DENSE + ["sparse"] * (LAYERS - DENSE), "indexer_types": ["full"] * LAYERS,
    "attention_bias": False, "tie_word_embeddings": False, "max_position_embeddings": 202752,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]},
}


def timed(argv: list[str], pythonpath: Path) -> tuple[float, str]:
    """Wall seconds and stdout of one process, start-up included."""
    env = dict(os.environ, PYTHONPATH=str(pythonpath))
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "quantkit", *argv], capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - t0
    if done.returncode:
        raise SystemExit(f"quantkit {' '.join(argv)} failed:\n{done.stderr[-2000:]}")
    return seconds, done.stdout


def checkout(rev: str, work: Path) -> Path:
    """The package of ``rev``, unpacked beside the work folder (nothing in the repository changes)."""
    folder = work / f"rev-{rev}"
    if not (folder / "quantkit").is_dir():
        folder.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "quantkit", "recipes"],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/plan-bench"))
    ap.add_argument("--baseline", help="a git revision to time beside the working tree")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()

    cfg = args.work / "glm5-config"
    cfg.mkdir(parents=True, exist_ok=True)
    (cfg / "config.json").write_text(json.dumps(GLM5, indent=2))
    trees = {"working tree": REPO}
    if args.baseline:
        trees[args.baseline] = checkout(args.baseline, args.work)
    argv = ["plan", str(cfg), "-r", "glm5-int4-experts-g32", "--tp", "8", "--json"]

    runs: dict[str, list[float]] = {name: [] for name in trees}
    floor: list[float] = []
    reports: dict[str, dict] = {}
    for _ in range(args.reps):
        floor.append(timed(["--version"], REPO)[0])
        for name, tree in trees.items():
            seconds, out = timed(argv, tree)
            runs[name].append(seconds)
            reports[name] = json.loads(out)
    for name in trees:
        ordered = sorted(runs[name])
        print(f"{name:>14}: fastest {ordered[0]:.2f} s, median {ordered[len(ordered) // 2]:.2f} s "
              f"({', '.join(f'{s:.2f}' for s in runs[name])})")
    print(f"{'start-up':>14}: fastest {min(floor):.2f} s (quantkit --version)")
    report = reports["working tree"]
    print(f"planned: bytes now {report['bytes_now']:,}, after {report['bytes_after']:,}")
    if args.baseline:
        same = reports[args.baseline] == report
        print(f"reports equal: {same}; speed-up {min(runs[args.baseline]) / min(runs['working tree']):.2f}x")
        if not same:
            raise SystemExit("the two revisions planned differently")


if __name__ == "__main__":
    main()
