"""``eval``: run the release benchmarks on a model and keep every item's outcome.

lm-eval runs the tasks through its Python API. With ``--data-dir`` (the hub's schema, as in
shared/evaldata) each task is an lm-eval task YAML written into RUN_DIR that reads the local
JSONL files; without it lm-eval's own hub-backed tasks run. The in-process ``hf`` engine loads
the model with quantkit's strict loader (so INT4 MoE experts are really there) and can emulate
an FP8 KV cache with the checkpoint's calibrated scales.

RUN_DIR keeps ``run.json`` (provenance), ``samples/<task>.jsonl`` (per item: id, prompt hash,
correct, choice log-likelihoods, gold), ``results.json`` (scores with stderr) and lm-eval's
request cache, so a re-run with the same RUN_DIR resumes from cached requests.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from quantkit.errors import QuantkitError
from quantkit.shard_writer import sha256_file

# Zero-shot tasks over local files in the hub's schema. {data} is the data directory.
TASKS = {
    "arc_easy": {
        "file": "arc_easy/test.jsonl",
        "output_type": "multiple_choice",
        "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_target": "{{choices.label.index(answerKey)}}",
        "doc_to_choice": "{{choices.text}}",
        "metric": "acc",
    },
    "arc_challenge": {
        "file": "arc_challenge/test.jsonl",
        "output_type": "multiple_choice",
        "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_target": "{{choices.label.index(answerKey)}}",
        "doc_to_choice": "{{choices.text}}",
        "metric": "acc",
    },
    "mmlu": {
        "file": "mmlu/test.jsonl",
        "output_type": "multiple_choice",
        "doc_to_text": "{{question.strip()}}\nA. {{choices[0]}}\nB. {{choices[1]}}\nC. {{choices[2]}}\nD. {{choices[3]}}\nAnswer:",
        "doc_to_target": "answer",
        "doc_to_choice": ["A", "B", "C", "D"],
        "metric": "acc",
    },
    "mmlu_pro": {
        "file": "mmlu_pro/test.jsonl",
        "output_type": "multiple_choice",
        "doc_to_text": "{{question.strip()}}\nAnswer:",
        "doc_to_target": "answer_index",
        "doc_to_choice": "{{options}}",
        "metric": "acc",
    },
    "gsm8k": {
        "file": "gsm8k/test.jsonl",
        "output_type": "generate_until",
        "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_target": "{{answer.split('####')[-1].strip()}}",
        "metric": "exact_match",
    },
}
SEEDS = {"random_seed": 0, "numpy_random_seed": 1234, "torch_random_seed": 1234, "fewshot_random_seed": 1234}


@dataclass
class EvalResult:
    model: str
    run_dir: str
    engine: str
    scores: dict[str, dict[str, float]]  # task -> {"score", "stderr", "n"}
    seconds: float


def task_yaml(task: str, data_dir: Path) -> tuple[str, str]:
    """The lm-eval YAML for a task over local data, and a hash that names the data by content."""
    import yaml

    spec = TASKS[task]
    data = data_dir / spec["file"]
    if not data.is_file():
        raise QuantkitError(f"missing data file for task {task}", data)
    doc = {
        "task": f"quantkit_{task}",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data.resolve())}},
        "output_type": spec["output_type"],
        "test_split": "test",
        "doc_to_text": spec["doc_to_text"],
        "doc_to_target": spec["doc_to_target"],
    }
    if spec["output_type"] == "multiple_choice":
        doc["doc_to_choice"] = spec["doc_to_choice"]
        doc["metric_list"] = [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]
    else:
        doc["generation_kwargs"] = {"until": ["Question:", "\n\n"], "do_sample": False, "max_gen_toks": 256}
        doc["filter_list"] = [{"name": "flexible-extract", "filter": [
            {"function": "regex", "group_select": -1, "regex_pattern": r"(-?[$0-9.,]{2,})|(-?[0-9]+)"},
            {"function": "take_first"}]}]
        doc["metric_list"] = [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                               "ignore_case": True, "ignore_punctuation": False,
                               "regexes_to_ignore": [",", r"\$", "(?s).*#### ", r"\.$"]}]
    identity = dict(doc, dataset_kwargs={"data_sha256": sha256_file(data)})
    return yaml.safe_dump(doc, sort_keys=False), hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def model_checksums(path: Path) -> dict[str, str]:
    from quantkit.checkpoint import open_checkpoint
    from quantkit.manifest import load_manifest

    manifest = load_manifest(path)
    shards = open_checkpoint(path).shards
    if manifest is not None and all(s.name in manifest.shards for s in shards):
        return {s.name: manifest.shards[s.name].sha256 for s in shards}
    return {s.name: sha256_file(s.path) for s in shards}


def evaluate(
    model: str | os.PathLike,
    engine: str = "hf",
    tasks: list[str] | None = None,
    data_dir: str | os.PathLike | None = None,
    limit: int | None = None,
    kv_cache_dtype: str = "auto",
    out: str | os.PathLike | None = None,
    batch_size: int = 8,
) -> EvalResult:
    import lm_eval
    import torch
    import transformers
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    from quantkit.checkpoint import open_checkpoint
    from quantkit.families import detect_family
    from quantkit.kv_cache import kv_hooks, kv_scales_of
    from quantkit.modeling import load_model

    started = time.perf_counter()
    if engine != "hf":
        raise QuantkitError(f"engine {engine!r} is not available in this version (hf only)")
    tasks = tasks or list(TASKS)
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise QuantkitError(f"unknown task {unknown[0]} (known: {', '.join(TASKS)})")
    if kv_cache_dtype not in ("auto", "fp8_e4m3"):
        raise QuantkitError("--kv-cache-dtype must be auto or fp8_e4m3")
    path = Path(model)
    scales = kv_scales_of(path) if kv_cache_dtype == "fp8_e4m3" else None
    if kv_cache_dtype == "fp8_e4m3" and not scales:
        raise QuantkitError("--kv-cache-dtype fp8_e4m3: no k_scale/v_scale tensors; run calibrate-kv first", path)
    run_dir = Path(out) if out else Path("runs") / path.name
    (run_dir / "samples").mkdir(parents=True, exist_ok=True)
    (run_dir / "tasks").mkdir(exist_ok=True)

    task_hashes = {}
    names = []
    for task in tasks:
        if data_dir is None:
            names.append(task)
            task_hashes[task] = f"lm-eval builtin {task}"
            continue
        text, digest = task_yaml(task, Path(data_dir))
        (run_dir / "tasks" / f"quantkit_{task}.yaml").write_text(text)
        names.append(f"quantkit_{task}")
        task_hashes[task] = digest

    tokenizer = AutoTokenizer.from_pretrained(path)
    template = getattr(tokenizer, "chat_template", None) or ""
    config = open_checkpoint(path).config
    provenance = {
        "model": str(path.resolve()),
        "model_checksums": model_checksums(path),
        "engine": {"name": engine, "version": f"transformers {transformers.__version__}, torch {torch.__version__}",
                   "args": {"kv_cache_dtype": kv_cache_dtype, "batch_size": batch_size, "dtype": "model"}},
        "lm_eval_version": lm_eval.__version__,
        "tasks": {t: {"config_sha256": task_hashes[t], "num_fewshot": 0, "limit": limit} for t in tasks},
        "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest(),
        "chat_template_applied": False,
        "seeds": SEEDS,
    }
    _check_same_run(run_dir, provenance)
    (run_dir / "run.json").write_text(json.dumps(provenance, indent=2) + "\n")

    lm_model = load_model(path)
    lm = HFLM(pretrained=lm_model, tokenizer=tokenizer, batch_size=batch_size)
    manager = TaskManager(include_path=str(run_dir / "tasks")) if data_dir is not None else TaskManager()
    emulate = kv_hooks(lm_model, detect_family(config).attention, scales=scales) if scales else nullcontext()
    with emulate:
        result = lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=manager, limit=limit, log_samples=True,
                                         use_cache=str(run_dir / "cache" / "requests"), **SEEDS)
    scores = {}
    for task, name in zip(tasks, names):
        metric = TASKS[task]["metric"]
        rows = result["samples"][name]
        key = next(k for k in result["results"][name] if k.startswith(metric + ",") and "stderr" not in k)
        scores[task] = {"score": 100 * result["results"][name][key],
                        "stderr": 100 * result["results"][name].get(key.replace(",", "_stderr,", 1), 0.0), "n": len(rows)}
        with open(run_dir / "samples" / f"{task}.jsonl", "w") as f:
            for row in rows:
                record = {"item_id": f"{task}-{row['doc_id']}", "prompt_hash": row["prompt_hash"],
                          "correct": int(row[metric] > 0), "gold": row["target"] if isinstance(row["target"], int) else None}
                if TASKS[task]["output_type"] == "multiple_choice":
                    record["choice_logprobs"] = [float(r[0]) for r in row["filtered_resps"]]
                else:
                    record["response"] = row["filtered_resps"][0] if row["filtered_resps"] else ""
                f.write(json.dumps(record) + "\n")
    (run_dir / "results.json").write_text(json.dumps(scores, indent=2) + "\n")
    return EvalResult(str(path), str(run_dir), engine, scores, time.perf_counter() - started)


def _check_same_run(run_dir: Path, provenance: dict) -> None:
    """A RUN_DIR resumes only the same run: cached requests of another model or setup would lie."""
    previous = run_dir / "run.json"
    if previous.is_file():
        old = json.loads(previous.read_text())
        for key in ("model", "model_checksums", "engine", "tasks"):
            if old.get(key) != provenance.get(key):
                raise QuantkitError(f"holds a run with a different {key}; use another --out", run_dir)
