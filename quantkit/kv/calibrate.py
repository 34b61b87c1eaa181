"""``calibrate-kv``: FP8 KV-cache scales written into a checkpoint the way SGLang and vLLM load them.

Giant models calibrate layer by layer (quantkit.layerwise): one decoder layer's weights in
memory at a time, observed on every batch's hidden states and dropped.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quantkit.calibration_data import DEFAULT_DATA, calibration_batches, model_tokenizer
from quantkit.checkpoint.config import ModelConfig, Quantization
from quantkit.checkpoint.families import detect_family
from quantkit.checkpoint.reader import INDEX_NAME, SCALES_SHARD, TensorReader, open_checkpoint
from quantkit.checkpoint.writer import LOCK_NAME, folder_lock, refuse_inside
from quantkit.compute_dtype import compute_dtype, dtype_name
from quantkit.devices import resolve_device
from quantkit.engines.kv_scales import engine_usage, scale_names
from quantkit.errors import QuantkitError
from quantkit.formats.fp8_block import FP8_MAX
from quantkit.kv.hooks import KVObserver, kv_hooks
from quantkit.layerwise import LayerWalk
from quantkit.modeling import model_dtype
from quantkit.settings import CALIBRATE

KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}


@dataclass
class KVCalibrationResult:
    model: str
    out: str
    attention: str
    samples: int
    seq_len: int
    layers: int
    scales: dict[int, tuple[float, float]]  # layer -> (k_scale, v_scale)
    json_path: str
    plot_path: str
    seconds: float
    peak_layer_bytes: int = 0
    notes: list[str] = field(default_factory=list)
    engines: dict[str, str] = field(default_factory=dict)  # per engine: loaded where, used by which backends
    dtype: str = ""  # what the layers computed in


def calibrate_kv(
    model: str | os.PathLike,
    *,
    out: str | os.PathLike | None = None,
    in_place: bool = False,
    data: str | os.PathLike | None = None,
    text_field: str = CALIBRATE.text_field,
    samples: int = CALIBRATE.samples,
    seq_len: int = CALIBRATE.seq_len,
    batch_size: int = CALIBRATE.batch_size,
    device: str = CALIBRATE.device,
    dtype: str = CALIBRATE.dtype,
    batches: list[torch.Tensor] | None = None,
) -> KVCalibrationResult:
    """Calibrate MODEL's FP8 KV scales; write them to OUT (a copy of MODEL) or into MODEL.

    Everything that can be refused is decided before the first byte is written (OUT inside MODEL, a
    quantization_config that cannot carry a KV scheme, bad data); the folder written is locked meanwhile.
    """
    started = time.perf_counter()
    src = Path(model)
    if (out is None) == (not in_place):
        raise QuantkitError("give either --out DST or --in-place")
    ckpt = open_checkpoint(src)
    family = detect_family(ckpt.config)
    if ckpt.config.num_attention_heads is None:
        raise QuantkitError(f"no attention layers quantkit knows in model_type {ckpt.config.model_type!r}",
                            src / "config.json")
    dst = src if in_place or out is None else Path(out)
    if not in_place:
        _check_out(src, dst)
    config = ckpt.config.with_quantization(_with_kv_scheme(ckpt.config.quantization))
    dev = resolve_device(device)
    computed_in = compute_dtype(dtype, dev, model_dtype(ckpt.config))
    if batches is not None:
        seq_len = int(batches[0].shape[1])
    ckpt.config.check_context(seq_len, "--seq-len")
    if batches is None:
        data_path = Path(data) if data else DEFAULT_DATA
        batches = calibration_batches(data_path, text_field, samples, seq_len, batch_size, lambda: model_tokenizer(src),
                                      ckpt.config.vocab_size)
    if not in_place:
        dst.mkdir(parents=True, exist_ok=True)
    with folder_lock(dst):
        observer, peak = layerwise_observe(ckpt, batches, dev, computed_in)
        scales = observer.scales()
        json_path, plot_path, engines = write_scales(ckpt, dst, scales, family.attention, copy=not in_place,
                                                     config=config, dtype=dtype_name(computed_in))
    return KVCalibrationResult(
        model=str(src), out=str(dst), attention=family.attention, samples=sum(len(b) for b in batches),
        seq_len=int(batches[0].shape[1]), layers=len(scales), scales=scales, json_path=str(json_path),
        plot_path=str(plot_path), seconds=time.perf_counter() - started, peak_layer_bytes=peak, engines=engines,
        dtype=dtype_name(computed_in),
    )


def _check_out(src: Path, dst: Path) -> None:
    """OUT is a new or empty folder outside MODEL: a copy inside MODEL would be copied along by the next convert."""
    s, d = src.resolve(), dst.resolve()
    if d == s:
        raise QuantkitError("--out must differ from the model folder (or use --in-place)", dst)
    refuse_inside(src, dst, "--out")
    if dst.exists() and (not dst.is_dir() or any(p.name != LOCK_NAME for p in dst.iterdir())):
        raise QuantkitError("is not empty", dst)


def layerwise_observe(ckpt, batches: list[torch.Tensor], device: str = "cpu",
                      dtype: torch.dtype | None = None) -> tuple[KVObserver, int]:
    """Observe the cached KV of every decoder layer, one layer's weights in memory at a time."""
    walk = LayerWalk(ckpt, batches, device, dtype=dtype)
    attention = detect_family(ckpt.config).attention
    observer = KVObserver()
    peak = 0
    with TensorReader(ckpt) as reader:
        for i in range(len(walk.layers)):
            state = walk.read_layer(i, reader)
            peak = max(peak, sum(t.numel() * t.element_size() for t in state.values()))
            layer = walk.load(i, state)
            del state
            with kv_hooks([layer], attention, observer=observer):
                walk.run(i, layer)
            walk.unload(i)
    return observer, peak


