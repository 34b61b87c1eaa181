"""Run folders and suites written by hand, as eval and gate write them: what the gate, publish and card tests read."""

import json
import math

from quantkit.release.gate import gate


def write_run(folder, outcomes: dict[str, list[int]], model="m", engine="hf", logprobs=None):
    (folder / "samples").mkdir(parents=True)
    meta = {"model": model, "model_checksums": {"model-00001-of-00001.safetensors": model * 8},
            "engine": {"name": engine, "version": "1"}, "tasks": {t: {"num_fewshot": 0} for t in outcomes}}
    (folder / "run.json").write_text(json.dumps(meta))
    for task, values in outcomes.items():
        rows = []
        for i, v in enumerate(values):
            row = {"item_id": f"{task}-{i}", "prompt_hash": f"h{i}", "correct": v}
            if logprobs is not None:
                row.update(choice_logprobs=logprobs[task][i], gold=0)
            rows.append(json.dumps(row))
        (folder / "samples" / f"{task}.jsonl").write_text("\n".join(rows) + "\n")
    return folder


def suite(tmp_path, tasks, margin=1.0, **extra):
    path = tmp_path / "suite.yaml"
    lines = [f"{k}: {v}" for k, v in extra.items()] + ["tasks:"] + [f"  {t}: {{margin: {margin}}}" for t in tasks]
    path.write_text("\n".join(lines) + "\n")
    return path


def passing_verdict(model, folder):
    """FOLDER/gate/verdict.json: two equal runs of 200 ARC-Easy items gated at a 5-point margin, the candidate's
    run recording MODEL's files as what it ships and the baseline's the checkpoint MODEL was converted from (what
    publish checks them against), as eval records them."""
    from quantkit.checkpoint.manifest import load_manifest
    from quantkit.checkpoint.reader import open_checkpoint
    from quantkit.evaluation import model_checksums

    base = write_run(folder / "base", {"arc_easy": [1, 0, 1, 1] * 50})
    cand = write_run(folder / "cand", {"arc_easy": [1, 0, 1, 1] * 50})
    meta = json.loads((cand / "run.json").read_text())
    meta["model_checksums"] = model_checksums(model)
    meta["model_fingerprint"] = open_checkpoint(model).fingerprint()
    (cand / "run.json").write_text(json.dumps(meta))
    meta = json.loads((base / "run.json").read_text())
    meta["model_fingerprint"] = load_manifest(model).source_fingerprint
    (base / "run.json").write_text(json.dumps(meta))
    gate(base, cand, suite=suite(folder, ["arc_easy"], margin=5.0), report_dir=folder / "gate")
    return folder / "gate" / "verdict.json"


# Nine levels of ten aliases each: a few hundred bytes that expand to 10^9 strings.
BILLION_LAUGHS = "l0: &l0 [lol]\n" + "".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]\n" for i in range(1, 10))


def write_generations(folder, tokens, correct=None, model="m", batch_size=None, limit=256):
    write_run(folder, {"gsm8k": correct or [1] * len(tokens)}, model=model)
    rows = []
    for i, n in enumerate(tokens):
        rows.append(json.dumps({"item_id": f"gsm8k-{i}", "prompt_hash": f"h{i}", "correct": (correct or [1] * len(tokens))[i],
                                "generated_tokens": n, "hit_limit": n >= limit, "repetition": 0.0}))
    (folder / "samples" / "gsm8k.jsonl").write_text("\n".join(rows) + "\n")
    if batch_size is not None:
        meta = json.loads((folder / "run.json").read_text())
        meta["engine"]["args"] = {"batch_size": batch_size}
        (folder / "run.json").write_text(json.dumps(meta))
    return folder


def write_seeded(folder, task, outcomes, population, fraction=None, model="m"):
    """A run of ``task`` in the seeded order: the first ``fraction`` of ``population`` items (baseline: all, in file
    order)."""
    from quantkit.evaluation.run_dir import seeded_order

    (folder / "samples").mkdir(parents=True)
    seeded = fraction is not None
    count = math.ceil(fraction * population) if seeded else population
    ids = seeded_order(population)[:count] if seeded else list(range(population))
    identity = {"num_fewshot": 0, "items": count, "population": population, "order": "seeded" if seeded else "file",
                "limit": count if seeded else None}
    meta = {"model": model, "model_checksums": {"w.safetensors": model * 8}, "engine": {"name": "hf", "version": "1"},
            "tasks": {task: identity}}
    (folder / "run.json").write_text(json.dumps(meta))
    rows = [json.dumps({"item_id": f"{task}-{i}", "prompt_hash": f"h{i}", "correct": outcomes[i]}) for i in ids]
    (folder / "samples" / f"{task}.jsonl").write_text("\n".join(rows) + "\n")
    return folder


def evaluate_small(model, out, **kw):
    """Four ARC-Easy items of the demo's data on the CPU: an evaluation in a second or two."""
    from quantkit.evaluation import evaluate
    from quantkit.examples.demo import DATA

    return evaluate(model, tasks=["arc_easy"], data_dir=DATA, limit=4, out=out, batch_size=4, device="cpu", **kw)
