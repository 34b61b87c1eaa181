"""A conversion killed with SIGKILL at any moment resumes to byte-identical output."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import tree_bytes
from helpers import one_line_error, quantkit, revise_in_place

from quantkit.checkpoint.reader import open_checkpoint
from quantkit.convert import DifferentRun, convert
from quantkit.errors import QuantkitError
from quantkit.examples.synthetic import build_synthetic

ARGS = ["-r", "glm5-int4-experts-g32", "--max-shard-size", "1MB", "--workers", "1", "--device", "cpu", "--json"]


def run_cli(*args, **kw):
    return subprocess.Popen([sys.executable, "-m", "quantkit", "convert", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, **kw)


def shards_done(dst):
    try:
        return len(json.loads((dst / "quantkit-manifest.json").read_text())["shards"])
    except (OSError, ValueError, KeyError):
        return -1


def kill_when(proc, dst, threshold, deadline=120.0):
    """SIGKILL once the manifest records ``threshold`` shards (or a partial file appears)."""
    start = time.monotonic()
    while proc.poll() is None and time.monotonic() - start < deadline:
        if shards_done(dst) >= threshold or (threshold == 0 and any(dst.glob(".*.partial"))):
            break
        time.sleep(0.002)
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait()


@pytest.fixture(scope="module")
def big_source(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    src = build_synthetic("glm_moe_dsa", root / "src", seed=2, n_routed_experts=32, num_hidden_layers=4)
    reference = root / "reference"
    convert(src, reference, "glm5-int4-experts-g32", device="cpu", workers=1, max_shard_size="1MB")
    return src, reference


def test_kill_9_at_random_points_then_resume_is_byte_identical(big_source, tmp_path):
    src, reference = big_source
    want = tree_bytes(reference)
    total = json.loads((reference / "quantkit-manifest.json").read_text())
    n_shards = len(total["shards"])
    assert n_shards >= 10
    rng = random.Random(1234)
    for trial in range(4):
        dst = tmp_path / f"trial{trial}"
        kills = sorted(rng.sample(range(0, n_shards), 2))
        for threshold in kills:
            kill_when(run_cli(src, dst, *ARGS, *(["--resume"] if dst.exists() else []), cwd=os.getcwd()), dst, threshold)
            assert not (dst / "config.json").exists() or shards_done(dst) == n_shards
        proc = run_cli(src, dst, *ARGS, "--resume")
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err.decode()[-2000:]
        result = json.loads(out)
        assert result["shards_reused"] >= 1
        got = tree_bytes(dst)
        assert got == want, f"trial {trial}: differs in {sorted(k for k in want if got.get(k) != want[k])}"
        assert not list(dst.glob(".*.partial"))


def test_resume_refuses_another_source_or_recipe_without_force(big_source, synthetic, tmp_path):
    src, _ = big_source
    dst = tmp_path / "dst"
    convert(src, dst, "glm5-int4-experts-g32", device="cpu", max_shard_size="1MB")
    with pytest.raises(QuantkitError, match="holds another run .*source"):
        convert(synthetic["glm_moe_dsa"], dst, "glm5-int4-experts-g32", device="cpu", max_shard_size="1MB", resume=True)
    with pytest.raises(QuantkitError, match="holds another run .*recipe"):
        convert(src, dst, "glm5-int4-experts-g128-fp8", device="cpu", max_shard_size="1MB", resume=True)
    with pytest.raises(QuantkitError, match="use --resume"):
        convert(src, dst, "glm5-int4-experts-g32", device="cpu", max_shard_size="1MB")
    again = convert(src, dst, "glm5-int4-experts-g32", device="cpu", max_shard_size="1MB", resume=True)
    assert again.shards_written == 0
    forced = convert(synthetic["glm_moe_dsa"], dst, "glm5-int4-experts-g32", device="cpu", force=True)
    assert forced.shards_reused == 0
    assert len(list(dst.glob("*.safetensors"))) == forced.shards_total


def test_resume_redoes_a_shard_whose_file_was_damaged(big_source, tmp_path):
    src, reference = big_source
    dst = tmp_path / "dst"
    convert(src, dst, "glm5-int4-experts-g32", device="cpu", workers=1, max_shard_size="1MB")
    victim = sorted(dst.glob("model-*.safetensors"))[3]
    victim.write_bytes(victim.read_bytes()[:1000])  # a truncated copy
    result = convert(src, dst, "glm5-int4-experts-g32", device="cpu", workers=1, max_shard_size="1MB", resume=True)
    assert result.shards_written == 1
    assert victim.read_bytes() == (reference / victim.name).read_bytes()


def _stopped_midway(src, dst, keep: int) -> None:
    """A finished conversion turned into one killed after ``keep`` shards (the manifest records only those)."""
    convert(src, dst, "glm5-int4-experts-g32", device="cpu", workers=1, max_shard_size="1MB")
    manifest = json.loads((dst / "quantkit-manifest.json").read_text())
    names = sorted(manifest["shards"])
    for name in names[keep:]:
        del manifest["shards"][name]
        (dst / name).unlink()
    manifest["status"] = "running"
    (dst / "config.json").unlink()
    (dst / "quantkit-manifest.json").write_text(json.dumps(manifest))


def test_resume_refuses_a_source_updated_in_place_under_the_same_headers(big_source, tmp_path):
    """A run killed mid-way, the source then replaced in place by another revision with identical names, sizes and
    headers: the resume must not finish the output from the new bytes beside shards made from the old ones."""
    src = tmp_path / "src"
    shutil.copytree(big_source[0], src)
    dst = tmp_path / "dst"
    _stopped_midway(src, dst, keep=4)
    before = open_checkpoint(src).fingerprint()
    assert revise_in_place(src)
    assert open_checkpoint(src).fingerprint() == before  # what identified a source until now cannot tell
    with pytest.raises(DifferentRun, match="source changed since this run started"):
        convert(src, dst, "glm5-int4-experts-g32", device="cpu", workers=1, max_shard_size="1MB", resume=True)
    assert not (dst / "config.json").exists()
    one_line_error(quantkit("convert", src, dst, *ARGS, "--resume"), "source changed since this run started", "--force")
    # a finished run is held to its source too, and --force starts over from the new revision
    forced = convert(src, dst, "glm5-int4-experts-g32", device="cpu", workers=1, max_shard_size="1MB", force=True)
    assert forced.shards_reused == 0
    again = convert(src, dst, "glm5-int4-experts-g32", device="cpu", workers=1, max_shard_size="1MB", resume=True)
    assert again.shards_written == 0
    revise_in_place(src, tensors="layers.2.")
    with pytest.raises(DifferentRun, match="source changed"):
        convert(src, dst, "glm5-int4-experts-g32", device="cpu", workers=1, max_shard_size="1MB", resume=True)


def test_a_source_merely_touched_or_copied_still_resumes(big_source, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(big_source[0], src)
    dst = tmp_path / "dst"
    _stopped_midway(src, dst, keep=4)
    for shard in src.glob("*.safetensors"):
        os.utime(shard)
    result = convert(src, dst, "glm5-int4-experts-g32", device="cpu", workers=1, max_shard_size="1MB", resume=True)
    assert result.shards_reused == 4
    manifest = {"quantkit-manifest.json": b""}  # it names the source's path, which is another here
    assert tree_bytes(dst) | manifest == tree_bytes(big_source[1]) | manifest


def test_resume_over_a_finished_output_keeps_its_kv_scales(smollm2_bf16, tmp_path):
    from quantkit.kv.calibrate import calibrate_kv

    dst = tmp_path / "int4"
    convert(smollm2_bf16, dst, "dense-mlp-w4a16-g32", device="cpu")
    calibrate_kv(dst, in_place=True, samples=2, seq_len=32, device="cpu")
    before = tree_bytes(dst)
    result = convert(smollm2_bf16, dst, "dense-mlp-w4a16-g32", device="cpu", resume=True)
    assert result.shards_written == 0
    assert tree_bytes(dst) == before
    assert json.loads((dst / "config.json").read_text())["quantization_config"]["kv_cache_scheme"] is not None


def test_a_tampered_finished_shard_is_not_reused(synthetic, tmp_path):
    clean, dst = tmp_path / "clean", tmp_path / "dst"
    convert(synthetic["glm_moe_dsa"], clean, "glm5-int4-experts-g32", device="cpu", max_shard_size="1MB")
    shutil.copytree(clean, dst)
    manifest = json.loads((dst / "quantkit-manifest.json").read_text())
    manifest["status"] = "running"  # as a kill after the last shard leaves it
    (dst / "quantkit-manifest.json").write_text(json.dumps(manifest))
    shard = sorted(dst.glob("model-*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF  # same size, other bytes
    shard.write_bytes(bytes(data))
    result = convert(synthetic["glm_moe_dsa"], dst, "glm5-int4-experts-g32", device="cpu", max_shard_size="1MB",
                     resume=True)
    assert result.shards_written == 1
    assert tree_bytes(dst) == tree_bytes(clean)


def test_force_never_clears_a_folder_of_other_files(synthetic, tmp_path):
    dst = tmp_path / "photos"
    dst.mkdir()
    (dst / "holiday.safetensors").write_bytes(b"not a model")
    (dst / "config.json").write_text("{}")
    before = tree_bytes(dst)
    r = quantkit("convert", synthetic["llama"], dst, "-r", "dense-w4a16-g128", "--device", "cpu", "--force")
    one_line_error(r, str(dst), "holds other files and no quantkit-manifest.json")
    assert tree_bytes(dst) == before
