"""The calibrated-layer driver every calibrated algorithm (GPTQ, SignRound) runs under, written once.

The model is streamed one decoder layer at a time from the source (quantkit.layerwise): each layer's weights are
decoded, the algorithm quantizes the layer's targets on the calibration inputs, and the layer's outputs become the next
layer's inputs, the way the algorithm says they are made (GPTQ: through the quantized layer, as llm-compressor's
sequential pipeline propagates errors; SignRound: through the full-precision one). Peak memory: one decoded layer,
what the algorithm holds for it, and the hidden states.

Each finished layer's packed weights and scales (and zero points) go to
``DST/.quantkit-calibrated/layer-NNNNN.safetensors``, written in a thread of their own while the walk goes on, and into
the manifest once whole, so a killed run redoes no finished layer and gives the same bits. The shard pipeline then
writes these tensors where RTN would have written its own, so the output format is the RTN recipe's to the byte.
"""

from __future__ import annotations

import hashlib
import json
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol

import torch

from quantkit.checkpoint.manifest import CalibratedModuleRecord, Manifest, ShardRecord
from quantkit.checkpoint.names import LAYER
from quantkit.checkpoint.reader import Checkpoint, TensorReader
from quantkit.checkpoint.source_digest import layer_tensors, tensors_digest
from quantkit.checkpoint.writer import work_folder, write_safetensors
from quantkit.convert.calibrated.memory import HELP, Budget, Run
from quantkit.convert.tensor_plan import ActionKind, ConversionPlan
from quantkit.errors import QuantkitError
from quantkit.formats.quant_config import QuantizationArgs
from quantkit.formats.recipe import Recipe

if TYPE_CHECKING:
    from quantkit.layerwise import LayerWalk

WORK_DIR = ".quantkit-calibrated"
LEGACY_WORK_DIR = ".quantkit-gptq"  # where runs of quantkit before the rename kept their finished layers
QUANTIZED_PARTS = ("weight_packed", "weight_scale", "weight_zero_point")  # the zero point: asymmetric groups only


@dataclass
class Target:
    """One INT4 weight a calibrated algorithm quantizes: its on-disk module name and what the recipe asks for it."""

    module: str  # model.layers.N.<rel>
    rel: str  # name inside the decoder layer
    group_size: int
    args: QuantizationArgs  # formats/quant_config.py's, converted to compressed-tensors' for llm-compressor


@dataclass
class LayerReport:
    layer: int
    seconds: float
    weights: int
    loss: float  # GPTQ: the sum of its losses over the layer's weights; SignRound: the layer's best block-output MSE
    rtn: int  # weights that fell back to round-to-nearest
    reused: bool = False
    phases: dict[str, float] = field(default_factory=dict)  # read, hessians/capture, quantize/tune, write, forward
    peak_device_bytes: int = 0  # CUDA: the most memory allocated on the walk's device during the layer
    method: str = "gptq"  # the algorithm that quantized the layer
    expert_groups: int = 0  # the groups a MoE layer's experts were worked in to fit the GPU memory budget


@dataclass
class QuantizedLayer:
    """What an algorithm made of one layer: the tensors of its layer file, a record per weight, and whether making
    them already ran the calibration inputs on to the next layer."""

    tensors: dict[str, torch.Tensor]
    records: dict[str, CalibratedModuleRecord]
    advanced: bool = False
    expert_groups: int = 0  # the groups its routed experts were worked in (0: none)
    first: Callable[[], None] | None = None  # run in the writer's thread before the layer file: what a resume needs


