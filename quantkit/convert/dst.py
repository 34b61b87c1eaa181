"""DST: whether it may be written (new, or this job's own run), what a resumed run keeps, and the files that close a
run (side files, index, config.json with its quantization_config, the manifest marked complete)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from quantkit.checkpoint.config import ModelConfig
from quantkit.checkpoint.families import is_linear_weight
from quantkit.checkpoint.manifest import MANIFEST_NAME, Manifest, ManifestStatus, load_manifest
from quantkit.checkpoint.reader import INDEX_NAME, Checkpoint
from quantkit.checkpoint.writer import (
    LOCK_NAME,
    PARTIAL_SUFFIX,
    copy_file_atomic,
    work_folder,
    write_bytes_atomic,
    write_error,
)
from quantkit.convert.tensor_plan import ActionKind, ConversionPlan, OutputShard
from quantkit.errors import QuantkitError
from quantkit.formats.recipe import Recipe


class DifferentRun(QuantkitError):
    """DST holds a quantkit run of another source, recipe or layout."""


def make_folder(dst: Path) -> None:
    if dst.exists() and not dst.is_dir():
        raise QuantkitError("exists and is not a folder", dst)
    try:
        dst.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise write_error(dst, exc) from exc


def check_paths(src: Path, dst: Path) -> None:
    s, d = src.resolve(), dst.resolve()
    if d == s or s in d.parents:
        raise QuantkitError(f"DST must not be the source folder or inside it ({src})", dst)
    if d in s.parents:
        raise QuantkitError(f"DST must not contain the source folder ({src})", dst)


def prepare_dst(dst: Path, fresh: Manifest, resume: bool, force: bool) -> tuple[Manifest, bool]:
    """Decide whether DST is new, ours to resume, or someone else's; returns the manifest to
    continue and whether DST already holds this job, finished. Runs under DST's lock."""
    try:
        old = load_manifest(dst)
    except QuantkitError:
        if not force:
            raise
        old = None
    refuse_foreign(dst)
    finished = False
    if force:
        _clear_outputs(dst)
    elif old is not None:
        diffs = old.differences(fresh)
        if diffs:
            raise DifferentRun(f"holds another run (different {', '.join(diffs)}); use --force to replace it", dst)
        if not resume:
            raise QuantkitError("holds a previous run of this conversion; use --resume to finish it or --force", dst)
        fresh.shards = old.shards
        fresh.calibrated_layers, fresh.calibrated_modules = old.calibrated_layers, old.calibrated_modules
        finished = old.status == ManifestStatus.COMPLETE
    for stale in dst.glob(f".*{PARTIAL_SUFFIX}"):  # ours: no other writer holds the lock
        stale.unlink()
    if not finished:
        fresh.save(dst)  # status RUNNING, as every new manifest starts
    return fresh, finished


def refuse_foreign(dst: Path) -> None:
    """DST must be empty or hold a quantkit run: another folder's files are never written into or cleared (not even
    with --force)."""
    if any(p.name != LOCK_NAME and not p.name.endswith(PARTIAL_SUFFIX) for p in dst.iterdir()) and not (
            dst / MANIFEST_NAME).is_file():
        raise QuantkitError(f"holds other files and no {MANIFEST_NAME}, so it is not a quantkit output; "
                            "choose an empty or new folder", dst)


def _clear_outputs(dst: Path) -> None:
    for p in dst.glob("*.safetensors"):
        p.unlink()
    for name in (INDEX_NAME, MANIFEST_NAME, "config.json"):
        (dst / name).unlink(missing_ok=True)


def same_source(ckpt: Checkpoint, shards: list[OutputShard], manifest: Manifest, calibrated: frozenset[str],
                workers: int) -> None:
    """Each finished shard's source bytes, read again, are the ones it was made from: a source updated in place
    since (same names, sizes and headers) must not be mixed into this run's output."""
    from concurrent.futures import ThreadPoolExecutor

    from quantkit.checkpoint.reader import TensorReader
    from quantkit.checkpoint.source_digest import tensors_digest

    recorded = [(s, manifest.shards[s.name].source_digest) for s in shards]
    checked = [(s, digest) for s, digest in recorded if digest is not None]  # older manifests recorded none

    def now(shard: OutputShard) -> str:
        names = [n for a in shard.actions if a.module not in calibrated for n in a.sources]
        with TensorReader(ckpt) as reader:
            return tensors_digest(reader, names)

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for (shard, digest), current in zip(checked, pool.map(now, [s for s, _ in checked]), strict=True):
            if current != digest:
                files = sorted({ckpt.tensors[n].file for a in shard.actions for n in a.sources})
                raise DifferentRun(f"the source changed since this run started: {', '.join(files)} no longer hold the "
                                   f"bytes {shard.name} was made from; use --force to start over", ckpt.root)


def is_done(dst: Path, shard: OutputShard, manifest: Manifest, verify: bool) -> bool:
    """Whether a finished shard can be kept: recorded, present, and (``verify``) still the bytes recorded."""
    record = manifest.shards.get(shard.name)
    return record is not None and record.matches(dst / shard.name, rehash=verify)


