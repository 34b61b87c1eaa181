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

from quantkit.calibration_data import DEFAULT_DATA, load_texts, model_tokenizer, token_batches
from quantkit.checkpoint.families import detect_family
from quantkit.checkpoint.reader import INDEX_NAME, TensorReader, open_checkpoint
from quantkit.errors import QuantkitError
from quantkit.formats.fp8_block import FP8_MAX
from quantkit.kv.engine_names import engine_usage, scale_names
from quantkit.kv.hooks import KVObserver, kv_hooks
from quantkit.layerwise import LayerWalk

SCALES_SHARD = "kv-scales.safetensors"
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


def calibrate_kv(
    model: str | os.PathLike,
    out: str | os.PathLike | None = None,
    in_place: bool = False,
    data: str | os.PathLike | None = None,
    text_field: str = "text",
    samples: int = 512,
    seq_len: int = 2048,
    batch_size: int = 4,
    device: str = "auto",
    batches: list[torch.Tensor] | None = None,
) -> KVCalibrationResult:
    """Calibrate MODEL's FP8 KV scales; write them to OUT (a copy of MODEL) or into MODEL."""
    started = time.perf_counter()
    src = Path(model)
    if (out is None) == (not in_place):
        raise QuantkitError("give either --out DST or --in-place")
    ckpt = open_checkpoint(src)
    family = detect_family(ckpt.config)
    if "num_attention_heads" not in ckpt.config or not _known_attention(ckpt.config):
        raise QuantkitError(f"no attention layers quantkit knows in model_type {ckpt.config.get('model_type')!r}", src / "config.json")
    if batches is not None:
        seq_len = int(batches[0].shape[1])
    limit = int(ckpt.config.get("max_position_embeddings") or seq_len)
    if seq_len > limit:
        raise QuantkitError(f"--seq-len {seq_len} exceeds the model's context ({limit})", src / "config.json")
    if batches is None:
        data_path = Path(data) if data else DEFAULT_DATA
        batches = token_batches(model_tokenizer(src), load_texts(data_path, text_field), samples, seq_len, batch_size,
                                data_path)
    dev = "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
    observer, peak = layerwise_observe(ckpt, batches, dev)
    scales = observer.scales()
    dst = Path(out) if out is not None else src
    json_path, plot_path = write_scales(ckpt, dst, scales, family.attention, copy=not in_place)
    return KVCalibrationResult(
        model=str(src), out=str(dst), attention=family.attention, samples=sum(len(b) for b in batches),
        seq_len=int(batches[0].shape[1]), layers=len(scales), scales=scales, json_path=str(json_path),
        plot_path=str(plot_path), seconds=time.perf_counter() - started, peak_layer_bytes=peak,
        engines=json.loads(Path(json_path).read_text())["engines"],
    )


def _known_attention(config: dict) -> bool:
    return "kv_lora_rank" in config or "num_key_value_heads" in config or "num_attention_heads" in config


def layerwise_observe(ckpt, batches: list[torch.Tensor], device: str = "cpu") -> tuple[KVObserver, int]:
    """Observe the cached KV of every decoder layer, one layer's weights in memory at a time."""
    walk = LayerWalk(ckpt, batches, device)
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


def write_scales(ckpt, dst: Path, scales: dict[int, tuple[float, float]], attention: str, copy: bool) -> tuple[Path, Path]:
    """k_scale / v_scale tensors beside each attention module, kv_cache_scheme in the config,
    the index and manifest updated; DST starts as a copy (hard links where possible) of the model."""
    from quantkit.checkpoint.manifest import ShardRecord, load_manifest
    from quantkit.checkpoint.writer import write_bytes_atomic, write_safetensors

    src = ckpt.root
    if copy:
        if dst.resolve() == src.resolve():
            raise QuantkitError("--out must differ from the model folder (or use --in-place)", dst)
        if dst.exists() and any(dst.iterdir()):
            raise QuantkitError("is not empty", dst)
        dst.mkdir(parents=True, exist_ok=True)
        for p in sorted(src.rglob("*")):
            if p.is_file():
                target = dst / p.relative_to(src)
                target.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(p, target)  # same bytes, no copy; we never write into these files
                except OSError:
                    shutil.copy2(p, target)
    tensors = {}
    for layer, (k, v) in scales.items():
        k_name, v_name = scale_names(layer)  # the names the engines load (kv/engine_names.py)
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

    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = _with_kv_scheme(config.get("quantization_config"))
    # a new inode: DST's files may be hard links to the model's, which must stay untouched
    write_bytes_atomic(dst / "config.json", (json.dumps(config, indent=2) + "\n").encode())

    manifest = load_manifest(dst)
    if manifest is not None:
        manifest.shards[SCALES_SHARD] = ShardRecord(sha256=written.sha256, size=written.size)
        manifest.save(dst)

    json_path = dst / "kv_scales.json"
    record = {"attention": attention, "observed": "latent [kv_c_normed | k_pe]" if attention == "mla" else "post-RoPE K and V",
              "fp8_max": FP8_MAX, "engines": engine_usage(config),
              "layers": {str(i): {"k_scale": k, "v_scale": v} for i, (k, v) in scales.items()}}
    write_bytes_atomic(json_path, (json.dumps(record, indent=2) + "\n").encode())
    return json_path, _plot(scales, dst / "kv_scales.png", attention)


def _with_kv_scheme(qc: dict | None) -> dict:
    """The quantization_config with the static FP8 KV-cache scheme (formats/quant_config.py: the JSON
    compressed-tensors writes, as convert's is)."""
    from quantkit.formats.quant_config import QuantizationArgs, QuantizationConfig

    scheme = QuantizationArgs.model_validate(KV_CACHE_SCHEME)
    if qc and qc.get("quant_method") == "compressed-tensors":
        return dict(qc, kv_cache_scheme=scheme.model_dump(mode="json"))
    if qc:
        raise QuantkitError(f"cannot add KV scales to a {qc.get('quant_method')} quantization_config; convert first")
    config = QuantizationConfig(config_groups={}, kv_cache_scheme=scheme, quantization_status="compressed", format="dense")
    return config.model_dump(mode="json")


def _plot(scales: dict[int, tuple[float, float]], path: Path, attention: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = list(scales)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(layers, [scales[i][0] for i in layers], marker="o", label="k_scale")
    ax.plot(layers, [scales[i][1] for i in layers], marker="x", label="v_scale")
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("scale (absmax / 448)")
    ax.set_yscale("log")
    ax.set_title(f"FP8 KV-cache scales ({'MLA latent' if attention == 'mla' else 'GQA K and V'})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
