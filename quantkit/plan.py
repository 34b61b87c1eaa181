"""``plan``: what a conversion will weigh and what it buys on the GPUs, before 700 GB are touched.

Works from shard headers when the weights are present, or from config.json alone: the tensors
transformers' model class holds (checkpoint/layout.py, or the class built on the meta device for a
family it does not cover), laid out the way releases store them (per-expert tensors, block-FP8
where the release has it, the MTP layer). The output size is not estimated: it is
the size of the exact files ``convert`` would write, from the same plan.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from quantkit.charts import check_chart_path, figure
from quantkit.checkpoint.config import ModelConfig
from quantkit.checkpoint.families import COMPONENTS, component, detect_family, release_stores_fp8
from quantkit.checkpoint.layout import model_tensors
from quantkit.checkpoint.reader import DTYPES, TORCH_TO_CODE, Checkpoint, TensorInfo
from quantkit.errors import QuantkitError
from quantkit.gc_pause import gc_paused
from quantkit.settings import PLAN

GIB = 2**30
# Memory the GPU reports (nvidia-smi's MiB); b200 from its 192 GB datasheet figure.
GPUS = {"h100": 81559 * 2**20, "h200": 143771 * 2**20, "b200": 192 * 10**9}
KV_BYTES = {"bf16": 2, "fp8_e4m3": 1}
REPLICATED = ("norms", "router")  # kept whole on every tensor-parallel rank; the rest is split
INDEXER_SCALE_BLOCK = 128  # DSA indexer keys: fp8 with one fp32 scale per 128 values


@dataclass
class ComponentSize:
    params: int = 0
    bytes_now: int = 0
    bytes_after: int = 0


@dataclass
class PoolPlan:
    role: str  # prefill | decode
    checkpoint: str
    kv_dtype: str
    weights_per_gpu: int
    kv_bytes_per_token: int
    kv_tokens_per_gpu: int
    concurrent_requests: int
    launch: str
    kv_scales: str = ""  # whether this pool's attention backend uses calibrated FP8 KV scales, and why


@dataclass
class PlanReport:
    source: str
    family: str
    from_headers: bool
    recipe: str | None
    components: dict[str, ComponentSize]
    total_params: int
    bytes_now: int
    bytes_after: int | None
    tp: int
    gpu_bytes: int
    mem_fraction: float
    context_len: int
    page_size: int
    attention: str
    kv_bytes_per_token: int  # per GPU, for the chosen --kv-dtype
    weights_per_gpu: int  # after conversion when a recipe is given, else now
    kv_tokens_per_gpu: int
    concurrent_requests: int
    pools: list[PoolPlan] = field(default_factory=list)
    chart: str | None = None
    assumptions: list[str] = field(default_factory=list)


@gc_paused
def plan(
    src: str | os.PathLike,
    recipe: str | None = None,
    *,
    tp: int = PLAN.tp,
    gpu: str | None = PLAN.gpu,
    gpu_mem_gib: float | None = PLAN.gpu_mem_gib,
    kv_dtype: str = PLAN.kv_dtype,
    mem_fraction: float = PLAN.mem_fraction,
    context_len: int = PLAN.context_len,
    page_size: int = PLAN.page_size,
    max_shard_size: str = PLAN.max_shard_size,
    deploy: bool = False,
    chart: str | os.PathLike | None = None,
    dst_hint: str = "DST",
    prefill_recipe: str | None = None,
    prefill_hint: str = "PREFILL_DST",
    decode_kv_dtype: str = "fp8_e4m3",
) -> PlanReport:
    """What SRC is and what RECIPE makes of it, from headers (or config.json alone): bytes per component now and
    after, and the KV tokens and concurrent requests each GPU holds at ``tp``; ``deploy``: the prefill pool (SRC, or
    ``prefill_recipe``'s output; BF16 KV) and the decode pool (RECIPE's; ``decode_kv_dtype`` KV), and a chart."""
    from quantkit.checkpoint.reader import open_checkpoint

    if kv_dtype not in KV_BYTES:
        raise QuantkitError(f"--kv-dtype must be one of {', '.join(KV_BYTES)}")
    gpu_bytes = _gpu_bytes(gpu, gpu_mem_gib)
    root = Path(src)
    from_headers = any(root.glob("*.safetensors"))
    ckpt = open_checkpoint(root) if from_headers else virtual_checkpoint(root)
    config = ckpt.config

    component_of = _ComponentOf(config)
    sizes = _sizes_now(ckpt, component_of)
    bytes_now = ckpt.total_bytes if from_headers else sum(c.bytes_now for c in sizes.values())
    bytes_after = _sizes_after(ckpt, recipe, max_shard_size, sizes, component_of) if recipe else None
    family = detect_family(config)
    kv_now = kv_bytes_per_token(config, family, tp, KV_BYTES[kv_dtype])
    after = {k: (v.bytes_after if bytes_after is not None else v.bytes_now) for k, v in sizes.items()}
    now = {k: v.bytes_now for k, v in sizes.items()}
    weights = weights_per_gpu(after, tp)
    tokens = kv_tokens(gpu_bytes, mem_fraction, weights, kv_now, page_size)
    report = PlanReport(
        source=str(root),
        family=family.name,
        from_headers=from_headers,
        recipe=recipe,
        components={k: v for k, v in sizes.items() if v.bytes_now},
        total_params=sum(v.params for v in sizes.values()),
        bytes_now=bytes_now,
        bytes_after=bytes_after,
        tp=tp,
        gpu_bytes=gpu_bytes,
        mem_fraction=mem_fraction,
        context_len=context_len,
        page_size=page_size,
        attention=family.attention,
        kv_bytes_per_token=kv_now,
        weights_per_gpu=weights,
        kv_tokens_per_gpu=tokens,
        concurrent_requests=tokens // context_len,
        assumptions=ASSUMPTIONS,
    )
    if deploy:
        if not recipe:
            raise QuantkitError("--deploy needs --recipe: the decode pool serves the converted checkpoint")
        if decode_kv_dtype not in KV_BYTES:
            raise QuantkitError(f"the decode pool's KV dtype must be one of {', '.join(KV_BYTES)}")
        check_chart_path(Path(chart or "plan-memory.png"))
        prefill, prefill_at = now, str(root)
        if prefill_recipe:
            prefill_sizes = {name: ComponentSize() for name in COMPONENTS}
            _sizes_after(ckpt, prefill_recipe, max_shard_size, prefill_sizes, component_of)
            prefill, prefill_at = {k: v.bytes_after for k, v in prefill_sizes.items()}, prefill_hint
        report.pools = [_pool(report, "prefill", prefill_at, "bf16", prefill, config, family),
                        _pool(report, "decode", dst_hint, decode_kv_dtype, after, config, family)]
        report.chart = str(memory_chart(report, Path(chart or "plan-memory.png")))
    return report


def _gpu_bytes(gpu: str | None, gpu_mem_gib: float | None) -> int:
    if gpu_mem_gib is not None and not 0 < gpu_mem_gib < 1 << 20:  # also refuses NaN and infinity
        raise QuantkitError(f"--gpu-mem-gib must be a GPU's memory in GiB, not {gpu_mem_gib:g}")
    gpu_bytes = int(gpu_mem_gib * GIB) if gpu_mem_gib else GPUS.get(gpu or "")
    if not gpu_bytes:
        raise QuantkitError(f"unknown GPU {gpu!r} (known: {', '.join(GPUS)}); or give --gpu-mem-gib GiB")
    return gpu_bytes


def _sizes_now(ckpt, component_of: _ComponentOf) -> dict[str, ComponentSize]:
    """Bytes and parameters of each component as the checkpoint stores them."""
    from quantkit.checkpoint.inspection import param_count

    sizes = {name: ComponentSize() for name in COMPONENTS}
    for info in ckpt.tensors.values():
        c = sizes[component_of(info.name)]
        c.bytes_now += info.nbytes
        c.params += param_count(info)
    return sizes


def _sizes_after(ckpt, recipe: str, max_shard_size: str, sizes: dict[str, ComponentSize],
                 component_of: _ComponentOf) -> int:
    """The converted checkpoint's bytes, exact to the byte (shards with their headers, as convert writes them); each
    component's share goes into ``sizes``."""
    from quantkit.convert.tensor_plan import plan_conversion
    from quantkit.formats.recipe import load_recipe
    from quantkit.sizes import parse_size

    conversion = plan_conversion(ckpt, load_recipe(recipe), parse_size(max_shard_size))
    for shard in conversion.shards:
        for a in shard.actions:  # an action's outputs are one module's: one component
            size = sizes[component_of(a.outputs[0].name)]
            for o in a.outputs:
                size.bytes_after += o.nbytes
    return conversion.file_bytes