def output_quantization_config(recipe: Recipe, plan: ConversionPlan, config: ModelConfig) -> dict:
    """quantization_config for config.json: compressed-tensors' JSON of the recipe's groups, with the names the
    serving engines match their own modules by.

    Only groups that quantized something are kept, so the config describes exactly the
    quantized tensors the checkpoint holds; the format is the single one used, or
    ``mixed-precision`` when groups differ. A block-FP8 group also targets the class ``Linear``: SGLang loads a fused
    Linear's block-FP8 scales with the block of the group that targets ``Linear`` and no other (0.5.23
    ``compressed_tensors.py:273-279``, ``linear.py:1051-1053``; 0.5.17 failed to load ``gate_up_proj`` without one).
    Exact names and regexes match before a class in SGLang, vLLM and compressed-tensors, and every Linear no group
    quantizes is ignored by name, so the class target gives no module another scheme. The JSON is
    formats/quant_config.py's, which tests/test_quant_config.py holds equal to compressed-tensors' own dump of the same
    config (importing compressed-tensors would add seconds of transformers imports to every conversion).
    """
    from importlib.metadata import version

    used = plan.weights_by_group
    groups = {name: scheme for name, scheme in recipe.config.config_groups.items() if name in used}
    formats = {scheme.format for scheme in groups.values()}
    fmt = formats.pop() if len(formats) == 1 else ("mixed-precision" if formats else "dense")
    ignore, targets = engine_names(recipe, config, linear_groups(plan))
    # the engines' names first: compressed-tensors (transformers) credits a module to the first target it matches
    # and warns about a target it credits with none, so a group's class target listed first would take them all
    groups = {name: scheme.model_copy(update={"targets": targets[name] + scheme.targets}) if targets.get(name)
              else scheme for name, scheme in groups.items()}
    block_fp8 = next((n for n, scheme in groups.items() if scheme.weights and scheme.weights.block_structure), None)
    if block_fp8 is not None:
        groups[block_fp8] = groups[block_fp8].model_copy(update={"targets": [*groups[block_fp8].targets, "Linear"]})
    written = recipe.config.model_copy(update={"config_groups": groups, "ignore": ignore,
                                               "quantization_status": "compressed", "format": fmt})
    return {"version": version("compressed-tensors"), "quant_method": "compressed-tensors",
            **written.model_dump(mode="json")}


_LINEAR_KINDS = (ActionKind.KEEP_FLOAT, ActionKind.DEQUANTIZE, ActionKind.INT4_DEQUANT)


def linear_groups(plan: ConversionPlan) -> dict[str, str | None]:
    """Every Linear of the output and the recipe group that quantized it (None: kept in the model dtype)."""
    return {a.module: a.group for s in plan.shards for a in s.actions
            if a.group is not None or (a.kind in _LINEAR_KINDS and is_linear_weight(a.outputs[0].name,
                                                                                    len(a.outputs[0].shape)))}


def engine_names(recipe: Recipe, config: ModelConfig,
                 groups: dict[str, str | None]) -> tuple[list[str], dict[str, list]]:
    """``ignore`` and each group's extra targets, so that SGLang and vLLM match every module of the model class
    they build (engines/schemes.py), as llm-compressor's outputs are matched: every Linear kept in the model dtype
    is ignored by its own name (SGLang refuses a Linear that matches neither ignore nor a target), and so is each
    engine-fused module (SGLang's ``qkv_proj``, ``gate_up_proj``) whose members all are; a fused module whose members
    a group quantizes gets a target naming it. The extra target also names the members, so that compressed-tensors
    in transformers, which warns about a target matching no module, matches it too."""
    from quantkit.engines.loaders import loader_rules
    from quantkit.engines.schemes import engine_modules
    from quantkit.formats.quant_config import any_matcher

    ignore = list(recipe.config.ignore or [])
    ignored = any_matcher(ignore) if ignore else (lambda name: False)
    fused: dict[str, dict[str, list[str]]] = {}
    for engine in ("sglang", "vllm"):
        rules = loader_rules(engine, config.model_type)
        for module in engine_modules(groups, config, rules) if rules is not None else []:
            members = {groups[m] for m in module.members}
            if module.kind == "linear" and module.name not in module.members and len(members) == 1:
                fused.setdefault(str(members.pop()), {})[module.name] = list(module.members)
    for name in sorted(fused.pop("None", {})):
        if not ignored(name):
            ignore.append(name)
    ignore += [module for module, group in groups.items() if group is None and not ignored(module)]
    targets: dict[str, list[str]] = {}
    for group, modules in fused.items():
        claimed = any_matcher(recipe.config.config_groups[group].targets)
        names = sorted({n for name, members in modules.items() if not claimed(name) for n in [name, *members]})
        if names:
            targets[group] = ["re:(?:" + "|".join(re.escape(n) for n in names) + ")$"]
    return ignore, targets


def finish(ckpt: Checkpoint, recipe: Recipe, plan: ConversionPlan, dst: Path, manifest: Manifest) -> None:
    for rel in ckpt.other_files:
        folder = work_folder(dst, Path(rel).parent)  # a link planted at DST/sub would send the copy elsewhere
        copy_file_atomic(ckpt.root / rel, folder / Path(rel).name)
    weight_map = {o.name: s.name for s in plan.shards for o in s.tensors}
    index = {"metadata": {"total_size": plan.output_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    write_bytes_atomic(dst / INDEX_NAME, (json.dumps(index, indent=2) + "\n").encode())
    config = ckpt.config.with_quantization(output_quantization_config(recipe, plan, ckpt.config))
    write_bytes_atomic(dst / "config.json", config.to_json())
    manifest.status = ManifestStatus.COMPLETE
    manifest.save(dst)
