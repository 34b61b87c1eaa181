"""The benchmark tasks: each one an lm-eval task YAML over local files in the hub's schema (or data quantkit builds,
the needle_<N>k tasks), named by its content so that two runs of the same task over the same bytes are comparable.

The YAML handed to lm-eval is written to a private temporary folder for each run (``TASK_DIR`` in it), never read from
RUN_DIR, whose files anyone who shares the folder may have changed.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from quantkit.errors import QuantkitError
from quantkit.evaluation.long_context import is_needle_task, needed_context, needle_jsonl, needle_spec
from quantkit.evaluation.run_dir import Order, TaskIdentity, seeded_order
from quantkit.evaluation.task_data import MAX_DATA_BYTES, check_task_data

# Zero-shot tasks over local files in the hub's schema. {data} is the data directory.
TASKS: dict[str, dict] = {
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
        "doc_to_text": "{{question.strip()}}\nA. {{choices[0]}}\nB. {{choices[1]}}\nC. {{choices[2]}}\nD. "
                       "{{choices[3]}}\nAnswer:",
        "doc_to_target": "answer",
        "doc_to_choice": ["A", "B", "C", "D"],
        "metric": "acc",
        "cluster": "subject",  # questions of one subject are not independent (gate.md, "Clusters")
    },
    "mmlu_pro": {
        "file": "mmlu_pro/test.jsonl",
        "output_type": "multiple_choice",
        "doc_to_text": "{{question.strip()}}\nAnswer:",
        "doc_to_target": "answer_index",
        "doc_to_choice": "{{options}}",
        "metric": "acc",
        "cluster": "category",
    },
    "gsm8k": {
        "file": "gsm8k/test.jsonl",
        "output_type": "generate_until",
        "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_target": "{{answer.split('####')[-1].strip()}}",
        "metric": "exact_match",
        "until": ["Question:", "\n\n"],
        "max_gen_toks": 256,
        "extract": r"(-?[$0-9.,]{2,})|(-?[0-9]+)",
    },
}
SEEDS = {"random_seed": 0, "numpy_random_seed": 1234, "torch_random_seed": 1234, "fewshot_random_seed": 1234}


TASK_DIR = "@TASK_DIR@"  # in a task YAML: the private folder its built data file is written to


@dataclass(frozen=True)
class TaskConfig:
    yaml: str | None  # the lm-eval task YAML; None: lm-eval's own (hub-backed) task
    digest: str  # names the task by content: its YAML with the original data's sha256 in place of the path
    items: int | None  # items in the data
    data: bytes | None = None  # a data file quantkit builds (needle_<N>k, a seeded order), written beside the YAML
    order: Order = "file"


def task_spec(task: str) -> dict:
    if is_needle_task(task):
        return needle_spec()
    if task not in TASKS:
        raise QuantkitError(f"unknown task {task} (known: {', '.join(TASKS)}, needle_<N>k)")
    return TASKS[task]


def task_yaml(task: str, data_dir: Path | None, tokenizer=None, order: Order = "file") -> TaskConfig:
    """The lm-eval YAML of a task over local data (or data quantkit builds), named by its content. ``seeded``: the
    rows are handed to lm-eval in run_dir.seeded_order, each carrying its index in the data (``quantkit_item``), so a
    limit takes a seeded prefix and every item keeps its id."""
    import yaml

    spec = task_spec(task)
    if is_needle_task(task):
        raw = needle_jsonl(task, tokenizer)
        location = f"{TASK_DIR}/quantkit_{task}.jsonl"
    else:
        data = data_dir / spec["file"]
        if not data.is_file():
            raise QuantkitError(f"missing data file for task {task}", data)
        if data.stat().st_size > MAX_DATA_BYTES:
            raise QuantkitError(f"over {MAX_DATA_BYTES >> 30} GiB: not the data of task {task}", data)
        raw = data.read_bytes()  # one read: the hash and the item count describe the same bytes
        location = str(data.resolve())
    doc = {
        "task": f"quantkit_{task}",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": location}},
        "output_type": spec["output_type"],
        "test_split": "test",
        "doc_to_text": spec["doc_to_text"],
        "doc_to_target": spec["doc_to_target"],
    }
    if spec["output_type"] == "multiple_choice":
        doc["doc_to_choice"] = spec["doc_to_choice"]
        doc["metric_list"] = [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]
    else:
        doc["generation_kwargs"] = {"until": spec["until"], "do_sample": False, "max_gen_toks": spec["max_gen_toks"]}
        doc["filter_list"] = [{"name": "flexible-extract", "filter": [
            {"function": "regex", "group_select": -1, "regex_pattern": spec["extract"]},
            {"function": "take_first"}]}]
        doc["metric_list"] = [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                               "ignore_case": True, "ignore_punctuation": False,
                               "regexes_to_ignore": [",", r"\$", "(?s).*#### ", r"\.$"]}]
    identity = dict(doc, dataset_kwargs={"data_sha256": hashlib.sha256(raw).hexdigest()})
    items = sum(1 for line in raw.splitlines() if line.strip()) if is_needle_task(task) else \
        check_task_data(task, raw, data)
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    built = raw if is_needle_task(task) else None
    if order == "seeded":
        rows = [line for line in raw.splitlines() if line.strip()]
        built = "".join(json.dumps(dict(json.loads(rows[i]), quantkit_item=i)) + "\n"
                        for i in seeded_order(len(rows))).encode()
        doc["dataset_kwargs"] = {"data_files": {"test": f"{TASK_DIR}/quantkit_{task}.jsonl"}}
    return TaskConfig(yaml.safe_dump(doc, sort_keys=False), digest, items, built, order)


def task_configs(tasks: list[str], data_dir: str | os.PathLike | None, model: Path,
                 tokenizer=None, order: Order = "file") -> dict[str, TaskConfig]:
    """Each task's config: an lm-eval YAML over the local data (or lm-eval's own task without ``data_dir``);
    needle_<N>k tasks are built with the model's tokenizer."""
    from quantkit.calibration_data import model_tokenizer

    check_context(tasks, model)
    needles = [t for t in tasks if is_needle_task(t)]
    if needles:
        tokenizer = tokenizer if tokenizer is not None else model_tokenizer(model)
    configs = {}
    for t in tasks:
        if is_needle_task(t):
            configs[t] = task_yaml(t, None, tokenizer, order)
        elif data_dir is None:
            if order != "file":
                raise QuantkitError(f"task {t}: a seeded order needs local data (--data-dir); lm-eval's own tasks "
                                    "come in their file's order")
            configs[t] = TaskConfig(None, f"lm-eval builtin {t}", None)
        else:
            configs[t] = task_yaml(t, Path(data_dir), order=order)
    return configs


