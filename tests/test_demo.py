"""The README's main job, in its CI variant: fewer items, same chain, same suite, same honesty."""

import json
import shutil
import time
from pathlib import Path

import pytest
import yaml
from helpers import OUTSIDE, plant_link
from typer.testing import CliRunner

from quantkit.cli import app
from quantkit.errors import QuantkitError
from helpers import quantkit


def test_the_margin_follows_the_suites_own_rule_for_the_items_asked_for(tmp_path):
    from quantkit.examples.demo import _suite, planned_margin
    from quantkit.packaged import suite_path

    built_in = yaml.safe_load(suite_path("small-model").read_text())["tasks"]["arc_easy"]["margin"]
    assert planned_margin(500) == built_in == 4.0  # the rule reproduces the margin chosen for the default 500 items
    assert planned_margin(200) == 6.0 and planned_margin(2376) == 2.0  # fewer items certify less
    written = yaml.safe_load(_suite(tmp_path, 200).read_text())
    assert written["tasks"]["arc_easy"]["margin"] == 6.0 and written["sequential"] == {
        "looks": [0.25, 0.5, 1.0], "spending": "obrien-fleming"}


@pytest.mark.slow  # real-model end-to-end: `pytest -m "not slow"` skips it in the edit loop
def test_demo_releases_both_pools_and_publishes_only_what_passes(smollm2_bf16, tmp_path):
    work = tmp_path / "demo"
    started = time.perf_counter()
    result = CliRunner().invoke(app, ["demo", "--workdir", str(work), "--arc-items", "200", "--gsm8k-items", "4",
                                      "--source-model", str(smollm2_bf16)])
    seconds = time.perf_counter() - started
    assert result.exit_code == 0, result.output
    print(result.output)
    print(f"demo CI variant: {seconds:.0f}s")

    # 200 items certify a 6-point margin by the suite's own rule (4 at the demo's 500).
    assert yaml.safe_load((work / "suite.yaml").read_text())["tasks"]["arc_easy"]["margin"] == 6.0
    # The prefill pool: every Linear FP8 with a scale per row, FP8 activations per token, the KV cache left BF16.
    prefill = json.loads((work / "release-prefill" / "model" / "config.json").read_text())["quantization_config"]
    group = next(iter(prefill["config_groups"].values()))
    assert (group["weights"]["strategy"], group["input_activations"]["strategy"]) == ("channel", "token")
    assert prefill["kv_cache_scheme"] is None and "calibrate_kv" not in (work / "release-prefill.yaml").read_text()
    # The decode pool: the INT4 release is asymmetric round-to-nearest, picked by measurement on the demo's suite
    # (docs/demo.md): a zero point per group of 32, as compressed-tensors writes it, with calibrated FP8 KV scales.
    decode = json.loads((work / "release-decode" / "model" / "config.json").read_text())["quantization_config"]
    assert [g["weights"]["symmetric"] for g in decode["config_groups"].values()] == [False]
    assert decode["kv_cache_scheme"]["type"] == "float"

    # Both verified for SGLang, both gated on the same items, each published exactly when its gate passes; a release
    # that is not published says why in one line.
    lines = result.output.splitlines()
    for name, published in (("prefill", "smollm2-135m-prefill"), ("decode", "smollm2-135m-decode-fp8kv")):
        assert json.loads((work / f"release-{name}" / "verify.json").read_text())["passed"]
        verdict = json.loads((work / f"release-{name}" / "gate" / "verdict.json").read_text())
        arc = next(t for t in verdict["tasks"] if t["task"] == "arc_easy")
        assert arc["n"] <= 200 and verdict["sequential"]["looks"] <= 3
        assert (work / "published" / published).exists() == verdict["passed"]
        if not verdict["passed"]:
            assert any(line.startswith("not published: gate: the candidate fails the gate: arc_easy")
                       for line in lines), result.output
        print(f"demo CI variant: {name} delta {arc['delta']:+.2f} ({'pass' if verdict['passed'] else 'fail'})")

    # What was published carries a card that says which pool it is for, how it was gated, and the bytes verified.
    for name, published, pool in (("prefill", "smollm2-135m-prefill", "prefill"),
                                  ("decode", "smollm2-135m-decode-fp8kv", "decode")):
        folder = work / "published" / published
        if folder.exists():
            card = (folder / "README.md").read_text()
            assert yaml.safe_load(card.split("---")[1])["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
            assert "## Release gate: PASS" in card and f"**{pool} (" in card
            assert (folder / "model-00001-of-00001.safetensors").read_bytes() == \
                (work / f"release-{name}" / "model" / "model-00001-of-00001.safetensors").read_bytes()

    # The source is written like the real releases: block-FP8 Linears with weight_scale_inv.
    config = json.loads((work / "smollm2-135m-fp8" / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    # The second release reused the first one's baseline run instead of evaluating the source again.
    state = json.loads((work / "release-decode" / "release-state.json").read_text())
    assert state["stages"]["eval-baseline"]["seconds"] < 5
    assert Path(work / "baseline-run" / "results.json").is_file()


def test_the_demo_writes_nothing_through_links_planted_in_its_workdir(smollm2_bf16, tmp_path):
    from quantkit.examples.demo import demo

    work = tmp_path / "work"
    suite_target = plant_link(work / "suite.yaml", tmp_path)
    (tmp_path / "elsewhere").mkdir()
    (work / "data").mkdir()
    (work / "data" / "arc_easy").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(QuantkitError, match="is a link: refused"):
        demo(work, arc_items=4, gsm8k_items=1, source_model=smollm2_bf16)
    assert list((tmp_path / "elsewhere").iterdir()) == [] and suite_target.read_bytes() == OUTSIDE

    (work / "data" / "arc_easy").unlink()  # the folder link gone, the file link is replaced, never written through
    (work / "data" / "gsm8k").mkdir()
    ok = (work / "data" / "gsm8k" / "test.jsonl")
    plant_link(ok, tmp_path / "elsewhere")
    from quantkit.examples import demo as demo_module

    demo_module._slice(demo_module.DATA / "gsm8k" / "test.jsonl", work, "data/gsm8k/test.jsonl", 2)
    assert not ok.is_symlink() and len(ok.read_text().splitlines()) == 2
    assert (tmp_path / "elsewhere" / "outside.txt").read_bytes() == OUTSIDE


def test_a_block_fp8_source_is_written_again_for_another_model(smollm2_bf16, tmp_path):
    from quantkit.examples.smollm2 import block_fp8_release
    from quantkit.checkpoint.reader import open_checkpoint

    out = block_fp8_release(smollm2_bf16, tmp_path / "fp8")
    first = open_checkpoint(out).fingerprint()
    assert block_fp8_release(smollm2_bf16, out) == out and open_checkpoint(out).fingerprint() == first  # resumed
    other = tmp_path / "other"
    shutil.copytree(smollm2_bf16, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(dict(config, rms_norm_eps=1e-6)))  # another model, same headers
    block_fp8_release(other, out)
    assert json.loads((out / "config.json").read_text())["rms_norm_eps"] == 1e-6
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(QuantkitError, match="holds files this demo did not write"):
        block_fp8_release(smollm2_bf16, foreign)
    assert (foreign / "notes.txt").read_text() == "mine"


def test_version_and_the_demos_help_say_what_is_true():
    from quantkit import __version__

    r = quantkit("--version")
    assert r.exit_code == 0 and r.output.strip() == f"quantkit {__version__}"
    from quantkit.examples.demo import CANDIDATES

    r = quantkit("demo", "--help")
    said = " ".join(r.output.split())
    assert "two pools" in said and len(CANDIDATES) == 2
    assert all(f"{c.pool} (" in said for c in CANDIDATES.values()), said
