"""One evaluation run into RUN_DIR: its provenance (run.json), the engine started for it, lm-eval over each task with a
request cache bound to the run (request_cache.py: a re-run resumes), and every item's outcome kept
(samples/<task>.jsonl, results.json)."""

from __future__ import annotations

import hashlib
import tempfile
from contextlib import ExitStack, contextmanager
from pathlib import Path

from quantkit.checkpoint.writer import work_folder
from quantkit.errors import QuantkitError
from quantkit.evaluation.engines import ENGINES
from quantkit.evaluation.eval_run import EvalRun
from quantkit.evaluation.generation import generation_stats
from quantkit.evaluation.identity import (
    cache_binding,
    check_same_family,
    check_same_run,
    model_checksums,
    model_family,
    previous_run,
)
from quantkit.evaluation.probe import probe
from quantkit.evaluation.run_dir import (
    RunRecord,
    SampleRecord,
    TaskScore,
    write_run_record,
    write_samples,
    write_scores,
)
from quantkit.evaluation.tasks import SEEDS, TASK_DIR, TaskConfig, task_identities, task_limits, task_spec


def evaluate_into(run: EvalRun, run_dir: Path, attempt: int) -> dict[str, TaskScore]:
    """Evaluate into RUN_DIR (locked by the caller); resumes from its request cache when it holds this run."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from quantkit.evaluation.progress import TaskProgress
    from quantkit.evaluation.request_cache import CachedLM, RequestCache

    work_folder(run_dir, "samples")
    cache_dir = work_folder(run_dir, "cache")
    provenance = _provenance(run)
    previous = previous_run(run_dir)
    check_same_family(run_dir, previous, provenance)
    with ExitStack() as stack:
        task_folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="quantkit-tasks-")))
        names = _write_task_files(run.configs, task_folder)
        engine = ENGINES[run.settings.engine].start(run, run_dir, stack)
        record = RunRecord(**provenance, engine=engine.record, server=engine.server)
        check_same_run(run_dir, previous, record)  # before the probe decodes two models for a run it would refuse
        if engine.url is not None:  # a server's load, checked (evaluation/probe.py)
            try:
                record = record.model_copy(update={"probe": probe(engine.lm, run.path)})
            except (QuantkitError, KeyboardInterrupt):
                raise
            except Exception as exc:
                engine.failed("the post-boot probe", exc)
        cache = RequestCache(cache_dir / "requests.jsonl", cache_binding(record, attempt))
        write_run_record(run_dir, record)

        built = [c.yaml is not None for c in run.configs.values()]
        # indexing lm-eval's own few thousand task files takes 10 s; a run of quantkit's files alone needs none
        manager = (TaskManager(include_path=str(task_folder), include_defaults=not all(built)) if any(built)
                   else TaskManager())
        stack.enter_context(_no_environment_probe())
        cached = CachedLM(engine.lm, cache)
        limits = task_limits(run.configs, run.settings.limit, run.fraction)
        scores = {}
        for task, name in zip(run.configs, names, strict=True):
            try:
                result = lm_eval.simple_evaluate(
                    model=TaskProgress(cached, task, run.on_progress), tasks=[name], task_manager=manager,
                    limit=limits[task], log_samples=True, **SEEDS)
            except (QuantkitError, KeyboardInterrupt):
                raise
            except Exception as exc:
                engine.failed(f"task {task}", exc)
            scores[task] = _task_samples(run_dir, task, result["samples"][name], result["results"][name],
                                         run.tokenizer)
    write_scores(run_dir, scores)
    return scores


def _provenance(run: EvalRun) -> dict:
    import lm_eval

    template = getattr(run.tokenizer, "chat_template", None) or ""
    return {
        "model": str(run.path.resolve()),
        "model_checksums": model_checksums(run.path),
        "model_fingerprint": _fingerprint(run.path),
        "model_family": model_family(run.path),
        "lm_eval_version": lm_eval.__version__,
        "tasks": task_identities(run.configs, run.settings.limit, run.fraction),
        "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest(),
        "chat_template_applied": False,
        "seeds": SEEDS,
    }


def _fingerprint(model: Path) -> str | None:
    from quantkit.checkpoint.reader import open_checkpoint

    try:
        return open_checkpoint(model).fingerprint()
    except QuantkitError:  # a model folder no conversion could have come from: nothing to bind a baseline to
        return None


def _write_task_files(configs: dict[str, TaskConfig], folder: Path) -> list[str]:
    """Each task's YAML (and the data quantkit built for it) in the run's private folder; the names lm-eval knows
    the tasks by."""
    names = []
    for task, config in configs.items():
        if config.yaml is not None:
            (folder / f"quantkit_{task}.yaml").write_text(config.yaml.replace(TASK_DIR, str(folder)))
        if config.data is not None:
            (folder / f"quantkit_{task}.jsonl").write_bytes(config.data)
        names.append(task if config.yaml is None else f"quantkit_{task}")
    return names


@contextmanager
def _no_environment_probe():
    """lm-eval ends every ``simple_evaluate`` by recording the environment: ``git describe`` in the working folder
    (which prints git's "fatal: not a git repository" outside a checkout) and torch's collect_env (2 s of
    subprocesses per task). quantkit keeps its own provenance in run.json and reads neither."""
    import lm_eval.evaluator as evaluator

    saved = evaluator.get_git_commit_hash, evaluator.add_env_info
    evaluator.get_git_commit_hash, evaluator.add_env_info = (lambda: None), (lambda storage: None)
    try:
        yield
    finally:
        evaluator.get_git_commit_hash, evaluator.add_env_info = saved


def _task_samples(run_dir: Path, task: str, rows: list[dict], results: dict, tokenizer) -> TaskScore:
    spec = task_spec(task)
    metric = spec["metric"]
    key = next(k for k in results if k.startswith(metric + ",") and "stderr" not in k)
    stderr = results.get(key.replace(",", "_stderr,", 1))
    score = TaskScore(score=100 * float(results[key]), n=len(rows),
                      stderr=100 * float(stderr) if isinstance(stderr, (int, float)) else 0.0)
    records = []
    cluster = spec.get("cluster")
    for row in rows:
        doc = row.get("doc") or {}
        index = doc.get("quantkit_item", row["doc_id"])  # a seeded order keeps each item's index in the data
        record = SampleRecord(item_id=f"{task}-{index}", prompt_hash=row["prompt_hash"],
                              correct=int(row[metric] > 0), gold=row["target"] if isinstance(row["target"],
                                                                                             int) else None,
                              cluster=str(doc[cluster]) if cluster and cluster in doc else None)
        if spec["output_type"] == "multiple_choice":
            record.choice_logprobs = [float(r[0]) for r in row["filtered_resps"]]
        else:
            record.response = row["filtered_resps"][0] if row["filtered_resps"] else ""
            raw = row["resps"][0][0] if row.get("resps") and row["resps"][0] else ""
            stats = generation_stats(tokenizer(raw, add_special_tokens=False)["input_ids"], spec["max_gen_toks"])
            record.generation, record.generated_tokens = raw, stats.tokens
            record.hit_limit, record.repetition = stats.hit_limit, round(stats.repetition, 4)
        records.append(record)
    write_samples(run_dir, task, records)
    return score
