"""Every INT4 method quantkit ships, and the peers' own runs, on the real SmolLM2-135M-Instruct from one run: the same
calibration tokens for every calibrated candidate, the same scorers for all of them.

    python benchmarks/int4_quality.py --work /tmp/qk/int4 [--device cuda] [--budget-size 0.68] [--margin 2]
        [--only rtn,signround,...] [--batch-size 64]

The source is SmolLM2 in BF16. Candidates (MLP gate/up/down to INT4 group 32, the rest BF16):
- ``rtn``, ``rtn-asym``: the round-to-nearest recipes; ``gptq``: the GPTQ recipe on ``--device``; ``gptq-cpu``: the
  same on the CPU, run beside the others in a process of its own; ``signround``: the shipped SignRound recipe;
- ``budget``: a recipe ``quantkit budget`` writes from the RTN recipe at ``--budget-size`` of the source's bytes (the
  MLPs it keeps BF16 are the ones whose INT4 moves the output most);
- peers: ``oneshot``, llm-compressor's own oneshot with the shipped SignRound recipe file, as its users run it; and
  ``auto-round``, AutoRound itself (W4A16, group 32, symmetric, 200 steps, attention left alone), saved as its
  ``fake`` (dequantized) format.
Every calibrated candidate takes the shipped recipes' 64 x 256 tokens of quantkit's built-in text, tokenized once.

Scored by measures quantkit did not write: perplexity on held-out GSM8K *test* text (64 x 256 tokens, transformers'
own loading and forward) and lm-eval's ``arc_easy`` on all 2,376 items through ``quantkit eval --engine hf``, paired
with the source: the delta and the gate's two-sided 95 % interval, passed when it clears ``-margin`` points. Prints a
Markdown table and writes WORK/int4-quality.json. ``--made signround=F --made oneshot=G`` scores folders the GPU
test made from the same tokens instead of making them again (7 minutes of an H200).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the measures tests/test_signround.py asserts on, one text of each
from helpers import held_out_batches, perplexity  # noqa: E402
from test_signround import SHIPPED, users_oneshot  # noqa: E402

from quantkit.budget import budget  # noqa: E402
from quantkit.calibration_data import DEFAULT_DATA, calibration_batches, model_tokenizer  # noqa: E402
from quantkit.convert import convert  # noqa: E402
from quantkit.examples.smollm2 import smollm2_checkpoint  # noqa: E402
from quantkit.formats.recipe import load_recipe  # noqa: E402
from quantkit.packaged import evaldata_dir, recipes_dir  # noqa: E402
from quantkit.release.stats import paired_binary_interval, z_of  # noqa: E402

RECIPES = {"rtn": "dense-mlp-w4a16-g32", "rtn-asym": "dense-mlp-w4a16-asym-g32", "gptq": "dense-mlp-w4a16-gptq-g32",
           "signround": SHIPPED}
MLP_PARAMS = 30 * 3 * 576 * 1536


def calibration_rows(source: Path) -> list[list[int]]:
    """The shipped recipes' calibration tokens, exactly as convert reads them."""
    cal = load_recipe(SHIPPED).calibration
    batches = calibration_batches(DEFAULT_DATA, cal.text_field, cal.samples, cal.seq_len, 1,
                                  lambda: model_tokenizer(source), None, require_all=True)
    return [b[0].tolist() for b in batches]


def auto_round(source: Path, rows: list[list[int]], out: Path, device: str, iters: int = 200) -> Path:
    """AutoRound itself at the recipe's settings; its ``fake`` export holds the dequantized weights."""
    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    tuner = AutoRound(model, model_tokenizer(source), scheme="W4A16", group_size=32, sym=True, iters=iters,
                      nsamples=len(rows), seqlen=len(rows[0]), batch_size=8, dataset=[torch.tensor([r]) for r in rows],
                      ignore_layers="self_attn", enable_torch_compile=False, device_map=device)
    _, folders = tuner.quantize_and_save(str(out), format="fake")
    folder = Path(folders[0] if isinstance(folders, list) else folders)
    model_tokenizer(source).save_pretrained(folder)
    return folder


def make(name: str, source: Path, work: Path, rows, args) -> tuple[Path, dict]:
    """Candidate NAME in WORK/NAME and what is known of it: seconds to make, bytes, the MLP weights' INT4 share."""
    out = work / name
    started = time.perf_counter()
    info: dict = {"int4_share": 1.0}
    if name in RECIPES:
        convert(source, out, RECIPES[name], device=args.device, force=out.exists())
    elif name == "budget":
        plan = budget(source, recipe=RECIPES["rtn"], size=str(args.budget_size), out=work / "budget.yaml",
                      device=args.device)
        convert(source, out, work / "budget.yaml", device=args.device, force=out.exists())
        int4 = sum(m * n for g in plan.groups if g.choice.startswith("int4") for m, n in g.shapes)
        kept = [g.name for g in plan.groups if not g.choice.startswith("int4")]
        info = {"int4_share": int4 / MLP_PARAMS, "kept": kept}
    elif name == "oneshot":
        users_oneshot(source, recipes_dir() / f"{SHIPPED}.yaml", rows, out, args.device)
    elif name == "auto-round":
        out = auto_round(source, rows, out, args.device)
    info["seconds"] = time.perf_counter() - started
    info["bytes"] = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    return out, info


