"""The engine's rules: its INT4 kernels' group sizes and per-rank input multiples at the chosen tensor-parallel size,
one scheme per fused group, and every tensor name through its loader's renaming (engines/, read in each engine's
source)."""

from __future__ import annotations

from collections import defaultdict

from quantkit.checkpoint.families import is_linear_weight
from quantkit.checkpoint.names import EXPERT
from quantkit.checkpoint.reader import Checkpoint
from quantkit.engines.kernels import FUSED_GROUPS, ROW_PARALLEL, SGLANG_MARLIN, EngineRules
from quantkit.verify.findings import Finding
from quantkit.verify.structure import Stored


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
    found += _shared_schemes(stored)
    found += w4a8_findings(ckpt, stored, rules.name, tp)
    return found


def w4a8_size_problem(engine: str, hidden: int, expert_width: int, tp: int) -> str | None:
    """Why ``engine`` cannot run W4A8 experts of these sizes at tensor-parallel size ``tp``, or None."""
    from quantkit.engines.kernels import W4A8_RULES

    multiple = W4A8_RULES[engine].multiple
    per_rank = expert_width / tp
    if hidden % multiple == 0 and per_rank == int(per_rank) and per_rank % multiple == 0:
        return None
    return (f"hidden {hidden}, expert width {expert_width} / {tp} = {per_rank:g}: {engine} cannot run this checkpoint "
            f"at tp={tp}")


def w4a8_findings(ckpt: Checkpoint, stored: dict[str, Stored], engine: str, tp: int) -> list[Finding]:
    """A W4A8 group (INT4 weights, FP8 activations per token) against the engine's W4A8 MoE scheme: its group size,
    the sizes each rank gets, where the engine reads the scheme, and no dense Linear in it."""
    from quantkit.checkpoint.describe import described_by
    from quantkit.convert.tensor_plan import is_w4a8
    from quantkit.engines.kernels import W4A8_RULES

    described = described_by(ckpt)
    rules = W4A8_RULES.get(engine)
    if described is None or rules is None:
        return []
    groups = {name: s for name, s in described.config.config_groups.items() if is_w4a8(s)}
    if not groups:
        return []
    found: list[Finding] = []
    rule = lambda text: f"{text} ({rules.source})"  # noqa: E731
    if rules.needs_pack_quantized and ckpt.config.quantization.format != "pack-quantized":
        found.append(Finding("engine", rule("the config's format is pack-quantized for the W4A8 MoE scheme"),
                             f"format {ckpt.config.quantization.format}: the engine takes another path and fails"))
    if rules.needs_linear_target and not any("Linear" in s.targets for s in groups.values()):
        found.append(Finding("engine", rule("a W4A8 group targets the class Linear"),
                             "no group targets Linear: the engine fails loading the MoE scheme (KeyError: 'Linear')"))
    for name, s in groups.items():
        w = s.weights
        assert w is not None  # is_w4a8
        if w.group_size != rules.group_size or not w.symmetric:
            found.append(Finding("engine", rule(f"W4A8 weights symmetric, group {rules.group_size}"),
                                 f"group {name}: {'symmetric' if w.symmetric else 'asymmetric'}, group "
                                 f"{w.group_size}"))
    hidden, inter = ckpt.config.hidden_size, ckpt.config.moe_intermediate_size
    problem = w4a8_size_problem(engine, hidden, inter, tp) if hidden and inter else None
    if problem:
        found.append(Finding("engine", rule(f"tp={tp}: the hidden size and each rank's expert width are multiples of "
                                            f"{rules.multiple}"), problem))
    def w4a8(module: str) -> bool:
        match = described.scheme_for(module, True)
        return match is not None and is_w4a8(match[1])

    dense = sorted(m for m, st in stored.items() if st.kind == "int4" and not EXPERT.match(m) and w4a8(m))
    if dense and rules.dense:
        found.append(Finding("engine", rule("no dense Linear in a W4A8 group"), f"{len(dense)} dense Linear(s) "
                             f"stored W4A8: {rules.dense}", f"{dense[0]}.weight_packed"))
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


