"""The model card (README.md) of a published checkpoint: hub metadata, the gate, how to serve it.

The YAML front matter comes from huggingface_hub's ``ModelCardData`` (``model-index`` included);
the rest is Markdown built from what the files say: the manifest (source, recipe), the gate
verdict, the candidate's run provenance, and inspect's parameter count, which reads packed INT4
as the weights it stands for (the hub's counter sees one int32 per eight weights).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import quantkit
from quantkit.checkpoint.config import ModelConfig
from quantkit.engines.launch import SGLangLaunch, vllm_serve
from quantkit.errors import QuantkitError
from quantkit.evaluation.run_dir import read_run_record
from quantkit.inert import markdown_cell, markdown_code, markdown_text, visible

if TYPE_CHECKING:
    from quantkit.release.verdict import GateReport

# task -> (hub dataset, name, config, metric)
DATASETS = {
    "gsm8k": ("openai/gsm8k", "GSM8K", "main", "exact_match"),
    "arc_easy": ("allenai/ai2_arc", "ARC-Easy", "ARC-Easy", "accuracy"),
    "arc_challenge": ("allenai/ai2_arc", "ARC-Challenge", "ARC-Challenge", "accuracy"),
    "mmlu": ("cais/mmlu", "MMLU", "all", "accuracy"),
    "mmlu_pro": ("TIGER-Lab/MMLU-Pro", "MMLU-Pro", None, "accuracy"),
}
FORMAT_TAGS = {"pack-quantized": ["int4", "w4a16"], "float-quantized": ["fp8"]}
FORMAT_WORDS = {"pack-quantized": "INT4 group-quantized (`pack-quantized`)",
                "float-quantized": "FP8 (`float-quantized`)"}


def scheme_words(scheme) -> tuple[str, str]:
    """A config group's weights and activations, as a reader of the card says them."""
    w, a = scheme.weights, scheme.input_activations
    if w is None:
        weights = "as stored"
    elif w.type == "int":
        size = f"group {w.group_size}" if w.strategy == "group" else w.strategy
        weights = f"INT{w.num_bits} {'symmetric' if w.symmetric else 'asymmetric'}, {size}"
    else:
        how = {"channel": "a scale per output row", "block": "a scale per "
               + "x".join(str(b) for b in w.block_structure or ()) + " block", "tensor": "one scale"}
        weights = f"FP{w.num_bits} e4m3, {how.get(w.strategy or '', w.strategy)}"
    if a is None:
        activations = "model dtype (weight-only)"
    else:
        per = {"token": "per token", "group": f"per group of {a.group_size}", "tensor": "per tensor"}
        activations = (f"FP{a.num_bits} {'dynamic' if a.dynamic else 'static'} {per.get(a.strategy or '', a.strategy)}"
                       if a.type == "float" else f"INT{a.num_bits} {per.get(a.strategy or '', a.strategy)}")
    return weights, activations


def pool(config: ModelConfig) -> str:
    """Which of the recipe's two GPU pools this checkpoint is made for: prefill runs FP8 weights with a BF16 KV cache,
    decode INT4 weights with an FP8 KV cache (a checkpoint that is neither says so)."""
    formats, fp8_kv = config.quantization.group_formats(), bool(config.quantization.kv_cache_scheme)
    if "pack-quantized" in formats and fp8_kv:
        return "decode (INT4 weights, FP8 KV cache)"
    if formats == {"float-quantized"} and not fp8_kv:
        return "prefill (FP8 weights, BF16 KV cache)"
    return "neither pool's exact formats (prefill: FP8 weights + BF16 KV; decode: INT4 weights + FP8 KV)"


def _formats(config: ModelConfig) -> list[str]:
    """The compressed-tensors formats the checkpoint's groups use, in a fixed order."""
    used = config.quantization.group_formats()
    return [f for f in FORMAT_TAGS if f in used]


def front_matter(source_card: Path | None) -> dict:
    """The YAML header of a card, or {} (a source without a card, or with none at its top)."""
    import yaml

    if source_card is None or not source_card.is_file():
        return {}
    text = source_card.read_text(errors="replace")
    if not text.startswith("---"):
        return {}
    head = text[3:].split("\n---", 1)[0]
    try:
        data = yaml.safe_load(head)
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


