"""``eval``: run the release benchmarks on a model and keep every item's outcome.

lm-eval runs the tasks through its Python API. With ``--data-dir`` (the hub's schema, as in
shared/evaldata) each task is an lm-eval task YAML that reads the local JSONL files; without it lm-eval's own hub-backed tasks run. The in-process ``hf`` engine loads
the model with quantkit's strict loader (so INT4 MoE experts are really there) and can emulate
an FP8 KV cache with the checkpoint's calibrated scales.

RUN_DIR keeps ``run.json`` (provenance), ``samples/<task>.jsonl`` (per item: id, prompt hash,
correct, choice log-likelihoods, gold), ``results.json`` (scores with stderr) and a request
cache of JSON lines (never pickles: request_cache.py), so a re-run with the same RUN_DIR resumes.
The task YAML handed to lm-eval is written to a private temporary folder for each run, never
read from RUN_DIR, whose files anyone who shares the folder may have changed.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from quantkit.checkpoint.writer import folder_lock, sha256_file, work_folder, write_error
from quantkit.errors import QuantkitError
from quantkit.evaluation.generation import generation_stats
from quantkit.evaluation.long_context import is_needle_task, needed_context, needle_jsonl, needle_spec
from quantkit.evaluation.run_dir import (
    EngineRecord,
    RunRecord,
    SampleRecord,
    TaskIdentity,
    TaskScore,
    read_run_record,
    read_scores,
    seeded_order,
    write_run_record,
    write_samples,
    write_scores,
)
from quantkit.evaluation.task_data import MAX_DATA_BYTES, check_task_data

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


@dataclass
class EvalResult:
    model: str
    run_dir: str
    engine: str
    scores: dict[str, dict[str, float]]  # task -> {"score", "stderr", "n"}
    seconds: float


TASK_DIR = "@TASK_DIR@"  # in a task YAML: the private folder its built data file is written to


@dataclass(frozen=True)
class TaskConfig:
    yaml: str | None  # the lm-eval task YAML; None: lm-eval's own (hub-backed) task
    digest: str  # names the task by content: its YAML with the original data's sha256 in place of the path
    items: int | None  # items in the data
    data: bytes | None = None  # a data file quantkit builds (needle_<N>k, a seeded order), written beside the YAML
    order: str = "file"


def task_spec(task: str) -> dict:
    if is_needle_task(task):
        return needle_spec()
    if task not in TASKS:
        raise QuantkitError(f"unknown task {task} (known: {', '.join(TASKS)}, needle_<N>k)")
    return TASKS[task]


def task_yaml(task: str, data_dir: Path | None, tokenizer=None, order: str = "file") -> TaskConfig:
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
                 tokenizer=None, order: str = "file") -> dict[str, TaskConfig]:
    """Each task's config: an lm-eval YAML over the local data (or lm-eval's own task without ``data_dir``);
    needle_<N>k tasks are built with the model's tokenizer."""
    _check_context(tasks, model)
    needles = [t for t in tasks if is_needle_task(t)]
    if needles:
        tokenizer = tokenizer if tokenizer is not None else _tokenizer(model)
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


def task_limits(configs: dict[str, TaskConfig], limit: int | None, fraction: float | None) -> dict[str, int | None]:
    """Items each task evaluates: the first ``limit``, or the first ``fraction`` of its items (rounded up), or all."""
    if fraction is None:
        return {t: limit for t in configs}
    return {t: None if c.items is None or fraction >= 1 else max(1, math.ceil(fraction * c.items))
            for t, c in configs.items()}


def task_identities(configs: dict[str, TaskConfig], limit: int | None,
                    fraction: float | None = None) -> dict[str, TaskIdentity]:
    """What names each task of a run in its provenance: config hash (YAML + data sha256), shots, limit, items scored,
    their order, how many the data holds, and the cluster key its records carry."""
    limits = task_limits(configs, limit, fraction)
    return {t: TaskIdentity(config_sha256=c.digest, num_fewshot=0, limit=limits[t],
                            items=None if c.items is None else min(c.items, limits[t] or c.items),
                            order=c.order, population=c.items, cluster_key=task_spec(t).get("cluster"))
            for t, c in configs.items()}