def whole_model_observe(path, batches: list[torch.Tensor]) -> KVObserver:
    """The reference: one forward of the whole model per batch (small models only)."""
    from quantkit.modeling import load_model

    ckpt = open_checkpoint(path)
    model = load_model(path)
    observer = KVObserver()
    with torch.no_grad(), kv_hooks(model, detect_family(ckpt.config).attention, observer=observer):
        for batch in batches:
            model(input_ids=batch, use_cache=False)
    return observer


def write_scales(ckpt, dst: Path, scales: dict[int, tuple[float, float]], attention: str, copy: bool,
                 config: ModelConfig | None = None, dtype: str | None = None) -> tuple[Path, Path, dict[str, str]]:
    """k_scale / v_scale tensors beside each attention module, kv_cache_scheme in the config (``config``: the
    model's config with it, when the caller has built it already), the index and manifest updated; DST starts
    as a copy (hard links where possible) of the model. Returns the JSON record, the plot and per engine where
    it loads the scales."""
    from quantkit.checkpoint.manifest import ShardRecord, load_manifest
    from quantkit.checkpoint.writer import write_bytes_atomic, write_safetensors

    src = ckpt.root
    if config is None:
        config = ckpt.config.with_quantization(_with_kv_scheme(ckpt.config.quantization))
    if copy:
        _check_out(src, dst)
        dst.mkdir(parents=True, exist_ok=True)
        for p in sorted(src.rglob("*")):
            rel = p.relative_to(src)
            if p.is_file() and not any(part.startswith(".") for part in rel.parts):  # no lock, temporaries, caches
                target = dst / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(p, target, follow_symlinks=True)  # same bytes, no copy; we never write into these files
                except OSError:
                    shutil.copy2(p, target)
    tensors = {}
    for layer, (k, v) in scales.items():
        k_name, v_name = scale_names(layer)  # the names the engines load (engines/kv_scales.py)
        tensors[k_name] = torch.tensor(k, dtype=torch.float32)
        tensors[v_name] = torch.tensor(v, dtype=torch.float32)
    written = write_safetensors(dst / SCALES_SHARD, tensors, {"format": "pt"})

    index_path = dst / INDEX_NAME
    if index_path.is_file():
        index = json.loads(index_path.read_text())
    else:
        index = {"metadata": {}, "weight_map": {n: s.name for s in ckpt.shards for n in s.tensors}}
    # Scales of an earlier calibration (perhaps under older names) go with the shard they lived in.
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if f != SCALES_SHARD}
    index["weight_map"].update({name: SCALES_SHARD for name in tensors})
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    write_bytes_atomic(index_path, (json.dumps(index, indent=2) + "\n").encode())

    # a new inode: DST's files may be hard links to the model's, which must stay untouched
    write_bytes_atomic(dst / "config.json", config.to_json())

    manifest = load_manifest(dst)
    if manifest is not None:
        manifest.shards[SCALES_SHARD] = ShardRecord(sha256=written.sha256, size=written.size)
        manifest.save(dst)

    json_path = dst / "kv_scales.json"
    observed = "latent [kv_c_normed | k_pe]" if attention == "mla" else "post-RoPE K and V"
    record: dict = {"attention": attention, "observed": observed, "computed_in": dtype,
                    "fp8_max": FP8_MAX, "engines": engine_usage(config),
              "layers": {str(i): {"k_scale": k, "v_scale": v} for i, (k, v) in scales.items()}}
    write_bytes_atomic(json_path, (json.dumps(record, indent=2) + "\n").encode())
    return json_path, _plot(scales, dst / "kv_scales.png", attention), record["engines"]


def _with_kv_scheme(q: Quantization) -> dict:
    """The quantization_config with the static FP8 KV-cache scheme (formats/quant_config.py: the JSON
    compressed-tensors writes, as convert's is)."""
    from quantkit.formats.quant_config import QuantizationArgs, QuantizationConfig

    scheme = QuantizationArgs.model_validate(KV_CACHE_SCHEME)
    if q.method == "compressed-tensors":
        return dict(q.raw, kv_cache_scheme=scheme.model_dump(mode="json"))
    if q.raw:
        raise QuantkitError(f"cannot add KV scales to a {q.method} quantization_config; convert first", q.path)
    config = QuantizationConfig(config_groups={}, kv_cache_scheme=scheme, quantization_status="compressed",
                                format="dense")
    return config.model_dump(mode="json")


def _plot(scales: dict[int, tuple[float, float]], path: Path, attention: str) -> Path:
    from quantkit.charts import figure

    layers = list(scales)
    with figure(path, figsize=(7, 3.5)) as (_, ax):
        _scale_lines(ax, scales, layers, attention)
    return path


def _scale_lines(ax, scales: dict[int, tuple[float, float]], layers: list[int], attention: str) -> None:
    ax.plot(layers, [scales[i][0] for i in layers], marker="o", label="k_scale")
    ax.plot(layers, [scales[i][1] for i in layers], marker="x", label="v_scale")
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("scale (absmax / 448)")
    ax.set_yscale("log")
    ax.set_title(f"FP8 KV-cache scales ({'MLA latent' if attention == 'mla' else 'GQA K and V'})")
    ax.legend()
