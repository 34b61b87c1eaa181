"""``demo``: the recipe's two pools for a real small model, released offline on a laptop CPU.

SmolLM2-135M-Instruct (fetched from PyPI, see real_models) is written as a block-FP8 source the way
DeepSeek-V3 and GLM 5.x are released. Then ``release`` runs once for each pool of the recipe quantkit implements,
from that source, with the in-process engine on slices of the built-in ARC-Easy and GSM8K test sets, under the
small-model suite (eval/suites/small-model.yaml):

  prefill    every Linear to FP8 with a scale per row and FP8 activations per token (``dense-fp8-dynamic``, the
             FP8_DYNAMIC preset), the KV cache BF16: the prefill pool's formats. Block-FP8, the source's own, does not
             run on this model (SGLang quantizes a block-FP8 Linear's input in groups of 128 and SmolLM2's MLP input
             is 576 wide; docs/verify.md); per-row FP8 has no such rule. The in-process engine quantizes each token's
             input as the engines do (evaluation/activations.py);
  decode     the MLP to asymmetric INT4 group 32 by round-to-nearest, attention kept, with a calibrated FP8 KV cache:
             the GLM 5.x decode-pool recipe's counterpart for a dense model (its MLPs play the routed experts).
             Asymmetric RTN is the INT4 method a CPU makes that lost fewest items on the demo's own suite, ahead of
             symmetric RTN and GPTQ (benchmarks/demo_candidates.py; SignRound needs a GPU for its 200 steps a layer).

Each is published to a local folder, with its card, only if it passes ``verify`` for SGLang and then its gate; the
second reuses the first's baseline run. Nothing here is special-cased: each release is a config file like any other.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from quantkit.packaged import evaldata_dir, suite_path
from quantkit.release import ReleaseResult, ReleaseStopped, StageRecord, release

DATA = evaldata_dir()
SUITE = "small-model"  # built-in (quantkit.suites)


@dataclass(frozen=True)
class Candidate:
    """A release of the demo: a built-in recipe (or, ``budgeted``, the recipe ``quantkit budget`` writes from it), the
    serving pool it is for, and whether its KV cache is FP8 (calibrated) or stays as the source's."""

    recipe: str
    pool: str = "decode"
    fp8_kv: bool = True
    budgeted: bool = False

    def published_name(self, name: str) -> str:
        return f"smollm2-135m-{name}" + ("-fp8kv" if self.fp8_kv else "")


# the decode pool's INT4 chosen by measurement on the demo's own suite (docs/demo.md, benchmarks/demo_candidates.py):
# asymmetric RTN lost fewer items than symmetric RTN and than GPTQ, whose 2 minutes of calibration bought nothing
# measurable here
CANDIDATES = {"prefill": Candidate("dense-fp8-dynamic", pool="prefill", fp8_kv=False),
              "decode": Candidate("dense-mlp-w4a16-asym-g32", pool="decode", fp8_kv=True)}
# of the block-FP8 source's bytes, for a budgeted candidate: all-INT4 MLPs take 0.949; each MLP kept BF16 adds 0.023
BUDGET = "1.0"
FLIP_SHARE = 0.14  # of ARC-Easy items whose correctness INT4 RTN of the MLP flips on this model (all 2,376 measured)


def planned_margin(items: int) -> float:
    """The small-model suite's rule for its ARC-Easy margin (its header): the half-width z * 100 * sqrt(p / n) of the
    paired interval at the flip share INT4 shows, rounded up to a whole point; 4 at the default 500 items."""
    return float(math.ceil(1.96 * 100 * math.sqrt(FLIP_SHARE / items)))


@dataclass
class DemoRelease:
    name: str  # the pool it is for
    recipe: str
    config: str
    passed: bool
    published: str | None  # the local folder, when the gate passed
    stopped: str | None  # why the release stopped, when it did: the stage and the cause, one line
    gate_table: str
    report: str | None
    result: ReleaseResult | None = None


@dataclass
class DemoResult:
    work_dir: str
    source: str
    releases: list[DemoRelease] = field(default_factory=list)
    seconds: float = 0.0