class LayerQuantizer(Protocol):
    """One calibrated algorithm's part of the walk (convert/calibrated/gptq.py, signround.py)."""

    method: str
    walk: LayerWalk
    budget: Budget | None  # the device memory one layer may take (convert/calibrated/memory.py); None: not planned
    resumes_started_dtype: bool  # --resume with --dtype auto computes in what the run started in

    @staticmethod
    def walk_dtype(recipe: Recipe, spec: str, device: str, stored: torch.dtype) -> torch.dtype | None:
        """What the walk computes in where not the model's dtype ``stored`` (``spec``: --dtype), or a refusal."""

    def __init__(self, ckpt: Checkpoint, recipe: Recipe, batches: list[torch.Tensor], devices: list[str], work: Path,
                 dtype: torch.dtype | None = None, budget: Budget | None = None, store: str | None = None) -> None:
        """``store``: where the walk keeps the layer inputs between layers (None: on the device)."""

    @staticmethod
    def least_bytes(ckpt: Checkpoint, recipe: Recipe, i: int, targets: list[Target], run: Run) -> int:
        """The least device memory quantizing layer ``i`` takes, besides the layer inputs the walk stores there."""

    @staticmethod
    def check(ckpt: Checkpoint, plan: ConversionPlan, recipe: Recipe) -> None:
        """Before DST exists: the algorithm's libraries are there and it reaches the recipe's targets."""

    def quantize(self, i: int, state: dict[str, torch.Tensor], targets: list[Target], phases: Phases
                 ) -> QuantizedLayer: ...

    def advance(self, i: int, state: dict[str, torch.Tensor], targets: list[Target], done: Path | None) -> None:
        """Run the calibration inputs through layer ``i`` to make the next layer's; ``done``: its layer file when a
        previous run quantized it."""

    def recorded(self, i: int) -> None:
        """Layer ``i`` is in the manifest: what a resumed run would have needed before it can go."""

    def layer_loss(self, records: list[CalibratedModuleRecord]) -> float: ...

    def running(self) -> AbstractContextManager:
        """Held while the walk runs."""


@dataclass
class CalibratedResult:
    """Where each calibrated module's packed weight, scale (and zero point) wait for the shard pipeline."""

    files: dict[str, Path] = field(default_factory=dict)  # module -> layer file
    layers: list[LayerReport] = field(default_factory=list)

    def read(self, module: str, reader_cache: dict) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        path = self.files[module]
        if path not in reader_cache:
            reader_cache.clear()  # layers are visited in order: one open file at a time
            f = safe_open(str(path), framework="pt")
            reader_cache[path] = f, set(f.keys())
        f, held = reader_cache[path]
        names = [f"{module}.{part}" for part in QUANTIZED_PARTS]
        return {n: f.get_tensor(n) for n in names if n in held}


def calibration_targets(ckpt: Checkpoint, plan: ConversionPlan, recipe: Recipe) -> dict[int, list[Target]]:
    """Decoder layer -> the INT4 weights the algorithm quantizes in it. Layers transformers does not build (a GLM /
    DeepSeek MTP layer) are not reached by the calibration forward and stay RTN."""
    layers = ckpt.config.size("num_hidden_layers")
    out: dict[int, list[Target]] = {}
    for shard in plan.shards:
        for action in shard.actions:
            if action.kind != ActionKind.INT4:
                continue
            m = LAYER.match(action.module)
            if m is None or int(m.group(1)) >= layers:
                continue
            assert action.group is not None and action.group_size is not None  # every INT4 action has them
            args = recipe.config.config_groups[action.group].weights
            assert args is not None
            out.setdefault(int(m.group(1)), []).append(Target(action.module, m.group(2), action.group_size, args))
    return dict(sorted(out.items()))


def target_modules(ckpt, plan, rec) -> frozenset[str]:
    """The modules a calibrated recipe's layer walk quantizes (none for round-to-nearest)."""
    if rec.calibration is None:
        return frozenset()
    return frozenset(t.module for layer in calibration_targets(ckpt, plan, rec).values() for t in layer)


def needs_layer_walk(todo, ckpt, plan, rec) -> bool:
    targets = target_modules(ckpt, plan, rec)
    return any(a.module in targets for s in todo for a in s.actions)


