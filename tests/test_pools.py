"""A release of the recipe's two pools: both artifacts of one source, gated against one baseline run, published
together with one card that says which pool serves which, and never one pool alone."""

import json
from pathlib import Path

import pytest
import yaml
from helpers import evaldata
from typer.testing import CliRunner

from quantkit.cli import app
from quantkit.errors import QuantkitError
from quantkit.examples.smollm2 import block_fp8_release
from quantkit.release import ReleaseStopped, load_config, release
from quantkit.release.pools import PoolsResult, publish_pools
from quantkit.release.publish import PublishRefused

DATA = evaldata("arc_easy")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fp8_source(smollm2_bf16, tmp_path_factory):
    return block_fp8_release(smollm2_bf16, tmp_path_factory.mktemp("fp8") / "smollm2-fp8")


def write_pools(folder: Path, source: Path, prefill: dict) -> Path:
    """Both pools of SmolLM2 on 8 ARC-Easy items (the suite's margin is wide: 8 items certify nothing)."""
    (folder / "suite.yaml").write_text("may_differ: [engine.args.kv_cache_dtype]\ntasks:\n  arc_easy: {margin: 100}\n")
    config = {
        "source": str(source),
        "pools": {"prefill": prefill,
                  "decode": {"recipe": "dense-mlp-w4a16-g32",
                             "calibrate_kv": {"samples": 4, "seq_len": 64, "device": "cpu"}}},
        "convert": {"device": "cpu"},
        "verify": {"engine": "sglang", "tp": 1},
        "eval": {"engine": "hf", "tasks": ["arc_easy"], "data_dir": str(DATA), "limit": 8},
        "suite": "suite.yaml",
        "publish": {"repo": "file://published", "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct"},
    }
    path = folder / "pools.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.slow  # the real SmolLM2, both pools through every stage
def test_both_pools_gated_against_one_baseline_and_published_with_one_card(fp8_source, tmp_path):
    config = write_pools(tmp_path, fp8_source, {"recipe": "dense-fp8-dynamic"})
    seen = []
    result = release(config, on_stage=seen.append)
    assert isinstance(result, PoolsResult)
    stages = [(r.pool, r.stage, str(r.status)) for r in seen]
    assert stages[0] == ("both", "plan", "ran") and stages[-1] == ("both", "publish", "ran")
    assert ("prefill", "eval-baseline", "ran") in stages and ("decode", "eval-baseline", "reused") in stages
    assert ("prefill", "calibrate-kv", "skipped") in stages and ("decode", "calibrate-kv", "ran") in stages
    assert ("prefill", "publish", "skipped") in stages  # neither pool publishes alone

    work = tmp_path / "pools-work"
    plan = json.loads((work / "plan.json").read_text())
    assert [(p["role"], p["checkpoint"], p["kv_dtype"]) for p in plan["pools"]] == [
        ("prefill", str(work / "prefill" / "model"), "bf16"), ("decode", str(work / "decode" / "model"), "fp8_e4m3")]
    assert plan["pools"][1]["weights_per_gpu"] < plan["pools"][0]["weights_per_gpu"]  # INT4 MLP vs FP8 everything
    for name in ("prefill", "decode"):
        verdict = json.loads((work / name / "gate" / "verdict.json").read_text())
        assert verdict["baseline"] == str(work / "runs" / "baseline")  # one baseline run for both

    published = tmp_path / "published"
    top = (published / "README.md").read_text()
    rows = [line for line in top.splitlines() if line.startswith(("| prefill ", "| decode "))]
    assert len(rows) == 2
    assert "FP8 e4m3, a scale per output row" in rows[0] and "FP8 dynamic per token" in rows[0]
    assert "| BF16 |" in rows[0]
    assert "INT4 symmetric, group 32" in rows[1] and "FP8 e4m3, calibrated" in rows[1]
    assert all("pass: arc_easy" in row for row in rows)
    for name in ("prefill", "decode"):
        card = (published / name / "README.md").read_text()
        assert top.strip() in card  # each pool's own card carries the deployment's section
        assert (published / name / "config.json").is_file()
    assert "--kv-cache-dtype fp8_e4m3" in (published / "decode" / "README.md").read_text()

    resumed = CliRunner().invoke(app, ["release", str(config), "--resume"])  # done: each pool resumes, none runs
    assert resumed.exit_code == 0, resumed.output
    said = " ".join(resumed.output.split())
    assert said.count("done earlier") == 16 and f"released: {published / 'decode'}" in said
    assert "prefill (dense-fp8-dynamic) # Release gate: PASS" in said and "both pools sized for the deployment" in said

    # Publishing checks every gate before it copies a byte: a decode file changed since its gate leaves the prefill
    # pool unpublished too.
    shipped = work / "decode" / "model" / "generation_config.json"
    shipped.write_text(shipped.read_text().replace("{", '{"edited": 1, ', 1))
    changed = yaml.safe_load(config.read_text())
    changed["publish"]["repo"] = "file://published-again"
    config.write_text(yaml.safe_dump(changed))
    with pytest.raises(PublishRefused, match="changed since it was gated"):
        publish_pools(result, load_config(config), config, None)
    assert not (tmp_path / "published-again").exists()