class _ComponentOf:
    """``component(name)``, worked out once per module (a module's tensors are one component's): a plan of a
    700 GB checkpoint asks it for 60,000 modules some 240,000 times."""

    def __init__(self, config: ModelConfig):
        self.config = config
        self.of: dict[str, str] = {}

    def __call__(self, name: str) -> str:
        module = name.rpartition(".")[0]
        found = self.of.get(module)
        if found is None:
            found = self.of[module] = component(name, self.config)
        return found


ASSUMPTIONS = [
    "weights: every component is split evenly over the tensor-parallel ranks except norms and the "
    "router, which every rank holds whole",
    "KV cache: GQA caches K and V per KV head (heads split over ranks, at least one per rank); MLA caches one "
    "latent of kv_lora_rank + qk_rope_head_dim per token and layer, replicated on every rank",
    "sparse-attention (DSA) models add an indexer key cache per token and layer: index_head_dim FP8 bytes "
    "plus one fp32 scale per 128",
    "usable memory = GPU memory x mem_fraction (SGLang's --mem-fraction-static); the rest is the reserve "
    "for activations, CUDA graphs and the allocator",
    "KV tokens are rounded down to whole pages of --page-size tokens; MTP draft layers' cache is not counted",
]


def kv_bytes_per_token(config: ModelConfig, family, tp: int, dtype_bytes: int) -> int:
    layers = config.layers
    if family.attention == "mla":
        per_layer = (config.size("kv_lora_rank") + config.size("qk_rope_head_dim")) * dtype_bytes
        if family.has_indexer and config.index_head_dim:
            d = config.index_head_dim
            per_layer += d + 4 * math.ceil(d / INDEXER_SCALE_BLOCK)
        return per_layer * layers
    heads = config.num_key_value_heads or config.size("num_attention_heads")
    head_dim = config.head_dim or config.size("hidden_size") // config.size("num_attention_heads")
    return 2 * math.ceil(heads / tp) * head_dim * dtype_bytes * layers


