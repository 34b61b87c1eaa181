"""``calibrate-kv``: FP8 KV-cache scales written into a checkpoint the way SGLang and vLLM load them.

Giant models calibrate layer by layer: the model is built on the meta device, the calibration
batches are run up to the first decoder layer once, and then each decoder layer in turn is
loaded from the checkpoint (decoded from whatever encoding it has), run on every batch's hidden
states, observed and dropped. Peak memory is one layer's weights plus the hidden states.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quantkit.checkpoint.families import detect_family
from quantkit.checkpoint.reader import INDEX_NAME, TensorReader, open_checkpoint
from quantkit.errors import QuantkitError
from quantkit.formats.fp8_block import FP8_MAX
from quantkit.kv.engine_names import engine_usage, scale_names
from quantkit.kv.hooks import KVObserver, kv_hooks

DEFAULT_DATA = Path(__file__).resolve().parent.parent / "data" / "calibration.jsonl"
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


def load_texts(path: Path, text_field: str = "text") -> list[str]:
    if not path.is_file():
        raise QuantkitError("calibration data not found", path)
    raw = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".jsonl":
        texts = []
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise QuantkitError(f"line {n}: invalid JSON ({exc.msg})", path) from exc
            if text_field not in row:
                raise QuantkitError(f"line {n}: no field {text_field!r} (use --text-field)", path)
            texts.append(str(row[text_field]))
    else:
        texts = [p for p in raw.split("\n\n")]
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise QuantkitError("calibration data is empty", path)
    return texts


def token_batches(tokenizer, texts: list[str], samples: int, seq_len: int, batch_size: int, source: Path) -> list[torch.Tensor]:
    """Concatenate the texts (EOS between), cut into ``samples`` sequences of ``seq_len`` tokens."""
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    ids: list[int] = []
    need = samples * seq_len
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"] + [eos])
        if len(ids) >= need:
            break
    usable = len(ids) // seq_len
    if usable == 0:
        raise QuantkitError(f"too short: {len(ids)} tokens, not one sequence of {seq_len}", source)
    sequences = torch.tensor(ids[: min(usable, samples) * seq_len]).view(-1, seq_len)
    return list(sequences.split(batch_size))


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
        from transformers import AutoTokenizer

        data_path = Path(data) if data else DEFAULT_DATA
        try:
            tokenizer = AutoTokenizer.from_pretrained(src)
        except (OSError, ValueError) as exc:
            raise QuantkitError(f"no tokenizer in the model folder ({type(exc).__name__})", src) from exc
        batches = token_batches(tokenizer, load_texts(data_path, text_field), samples, seq_len, batch_size, data_path)
    dev = "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
    observer, peak = layerwise_observe(ckpt, batches, dev)
    scales = observer.scales()
    dst = Path(out) if out is not None else src
    json_path, plot_path = write_scales(ckpt, dst, scales, family.attention, copy=not in_place)
    return KVCalibrationResult(
        model=str(src), out=str(dst), attention=family.attention, samples=sum(len(b) for b in batches),
        seq_len=int(batches[0].shape[1]), layers=len(scales), scales=scales, json_path=str(json_path),
        plot_path=str(plot_path), seconds=time.perf_counter() - started, peak_layer_bytes=peak,
    )


def _known_attention(config: dict) -> bool:
    return "kv_lora_rank" in config or "num_key_value_heads" in config or "num_attention_heads" in config


class _Captured(Exception):
    def __init__(self, args, kwargs):
        self.args, self.kwargs = args, kwargs


class _Catcher(torch.nn.Module):
    """Stands in for decoder layer 0 and stops the forward with the inputs it was given."""

    def forward(self, *args, **kwargs):
        raise _Captured(args, kwargs)


def layerwise_observe(ckpt, batches: list[torch.Tensor], device: str = "cpu") -> tuple[KVObserver, int]:
    """Observe the cached KV of every decoder layer, one layer's weights in memory at a time."""
    from transformers import AutoModelForCausalLM

    from quantkit.modeling import fuse_experts, model_config, model_dtype, read_weight

    config, family = ckpt.config, detect_family(ckpt.config)
    cfg = model_config(config)
    dtype = model_dtype(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    base = model.model
    # the parts before layer 0: embeddings (from the checkpoint) and rotary tables (from the config)
    with TensorReader(ckpt) as reader:
        base.embed_tokens.to_empty(device=device)
        base.embed_tokens.weight.data.copy_(reader.read("model.embed_tokens.weight"))
    base.rotary_emb = type(base.rotary_emb)(config=cfg).to(device)
    layers = list(base.layers)
    base.layers[0] = _Catcher()
    captured = []
    for batch in batches:
        try:
            base(input_ids=batch.to(device), use_cache=False)
        except _Captured as c:
            captured.append((list(c.args), dict(c.kwargs)))
    observer = KVObserver()
    peak = 0
    with TensorReader(ckpt) as reader:
        for i, layer in enumerate(layers):
            prefix = f"model.layers.{i}."
            state = {}
            for name in ckpt.tensors:
                if not name.startswith(prefix):
                    continue
                module, _, param = name.rpartition(".")
                if param in ("weight_scale_inv", "weight_scale", "weight_shape", "k_scale", "v_scale"):
                    continue
                key = f"{module}.weight" if param in ("weight", "weight_packed") else name
                state[key] = read_weight(ckpt, reader, module, dtype) if param in ("weight", "weight_packed") else reader.read(name)
            state = {k.removeprefix(prefix): v for k, v in fuse_experts(state, config).items()}
            layer.to_empty(device=device)
            layer.load_state_dict(state, strict=True)
            peak = max(peak, sum(t.numel() * t.element_size() for t in state.values()))
            del state
            with torch.no_grad(), kv_hooks([layer], family.attention, observer=observer):
                for args, kwargs in captured:
                    try:
                        output = layer(*args, **kwargs)
                    except FloatingPointError as exc:
                        raise QuantkitError(str(exc), ckpt.root, f"model.layers.{i}") from exc
                    hidden = output[0] if isinstance(output, tuple) else output
                    if not bool(torch.isfinite(hidden).all()):
                        raise QuantkitError(f"NaN or Inf activations after decoder layer {i}", ckpt.root, f"model.layers.{i}")
                    args[0] = hidden
                    if isinstance(output, tuple) and "prev_topk_indices" in kwargs:
                        kwargs["prev_topk_indices"] = output[1]  # GLM-5 DSA: shared-indexer layers reuse it
            layer.to("meta")
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
              "fp8_max": FP8_MAX, "engines": engine_usage(attention, sparse=detect_family(ckpt.config).has_indexer),
              "layers": {str(i): {"k_scale": k, "v_scale": v} for i, (k, v) in scales.items()}}
    write_bytes_atomic(json_path, (json.dumps(record, indent=2) + "\n").encode())
    return json_path, _plot(scales, dst / "kv_scales.png", attention)


def _with_kv_scheme(qc: dict | None) -> dict:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationStatus

    if qc and qc.get("quant_method") == "compressed-tensors":
        qc = dict(qc)
        qc["kv_cache_scheme"] = QuantizationArgs.model_validate(KV_CACHE_SCHEME).model_dump(mode="json")
        return qc
    if qc:
        raise QuantkitError(f"cannot add KV scales to a {qc.get('quant_method')} quantization_config; convert first")
    config = QuantizationConfig(config_groups={}, kv_cache_scheme=QuantizationArgs.model_validate(KV_CACHE_SCHEME),
                                quantization_status=QuantizationStatus.COMPRESSED, format="dense")
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