def schemes_chosen(ckpt: Checkpoint, stored: dict[str, Stored], engine: str, tp: int, checked: dict[str, int],
                   notes: list[str]) -> list[Finding]:
    """Every Linear and MoE module of the engine's model class gets from quantization_config the scheme its weights
    are stored in (engines/schemes.py, the engines' own matching restated): SGLang refuses to build a module that
    matches neither ignore nor a target, and a module given no scheme has no parameter for packed weights."""
    from quantkit.engines.loaders import loader_rules
    from quantkit.engines.schemes import SchemeError, engine_modules, group_of, scheme_matching

    model_type = ckpt.config.model_type
    rules, matching = loader_rules(engine, model_type), scheme_matching(engine, model_type)
    if rules is None or matching is None:
        notes.append(f"{engine}'s model class for model_type {model_type!r} was not read in its source: the scheme "
                     "each of its modules gets was not checked")
        return []
    qc = ckpt.config.quantization.raw
    groups = qc.get("config_groups") or {}
    linears = [m for m, s in stored.items() if s.kind != "float" or is_linear_weight(f"{m}.weight", 2)]
    found = []
    for module in engine_modules(linears, ckpt.config, rules):
        checked["engine modules given a scheme"] += 1
        kinds = sorted({stored[m].kind for m in module.members})
        rule = f"{engine} {matching.version} gives {module.name} the scheme its weights are stored in"
        try:
            group = group_of(qc, matching.select(module, ckpt.config))
        except SchemeError as exc:
            found.append(Finding("engine", rule, f"{exc} (the engine refuses to build the model)",
                                 module.members[0], _file(ckpt, module.members[0])))
            continue
        given = "float" if group is None else _kind_of(groups[group])
        if kinds != [given]:
            found.append(Finding("engine", rule, f"stored {'/'.join(kinds)}, given "
                                 f"{'no scheme' if group is None else f'group {group} ({given})'}",
                                 module.members[0], _file(ckpt, module.members[0])))
        elif given == "int4" and engine == "sglang":
            problem = marlin_problem(module, stored, tp)
            if problem:
                found.append(Finding("engine", f"tp={tp}: a Marlin thread tile divides each GEMM ({engine} "
                                     f"{matching.version} {SGLANG_MARLIN.source[module.kind]})", problem,
                                     module.members[0], _file(ckpt, module.members[0])))
        elif given == "fp8" and module.kind == "linear":
            block = (groups[group].get("weights") or {}).get("block_structure")
            problem = fp8_block_problem(module, stored, block, tp) if block else None
            if problem:
                found.append(Finding("engine", f"tp={tp}: {module.name}'s block-FP8 partitions are whole blocks "
                                     f"({engine} {matching.version} {_FP8_BLOCK_SOURCE[engine]})", problem,
                                     module.members[0], _file(ckpt, module.members[0])))
            problem = sglang_activation_problem(module, stored, block, tp) if block and engine == "sglang" else None
            if problem:
                found.append(Finding("engine", f"tp={tp}: {module.name}'s input splits into whole activation "
                                     f"groups ({engine} {matching.version} {_SGLANG_ACT_GROUP_SOURCE})", problem,
                                     module.members[0], _file(ckpt, module.members[0])))
            if block and engine == "sglang" and len(module.members) > 1 and not sglang_block_size(groups):
                found.append(Finding("engine", f"{module.name}'s block-FP8 scales load shard by shard ({engine} "
                                     f"{matching.version} {_SGLANG_BLOCK_SIZE_SOURCE})", _NO_LINEAR_BLOCK,
                                     module.members[0], _file(ckpt, module.members[0])))
    return found


# SGLang loads a fused Linear's block-FP8 scales (merged gate/up, q/k/v) with the block size of the config group
# that targets the class "Linear" (its CompressedTensorsConfig.weight_block_size), whatever group quantized them
_SGLANG_BLOCK_SIZE_SOURCE = ("sglang/srt/layers/quantization/compressed_tensors/compressed_tensors.py:273-279, "
                             "sglang/srt/layers/linear.py:1051-1053, 1310-1312")
_NO_LINEAR_BLOCK = ("no config group targets the class Linear with a block_structure, where the engine reads the "
                    "block size: it fails at load (\"'NoneType' object is not subscriptable\", SGLang 0.5.17 on an "
                    "H200)")


# SGLang's block-FP8 Linear quantizes its input per token in groups of block_k and asserts they divide the input
_SGLANG_ACT_GROUP_SOURCE = ("sglang/srt/layers/quantization/fp8_utils.py:1805-1811 (triton_w8a8_block_fp8_linear) -> "
                            "sglang/kernels/ops/quantization/fp8_kernel.py:502-504")


def sglang_activation_problem(module, stored: dict[str, Stored], block: list[int], tp: int) -> str | None:
    """The input a block-FP8 Linear gets per rank (split where row-parallel) is whole groups of block_k."""
    k = _input_per_rank(module, stored, tp)
    if k % block[1]:
        return (f"input {k} per rank is not a multiple of block_k {block[1]}: the engine quantizes each token's input "
                "in groups of block_k and fails at the first forward (\"the last dimension of `x` cannot be divisible "
                "by `group_size`\", SGLang 0.5.17 on an H200)")
    return None


def _input_per_rank(module, stored: dict[str, Stored], tp: int) -> int:
    """A Linear's input width on each rank: split across ranks where row-parallel, whole where column-parallel."""
    width = stored[module.members[0]].in_features
    return width // tp if module.class_name == "RowParallelLinear" else width


def sglang_block_size(groups: dict) -> list | None:
    """The block size SGLang loads block-FP8 scales of fused Linears with: that of the last group (its scheme map is
    keyed by target) that targets ``Linear``."""
    linear = [g for g in groups.values() if "Linear" in (g.get("targets") or [])]
    return ((linear[-1].get("weights") or {}).get("block_structure")) if linear else None