def arc_outcomes(model: Path, run: Path, args) -> dict[str, int]:
    if not args.arc:
        return {}
    from quantkit.evaluation import evaluate  # lm-eval: only the ARC-Easy score needs it

    evaluate(model, tasks=["arc_easy"], data_dir=evaldata_dir(), out=run, batch_size=args.batch_size,
             device=args.device, limit=args.limit)
    rows = [json.loads(line) for line in (run / "samples" / "arc_easy.jsonl").read_text().splitlines() if line]
    return {r["item_id"]: int(r["correct"]) for r in rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/qk/int4"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--budget-size", type=float, default=0.68)
    parser.add_argument("--margin", type=float, default=2.0)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--limit", type=int, help="ARC-Easy items (default: all 2,376)")
    parser.add_argument("--made", action="append", default=[], metavar="NAME=FOLDER",
                        help="a candidate this benchmark's own code already made elsewhere (tests/test_signround.py's "
                             "GPU test makes signround and oneshot from the same tokens): scored, not made again")
    parser.add_argument("--only", default="", help="comma-separated candidates (default: all)")
    parser.add_argument("--no-arc", dest="arc", action="store_false",
                        help="held-out perplexity and the time to make each candidate only (no lm-eval needed)")
    args = parser.parse_args()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    source = work / "bf16" if (work / "bf16" / "config.json").is_file() else smollm2_checkpoint(work / "bf16")
    names = [n.strip() for n in args.only.split(",") if n.strip()] or [
        "rtn", "rtn-asym", "gptq", "gptq-cpu", "signround", "budget", "oneshot", "auto-round"]
    cpu_gptq = None
    if "gptq-cpu" in names:  # the GPU's candidates meanwhile, on half the cores: the GPU's runs need a core to launch
        threads = str(max(1, (os.cpu_count() or 2) // 2))
        cpu_gptq = subprocess.Popen([sys.executable, "-m", "quantkit", "convert", str(source), str(work / "gptq-cpu"),
                                     "-r", RECIPES["gptq"], "--device", "cpu", "--force", "--json"],
                                    stdout=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS=threads))
    try:
        score_all(names, source, work, cpu_gptq, args)
    finally:  # a candidate that fails must not leave the CPU conversion running beside whatever runs next
        if cpu_gptq is not None and cpu_gptq.poll() is None:
            cpu_gptq.kill()


def score_all(names: list[str], source: Path, work: Path, cpu_gptq, args) -> None:
    """Make and score each candidate; the table at the end."""
    rows = calibration_rows(source)
    held_out = held_out_batches(source)
    base = arc_outcomes(source, work / "runs" / "source", args)
    results = {"source": {"ppl": perplexity(source, held_out, args.device), "arc": _share(base)}}
    made = dict(spec.split("=", 1) for spec in args.made)
    for name in names:
        if name in made:
            out, info = Path(made[name]), {"seconds": float("nan"), "int4_share": 1.0}
            info["bytes"] = sum(f.stat().st_size for f in out.glob("*.safetensors"))
        elif name == "gptq-cpu":
            out, info = work / name, {"seconds": json.loads(cpu_gptq.communicate()[0])["seconds"], "int4_share": 1.0}
            info["bytes"] = sum(f.stat().st_size for f in out.glob("*.safetensors"))
        else:
            out, info = make(name, source, work, rows, args)
        cand = arc_outcomes(out, work / "runs" / name, args)
        ids = sorted(base)
        delta, low, high = (paired_binary_interval([base[i] for i in ids], [cand[i] for i in ids], z_of(0.025))
                            if ids else (float("nan"),) * 3)
        info.update(ppl=perplexity(out, held_out, args.device), arc=_share(cand), delta=delta, low=low, high=high,
                    passed=low > -args.margin)
        results[name] = info
        print(name, json.dumps(info), flush=True)
        (work / "int4-quality.json").write_text(json.dumps(results, indent=2))
    report(results, args.margin)


def _share(outcomes: dict[str, int]) -> float:
    return sum(outcomes.values()) / len(outcomes) if outcomes else float("nan")


def report(results: dict, margin: float) -> None:
    src, rtn = results["source"]["ppl"], results.get("rtn", {}).get("ppl")
    print(f"\n| candidate | made in | MLP INT4 | held-out ppl | RTN's ppl damage removed | ARC-Easy | delta [95 %] | "
          f"{margin:g}-point margin |\n|---|---|---|---|---|---|---|---|")
    print(f"| source (BF16) | | | {src:.3f} | | {results['source']['arc']:.2%} | | |")
    for name, r in results.items():
        if name == "source":
            continue
        removed = "" if rtn is None or name == "rtn" else f"{(rtn - r['ppl']) / (rtn - src):.0%}"
        made_in = "elsewhere" if r["seconds"] != r["seconds"] else f"{r['seconds']:.0f} s"
        print(f"| {name} | {made_in} | {r['int4_share']:.0%} | {r['ppl']:.3f} | {removed} | {r['arc']:.2%} | "
              f"{r['delta']:+.2f} [{r['low']:+.2f}, {r['high']:+.2f}] | {'pass' if r['passed'] else 'fail'} |")


if __name__ == "__main__":
    main()