def calibration_digest(batches: list[torch.Tensor], recipe: Recipe) -> str:
    """Identifies the calibration: the token ids and the algorithm's settings (a resumed run must use the same)."""
    settings = recipe.calibrated
    assert settings is not None  # only a calibrated recipe has calibration batches
    h = hashlib.sha256(settings.model_dump_json().encode())
    for b in batches:
        h.update(json.dumps(list(b.shape)).encode())
        h.update(b.to(torch.int64).numpy().tobytes())
    return h.hexdigest()


def layer_folder(dst: Path) -> Path:
    """DST's folder of finished layer files; a run an older quantkit started keeps its folder under the new name."""
    legacy = dst / LEGACY_WORK_DIR
    if legacy.is_dir() and not legacy.is_symlink() and not (dst / WORK_DIR).exists():
        legacy.rename(dst / WORK_DIR)
    return work_folder(dst, WORK_DIR)


def walk_layers(ckpt: Checkpoint, recipe: Recipe, plan: ConversionPlan, dst: Path, manifest: Manifest,
                quantizer: LayerQuantizer, on_layer: Callable[[LayerReport, int], None] | None = None
                ) -> CalibratedResult:
    """Quantize every target layer with ``quantizer`` over its ``walk`` (quantkit.layerwise.LayerWalk); finished
    layers recorded in ``manifest`` are kept."""
    targets = calibration_targets(ckpt, plan, recipe)
    work = layer_folder(dst)
    result = CalibratedResult()
    if not targets:
        return result
    last, walk = max(targets), quantizer.walk
    # the chain closes last: the layer file still being written waits for its digest
    with SourceChain(ckpt) as chain, TensorReader(ckpt) as reader, quantizer.running(), \
            LayerFiles(dst, manifest, quantizer.recorded) as files:
        for i in range(last + 1):
            started = time.perf_counter()
            phases = Phases(walk.device)
            layer_targets = targets.get(i, [])
            path = work / f"layer-{i:05d}.safetensors"
            chain.add(i)
            with phases("read"):
                state = walk.read_layer(i, reader)
            reused = bool(layer_targets) and finished(path, manifest, i)
            if reused:
                chain.check(i, manifest.calibrated_layers[str(i)].source_digest)
            advanced, groups = False, 0
            if layer_targets and not reused:
                with out_of_memory_is_one_line(ckpt, i, quantizer.budget):
                    layer = quantizer.quantize(i, state, layer_targets, phases)
                with phases("write"):  # the wait for the previous layer's file, if it is still being written
                    files.write(i, path, layer.tensors, layer.records, layer.first, chain.digest(i))
                advanced, groups = layer.advanced, layer.expert_groups
            if i < last and not advanced:
                with phases("forward"):
                    quantizer.advance(i, state, layer_targets, path if reused else None)
            del state
            walk.unload(i)
            if layer_targets:
                result.files.update({t.module: path for t in layer_targets})
                recs = [manifest.calibrated_modules[t.module] for t in layer_targets]
                report = LayerReport(i, time.perf_counter() - started, len(recs), quantizer.layer_loss(recs),
                                     sum(r.method == "rtn" for r in recs), reused, phases.seconds, phases.peak(),
                                     quantizer.method, groups)
                result.layers.append(report)
                if on_layer:
                    on_layer(report, len(targets))
    return result