def demo(
    workdir: str | os.PathLike = "quantkit-demo",
    *,
    arc_items: int = 500,
    gsm8k_items: int = 8,
    source_model: str | os.PathLike | None = None,
    on_stage: Callable[[str, StageRecord], None] | None = None,
    on_progress: Callable[[str, int, int], None] | None = None,
    candidates: dict[str, Candidate] = CANDIDATES,
) -> DemoResult:
    """Run the demo in WORKDIR (re-running resumes); ``source_model``: a local BF16 SmolLM2 instead of fetching it;
    ``candidates``: other releases than the demo's own, on the same source, items and suite."""
    import yaml

    from quantkit.examples.smollm2 import block_fp8_release, smollm2_checkpoint

    started = time.perf_counter()
    work = Path(workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    bf16 = Path(source_model) if source_model else smollm2_checkpoint(work / "smollm2-135m-bf16")
    source = block_fp8_release(bf16, work / "smollm2-135m-fp8")
    data = work / "data"
    _slice(DATA / "arc_easy" / "test.jsonl", work, "data/arc_easy/test.jsonl", arc_items)
    _slice(DATA / "gsm8k" / "test.jsonl", work, "data/gsm8k/test.jsonl", gsm8k_items)
    result = DemoResult(str(work), str(source))
    suite = _suite(work, arc_items)
    baseline = work / "baseline-run"
    for name, candidate in candidates.items():
        recipe = _budgeted(source, candidate.recipe, work / f"{name}-recipe.yaml") if candidate.budgeted \
            else candidate.recipe
        config = {
            "source": str(source),
            "recipe": recipe,
            "work_dir": str(work / f"release-{name}"),
            "convert": {"device": "cpu"},
            **({"calibrate_kv": {"samples": 32, "seq_len": 512, "batch_size": 4, "device": "cpu"}}
               if candidate.fp8_kv else {}),
            "verify": {"engine": "sglang", "tp": 1},
            "eval": {"engine": "hf", "tasks": ["arc_easy", "gsm8k"], "data_dir": str(data), "batch_size": 16,
                     "baseline_run": str(baseline)},
            "suite": str(suite),
            "publish": {"repo": f"file://{work / 'published' / candidate.published_name(name)}",
                        "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct"},
        }
        path = work / f"release-{name}.yaml"
        _write_if_changed(work, path.name, "# written by quantkit demo\n" + yaml.safe_dump(config, sort_keys=False))
        state = work / f"release-{name}" / "release-state.json"
        stage_hook = (lambda record, n=name: on_stage(n, record)) if on_stage else None
        gate_dir = work / f"release-{name}" / "gate"
        try:
            done = release(path, resume=state.is_file(), on_stage=stage_hook, on_progress=on_progress)
            assert isinstance(done, ReleaseResult)  # each of the demo's configs names one recipe
            result.releases.append(DemoRelease(name, recipe, str(path), True, done.published, None, done.gate_table,
                                               done.report, done))
        except ReleaseStopped as exc:
            report = gate_dir / "report.md"
            table = report.read_text() if exc.stage == "gate" and report.is_file() else ""
            result.releases.append(DemoRelease(name, recipe, str(path), False, None, f"{exc.stage}: {exc.cause}", table,
                                               str(gate_dir / "report.html") if table else None))
            if exc.stage not in ("verify", "gate"):  # anything but an honest verdict is the demo's own failure
                raise
    result.seconds = time.perf_counter() - started
    return result


def _budgeted(source: Path, recipe: str, out: Path) -> str:
    """The recipe ``budget`` fits into the source's bytes from ``recipe``; written once, so a re-run resumes with it."""
    if not out.is_file():
        from quantkit.budget import budget

        budget(source, recipe=recipe, size=BUDGET, out=out, samples=4, seq_len=256, device="cpu")
    return str(out)


def _suite(work: Path, arc_items: int) -> Path:
    """The small-model suite with the margin its own rule gives for ``arc_items`` items (fewer, a wider margin)."""
    import yaml

    suite = yaml.safe_load(suite_path(SUITE).read_text())
    suite["tasks"]["arc_easy"]["margin"] = planned_margin(arc_items)
    path = work / "suite.yaml"
    _write_if_changed(work, path.name, f"# written by quantkit demo: the {SUITE} suite, ARC-Easy margin for "
                      f"{arc_items} items\n" + yaml.safe_dump(suite, sort_keys=False))
    return path


def _slice(src: Path, work: Path, rel: str, n: int) -> None:
    """The first N items of a test set (the same N items on every run: the gate pairs them)."""
    with open(src) as f:
        text = "".join(line for _, line in zip(range(n), f, strict=False))
    _write_if_changed(work, rel, text)


def _write_if_changed(work: Path, rel: str, text: str) -> None:
    """WORK/REL says ``text``: left untouched when it already does (a re-run resumes, and release fingerprints its
    inputs), else written atomically; never through a link planted in WORK (one at the file is replaced, one at a
    folder on the way refused)."""
    from quantkit.checkpoint.writer import work_folder, write_bytes_atomic

    parent = work_folder(work, Path(rel).parent) if Path(rel).parent != Path(".") else work
    path = parent / Path(rel).name
    if path.is_symlink() or not path.is_file() or path.read_text() != text:
        write_bytes_atomic(path, text.encode())