def hub_id(value: str, what: str) -> str:
    """``value`` if it is a valid hub model id by the hub's own rules (huggingface_hub's validate_repo_id),
    else a one-line error: the card's metadata and text never carry an id the hub would not accept."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(value)
    except HFValidationError as exc:
        raise QuantkitError(f"{what} {value!r} is not a hub model id: {str(exc).splitlines()[0]}") from exc
    return value


def _source_base_model(meta: dict) -> str | None:
    """The source card's ``base_model`` when it is one valid hub id; anything else in a file quantkit did not
    write is left out of the card rather than copied into it."""
    value = meta.get("base_model")
    try:
        return hub_id(value, "base_model") if isinstance(value, str) else None
    except QuantkitError:
        return None


def serving_tp(total_bytes: int) -> int:
    """Fewest H200s (a power of two) whose memory holds the weights with 30 % left for the KV cache (the memory
    the GPU reports, plan.GPUS)."""
    from quantkit.plan import GPUS

    need = max(1, math.ceil(total_bytes / (0.7 * GPUS["h200"])))
    return 1 << (need - 1).bit_length()


def model_card(dst: Path, repo: str, verdict: GateReport | None, base_model: str | None = None,
               pools: list[str] | None = None) -> str:
    from huggingface_hub import EvalResult, ModelCardData

    from quantkit.checkpoint.inspection import inspect_checkpoint
    from quantkit.checkpoint.manifest import load_manifest
    from quantkit.checkpoint.reader import read_config

    manifest = load_manifest(dst)
    source = Path(manifest.source_path) if manifest else None
    source_meta = front_matter(source / "README.md" if source else None)
    after = inspect_checkpoint(dst)
    before = inspect_checkpoint(source) if source and (source / "config.json").is_file() else None
    config = read_config(dst)
    fp8_kv = bool(config.quantization.kv_cache_scheme)
    name = repo.removeprefix("file://").rstrip("/").split("/")[-1] if repo.startswith("file://") else repo
    base_model = hub_id(base_model, "--base-model") if base_model is not None else _source_base_model(source_meta)

    formats = _formats(config)
    tags = ["quantkit", "compressed-tensors"] + [t for f in formats for t in FORMAT_TAGS[f]]
    tags += ["fp8-kv-cache"] if fp8_kv else []
    if config.is_moe:
        tags.append("mixture-of-experts")
    results = []
    for t in verdict.tasks if verdict else []:
        dataset, pretty, subset, metric = DATASETS.get(t.task, (t.task, t.task, None, "accuracy"))
        results.append(EvalResult(task_type="text-generation", dataset_type=dataset, dataset_name=pretty,
                                  dataset_config=subset, dataset_split="test", metric_type=metric,
                                  metric_value=round(t.candidate, 2)))
    data = ModelCardData(
        license=source_meta.get("license"),
        base_model=base_model,
        tags=tags,
        library_name="transformers",
        pipeline_tag="text-generation",
        model_name=name,
        eval_results=results or None,
    )

    lines = ["---", data.to_yaml().strip(), "---", "", f"# {markdown_text(name)}", ""]
    recipe = manifest.recipe_name if manifest else "unknown"
    described = " + ".join(FORMAT_WORDS[f] for f in formats) or "BF16"
    origin = base_model or (source.name if source else "the source")
    lines += [f"{described} ([compressed-tensors](https://github.com/vllm-project/compressed-tensors)) conversion of "
              f"{markdown_code(origin)} made with quantkit {quantkit.__version__}, recipe {markdown_code(recipe)}"
              + (", with calibrated FP8 (e4m3) KV-cache scales." if fp8_kv else "."), ""]
    lines += pools or []
    lines += _formats_section(config)
    lines += _gate_section(verdict)
    tp = serving_tp(after.total_bytes)
    served = visible(name)  # a folder name is data: the builders quote it as one shell word, whatever it holds
    sglang = SGLangLaunch(served, tp=tp, kv_cache_dtype="fp8_e4m3" if fp8_kv else "auto").command()
    lines += ["## Serving", "", "SGLang:", "", "```bash", sglang, "```", "", "vLLM:", "", "```bash",
              vllm_serve(served, tp, fp8_kv), "```", "",
              f"(`{tp}` is the fewest H200s that hold the weights with 30 % of memory left for the KV cache; "
              "`quantkit plan` sizes a deployment exactly.)", ""]
    if fp8_kv:
        lines += _kv_scale_section(dst, config)
    lines += ["## Size", "", "| | parameters | bytes on disk |", "|---|---|---|"]
    if before is not None:
        lines.append(f"| source | {before.total_params:,} | {before.total_bytes / 1e9:.3f} GB |")
    lines.append(f"| this checkpoint | {after.total_params:,} | {after.total_bytes / 1e9:.3f} GB |")
    if "pack-quantized" in formats:
        lines += ["", "The parameter count is the true one: each packed int32 holds eight INT4 weights, which the "
                  "hub's counter reads as one parameter."]
    lines.append("")
    lines += _provenance_section(manifest, verdict)
    return "\n".join(lines) + "\n"


def pools_section(pools: list, verdicts: dict[str, GateReport | None]) -> list[str]:
    """The deployment's pools, the same on every pool's card: what each serves, in which formats, with which KV
    cache, and its gate (``pools``: release/pools.py's PoolResult, prefill first)."""
    from quantkit.checkpoint.inspection import inspect_checkpoint
    from quantkit.checkpoint.reader import read_config

    lines = ["## The deployment's two pools", "",
             "Prefill and decode run in separate GPU pools, each serving its own artifact of the same source; both "
             "were made by quantkit " + quantkit.__version__ + " and each gated against the same run of the source.",
             "", "| pool | serve | weights | activations at run time | KV cache | bytes | gate |",
             "|---|---|---|---|---|---|---|"]
    for p in pools:
        model = Path(p.model)
        config = read_config(model)
        weights, activations = _artifact_words(config)
        kv = "FP8 e4m3, calibrated" if config.quantization.kv_cache_scheme else "BF16"  # as its files say
        verdict = verdicts.get(p.name)
        gate = ("pass: " + ", ".join(f"{t.task} {t.delta:+.2f} [{t.low:+.2f}, {t.high:+.2f}]" for t in verdict.tasks)
                if verdict else "none: the source as released is the baseline itself")
        serve = p.published if p.published else str(model)
        lines.append(f"| {p.name} | {markdown_code(visible(serve))} | {markdown_cell(weights)} | "
                     f"{markdown_cell(activations)} | {kv} | {inspect_checkpoint(model).total_bytes / 1e9:.3f} GB | "
                     f"{markdown_cell(gate)} |")
    return lines + ["", "Gate: the change in each task's score against the source, with its 95 % interval (a pool "
                    "passes when the interval's lower end is above minus the task's margin).", ""]


def _artifact_words(config: ModelConfig) -> tuple[str, str]:
    """What one artifact stores and runs, its config groups' words joined (a source as released: its own method)."""
    described = config.quantization.compressed()
    if described is None or not described.config_groups:
        q = config.quantization  # block-FP8 kernels quantize each input per token in groups of 128 (docs/verify.md)
        return (f"as released ({q.describe()})",
                "FP8 dynamic per token, in groups of 128" if q.fp8_release else "model dtype")
    words = [scheme_words(s) for s in described.config_groups.values()]
    return ("; ".join(dict.fromkeys(w for w, _ in words)), "; ".join(dict.fromkeys(a for _, a in words)))


def _formats_section(config: ModelConfig) -> list[str]:
    """The pool it serves and, per config group, what is stored and what the engine does at run time."""
    described = config.quantization.compressed()
    lines = ["## Formats", "", f"Made for the **{pool(config)}** pool of a prefill/decode deployment.", ""]
    if described is None or not described.config_groups:
        return lines
    lines += ["| group | modules | weights | activations at run time | stored as |", "|---|---|---|---|---|"]
    for name, scheme in described.config_groups.items():
        weights, activations = scheme_words(scheme)
        targets = ", ".join(t for t in scheme.targets if len(t) <= 80) or f"{len(scheme.targets)} patterns"
        lines.append(f"| {markdown_cell(name)} | {markdown_cell(targets)} | {weights} | {activations} | "
                     f"`{scheme.format or described.format}` |")
    kv = "FP8 e4m3, calibrated per layer" if config.quantization.kv_cache_scheme else "the model's dtype (BF16)"
    kept = markdown_cell(", ".join(kept_modules(described.ignore or []))) or "-"
    lines += ["", f"KV cache: {kv}. Left in the model's dtype: {kept}.", ""]
    return lines


def kept_modules(names: list[str], shown: int = 12) -> list[str]:
    """The modules a recipe left alone, as a person reads them: one entry per module of every layer (``layers.*``),
    the first ``shown`` of them and how many more (a GLM-5 checkpoint leaves thousands of names)."""
    import re

    entries = list(dict.fromkeys(re.sub(r"\.layers\.\d+\.", ".layers.*.", n) for n in names))
    return entries[:shown] + ([f"and {len(entries) - shown} more"] if len(entries) > shown else [])


def _kv_scale_section(dst: Path, config: ModelConfig) -> list[str]:
    """Per engine, where its loader puts the calibrated KV scales and which attention backends use them
    (read in its source: engines/kv_scales.py, engines/loaders.py)."""
    from quantkit.checkpoint.reader import open_checkpoint
    from quantkit.engines.kv_scales import engine_usage, is_kv_scale
    from quantkit.engines.loaders import loader_rules, unplaced_tensors
    from quantkit.engines.versions import SGLANG_VERSION, VLLM_VERSION

    names = sorted(n for n in open_checkpoint(dst).tensors if is_kv_scale(n))
    lines = ["### FP8 KV-cache scales", ""]
    for engine, usage in engine_usage(config).items():
        lines.append(f"- {engine}: {markdown_text(usage)}")
    for engine, version in (("sglang", SGLANG_VERSION), ("vllm", VLLM_VERSION)):
        rules = loader_rules(engine, config.model_type)
        skipped = unplaced_tensors(names, config, rules) if rules is not None else []
        if skipped:
            lines.append(f"- **{engine} {version} skips this checkpoint's scale tensors** "
                         f"({markdown_text(skipped[0].name)}: {markdown_text(skipped[0].reason)})")
    return lines + [""]


def _gate_section(verdict: GateReport | None) -> list[str]:
    if verdict is None:
        return ["## Evaluation", "", "**Not gated.** This checkpoint was published with `--force-ungated`: no "
                "comparison against the original model vouches for its accuracy.", ""]
    lines = ["## Release gate: PASS", "",
             f"Paired non-inferiority test against the original on the same items, {verdict.confidence:.2%} "
             f"intervals per task (correction: {verdict.correction}).", "",
             "| benchmark | n | original | this model | delta | interval | margin | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for t in verdict.tasks:
        lines.append(f"| {markdown_cell(t.task)} | {t.n} | {t.baseline:.2f} | {t.candidate:.2f} | {t.delta:+.2f} | "
                     f"[{t.low:+.2f}, {t.high:+.2f}] | -{t.margin:g} | {'pass' if t.passed else 'FAIL'} |")
    for c in verdict.behaviour:
        if c.check == "output length":
            lines.append(f"- {markdown_text(c.task)}, length of generated answers: {c.candidate:.1f} tokens against "
                         f"{c.baseline:.1f} "
                         f"(x{c.estimate:.3f}, interval [x{c.low:.3f}, x{c.high:.3f}], limit x{c.limit:.2f})")
        else:
            lines.append(f"- {markdown_text(c.task)}, runaway generations (length limit or loop): {c.candidate:.1f} "
                         f"% against "
                         f"{c.baseline:.1f} % ({c.estimate:+.2f} points, interval [{c.low:+.2f}, {c.high:+.2f}], "
                         f"limit +{c.limit:g})")
    by_task = {t.task: t for t in verdict.tasks}
    for f in verdict.noise:
        lines.append(f"- {markdown_text(f.task)}, engine noise: the original flips {f.flip_rate:.1f} % of items "
                     f"between two runs of "
                     f"itself; this model {by_task[f.task].flip_rate:.1f} % against it "
                     f"({by_task[f.task].engine_noise})")
    return lines + [""]


def _provenance_section(manifest, verdict: GateReport | None) -> list[str]:
    lines = ["## Provenance", "", f"- quantkit {quantkit.__version__}"]
    if manifest is not None:
        lines += [f"- source fingerprint {markdown_code(manifest.source_fingerprint)}",
                  f"- recipe {markdown_code(manifest.recipe_name)} (sha256 "
                  f"{markdown_code(manifest.recipe_sha256[:16] + '…')})"]
    for role in ("baseline", "candidate"):
        run = Path(getattr(verdict, role)) if verdict else None
        if run is not None and (run / "run.json").is_file():
            meta = read_run_record(run)
            lines.append(f"- {role} evaluated with {markdown_text(meta.engine.name)} "
                         f"({markdown_text(meta.engine.version)}), lm-eval {markdown_text(meta.lm_eval_version)}")
    if verdict:
        lines.append(f"- gated files: {len(verdict.candidate_checksums)}, each bound by its sha256 in the verdict")
    return lines + [""]
