"""The engine's rules: its INT4 kernels' group sizes and per-rank input multiples at the chosen tensor-parallel size,
one scheme per fused group, and every tensor name through its loader's renaming (engines/, read in each engine's
source)."""

from __future__ import annotations

from collections import defaultdict

from quantkit.checkpoint.reader import Checkpoint
from quantkit.engines.kernels import FUSED_GROUPS, ROW_PARALLEL, EngineRules
from quantkit.verify.findings import Finding
from quantkit.verify.structure import EXPERT, Stored


def engine_findings(ckpt: Checkpoint, stored: dict[str, Stored], rules: EngineRules, tp: int) -> list[Finding]:
    found: list[Finding] = []
    where = lambda module: ckpt.tensors[f"{module}.weight_packed"].file  # noqa: E731
    for module, s in stored.items():
        if s.kind != "int4":
            continue
        tensor = f"{module}.weight_packed"
        assert s.group_size is not None  # every stored INT4 weight has one (-1: channel-wise)
        if s.group_size not in rules.group_sizes:
            found.append(Finding("engine", f"group size in {sorted(rules.group_sizes)} ({rules.name} kernels)",
                                 f"group size {s.group_size}", tensor, where(module)))
        # each rank holds a slice of the input dim of row-parallel layers, all of it otherwise
        per_rank = s.in_features / tp if ROW_PARALLEL.search(module) else s.in_features
        if per_rank != int(per_rank) or (s.group_size > 0 and per_rank % s.group_size):
            found.append(Finding("engine", f"tp={tp}: each rank's input slice is a multiple of the group size",
                                 f"in_features {s.in_features} / {tp} = {per_rank:g}, group "
                                 f"{s.group_size}", tensor, where(module)))
        elif rules.marlin_k and per_rank % rules.marlin_k:
            found.append(Finding("engine", f"tp={tp}: each rank's input is a multiple of {rules.marlin_k} (Marlin "
                                           f"kernels)",
                                 f"input {per_rank:g} per rank", tensor, where(module)))
    found += _shared_schemes(stored)
    return found


def _scheme(s: Stored | None) -> tuple:
    return ("absent",) if s is None else (s.kind, s.group_size)


def _shared_schemes(stored: dict[str, Stored]) -> list[Finding]:
    found = []
    experts: dict[str, dict[str, Stored]] = defaultdict(dict)
    for module, s in stored.items():
        m = EXPERT.match(module)
        if m:
            experts[f"{m['prefix']}.{m['index']}"][m["proj"]] = s
    for expert, projs in experts.items():
        if len({_scheme(s) for s in projs.values()}) > 1:
            detail = ", ".join(f"{p}: {_scheme(s)}" for p, s in sorted(projs.items()))
            found.append(Finding("engine", "gate/up/down of every expert share one "
                                           "scheme", detail, f"{expert}.gate_proj"))
    for members in FUSED_GROUPS:
        prefixes = {m.removesuffix("." + members[0]) for m in stored if m.endswith("." + members[0])}
        for prefix in sorted(prefixes):
            if EXPERT.match(f"{prefix}.{members[0]}"):
                continue  # experts are checked above
            schemes = {member: _scheme(stored.get(f"{prefix}.{member}")) for member in members}
            present = {k: v for k, v in schemes.items() if v != ("absent",)}
            if len(set(present.values())) > 1:
                detail = ", ".join(f"{k}: {v}" for k, v in present.items())
                found.append(Finding("engine", f"fused {'+'.join(members)} share one "
                                               f"scheme", detail, f"{prefix}.{members[0]}"))
    return found


def names_load(ckpt: Checkpoint, engine: str, checked: dict[str, int], notes: list[str]) -> list[Finding]:
    """Every tensor of the index lands on a parameter of the engine's model after its loader's renaming
    (engines/loaders.py, read in the engine's source): a tensor it has no place for is skipped or fails
    the load at serve time - a KV scale skipped this way leaves FP8 KV at scale 1.0 without a word."""
    from quantkit.engines.loaders import loader_rules, unplaced_tensors

    rules = loader_rules(engine, ckpt.config.get("model_type"))
    if rules is None:
        notes.append(f"{engine}'s loader for model_type {ckpt.config.get('model_type')!r} was not read in its source: "
                     "tensor names not checked against it")
        return []
    names = sorted(ckpt.tensors)
    checked["tensor names mapped"] = len(names)
    return [Finding("engine", f"every tensor lands on a {rules.engine} {rules.version} parameter of "
                              f"{rules.model_class}",
                    u.reason, u.name, ckpt.tensors[u.name].file)
            for u in unplaced_tensors(names, ckpt.config, rules)]