@contextmanager
def out_of_memory_is_one_line(ckpt: Checkpoint, i: int, budget: Budget | None):
    """A CUDA out-of-memory error inside a layer, which the plan should have prevented, as one line naming it."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as exc:
        device = budget.device if budget else "the GPU"
        raise QuantkitError(f"decoder layer {i} ran out of GPU memory on {device} "
                            f"({str(exc).splitlines()[0][:160]}): {HELP}", ckpt.root, f"model.layers.{i}") from None


class SourceChain:
    """Per decoder layer, the digest of the source it was calibrated from: its own tensors and, through the previous
    layer's digest, every layer before it and the embeddings (its inputs came through them). Read and hashed in a
    thread of its own (page-cache reads of what the walk just read) while the walk works."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="quantkit-source-digest")
        self._reader = TensorReader(ckpt)
        self._digests: dict[int, Future] = {}
        embed = [n for n in ("model.embed_tokens.weight",) if n in ckpt.tensors]
        self._last: Future = self._pool.submit(tensors_digest, self._reader, embed)

    def add(self, i: int) -> None:
        previous = self._last
        self._last = self._digests[i] = self._pool.submit(
            lambda: tensors_digest(self._reader, layer_tensors(self.ckpt, i), start=previous.result()))

    def digest(self, i: int) -> Future:
        return self._digests[i]

    def check(self, i: int, recorded: str | None) -> None:
        """A finished layer is kept only if the source up to it is still what it was made from."""
        if recorded is not None and self._digests[i].result() != recorded:
            from quantkit.convert.dst import DifferentRun

            raise DifferentRun(f"the source changed since this run started: decoder layer {i} or one before it no "
                               "longer holds the bytes its finished calibration was made from; use --force to start "
                               "over", self.ckpt.root, f"model.layers.{i}")

    def __enter__(self) -> "SourceChain":
        return self

    def __exit__(self, *exc) -> None:
        self._pool.shutdown(cancel_futures=True)
        self._reader.close()


def finished(path: Path, manifest: Manifest, i: int) -> bool:
    record = manifest.calibrated_layers.get(str(i))
    return record is not None and record.matches(path)


class LayerFiles:
    """Writes each quantized layer's file in a thread of its own while the walk goes on to the next layer (a GLM-5
    layer's is 5.4 GB: seconds of disk time). A layer enters the manifest only once its file is whole, so a run
    killed while it is written redoes that layer; on the way out (finished, or an exception from the walk or the
    caller's callback) the layer in flight is finished and recorded."""

    def __init__(self, dst: Path, manifest: Manifest, on_recorded: Callable[[int], None]):
        self.dst, self.manifest, self.on_recorded = dst, manifest, on_recorded
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="quantkit-layer-write")
        self._pending: tuple[int, Future, Future | None] | None = None

    def write(self, i: int, path: Path, tensors: dict[str, torch.Tensor],
              records: dict[str, CalibratedModuleRecord], first: Callable[[], None] | None = None,
              source: Future | None = None) -> None:
        """``first``: what must be on disk before the layer is (SignRound's quantized outputs), written beside it;
        ``source``: the digest of the source the layer was made from (``SourceChain``)."""
        meta = {m: r.model_dump() for m, r in records.items()}
        self.wait()  # one layer in flight: the host holds at most two layers' packed weights

        def both():
            if first is not None:
                first()
            return write_safetensors(path, tensors, {"format": "pt", "quantkit_calibrated": json.dumps(meta)})

        self.manifest.calibrated_modules.update(records)
        self._pending = (i, self._pool.submit(both), source)

    def wait(self) -> None:
        if self._pending is None:
            return
        i, future, source = self._pending
        self._pending = None
        written = future.result()
        self.manifest.calibrated_layers[str(i)] = ShardRecord(sha256=written.sha256, size=written.size,
                                                              source_digest=source.result() if source else None)
        self.manifest.save(self.dst)
        self.on_recorded(i)

    def __enter__(self) -> "LayerFiles":
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown()


class Phases:
    """Seconds per phase of one layer (the device synchronized at each boundary) and its peak memory."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.device = device
        self.seconds: dict[str, float] = {}
        self._open: tuple[str, float] | None = None
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)

    def start(self, name: str) -> None:
        self.stop()
        self._open = (name, time.perf_counter())

    def stop(self) -> None:
        if self._open is not None:
            if self.cuda:
                torch.cuda.synchronize(self.device)
            name, t0 = self._open
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
            self._open = None

    @contextmanager
    def __call__(self, name: str):
        self.start(name)
        try:
            yield
        finally:
            self.stop()

    def peak(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device)) if self.cuda else 0
