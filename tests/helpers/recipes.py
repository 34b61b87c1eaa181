"""Built-in recipes and release configs shrunk for a test."""

import json
from pathlib import Path

import torch

from quantkit.packaged import recipes_dir


def release_config(folder: Path, source: Path, **extra) -> Path:
    (folder / "suite.yaml").write_text("tasks:\n  arc_easy: {margin: 100}\n")
    config = {"source": str(source), "recipe": "dense-w4a16-g128", "convert": {"device": "cpu"},
              "verify": {"smoke": False}, "eval": {"tasks": ["arc_easy"], "data_dir": str(folder / "nodata")},
              "suite": "suite.yaml", "publish": {"repo": "file://published"}, **extra}
    path = folder / "release.yaml"
    path.write_text(json.dumps(config))
    return path


def signround_recipe(folder: Path, samples=4, seq_len=64, iters=4, batch_size=2, base="dense-mlp-w4a16-signround-g32",
                     seed=0) -> Path:
    """A built-in SignRound recipe shrunk for a test: a few tuning steps on a few random token sequences."""
    data = folder / f"calibration-{seed}.jsonl"
    gen = torch.Generator().manual_seed(seed)
    data.write_text("".join(json.dumps({"input_ids": torch.randint(2, 512, (seq_len,), generator=gen).tolist()}) + "\n"
                            for _ in range(samples)))
    text = (recipes_dir() / f"{base}.yaml").read_text()
    head, _, rest = text.partition("quantkit_calibration:\n")
    body = rest[rest.index("quant_stage:"):].replace("iters: 200", f"iters: {iters}")
    body = body.replace("batch_size: 8", f"batch_size: {batch_size}")
    path = folder / f"{base}-small.yaml"
    path.write_text(f"{head}quantkit_calibration:\n  dataset: {data}\n  samples: {samples}\n  seq_len: {seq_len}\n{body}")
    return path


INT4_GROUP = """quant_stage:
  quant_modifiers:
    QuantizationModifier:
      ignore: ["lm_head"]
      config_groups:
        g:
          targets: ["Linear"]
          weights: {{num_bits: 4, type: int, symmetric: {sym}, strategy: {strategy}, group_size: {gs}{more}}}
{fmt}"""


def int4_group_recipe(tmp_path, sym="true", strategy="group", gs="32", more="", fmt=""):
    """INT4_GROUP with these values, written to TMP_PATH/r.yaml."""
    path = tmp_path / "r.yaml"
    path.write_text(INT4_GROUP.format(sym=sym, strategy=strategy, gs=gs, more=more, fmt=fmt))
    return path
