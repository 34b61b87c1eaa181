"""quantkit's task definitions are lm-eval's own where they say so: the same prompt, answer and choices as the task
YAML lm-eval ships, read from the installed package; where quantkit differs on purpose, the test names it."""

from pathlib import Path

import lm_eval
import pytest
import yaml

from quantkit.evaluation.tasks import TASKS
import json
import shutil
from helpers import one_line_error, quantkit

LM_EVAL_TASKS = Path(lm_eval.__file__).parent / "tasks"
FIELDS = ("output_type", "doc_to_text", "doc_to_target", "doc_to_choice")


def lm_evals(relative: str) -> dict:
    """A task YAML of lm-eval's, its ``include`` resolved as lm-eval resolves it (the including file wins)."""
    path = LM_EVAL_TASKS / relative
    spec = yaml.safe_load(path.read_text())
    if "include" in spec:
        return {**lm_evals(str(path.parent.relative_to(LM_EVAL_TASKS) / spec.pop("include"))), **spec}
    return spec


@pytest.mark.parametrize(("task", "yaml_file"), [("arc_easy", "arc/arc_easy.yaml"),
                                                 ("arc_challenge", "arc/arc_challenge.yaml"),
                                                 ("mmlu", "mmlu/default/_default_template_yaml")])
def test_multiple_choice_tasks_are_lm_evals_own(task, yaml_file):
    theirs = lm_evals(yaml_file)
    assert {f: TASKS[task][f] for f in FIELDS} == {f: theirs[f] for f in FIELDS}
    assert TASKS[task]["metric"] == theirs["metric_list"][0]["metric"] == "acc"


def test_gsm8k_is_lm_evals_prompt_and_answer_extraction_zero_shot():
    theirs = lm_evals("gsm8k/gsm8k.yaml")
    ours = TASKS["gsm8k"]
    assert (ours["output_type"], ours["doc_to_text"]) == (theirs["output_type"], theirs["doc_to_text"])
    flexible = next(f for f in theirs["filter_list"] if f["name"] == "flexible-extract")["filter"][0]
    assert ours["extract"] == flexible["regex_pattern"] and ours["metric"] == "exact_match"
    # quantkit's choices, on purpose: zero shots (lm-eval's default is 5), and a blank line also ends an answer (with no
    # examples before it, a model's answer is not followed by another "Question:"); lm-eval adds the tokenizer's end
    # of text to the stops either way
    assert theirs["num_fewshot"] == 5 and "num_fewshot" not in ours
    assert ours["until"] == ["Question:", "\n\n"] and theirs["generation_kwargs"]["until"][0] == "Question:"


def test_a_needle_task_without_a_context_length_is_refused(llama_pair, tmp_path):
    base, _ = llama_pair
    model = tmp_path / "no-context"
    shutil.copytree(base, model)
    config = json.loads((model / "config.json").read_text())
    del config["max_position_embeddings"]
    (model / "config.json").write_text(json.dumps(config))
    r = quantkit("eval", model, "--tasks", "needle_1k", "--device", "cpu", "--out", tmp_path / "run")
    one_line_error(r, "config.json", "no max_position_embeddings")
    r = quantkit("eval", model, "--tasks", "needle_" + "9" * 5000 + "k", "--out", tmp_path / "run")
    one_line_error(r, "unknown task")


@pytest.mark.parametrize("content,message", [
    ('{"question": "q"\n', "line 1: not JSON"),
    ('{"question": "q", "choices": {"text": ["a", "b"], "label": ["A", "B"]}}\n', "line 1: 'answerKey' None"),
    ("\n\n", "no items"),
    ('{"question": "q", "choices": {"text": ["a"], "label": ["A", "B"]}, "answerKey": "A"}\n', "line 1: 'choices'"),
])
def test_bad_benchmark_data_is_one_line_naming_file_and_line(llama_pair, tmp_path, content, message):
    base, _ = llama_pair
    (tmp_path / "data" / "arc_easy").mkdir(parents=True)
    (tmp_path / "data" / "arc_easy" / "test.jsonl").write_text(content)
    r = quantkit("eval", base, "--tasks", "arc_easy", "--data-dir", tmp_path / "data", "--device", "cpu",
                 "--out", tmp_path / "run")
    one_line_error(r, "arc_easy/test.jsonl", message)