@pytest.mark.slow  # the real SmolLM2 as block-FP8: verify refuses it before anything is evaluated
def test_the_source_as_released_is_verified_for_its_pool(fp8_source, tmp_path):
    config = write_pools(tmp_path, fp8_source, {})
    seen = []
    with pytest.raises(ReleaseStopped, match=r"stopped at the prefill pool's stage verify: the source as released: "
                                             r".*resume with: quantkit release .*pools.yaml --resume") as info:
        release(config, on_stage=seen.append)
    assert info.value.pool == "prefill"
    assert [(r.pool, r.stage) for r in seen] == [("both", "plan")]
    assert not (tmp_path / "pools-work" / "runs").exists() and not (tmp_path / "published").exists()


def test_pool_configs_say_what_is_wrong(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("source: x\npools: {prefill: {recipe: a}, decode: {}}\npublish: null\n")
    with pytest.raises(QuantkitError, match="p.yaml: pools: .*pools.decode needs a recipe"):
        release(path)
    path.write_text("source: x\npools: {prefill: {calibrate_kv: {}}, decode: {recipe: b}}\npublish: null\n")
    with pytest.raises(QuantkitError, match="pools.prefill.calibrate_kv needs a recipe"):
        release(path)
    path.write_text("source: x\npools: {prefill: {}, decode: {recipe: b}, extra: {}}\npublish: null\n")
    with pytest.raises(QuantkitError, match="pools.extra: Extra inputs are not permitted"):
        release(path)


def test_the_shipped_pools_example_is_valid():
    from quantkit.release.gate import load_suite

    config = load_config(ROOT / "eval" / "release-pools-example.yaml")
    assert config.pools.prefill.recipe is None  # GLM 5.2's own block-FP8 serves prefill
    assert config.pools.decode.recipe == "glm5-int4-experts-g32" and config.pools.decode.calibrate_kv is not None
    assert set(load_suite(ROOT / "eval" / config.suite).tasks) <= set(config.eval.tasks)


def test_plan_sizes_a_converted_prefill_pool(synthetic, tmp_path):
    from quantkit.plan import plan

    src = synthetic["glm_moe_dsa"]
    as_released = plan(src, "glm5-int4-experts-g32", deploy=True, chart=tmp_path / "a.png")
    converted = plan(src, "glm5-int4-experts-g32", deploy=True, chart=tmp_path / "b.png",
                     prefill_recipe="glm5-fp8-dynamic", prefill_hint="P")
    assert as_released.pools[0].checkpoint == str(src) and converted.pools[0].checkpoint == "P"
    # FP8 with a scale per row, not per 128x128 block, and every Linear of the source's converted, not only experts
    assert converted.pools[0].weights_per_gpu != as_released.pools[0].weights_per_gpu
    assert converted.pools[1] == as_released.pools[1]
