"""release: the chain from one config, resumable after a kill between stages, stopping with a usable message."""

import json
import shutil
from pathlib import Path

import pytest
import yaml
from helpers import evaldata, release_config, revise_in_place

from quantkit.checkpoint.reader import open_checkpoint
from quantkit.checkpoint.manifest import load_manifest
from quantkit.errors import QuantkitError
from quantkit.examples.smollm2 import block_fp8_release
from quantkit.release import STAGES, ReleaseStopped, release
from conftest import tree_bytes
from helpers import one_line_error, quantkit
from safetensors.torch import load_file

DATA = evaldata("arc_easy")


@pytest.fixture(scope="module")
def fp8_source(smollm2_bf16, tmp_path_factory):
    return block_fp8_release(smollm2_bf16, tmp_path_factory.mktemp("fp8") / "smollm2-fp8")


def write_config(folder: Path, source: Path, **changes) -> Path:
    """A small release: 8 ARC-Easy items; the test suite's margin is wide because 8 items certify nothing."""
    (folder / "suite.yaml").write_text("may_differ: [engine.args.kv_cache_dtype]\ntasks:\n  arc_easy: {margin: 100}\n")
    config = {
        "source": str(source),
        "recipe": "dense-mlp-w4a16-g32",
        "convert": {"device": "cpu"},
        "calibrate_kv": {"samples": 4, "seq_len": 64, "device": "cpu"},
        "verify": {"engine": "sglang", "tp": 1},
        "eval": {"engine": "hf", "tasks": ["arc_easy"], "data_dir": str(DATA), "limit": 8},
        "suite": "suite.yaml",
        "publish": {"repo": "file://published"},
    }
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if field:
            config[section][field] = value
        else:
            config[section] = value
    path = folder / "release.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def kill_after(stage: str):
    """An ``on_stage`` callback that stops the release, as a kill would, once ``stage`` is done."""

    def stop(record):
        if record.stage == stage:
            raise KeyboardInterrupt

    return stop


@pytest.mark.slow  # the real SmolLM2 through every stage
def test_killed_between_stages_resumes_at_the_next_stage(fp8_source, tmp_path):
    config = write_config(tmp_path, fp8_source)
    with pytest.raises(KeyboardInterrupt):
        release(config, on_stage=kill_after("verify"))
    state = json.loads((tmp_path / "release-work" / "release-state.json").read_text())
    assert list(state["stages"]) == ["plan", "convert", "calibrate-kv", "verify"]
    with pytest.raises(QuantkitError, match="holds a release already; --resume"):
        release(config)

    result = release(config, resume=True)
    assert [(r.stage, r.status) for r in result.stages] == (
        [(s, "resumed") for s in STAGES[:4]] + [(s, "ran") for s in STAGES[4:]])
    published = tmp_path / "published"
    assert result.published == str(published)
    card = (published / "README.md").read_text()
    assert "## Release gate: PASS" in card and "--kv-cache-dtype fp8_e4m3" in card
    assert (published / "quantkit-manifest.json").is_file()
    cand = json.loads((tmp_path / "release-work" / "runs" / "candidate" / "run.json").read_text())
    assert cand["engine"]["args"]["kv_cache_dtype"] == "fp8_e4m3"  # the decode pool's KV cache was evaluated
    verdict = json.loads((tmp_path / "release-work" / "gate" / "verdict.json").read_text())
    assert verdict["allowed_differences"] == ["engine.args.kv_cache_dtype: 'auto' vs 'fp8_e4m3'"]

    again = release(config, resume=True)  # all done: nothing runs
    assert {r.status for r in again.stages} == {"resumed"}

    # Another candidate from the same source reuses the baseline run on disk without loading the model.
    other = tmp_path / "other"
    other.mkdir()
    second = write_config(other, fp8_source, calibrate_kv=None,
                          eval__baseline_run=str(tmp_path / "release-work" / "runs" / "baseline"))
    result = release(second)
    statuses = {r.stage: r.status for r in result.stages}
    assert statuses["eval-baseline"] == "reused" and statuses["calibrate-kv"] == "skipped"


