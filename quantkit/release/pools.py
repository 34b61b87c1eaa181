"""A release of the recipe's two pools: prefill and decode artifacts of one source, released together.

Each pool with a recipe is a release of its own in WORK/<pool> (release_one: plan, convert, calibrate-kv, verify,
eval, gate), all gated against one baseline run of the source in WORK/runs/baseline, evaluated once. A prefill pool
without a recipe is the source as released (GLM 5.x's own block-FP8): it is verified for the engine and needs no gate,
its candidate being the baseline itself. WORK/plan.json sizes both pools for the deployment (plan --deploy). Publish
runs only when every pool passed, checks every gate before it copies a byte (no pool is published alone), and ships
each converted pool with the same card, which says which pool serves which artifact: ``file://DIR`` to DIR/<pool>
with the card also at DIR/README.md, a hub ``ORG/NAME`` to ``ORG/NAME-<pool>`` (an engine loads a repo, not a
folder of one).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from quantkit.checkpoint.writer import work_folder, write_bytes_atomic
from quantkit.errors import QuantkitError
from quantkit.release.chain import ReleaseResult, ReleaseStopped, StageRecord, StageStatus, release_one
from quantkit.release.config import PoolsConfig, config_relative, publish_repo, work_dir_of
from quantkit.release.stages import refused, write_json


@dataclass
class PoolResult:
    name: str  # prefill | decode
    recipe: str | None  # None: the source as released
    model: str  # the artifact's folder
    kv_cache_dtype: str
    release: ReleaseResult | None = None  # None for the source as released
    published: str | None = None  # the folder or repo it was published to


@dataclass
class PoolsResult:
    config: str
    work_dir: str
    pools: list[PoolResult] = field(default_factory=list)
    plan: str | None = None  # WORK/plan.json: both pools sized for the deployment
    card: str | None = None  # the card both pools were published with (its local copy)


def release_pools(
    config: PoolsConfig,
    config_path: Path,
    *,
    resume: bool = False,
    on_stage: Callable[[StageRecord], None] | None = None,
    api=None,
    on_progress: Callable[[str, int, int], None] | None = None,
    on_launch: Callable[[list[str]], None] | None = None,
) -> PoolsResult:
    """Plan both pools, release each (prefill first), then publish both together; a stage that stops names its
    pool."""
    work = work_dir_of(config_path, config.work_dir)
    try:
        work.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise QuantkitError(f"cannot create the work folder ({exc.strerror})", work) from exc
    result = PoolsResult(str(config_path), str(work))
    source = config_relative(config_path, config.source)
    result.plan = _plan(config, source, work, config_path, on_stage)
    for name, settings in config.pools.items():
        def staged(record: StageRecord, name: str = name) -> None:
            record.pool = name
            if on_stage is not None:
                on_stage(record)

        if settings.recipe is None:
            result.pools.append(_as_released(config, source, work, name, config_path, staged))
            continue
        try:
            done = release_one(config.pool(name, work), config_path, resume=resume, on_stage=staged, api=api,
                               on_progress=on_progress, on_launch=on_launch)
        except ReleaseStopped as exc:
            raise ReleaseStopped(exc.stage, exc.cause, config_path, pool=name) from exc
        result.pools.append(PoolResult(name, settings.recipe, str(work / name / "model"),
                                       config.pool(name, work).candidate_kv, done))
    if config.publish is not None:
        started = time.perf_counter()
        try:
            result.card = publish_pools(result, config, config_path, api)
        except QuantkitError as exc:
            raise ReleaseStopped("publish", str(exc), config_path, pool="both") from exc
        shipped = ", ".join(f"{p.name} to {p.published}" for p in result.pools if p.release and p.published)
        if on_stage is not None:
            on_stage(StageRecord("publish", StageStatus.RAN, round(time.perf_counter() - started, 1), shipped,
                                 pool="both"))
    return result


def _plan(config: PoolsConfig, source: Path, work: Path, config_path: Path,
          on_stage: Callable[[StageRecord], None] | None) -> str:
    """Both pools sized at the verified TP (``plan --deploy``), before hours of converting."""
    from quantkit.plan import plan

    started = time.perf_counter()
    decode = config.pools.decode
    try:
        report = plan(source, decode.recipe, tp=config.verify.tp, max_shard_size=config.convert.max_shard_size,
                      deploy=True, chart=work / "plan-memory.png", dst_hint=str(work / "decode" / "model"),
                      prefill_recipe=config.pools.prefill.recipe, prefill_hint=str(work / "prefill" / "model"),
                      decode_kv_dtype=config.pool("decode", work).candidate_kv)
    except QuantkitError as exc:
        raise ReleaseStopped("plan", str(exc), config_path, pool="both") from exc
    out = work / "plan.json"
    write_json(out, report)
    summary = "; ".join(f"{p.role} {p.weights_per_gpu / 1e9:.3f} GB weights + {p.kv_tokens_per_gpu:,} {p.kv_dtype} "
                        f"KV tokens per GPU at tp={report.tp}" for p in report.pools)
    if on_stage is not None:
        on_stage(StageRecord("plan", StageStatus.RAN, round(time.perf_counter() - started, 1), summary, pool="both"))
    return str(out)


def _as_released(config: PoolsConfig, source: Path, work: Path, name: str, config_path: Path,
                 on_stage: Callable[[StageRecord], None]) -> PoolResult:
    """The source itself as a pool's artifact: verified for the engine at the planned TP; not gated, its candidate
    being the baseline (the same weights with the baseline's KV cache)."""
    from quantkit.verify import verify

    started = time.perf_counter()
    v = config.verify
    report = verify(source, engine=v.engine, tp=v.tp, smoke=v.smoke)
    folder = work_folder(work, name)
    write_json(folder / "verify.json", report)
    if not report.passed:
        raise ReleaseStopped("verify", f"the source as released: {refused(report, folder / 'verify.json')}",
                             config_path, pool=name)
    on_stage(StageRecord("verify", StageStatus.RAN, round(time.perf_counter() - started, 1),
                         f"the source as released passed for {v.engine} tp={v.tp} (not gated: it is the baseline)"))
    return PoolResult(name, None, str(source), config.eval.kv_cache_dtype)


def publish_pools(result: PoolsResult, config: PoolsConfig, config_path: Path, api=None) -> str:
    """Every converted pool's gate checked against its files first, then each published with the one card; returns
    the card's local copy."""
    from quantkit.release.card import pools_section
    from quantkit.release.publish import check_gate, publish

    p = config.publish
    assert p is not None
    converted = [r for r in result.pools if r.release is not None]
    verdicts = {r.name: check_gate(Path(r.model), Path(result.work_dir) / r.name / "gate" / "verdict.json", False)
                for r in converted}
    repo = publish_repo(config_path, p.repo)
    local = repo.startswith("file://")
    for r in result.pools:  # the source as released is served from where its owner published it
        r.published = (f"{repo}/{r.name}" if local else f"{repo}-{r.name}") if r.release else p.base_model
    section = pools_section(result.pools, verdicts)
    for r in converted:
        done = publish(r.model, r.published or "", gate=Path(result.work_dir) / r.name / "gate" / "verdict.json",
                       private=p.private, revision=p.revision, base_model=p.base_model, api=api, pools=section)
        r.published = done.target if local else done.repo
    card = Path(result.work_dir) / "pools-card.md"
    write_bytes_atomic(card, ("\n".join(section) + "\n").encode())
    if local:
        write_bytes_atomic(Path(repo.removeprefix("file://")) / "README.md", card.read_bytes())
    return str(card)
