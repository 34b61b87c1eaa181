"""``release``: the whole chain from one config file, resumable stage by stage.

plan -> convert -> calibrate-kv -> verify -> eval baseline -> eval candidate -> gate -> publish (release/stages.py).

Each finished stage is recorded in WORK/release-state.json (release/state.py) with a fingerprint of
the config sections it depends on (its own and every earlier stage's) and the files it left behind.
``--resume`` skips a stage whose fingerprint is unchanged and whose files are all still there as it
left them, so fixing a later stage's settings re-runs only from there, and a deleted or edited output
runs its stage again. WORK is locked while a release runs in it. A baseline
run already on disk with the same shards, tasks and engine settings is reused without serving
the source again. A failure stops the chain with the stage, the cause and the command to resume (release/chain.py).
A config with ``pools:`` releases the recipe's prefill and decode artifacts together (release/pools.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from quantkit.release.chain import STAGES, ReleaseResult, ReleaseStopped, StageRecord, StageStatus, release_one
from quantkit.release.config import PoolsConfig, ReleaseConfig, load_config
from quantkit.release.pools import PoolsResult, release_pools

__all__ = ["STAGES", "PoolsResult", "ReleaseConfig", "ReleaseResult", "ReleaseStopped", "StageRecord", "StageStatus",
           "load_config", "release"]


def release(
    config_path: str | os.PathLike,
    *,
    resume: bool = False,
    on_stage: Callable[[StageRecord], None] | None = None,
    api=None,
    on_progress: Callable[[str, int, int], None] | None = None,
    on_launch: Callable[[list[str]], None] | None = None,
) -> ReleaseResult | PoolsResult:
    """Run CONFIG's chain; ``on_stage`` after each stage, ``on_progress(task, done, total)`` during evals,
    ``on_launch(argv)`` before the config's engine command runs (it is executable configuration). A config with
    ``pools:`` releases the recipe's prefill and decode artifacts together (release/pools.py)."""
    config_path = Path(config_path).resolve()
    config = load_config(config_path)
    if isinstance(config, PoolsConfig):
        return release_pools(config, config_path, resume=resume, on_stage=on_stage, api=api, on_progress=on_progress,
                             on_launch=on_launch)
    return release_one(config, config_path, resume=resume, on_stage=on_stage, api=api, on_progress=on_progress,
                       on_launch=on_launch)