def _check_context(tasks: list[str], model: Path) -> None:
    """A task longer than the model's context is refused here, naming it, rather than cut from the left (a needle
    document) or stopped by an assertion inside lm-eval (a generation limit of the whole context). A needle task
    is refused too when config.json does not say how long the context is: it would be truncated without a word."""
    from quantkit.checkpoint.reader import read_config

    context = read_config(model).get("max_position_embeddings")
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
        if context and needed > int(context):
            raise QuantkitError(f"task {task} needs {needed:,} tokens of context; max_position_embeddings "
                                f"is {int(context):,}", model / "config.json")


def model_checksums(path: Path) -> dict[str, str]:
    """sha256 of every file that ships with the model (what publish uploads, less the card it
    writes), so a verdict binds the config, tokenizer and code as well as the weights. Shards
    the manifest records at their recorded size take its sha256 (hours of hashing saved on a
    700 GB model); publish hashes every file again before anything ships."""
    from quantkit.checkpoint.manifest import load_manifest
    from quantkit.checkpoint.reader import CARD_NAME, shipped_files

    manifest = load_manifest(path)
    recorded = manifest.shards if manifest is not None else {}
    sums = {}
    for f in shipped_files(path):
        name = f["name"]
        if name == CARD_NAME:
            continue
        record = recorded.get(name)
        sums[name] = record.sha256 if record is not None and record.size == f["bytes"] else sha256_file(path / name)
    return sums


ENGINES = ("hf", "sglang", "openai")
REPEAT_DIR = "repeat-2"  # RUN_DIR/repeat-2: the second run of ``--repeat 2`` (gate's default noise run)