def weights_per_gpu(component_bytes: dict[str, int], tp: int) -> int:
    return sum(b if name in REPLICATED else math.ceil(b / tp) for name, b in component_bytes.items())


def kv_tokens(gpu_bytes: int, mem_fraction: float, weights: int, kv_per_token: int, page_size: int) -> int:
    free = gpu_bytes * mem_fraction - weights
    if free <= 0 or kv_per_token <= 0:
        return 0
    return int(free // kv_per_token) // page_size * page_size


def _pool(report: PlanReport, role, checkpoint, kv_dtype, component_bytes, config, family) -> PoolPlan:
    """One pool serving ``checkpoint`` (its components' bytes) with a ``kv_dtype`` KV cache, on the report's GPUs."""
    tp, gpu_bytes, frac, ctx, page = (report.tp, report.gpu_bytes, report.mem_fraction, report.context_len,
                                      report.page_size)
    weights = weights_per_gpu(component_bytes, tp)
    kv = kv_bytes_per_token(config, family, tp, KV_BYTES[kv_dtype])
    tokens = kv_tokens(gpu_bytes, frac, weights, kv, page)
    from quantkit.engines.launch import SGLangLaunch

    backend, kv_scales = fp8_kv_backend(family) if kv_dtype == "fp8_e4m3" else (None, "")
    launch = SGLangLaunch(checkpoint, tp=tp, kv_cache_dtype="auto" if kv_dtype == "bf16" else kv_dtype,
                          mem_fraction=frac, context_length=ctx, page_size=page, disaggregation_mode=role,
                          attention_backend=backend).command()
    return PoolPlan(role, checkpoint, kv_dtype, weights, kv, tokens, tokens // ctx, launch, kv_scales)


def fp8_kv_backend(family) -> tuple[str | None, str]:
    """The SGLang attention backend for an FP8 KV pool, and what it does with calibrated scales: one whose
    FP8 path uses them where SGLang has one for this attention type (engines/kv_scales.py, read in its source)."""
    from quantkit.engines.kv_scales import attention_kind, backends, scale_backend
    from quantkit.engines.versions import SGLANG_VERSION

    kind = attention_kind(family)
    chosen = scale_backend(kind)
    if chosen is not None:
        others = [f"{b.backend} ({b.use})" for b in backends("sglang", kind) if b is not chosen]
        return chosen.backend, (f"{chosen.backend}: the SGLang {SGLANG_VERSION} {kind.upper()} backend whose FP8 KV "
                                f"path "
                                f"uses the calibrated scales ({chosen.how}; {chosen.source})"
                                + (f"; the others: {', '.join(others)}" if others else ""))
    traced = backends("sglang", kind)
    if traced:
        b = traced[0]
        return b.backend, (f"{b.backend}: calibrated scales unused - {b.how} ({b.source}); FP8 KV is served "
                           "without them")
    return None, f"no SGLang {SGLANG_VERSION} backend traced for {kind.upper()}: whether scales are used is unknown"


def memory_chart(report: PlanReport, path: Path) -> Path:
    """A chart of per-GPU memory in each pool: weights, KV cache, reserve."""
    with figure(path, figsize=(6, 4)) as (_, ax):
        _memory_bars(ax, report)
    return path


def _memory_bars(ax, report: PlanReport) -> None:
    names = [f"{p.role}\n{p.kv_dtype} KV" for p in report.pools]
    weights = [p.weights_per_gpu / GIB for p in report.pools]
    kv = [p.kv_tokens_per_gpu * p.kv_bytes_per_token / GIB for p in report.pools]
    total = report.gpu_bytes / GIB
    reserve = [total - w - k for w, k in zip(weights, kv, strict=False)]
    ax.bar(names, weights, label="weights", color="#4c72b0")
    ax.bar(names, kv, bottom=weights, label="KV cache", color="#55a868")
    ax.bar(names, reserve, bottom=[w + k for w, k in zip(weights, kv, strict=False)], label="reserve", color="#c8c8c8")
    for i, p in enumerate(report.pools):
        ax.text(i, total * 1.01, f"{p.kv_tokens_per_gpu:,} tokens\n{p.concurrent_requests} x {report.context_len:,}",
                ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("GiB per GPU")
    ax.set_ylim(0, total * 1.2)
    ax.set_title(f"{report.family}, tp={report.tp}: per-GPU memory by pool")
    ax.legend(loc="lower right", fontsize=8)


@gc_paused
def virtual_checkpoint(root: Path) -> Checkpoint:
    """The tensors a release of this config would hold, from config.json alone (no data)."""
    from quantkit.checkpoint.families import mtp_extra_shapes
    from quantkit.checkpoint.reader import read_config

    config = read_config(root)
    n_mtp = config.num_nextn_predict_layers or 0
    if not config.num_hidden_layers:
        raise QuantkitError("num_hidden_layers missing: cannot size a model from this config "
                            "alone", root / "config.json")
    layers = config.num_hidden_layers
    raw = config.raw | {"num_hidden_layers": layers + n_mtp}
    for per_layer in ("mlp_layer_types", "layer_types", "indexer_types", "index_topk_pattern"):
        if isinstance(raw.get(per_layer), (list, str)):  # the MTP layers are laid out as the last decoder layer
            raw[per_layer] = raw[per_layer] + raw[per_layer][-1:] * n_mtp
    shaped = ModelConfig.read(raw, config.path)
    dtype = config.dtype_code
    state = model_tensors(shaped, dtype) or meta_model_tensors(shaped, dtype)
    for index in range(layers, layers + n_mtp):
        for name, shape in mtp_extra_shapes(config).items():
            state[f"model.layers.{index}.{name}"] = (dtype, shape)
    fp8 = config.quantization.fp8_release
    tensors: dict[str, TensorInfo] = {}
    for name, (code, shape) in state.items():
        if fp8 and release_stores_fp8(name, len(shape)):
            tensors[name] = _virtual(name, "F8_E4M3", shape)
            scale_name = name.removesuffix(".weight") + ".weight_scale_inv"
            tensors[scale_name] = _virtual(scale_name, "F32", (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128)))
        else:
            tensors[name] = _virtual(name, code, shape)
    return Checkpoint(root=root, config=config, shards=[], tensors=tensors, other_files=[])


def meta_model_tensors(config: ModelConfig, dtype: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """What transformers' model of ``config``, built on the meta device, holds (per-expert names)."""
    import torch
    from transformers import AutoModelForCausalLM

    from quantkit.modeling import model_config, unfuse_experts

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config(config), dtype=getattr(torch, DTYPES[dtype][1]))
    state = unfuse_experts(dict(model.state_dict()))
    return {name: (TORCH_TO_CODE[str(t.dtype).removeprefix("torch.")], tuple(t.shape)) for name, t in state.items()}


def _virtual(name: str, code: str, shape: tuple[int, ...]) -> TensorInfo:
    return TensorInfo(name, "(config only)", code, shape, 0, math.prod(shape) * DTYPES[code][0])
