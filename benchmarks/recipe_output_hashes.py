"""sha256 of what every built-in recipe writes, to hold a refactor's outputs byte-identical to the code before it.

    python benchmarks/recipe_output_hashes.py --work /tmp/qk/hashes > after.json   # then diff with the code before

Each built-in recipe converts the synthetic model of its family (glm5-* the GLM-5, deepseek-v3-* the DeepSeek-V3,
dense-* the Llama; seed 0, the test suite's shapes). Calibrated recipes (GPTQ, SignRound) are shrunk as the tests
shrink them: 4 random sequences of 64 tokens, SignRound at 2 steps. Then calibrate-kv on the RTN INT4 output of each
family (4 random sequences of 64 tokens). Every file of each output is hashed but the manifest, whose timings differ run to run.
Prints one JSON object: output -> {file: sha256}.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path

import torch

from quantkit.convert import convert
from quantkit.examples.synthetic import build_synthetic
from quantkit.kv.calibrate import calibrate_kv
from quantkit.packaged import recipes_dir

FAMILY = {"glm5-": "glm_moe_dsa", "deepseek-v3-": "deepseek_v3", "dense-": "llama"}
MANIFEST = "quantkit-manifest.json"


def shrunk(recipe: Path, work: Path) -> Path:
    """A calibrated recipe on 4 x 64 random tokens (SignRound at 2 steps, batch 2); an RTN recipe as it is."""
    text = recipe.read_text()
    if "quantkit_calibration:" not in text:
        return recipe
    data = work / "calibration.jsonl"
    gen = torch.Generator().manual_seed(0)
    data.write_text("".join(json.dumps({"input_ids": torch.randint(2, 512, (64,), generator=gen).tolist()}) + "\n"
                            for _ in range(4)))
    head, _, rest = text.partition("quantkit_calibration:\n")
    body = rest[rest.index("quant_stage:"):].replace("iters: 200", "iters: 2").replace("batch_size: 8", "batch_size: 2")
    path = work / recipe.name
    path.write_text(f"{head}quantkit_calibration:\n  dataset: {data}\n  samples: 4\n  seq_len: 64\n{body}")
    return path


def hashes(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST and not p.name.startswith(".")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/qk/hashes"))
    args = parser.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    sources = {family: build_synthetic(family, args.work / "src" / family, seed=0) for family in FAMILY.values()}
    out = {}
    for recipe in sorted(recipes_dir().glob("*.yaml")):
        family = next(f for prefix, f in FAMILY.items() if recipe.stem.startswith(prefix))
        dst = args.work / recipe.stem
        convert(sources[family], dst, shrunk(recipe, args.work), device="cpu")
        out[recipe.stem] = hashes(dst)
    for rtn in ("glm5-int4-experts-g32", "deepseek-v3-int4-experts-g32", "dense-mlp-w4a16-g32"):
        kv = args.work / f"{rtn}-kv"
        gen = torch.Generator().manual_seed(1)
        batches = [torch.randint(2, 512, (2, 64), generator=gen) for _ in range(2)]
        calibrate_kv(args.work / rtn, out=kv, batches=batches, device="cpu")
        out[f"{rtn}-kv"] = hashes(kv)
    print(json.dumps(out, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