def evaluate(
    model: str | os.PathLike,
    *,
    engine: str = "hf",
    tasks: list[str] | None = None,
    data_dir: str | os.PathLike | None = None,
    limit: int | None = None,
    kv_cache_dtype: str = "auto",
    out: str | os.PathLike | None = None,
    batch_size: int = 8,
    tp: int = 1,
    ep: int = 1,
    url: str | None = None,
    engine_cmd: str | None = None,
    mem_fraction: float | None = None,
    health_timeout: float = 1800.0,
    device: str = "auto",
    order: str = "file",
    fraction: float | None = None,
    on_progress: Callable[[str, int, int], None] | None = None,
    on_launch: Callable[[list[str]], None] | None = None,
    repeat: int = 1,
) -> EvalResult:
    """Score MODEL on the tasks with one engine and keep every item's outcome in RUN_DIR.

    ``hf`` runs the model in-process on ``device``; ``sglang`` starts a server from ``engine_cmd`` for the run
    and stops it after; ``openai`` talks to a running server at ``url``. For the server engines MODEL is
    still the local checkpoint: its tokenizer splits context from continuation, its checksums go
    into the provenance. ``batch_size`` is requests per forward pass (hf) or in flight (servers).
    ``engine_cmd`` is executable configuration: it runs as given, and ``on_launch(argv)`` is told first.
    ``repeat=2`` runs everything again into RUN_DIR/repeat-2 with a request cache of its own: the engine's
    run-to-run noise, which ``gate`` uses as its floor. RUN_DIR is locked while the run writes into it.
    ``order="seeded"`` evaluates each task's items in a fixed seeded order and ``fraction`` the first share of them
    (a look of a sequential gate: a later, larger look answers the earlier items from the request cache).
    """
    started = time.perf_counter()
    if engine not in ENGINES:
        raise QuantkitError(f"unknown engine {engine!r} (known: {', '.join(ENGINES)})")
    if repeat not in (1, 2):
        raise QuantkitError(f"repeat must be 1 or 2, not {repeat}")
    if engine == "openai" and not url:
        raise QuantkitError("--engine openai needs --url of a running OpenAI-compatible server")
    tasks = tasks or list(TASKS)
    for task in tasks:
        task_spec(task)
    if kv_cache_dtype not in ("auto", "fp8_e4m3"):
        raise QuantkitError("--kv-cache-dtype must be auto or fp8_e4m3")
    if order not in ("file", "seeded"):
        raise QuantkitError(f"--order must be file or seeded, not {order!r}")
    if fraction is not None and not (0 < fraction <= 1 and order == "seeded" and limit is None):
        raise QuantkitError("--fraction takes a share of the items in (0, 1], with --order seeded and no --limit")
    path = Path(model)
    run = _Run(path, engine, tasks, data_dir, limit, kv_cache_dtype, batch_size, tp, ep, url, engine_cmd,
               mem_fraction, health_timeout, device if engine == "hf" else None, on_progress, on_launch,
               order=order, fraction=fraction)
    if engine == "hf":
        from quantkit.devices import resolve_device
        from quantkit.kv.hooks import kv_scales_of

        run.device = resolve_device(device)
        run.scales = kv_scales_of(path) if kv_cache_dtype == "fp8_e4m3" else None
        if kv_cache_dtype == "fp8_e4m3" and not run.scales:
            raise QuantkitError("--kv-cache-dtype fp8_e4m3: no k_scale/v_scale tensors; run calibrate-kv first", path)
    run.tokenizer = _tokenizer(path)
    run.configs = task_configs(tasks, data_dir, path, run.tokenizer, order)  # bad data: refused before RUN_DIR exists
    run_dir = Path(out) if out else Path("runs") / path.name
    if run_dir.exists() and not run_dir.is_dir():
        raise QuantkitError("RUN_DIR exists and is not a folder", run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise write_error(run_dir, exc) from exc
    with folder_lock(run_dir):
        scores = _evaluate_into(run, run_dir, attempt=1)
        if repeat == 2:  # a fresh request cache: the engine answers everything again
            again = work_folder(run_dir, REPEAT_DIR)
            with folder_lock(again):
                _evaluate_into(run, again, attempt=2)
    return EvalResult(str(path), str(run_dir), engine, {t: s.model_dump() for t, s in scores.items()},
                      time.perf_counter() - started)


@dataclass
class _Run:
    """One evaluation's settings, as ``evaluate`` checked them (shared by its first run and its repeat)."""

    path: Path
    engine: str
    tasks: list[str]
    data_dir: str | os.PathLike | None
    limit: int | None
    kv_cache_dtype: str
    batch_size: int
    tp: int
    ep: int
    url: str | None
    engine_cmd: str | None
    mem_fraction: float | None
    health_timeout: float
    device: str | None  # hf: the device the model runs on
    on_progress: Callable[[str, int, int], None] | None
    on_launch: Callable[[list[str]], None] | None
    order: str = "file"
    fraction: float | None = None
    scales: dict | None = None  # hf with FP8 KV: the checkpoint's calibrated scales
    tokenizer: object = None
    configs: dict[str, TaskConfig] = field(default_factory=dict)

    def settings(self) -> dict:
        return engine_settings(self.engine, self.kv_cache_dtype, self.batch_size, self.tp, self.ep, self.mem_fraction,
                               self.device)


def cache_binding(record: RunRecord, attempt: int) -> str:
    """What the cached answers of a run are bound to: the model's files, the engine and its settings, the
    prompts' template and seeds, and which pass of ``--repeat`` produced them (a copied first pass must not
    stand in for the repeat whose differences measure the engine's noise)."""
    bound = record.model_dump(include={"model_checksums", "engine", "lm_eval_version", "chat_template_sha256",
                                       "chat_template_applied", "seeds"})
    return hashlib.sha256(json.dumps(dict(bound, attempt=attempt), sort_keys=True).encode()).hexdigest()


def _evaluate_into(run: _Run, run_dir: Path, attempt: int) -> dict[str, TaskScore]:
    """Evaluate into RUN_DIR (locked by the caller); resumes from its request cache when it holds this run."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from quantkit.evaluation.progress import TaskProgress
    from quantkit.evaluation.request_cache import CachedLM, RequestCache
    from quantkit.evaluation.sglang import EngineError

    path = run.path
    work_folder(run_dir, "samples")
    cache_dir = work_folder(run_dir, "cache")
    tokenizer, configs = run.tokenizer, run.configs
    template = getattr(tokenizer, "chat_template", None) or ""
    provenance = {
        "model": str(path.resolve()),
        "model_checksums": model_checksums(path),
        "model_family": model_family(path),
        "lm_eval_version": lm_eval.__version__,
        "tasks": task_identities(configs, run.limit, run.fraction),
        "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest(),
        "chat_template_applied": False,
        "seeds": SEEDS,
    }
    previous = _previous_run(run_dir)
    _check_same_family(run_dir, previous, provenance)

    server = None
    url = run.url
    with ExitStack() as stack:
        task_folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="quantkit-tasks-")))
        names = []
        for task, config in configs.items():
            if config.yaml is not None:
                (task_folder / f"quantkit_{task}.yaml").write_text(config.yaml.replace(TASK_DIR, str(task_folder)))
            if config.data is not None:
                (task_folder / f"quantkit_{task}.jsonl").write_bytes(config.data)
            names.append(task if config.yaml is None else f"quantkit_{task}")
        if run.engine == "hf":
            lm, engine_record = _hf_engine(path, tokenizer, run, stack)
        else:
            if run.engine == "sglang":
                from quantkit.evaluation.sglang import LaunchSpec, SGLangServer, engine_command, free_port

                spec = LaunchSpec(str(path.resolve()), tp=run.tp, ep=run.ep, kv_cache_dtype=run.kv_cache_dtype,
                                  mem_fraction=run.mem_fraction, port=free_port(), seed=SEEDS["random_seed"])
                server = SGLangServer(engine_command(run.engine_cmd), spec, run_dir / "server.log", run.health_timeout)
                if run.on_launch is not None:
                    run.on_launch(server.command)
                url = stack.enter_context(server)
            lm, engine_record, provenance["server"] = _api_engine(run.engine, url, path, run.batch_size,
                                                                  run.settings())
        record = RunRecord(**provenance, engine=engine_record)
        _check_same_run(run_dir, previous, record)
        cache = RequestCache(cache_dir / "requests.jsonl", cache_binding(record, attempt))
        write_run_record(run_dir, record)

        built = any(c.yaml is not None for c in configs.values())
        manager = TaskManager(include_path=str(task_folder)) if built else TaskManager()
        stack.enter_context(_no_environment_probe())
        cached = CachedLM(lm, cache)
        limits = task_limits(configs, run.limit, run.fraction)
        scores = {}
        for task, name in zip(run.tasks, names):
            try:
                result = lm_eval.simple_evaluate(
                    model=TaskProgress(cached, task, run.on_progress), tasks=[name], task_manager=manager,
                    limit=limits[task], log_samples=True, **SEEDS)
            except (QuantkitError, KeyboardInterrupt):
                raise
            except Exception as exc:
                if run.engine == "hf":
                    raise
                if server is not None:
                    server.check_alive(f"during task {task}")
                raise EngineError(f"{url} failed during task {task}: {_cause(exc)}") from exc
            scores[task] = _write_samples(run_dir, task, result["samples"][name], result["results"][name], tokenizer)
    write_scores(run_dir, scores)
    return scores


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


def engine_settings(engine: str, kv_cache_dtype: str, batch_size: int, tp: int = 1, ep: int = 1,
                    mem_fraction: float | None = None, device: str | None = None) -> dict:
    """The engine settings a run records and two compared runs must share (engine.args in run.json); for hf the
    kind of device (cpu, cuda), whose arithmetic differs."""
    if engine == "sglang":
        from quantkit.evaluation.sglang import LaunchSpec

        settings = LaunchSpec("", tp=tp, ep=ep, kv_cache_dtype=kv_cache_dtype, mem_fraction=mem_fraction,
                              seed=SEEDS["random_seed"]).settings()
    elif engine == "hf":
        settings = {"kv_cache_dtype": kv_cache_dtype, "dtype": "model",
                    "device": (device or "cpu").split(":")[0]}
    else:
        settings = {"kv_cache_dtype": kv_cache_dtype}
    return dict(settings, batch_size=batch_size)


def finished_run(run_dir: str | os.PathLike, model: str | os.PathLike, engine: str, tasks: list[str],
                 data_dir: str | os.PathLike | None, limit: int | None, settings: dict) -> bool:
    """Whether RUN_DIR already holds this evaluation, complete: same shards, tasks and engine settings.

    Decided without starting an engine, so a 700 GB baseline is not served again to be reused.
    """
    run_dir = Path(run_dir)
    try:
        meta = read_run_record(run_dir)
        scores = read_scores(run_dir)
    except QuantkitError:
        return False
    return (meta.model_checksums == model_checksums(Path(model))
            and meta.tasks == task_identities(task_configs(tasks, data_dir, Path(model)), limit)
            and meta.engine.name == engine
            and meta.engine.args == settings
            and set(scores) == set(tasks)
            and all((run_dir / "samples" / f"{t}.jsonl").is_file() for t in tasks))


def _tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise QuantkitError(f"no usable tokenizer ({exc})", path) from exc


def _hf_engine(path: Path, tokenizer, run: _Run, stack: ExitStack):
    import torch
    import transformers
    from lm_eval.models.huggingface import HFLM

    from quantkit.checkpoint.families import detect_family
    from quantkit.checkpoint.reader import open_checkpoint
    from quantkit.kv.hooks import kv_hooks
    from quantkit.modeling import load_model

    lm_model = load_model(path, device=run.device)
    if run.scales:
        attention = detect_family(open_checkpoint(path).config).attention
        stack.enter_context(kv_hooks(lm_model, attention, scales=run.scales))
    engine = EngineRecord(name="hf", version=f"transformers {transformers.__version__}, torch {torch.__version__}",
                          args=run.settings())
    return HFLM(pretrained=lm_model, tokenizer=tokenizer, batch_size=run.batch_size), engine


def _api_engine(engine: str, url: str, path: Path, batch_size: int, settings: dict):
    """lm-eval's completions client on a server; the server's own report of its version."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from quantkit.evaluation.sglang import EngineError, base_url, get_json, served_model

    url = base_url(url)
    served = served_model(url)
    try:  # only SGLang has this endpoint: another server's refusal or odd answer means "unknown"
        info = get_json(f"{url}/get_server_info")
        version = info.get("version", "unknown") if isinstance(info, dict) else "unknown"
    except (OSError, EngineError):
        version = "unknown"
    lm = LocalCompletionsAPI(model=served, base_url=f"{url}/v1/completions", tokenizer=str(path),
                             tokenizer_backend="huggingface", num_concurrent=batch_size, max_retries=3,
                             seed=SEEDS["random_seed"])
    engine_meta = EngineRecord(name=engine, version=str(version), args=dict(settings))
    return lm, engine_meta, {"url": url, "served_model": served}


def _cause(exc: BaseException) -> str:
    """The reason at the bottom of lm-eval's retry wrapping, on one line."""
    chain = [exc]
    while True:
        nxt = chain[-1].__cause__ or (None if chain[-1].__suppress_context__ else chain[-1].__context__)
        if nxt is None or nxt in chain:
            break
        chain.append(nxt)
    for e in chain:
        if isinstance(e, json.JSONDecodeError) or type(e).__name__ in ("JSONDecodeError", "ContentTypeError"):
            return f"malformed JSON in the response ({type(e).__name__}: {e})"[:300]
    return f"{type(chain[-1]).__name__}: {chain[-1]}".replace("\n", " ")[:300]


def _write_samples(run_dir: Path, task: str, rows: list[dict], results: dict, tokenizer) -> TaskScore:
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
                              correct=int(row[metric] > 0), gold=row["target"] if isinstance(row["target"], int) else None,
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


def model_family(path: Path) -> dict:
    """What makes two checkpoints the same model up to quantization: architecture and tokenizer."""
    from quantkit.checkpoint.reader import open_checkpoint

    config = open_checkpoint(path).config
    tokenizer = path / "tokenizer.json"
    return {"model_type": config.get("model_type"), "architectures": config.get("architectures"),
            "tokenizer_sha256": sha256_file(tokenizer) if tokenizer.is_file() else None}


def _previous_run(run_dir: Path) -> RunRecord | None:
    """The run RUN_DIR already holds, validated (a folder someone else wrote is read as data, strictly)."""
    if not (run_dir / "run.json").exists():
        return None
    try:
        return read_run_record(run_dir)
    except QuantkitError as exc:
        raise QuantkitError(f"{exc.message}; use another --out", exc.file) from exc


def _check_same_family(run_dir: Path, previous: RunRecord | None, provenance: dict) -> None:
    old = previous.model_family if previous is not None else None
    if old is not None and old != provenance["model_family"]:
        raise QuantkitError(f"holds a run of another model family ({old.get('model_type')}, tokenizer "
                            f"{str(old.get('tokenizer_sha256'))[:12]}) than {provenance['model']} "
                            f"({provenance['model_family']['model_type']}); use another --out", run_dir)


def _check_same_run(run_dir: Path, previous: RunRecord | None, record: RunRecord) -> None:
    """A RUN_DIR resumes only the same run: cached requests of another model or setup would lie. Seeded-order runs of
    the same tasks may differ in how many items they take: a later look of a sequential gate extends an earlier one."""
    if previous is None:
        return
    for key in ("model", "model_checksums", "engine", "tasks"):
        old, new = getattr(previous, key), getattr(record, key)
        if key == "tasks" and set(old) == set(new) and all(
                o.order == n.order == "seeded" for o, n in ((old[t], new[t]) for t in new)):
            old = {t: v.model_copy(update={"limit": None, "items": None}) for t, v in old.items()}
            new = {t: v.model_copy(update={"limit": None, "items": None}) for t, v in new.items()}
        if old != new:
            raise QuantkitError(f"holds a run with a different {key}; use another --out", run_dir)