# validate_fp8_block_shape, the same text in both engines, called when a block-FP8 Linear is created
_FP8_BLOCK_SOURCE = {
    "sglang": "sglang/srt/layers/quantization/fp8_utils.py:2852-2893, from compressed_tensors/schemes/"
              "compressed_tensors_w8a8_fp8.py:84",
    "vllm": "vllm/model_executor/layers/quantization/utils/fp8_utils.py:1296-1345, from compressed_tensors/schemes/"
            "compressed_tensors_w8a8_fp8.py:107",
}
# the order an engine's fused Linear holds its members' output rows in
_MEMBER_ORDER = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "q_a_proj", "kv_a_proj_with_mqa")


def fp8_block_problem(module, stored: dict[str, Stored], block: list[int], tp: int) -> str | None:
    """validate_fp8_block_shape restated: a row-parallel Linear's input slice per rank is whole blocks; a merged
    Linear's partitions (all but the last when not split across ranks) and a column-parallel one's per-rank rows
    are whole blocks."""
    block_n, block_k = block
    members = sorted(module.members, key=lambda m: _MEMBER_ORDER.index(m.rsplit(".", 1)[-1])
                     if m.rsplit(".", 1)[-1] in _MEMBER_ORDER else 0)
    row_parallel = module.class_name == "RowParallelLinear"
    k = _input_per_rank(module, stored, tp)  # the members of a fused Linear share its input
    if tp > 1 and row_parallel and k % block_k:
        return f"input per rank {k} is not a multiple of block_k {block_k}"
    sizes = [stored[m].out_features // (tp if not row_parallel else 1) for m in members]
    split = tp > 1 and not row_parallel
    checked = sizes if split else sizes[:-1]
    bad = [n for n in checked if n % block_n]
    if (split or len(sizes) > 1) and bad:
        return (f"output partition {bad[0]} (of {sizes}) is not a multiple of block_n {block_n}; the engine "
                "raises ValueError when it builds the model")
    return None


def marlin_problem(module, stored: dict[str, Stored], tp: int) -> str | None:
    """The GEMMs SGLang's Marlin runs for ``module`` per rank, (K, N): a Linear's input and its members' summed
    outputs, the input split across ranks where row-parallel and the output where column-parallel; a MoE layer's
    gate+up (hidden -> 2 x intermediate per rank) and down (intermediate per rank -> hidden)."""
    if module.kind == "moe":
        down = stored[next(m for m in module.members if m.endswith("down_proj"))]
        hidden, inter = down.out_features, down.in_features // tp
        gemms = [("gate_up", hidden, 2 * inter), ("down", inter, hidden)]
    else:
        row_parallel = module.class_name == "RowParallelLinear"
        k = _input_per_rank(module, stored, tp)
        n = sum(stored[m].out_features for m in module.members) // (1 if row_parallel else tp)
        gemms = [(module.name.rsplit(".", 1)[-1], k, n)]
    for what, k, n in gemms:
        if not SGLANG_MARLIN.fits(module.kind, k, n):
            return (f"{what}: K {k} x N {n} per rank fits none of Marlin's tiles; the model loads, then its first "
                    "forward fails with \"Invalid thread config\"")
    return None


def _kind_of(group: dict) -> str:
    weights = group.get("weights") or {}
    if weights.get("type") == "float" and weights.get("num_bits") == 8:
        return "fp8"
    return "int4" if weights.get("num_bits") == 4 and weights.get("type", "int") == "int" else "other"


def _file(ckpt: Checkpoint, module: str) -> str | None:
    info = ckpt.tensors.get(f"{module}.weight_packed") or ckpt.tensors.get(f"{module}.weight")
    return info.file if info else None


def names_load(ckpt: Checkpoint, engine: str, checked: dict[str, int], notes: list[str]) -> list[Finding]:
    """Every tensor of the index lands on a parameter of the engine's model after its loader's renaming
    (engines/loaders.py, read in the engine's source): a tensor it has no place for is skipped or fails
    the load at serve time - a KV scale skipped this way leaves FP8 KV at scale 1.0 without a word."""
    from quantkit.engines.loaders import loader_rules, unplaced_tensors

    rules = loader_rules(engine, ckpt.config.model_type)
    if rules is None:
        notes.append(f"{engine}'s loader for model_type {ckpt.config.model_type!r} was not read in its source: "
                     "tensor names not checked against it")
        return []
    names = sorted(ckpt.tensors)
    checked["tensor names mapped"] = len(names)
    return [Finding("engine", f"every tensor lands on a {rules.engine} {rules.version} parameter of "
                              f"{rules.model_class}",
                    u.reason, u.name, ckpt.tensors[u.name].file)
            for u in unplaced_tensors(names, ckpt.config, rules)]