Fraction = float | dict[str, float] | None  # a share of every task's items, or one per task (others: all)


def task_limits(configs: dict[str, TaskConfig], limit: int | None, fraction: Fraction) -> dict[str, int | None]:
    """Items each task evaluates: the first ``limit``, or the first ``fraction`` of its items (rounded up; a mapping
    gives each task its own, a task it does not name all), or all."""
    if fraction is None:
        return {t: limit for t in configs}
    share = {t: fraction.get(t, 1.0) if isinstance(fraction, dict) else fraction for t in configs}
    return {t: None if c.items is None or share[t] >= 1 else max(1, math.ceil(share[t] * c.items))
            for t, c in configs.items()}


def task_identities(configs: dict[str, TaskConfig], limit: int | None,
                    fraction: Fraction = None) -> dict[str, TaskIdentity]:
    """What names each task of a run in its provenance: config hash (YAML + data sha256), shots, limit, items scored,
    their order, how many the data holds, and the cluster key its records carry."""
    limits = task_limits(configs, limit, fraction)
    return {t: TaskIdentity(config_sha256=c.digest, num_fewshot=0, limit=limits[t],
                            items=None if c.items is None else min(c.items, limits[t] or c.items),
                            order=c.order, population=c.items, cluster_key=task_spec(t).get("cluster"))
            for t, c in configs.items()}


def check_context(tasks: list[str], model: Path) -> None:
    """A task longer than the model's context is refused here, naming it, rather than cut from the left (a needle
    document) or stopped by an assertion inside lm-eval (a generation limit of the whole context). A needle task
    is refused too when config.json does not say how long the context is: it would be truncated without a word."""
    from quantkit.checkpoint.reader import read_config

    context = read_config(model).max_context
    for task in tasks:
        if is_needle_task(task):
            needed = needed_context(task)
            if not context:
                raise QuantkitError(f"task {task} needs {needed:,} tokens of context and config.json does not say "
                                    "how many the model holds (no max_position_embeddings)", model / "config.json")
        elif task_spec(task)["output_type"] == "generate_until":
            needed = task_spec(task)["max_gen_toks"] + 1  # lm-eval keeps at least one token of prompt
        else:
            continue
        if context and needed > context:
            raise QuantkitError(f"task {task} needs {needed:,} tokens of context; max_position_embeddings "
                                f"is {context:,}", model / "config.json")