@pytest.mark.slow  # the real SmolLM2 through every stage
def test_a_failing_stage_says_which_why_and_how_to_resume(fp8_source, tmp_path):
    config = write_config(tmp_path, fp8_source, eval__data_dir=str(tmp_path / "no-data"))
    with pytest.raises(ReleaseStopped, match=r"stopped at stage eval-baseline: .*missing data file for task arc_easy"
                                             r".*resume with: quantkit release .*release.yaml --resume") as info:
        release(config)
    assert info.value.stage == "eval-baseline"
    state = json.loads((tmp_path / "release-work" / "release-state.json").read_text())
    assert list(state["stages"])[-1] == "verify"

    # Fixing the config resumes at the failed stage: nothing before it runs again.
    write_config(tmp_path, fp8_source, suite="strict.yaml")
    (tmp_path / "strict.yaml").write_text("tasks:\n  arc_easy: {margin: 100}\n")  # no may_differ: FP8 KV is a difference
    with pytest.raises(ReleaseStopped, match="stopped at stage gate: .*engine.args.kv_cache_dtype: 'auto' vs 'fp8_e4m3'"):
        release(config, resume=True)
    assert not (tmp_path / "published").exists()


def test_bad_configs_are_named(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("source: x\nrecipe: y\npublish: {repo: org/x}\nevals: {}\n")
    with pytest.raises(QuantkitError, match="r.yaml: evals: Extra inputs are not permitted"):
        release(path)
    path.write_text("source: x\nrecipe: y\n")
    with pytest.raises(QuantkitError, match="r.yaml: publish: Field required"):
        release(path)
    with pytest.raises(QuantkitError, match="missing.yaml: release config not found"):
        release(tmp_path / "missing.yaml")


def test_the_shipped_example_config_is_valid():
    from quantkit.release import load_config
    from quantkit.release.gate import load_suite

    root = Path(__file__).resolve().parents[1] / "eval"
    config = load_config(root / "release-example.yaml")
    assert config.eval.engine == "sglang" and config.eval.candidate_kv_cache_dtype == "fp8_e4m3"
    assert load_suite(root / config.suite).may_differ == ["engine.args.kv_cache_dtype"]
    assert set(load_suite(root / config.suite).tasks) <= set(config.eval.tasks)  # it gates what it evaluates


@pytest.mark.slow  # the real SmolLM2 converted twice
def test_a_source_revised_in_place_is_converted_again_on_resume(fp8_source, tmp_path):
    """Same names, sizes and headers, other bytes: a resumed release must not keep the old conversion as done."""
    source = tmp_path / "source"
    shutil.copytree(fp8_source, source)
    config = write_config(tmp_path, source)
    with pytest.raises(KeyboardInterrupt):
        release(config, on_stage=kill_after("convert"))
    model = tmp_path / "release-work" / "model"
    before = load_manifest(model).shards
    statuses = []

    def record_then_kill(record):
        statuses.append((record.stage, record.status))
        kill_after("convert")(record)

    with pytest.raises(KeyboardInterrupt):
        release(config, resume=True, on_stage=record_then_kill)
    assert statuses == [("plan", "resumed"), ("convert", "resumed")]  # untouched: nothing runs again
    assert revise_in_place(source, tensors="layers.0.")
    statuses.clear()
    with pytest.raises(KeyboardInterrupt):
        release(config, resume=True, on_stage=record_then_kill)
    assert statuses == [("plan", "ran"), ("convert", "ran")]
    after = load_manifest(model).shards
    assert after != before and {n for n in after if after[n].source_digest != before[n].source_digest}


def test_release_resume_after_the_source_was_replaced_runs_every_stage_again(synthetic, tmp_path):
    """It reported every stage "done earlier" and would have published the old conversion."""
    import shutil


    from quantkit.examples.synthetic import build_synthetic
    from quantkit.release import ReleaseStopped, release

    source = tmp_path / "source"
    shutil.copytree(synthetic["llama"], source)
    config = release_config(tmp_path, source)
    with pytest.raises(ReleaseStopped, match="stage eval-baseline"):  # no data: the chain stops after verify
        release(config)
    shutil.rmtree(source)
    build_synthetic("llama", source, seed=9, fp8=False, num_hidden_layers=3)  # another model at the same path
    seen = []
    with pytest.raises(ReleaseStopped, match="stage eval-baseline"):
        release(config, resume=True, on_stage=seen.append)
    assert [(r.stage, r.status) for r in seen] == [("plan", "ran"), ("convert", "ran"), ("calibrate-kv", "skipped"),
                                                   ("verify", "ran")]
    assert open_checkpoint(tmp_path / "release-work" / "model").config.num_hidden_layers == 3


def test_release_never_deletes_a_checkpoint_it_did_not_write(synthetic, tmp_path):
    config = release_config(tmp_path, synthetic["llama"])
    mine = tmp_path / "release-work" / "model"
    shutil.copytree(synthetic["llama"], mine)
    before = tree_bytes(mine)
    r = quantkit("release", config, "--json")
    one_line_error(r, "release stopped at stage convert", "holds files this release did not write")
    assert tree_bytes(mine) == before


def test_release_resume_reruns_what_an_edited_recipe_or_suite_changes(synthetic, tmp_path):
    from quantkit.release import ReleaseStopped, release

    recipe = tmp_path / "mine.yaml"
    recipe.write_text((Path(__file__).resolve().parents[1] / "recipes" / "dense-w4a16-g128.yaml").read_text())
    config = release_config(tmp_path, synthetic["llama"], recipe=str(recipe))
    with pytest.raises(ReleaseStopped, match="stage eval-baseline"):  # no data: the chain stops after verify
        release(config)
    recipe.write_text(recipe.read_text().replace("group_size: 128", "group_size: 64"))
    seen = []
    with pytest.raises(ReleaseStopped, match="stage eval-baseline"):
        release(config, resume=True, on_stage=seen.append)
    assert [(r.stage, r.status) for r in seen] == [("plan", "ran"), ("convert", "ran"), ("calibrate-kv", "skipped"),
                                                   ("verify", "ran")]
    weights = load_file(next((tmp_path / "release-work" / "model").glob("model-*.safetensors")))
    scales = [t for n, t in weights.items() if n.endswith("q_proj.weight_scale")][0]
    assert scales.shape[1] == 256 // 64  # the edited recipe's group size, not the old output "done earlier"


def test_a_release_resumed_after_its_published_folder_was_deleted_publishes_again(llama_pair, tmp_path):
    base, _ = llama_pair
    (tmp_path / "suite.yaml").write_text("tasks:\n  arc_easy: {margin: 100}\n")
    config = {"source": str(base), "recipe": "dense-w4a16-g128", "convert": {"device": "cpu"},
              "verify": {"smoke": False}, "eval": {"tasks": ["arc_easy"], "data_dir": str(DATA), "limit": 4,
                                                   "device": "cpu"},
              "suite": "suite.yaml", "publish": {"repo": "file://published"}}
    path = tmp_path / "release.yaml"
    path.write_text(json.dumps(config))
    from quantkit.release import release

    first = release(path)
    published = tmp_path / "published"
    assert first.published == str(published) and (published / "config.json").is_file()
    shutil.rmtree(published)
    again = release(path, resume=True)
    statuses = {r.stage: (r.status, r.summary) for r in again.stages}
    assert statuses["gate"][0] == "resumed"
    assert statuses["publish"][0] == "ran" and "run again" in statuses["publish"][1]
    assert (published / "config.json").is_file()
    (tmp_path / "release-work" / "runs" / "candidate" / "samples" / "arc_easy.jsonl").write_text("")  # an edited run
    statuses = {r.stage: r.status for r in release(path, resume=True).stages}
    assert statuses["eval-baseline"] == "resumed" and statuses["eval-candidate"] == "ran"
    assert statuses["gate"] == statuses["publish"] == "ran"
