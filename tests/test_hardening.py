"""Findings of the adversarial pass, one test each: nothing lost, nothing leaked, nothing silent.

Each test plants what the finding describes and asserts the outcome the finding asked for.
"""

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from conftest import shard_of, tree_bytes
from helpers import BILLION_LAUGHS, one_line_error, passing_verdict, quantkit, release_config
from safetensors.torch import load_file

from quantkit.checkpoint.writer import folder_lock, write_safetensors
from quantkit.convert import convert
from quantkit.verify import verify

EXPERT = "model.layers.2.mlp.experts.3.up_proj"


@pytest.fixture
def llama_int4(synthetic, tmp_path):
    dst = tmp_path / "int4"
    convert(synthetic["llama"], dst, "dense-w4a16-g128", device="cpu")
    return dst


# --- Security -------------------------------------------------------------------------------------


def test_a_link_planted_at_a_temporary_name_is_never_followed(llama_int4, tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("precious")
    for name in (".README.md.partial", ".config.json.partial", ".quantkit-manifest.json.partial"):
        (llama_int4 / name).symlink_to(outside)
    r = quantkit("publish", llama_int4, "--repo", f"file://{tmp_path / 'out'}", "--force-ungated")
    assert r.exit_code == 0, r.output
    assert outside.read_text() == "precious"
    assert not (tmp_path / "out" / ".README.md.partial").exists()


def test_a_second_writer_gets_in_use(synthetic, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    with folder_lock(dst):
        r = quantkit("convert", synthetic["llama"], dst, "-r", "dense-w4a16-g128", "--device", "cpu")
    one_line_error(r, str(dst), "in use by another quantkit process")
    assert not list(dst.glob("*.safetensors"))


# --- Data loss ------------------------------------------------------------------------------------




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


@pytest.mark.parametrize("where", ["source", "dst", "inside-dst", "around-dst", "empty", "non-empty"])
def test_publish_never_writes_into_the_source_dst_or_someone_elses_folder(synthetic, llama_int4, tmp_path, where):
    src = synthetic["llama"]
    before_src, before_dst = tree_bytes(src), tree_bytes(llama_int4)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    target = {"source": f"file://{src}", "dst": f"file://{llama_int4}", "inside-dst": f"file://{llama_int4 / 'sub'}",
              "around-dst": f"file://{tmp_path}", "empty": "file://", "non-empty": f"file://{other}"}[where]
    r = quantkit("publish", llama_int4, "--repo", target, "--force-ungated")
    one_line_error(r, "error:")
    assert tree_bytes(src) == before_src and tree_bytes(llama_int4) == before_dst
    assert (other / "notes.txt").read_text() == "mine" and len(list(other.iterdir())) == 1


@pytest.fixture
def gated(llama_int4, tmp_path):
    """DST with a passing verdict whose checksums are DST's files now."""

    return llama_int4, passing_verdict(llama_int4, tmp_path)


@pytest.mark.parametrize("change, name", [
    (lambda d: (d / "config.json").write_text((d / "config.json").read_text().replace("llama", "llama ")), "config.json"),
    (lambda d: (d / "modeling_evil.py").write_text("import os\n"), "modeling_evil.py"),
    (lambda d: (d / "tokenizer_config.json").write_text("{}"), "tokenizer_config.json"),
])
def test_publish_ships_only_files_the_gate_saw(gated, tmp_path, change, name):
    dst, verdict = gated
    change(dst)
    r = quantkit("publish", dst, "--repo", f"file://{tmp_path / 'out'}", "--gate", verdict)
    one_line_error(r, name)
    assert not (tmp_path / "out").exists()


def test_a_forged_verdict_is_refused(gated, tmp_path):
    dst, verdict = gated
    forged = json.loads(verdict.read_text())
    del forged["tasks"][0]["margin"]
    verdict.write_text(json.dumps(forged))
    r = quantkit("publish", dst, "--repo", f"file://{tmp_path / 'out'}", "--gate", verdict)
    one_line_error(r, "not a gate verdict (tasks.0.margin: Field required)")
    r = quantkit("publish", dst, "--repo", "not a repo id", "--force-ungated")
    one_line_error(r, "invalid repo id")


def test_publish_gates_again_instead_of_trusting_the_verdicts_flag(gated, tmp_path):
    """A failing verdict edited to say pass, or a candidate run changed after the gate, gives another verdict when
    publish gates the runs the verdict names again: refused, nothing shipped."""
    dst, verdict = gated
    text = verdict.read_text()
    failing = json.loads(text)
    failing["tasks"][0].update(margin=0.5)  # the same runs fail a 0.5-point margin: the file claims they pass it
    verdict.write_text(json.dumps(failing))
    r = quantkit("publish", dst, "--repo", f"file://{tmp_path / 'out'}", "--gate", verdict)
    one_line_error(r, "differs from the verdict its runs give when gated again")
    verdict.write_text(text)
    samples = Path(json.loads(text)["candidate"]) / "samples" / "arc_easy.jsonl"
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    rows[0]["correct"] = 1 - rows[0]["correct"]
    samples.write_text("".join(json.dumps(row) + "\n" for row in rows))
    r = quantkit("publish", dst, "--repo", f"file://{tmp_path / 'out'}", "--gate", verdict)
    one_line_error(r, "differs from the verdict its runs give when gated again")
    assert not (tmp_path / "out").exists()


# --- Symlinks: one rule -------------------------------------------------------------------------


def test_a_side_file_linking_out_of_src_is_refused(synthetic, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(synthetic["llama"], src)
    secret = tmp_path / "secret.txt"
    secret.write_text("token")
    (src / "tokenizer.json").symlink_to(secret)
    r = quantkit("convert", src, tmp_path / "dst", "-r", "dense-w4a16-g128", "--device", "cpu")
    one_line_error(r, "tokenizer.json", "outside the model's folder")
    assert not (tmp_path / "dst" / "tokenizer.json").exists()


def test_a_shard_linking_out_of_src_is_refused_without_an_index(synthetic, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(synthetic["llama"], src)
    shard = sorted(src.glob("*.safetensors"))[0]
    (src / "model.safetensors.index.json").unlink()
    moved = tmp_path / shard.name
    shard.rename(moved)
    shard.symlink_to(moved)
    r = quantkit("inspect", src)
    one_line_error(r, shard.name, "outside the model's folder")


def test_a_link_inside_dst_is_not_published(llama_int4, tmp_path):
    outside = tmp_path / "private.key"
    outside.write_text("secret")
    (llama_int4 / "extra.txt").symlink_to(outside)
    r = quantkit("publish", llama_int4, "--repo", f"file://{tmp_path / 'out'}", "--force-ungated", "--dry-run")
    one_line_error(r, "extra.txt", "outside the model's folder")


def test_a_hub_cache_snapshot_is_read(synthetic, tmp_path):
    """models--org--name/snapshots/REV/* are links into ../../blobs: the usual way a download is held."""
    repo = tmp_path / "hub" / "models--org--llama"
    snapshot, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for f in sorted(synthetic["llama"].iterdir()):
        blob = blobs / f"blob-{f.name}"
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    result = convert(snapshot, tmp_path / "dst", "dense-w4a16-g128", device="cpu")
    assert result.shards_written >= 1 and not any(p.is_symlink() for p in (tmp_path / "dst").iterdir())
    from quantkit.evaluation import model_checksums  # what eval records of a baseline held this way

    assert set(model_checksums(snapshot)) == {p.name for p in synthetic["llama"].iterdir()}


# --- Hangs ----------------------------------------------------------------------------------------


def test_a_fifo_in_place_of_a_shard_ends_at_once(synthetic, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(synthetic["llama"], src)
    shard = sorted(src.glob("*.safetensors"))[0]
    shard.unlink()
    os.mkfifo(shard)
    done = subprocess.run([sys.executable, "-m", "quantkit", "inspect", str(src)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1 and shard.name in done.stderr and "not a regular file" in done.stderr


@pytest.mark.parametrize("field, value", [("num_hidden_layers", 10**9), ("n_routed_experts", 10**7),
                                          ("num_hidden_layers", "3"), ("num_hidden_layers", -1),
                                          ("kv_lora_rank", "abc"), ("index_head_dim", 2.5), ("q_lora_rank", [1])])
def test_absurd_config_values_are_refused_at_once(tmp_path, field, value):
    folder = tmp_path / "cfg"
    folder.mkdir()
    config = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 64,
              "num_hidden_layers": 2, "n_routed_experts": 4}
    config[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    one_line_error(quantkit("plan", folder), "config.json", field)
    r = quantkit("verify", folder, "--no-smoke")  # verify reports it as a finding of its structure check
    assert r.exit_code == 1 and f"config.json: readable checkpoint: {field} = " in r.output


@pytest.mark.parametrize("field, value, says", [("indexer_types", ["full"] * 3, "has 3 entries for num_hidden_layers = 4"),
                                                ("mlp_layer_types", ["dense", "moe", "sparse", "sparse"], "expected a list"),
                                                ("indexer_types", "full", "expected a list")])
def test_per_layer_lists_of_the_wrong_length_or_kind_are_refused(synthetic, tmp_path, field, value, says):
    """A per-layer list shorter than the layers was an IndexError deep in plan's layout (GLM-5 configs carry two)."""
    folder = tmp_path / "cfg"
    folder.mkdir()
    config = json.loads((synthetic["glm_moe_dsa"] / "config.json").read_text())
    config.update({"num_hidden_layers": 4, "mlp_layer_types": ["dense"] + ["sparse"] * 3,
                   "indexer_types": ["full"] * 4, field: value})
    (folder / "config.json").write_text(json.dumps(config))
    one_line_error(quantkit("plan", folder, "-r", "glm5-int4-experts-g32"), "config.json", field, says)


def test_an_unreadable_quantization_config_is_one_line_naming_config_json(llama_int4, tmp_path):
    dst = tmp_path / "bad"
    shutil.copytree(llama_int4, dst)
    config = json.loads((dst / "config.json").read_text())
    next(iter(config["quantization_config"]["config_groups"].values()))["weights"]["num_bits"] = "four"
    (dst / "config.json").write_text(json.dumps(config))
    one_line_error(quantkit("verify", dst, "--no-smoke"), "config.json", "invalid quantization_config")


def test_a_recipe_alias_bomb_is_refused(synthetic, tmp_path):

    recipe = tmp_path / "bomb.yaml"
    recipe.write_text(BILLION_LAUGHS)
    r = quantkit("convert", synthetic["llama"], tmp_path / "dst", "-r", recipe)
    one_line_error(r, "bomb.yaml", "alias")


# --- Silent wrong results -------------------------------------------------------------------------

RECIPE = """quant_stage:
  quant_modifiers:
    QuantizationModifier:
      ignore: {ignore}
      config_groups:
        group_0:
          targets: {targets}
          weights: {{num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 32}}
{more}"""


@pytest.mark.parametrize("targets, ignore, more, message", [
    (["Linaer"], ["lm_head"], "", "group group_0 (targets ['Linaer']) matches no weight"),
    (["Linear"], ["re:.*"], "", "group group_0 (targets ['Linear']) matches no weight"),
    (["re:.*_proj$"], ["lm_head"], "        group_1:\n          targets: ['re:.*mlp.*']\n"
     "          weights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 32}\n",
     "recipe groups group_0 and group_1 both target this module"),
    (["re:(unclosed"], [], "", "bad regex"),
    (["Linear"], [], "        group_1:\n          targets: [Linear]\n          weights: {num_bits: four}\n",
     "config_groups.group_1.weights.num_bits"),
])
def test_recipes_that_would_convert_silently_wrong_are_refused(synthetic, tmp_path, targets, ignore, more, message):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE.format(targets=json.dumps(targets), ignore=json.dumps(ignore), more=more))
    r = quantkit("convert", synthetic["deepseek_v3"], tmp_path / "dst", "-r", recipe, "--device", "cpu")
    one_line_error(r, message)
    assert not (tmp_path / "dst" / "config.json").exists()


def test_each_group_reports_what_it_took(synthetic, tmp_path):
    r = quantkit("convert", synthetic["deepseek_v3"], tmp_path / "dst", "-r", "deepseek-v3-int4-experts-g32", "--json")
    result = json.loads(r.stdout)
    assert list(result["tensors_by_group"].values()) == [result["tensors_by_kind"]["int4"]] == [3 * 8 * 3]


def test_an_unindexed_weight_file_is_not_copied(glm_copy, tmp_path):
    shutil.copyfile(sorted(glm_copy.glob("model-*.safetensors"))[0], glm_copy / "consolidated.safetensors")
    r = quantkit("convert", glm_copy, tmp_path / "dst", "-r", "glm5-int4-experts-g32", "--device", "cpu")
    assert r.exit_code == 0 and "not copied" in r.output and "consolidated.safetensors" in r.output
    assert not (tmp_path / "dst" / "consolidated.safetensors").exists()


def test_an_all_zero_scale_block_is_warned_about(glm_copy, tmp_path):
    name = EXPERT + ".weight_scale_inv"
    path = shard_of(glm_copy, name)
    tensors = load_file(path)
    tensors[name] = torch.zeros_like(tensors[name])
    write_safetensors(path, tensors)
    r = quantkit("convert", glm_copy, tmp_path / "dst", "-r", "glm5-int4-experts-g32", "--device", "cpu")
    assert r.exit_code == 0 and "warning" in r.output and name in r.output and "decode to 0" in r.output


def test_an_e5m2_source_is_refused(glm_copy, tmp_path):
    name = EXPERT + ".weight"
    path = shard_of(glm_copy, name)
    tensors = load_file(path)
    tensors[name] = tensors[name].to(torch.float32).to(torch.float8_e5m2)
    write_safetensors(path, tensors)
    r = quantkit("convert", glm_copy, tmp_path / "dst", "-r", "glm5-int4-experts-g32", "--device", "cpu")
    one_line_error(r, path.name, name, "e5m2")
    config = json.loads((glm_copy / "config.json").read_text())
    config["quantization_config"]["fmt"] = "e5m2"
    (glm_copy / "config.json").write_text(json.dumps(config))
    one_line_error(quantkit("inspect", glm_copy), "config.json", "fmt")


def test_force_never_clears_a_folder_of_other_files(synthetic, tmp_path):
    dst = tmp_path / "photos"
    dst.mkdir()
    (dst / "holiday.safetensors").write_bytes(b"not a model")
    (dst / "config.json").write_text("{}")
    before = tree_bytes(dst)
    r = quantkit("convert", synthetic["llama"], dst, "-r", "dense-w4a16-g128", "--device", "cpu", "--force")
    one_line_error(r, str(dst), "holds other files and no quantkit-manifest.json")
    assert tree_bytes(dst) == before


# --- The error path -------------------------------------------------------------------------------


def test_an_unexpected_failure_is_one_line_asking_for_a_report(synthetic, monkeypatch):
    from quantkit.checkpoint import inspection

    def broken(path):
        raise RuntimeError("something quantkit did not foresee")

    monkeypatch.setattr(inspection, "inspect_checkpoint", broken)
    r = quantkit("inspect", synthetic["llama"])
    one_line_error(r, "internal error", "RuntimeError: something quantkit did not foresee", "please report", "--debug")
    r = quantkit("--debug", "inspect", synthetic["llama"])
    assert r.exit_code == 1 and "Traceback" in r.output


def test_file_system_and_network_errors_name_what_failed():
    from quantkit.cli import _one_line

    kind, message, code = _one_line(PermissionError(13, "Permission denied", "/models/x/config.json"))
    assert (kind, code) == ("error", 1) and message == "/models/x/config.json: permission denied"
    network = type("ConnectError", (Exception,), {"__module__": "httpx"})("[Errno -3] name resolution failed")
    kind, message, code = _one_line(network)
    assert code == 1 and message.startswith("network or hub failure (ConnectError)")


def test_a_log_gets_whole_file_names(synthetic, tmp_path):
    """verify's findings once sat in an 80-column table that cut the failing shard's name."""
    dst = tmp_path / ("a-very-long-folder-name-" * 4) / "out"
    convert(synthetic["llama"], dst, "dense-w4a16-g128", device="cpu")
    shard = sorted(dst.glob("model-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    r = quantkit("verify", dst, "--no-smoke")
    assert r.exit_code == 1 and str(shard) in r.output


def test_concurrent_writers_never_share_a_temporary_file(tmp_path):
    from quantkit.checkpoint.writer import write_bytes_atomic

    target = tmp_path / "config.json"
    payloads = [(str(i) * 100_000).encode() for i in range(8)]
    threads = [threading.Thread(target=write_bytes_atomic, args=(target, p)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert target.read_bytes() in payloads and not list(tmp_path.glob(".*partial"))


def test_overlapping_groups_are_refused_for_an_int4_source_too(synthetic, tmp_path):
    """The one-group rule lives where every weight's group is looked up, INT4 sources included."""
    int4 = tmp_path / "int4"
    convert(synthetic["llama"], int4, "dense-w4a16-g128", device="cpu")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE.format(targets=json.dumps(["re:.*_proj$"]), ignore=json.dumps(["lm_head"]),
                                    more="        group_1:\n          targets: ['re:.*mlp.*']\n"
                                         "          weights: {num_bits: 4, type: int, symmetric: true, strategy: group, "
                                         "group_size: 32}\n"))
    r = quantkit("convert", int4, tmp_path / "dst", "-r", recipe, "--device", "cpu")
    one_line_error(r, "recipe groups group_0 and group_1 both target this module", "weight_packed")


def test_a_name_or_regex_group_wins_over_a_linear_group_as_in_every_engine(synthetic, tmp_path):
    """compressed-tensors (match_targets), SGLang and vLLM (find_matched_target) all give a module the group naming
    it before the group targeting its class: no ambiguity, so no refusal, and the engines read what was written."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE.format(targets=json.dumps(["Linear"]), ignore=json.dumps(["lm_head"]),
                                    more="        group_1:\n          targets: ['re:.*mlp.*']\n"
                                         "          weights: {num_bits: 4, type: int, symmetric: true, strategy: group, "
                                         "group_size: 128}\n").replace("group_size: 32", "group_size: 64"))
    convert(synthetic["llama"], tmp_path / "dst", recipe, device="cpu")
    shapes = {n: t.shape for f in sorted((tmp_path / "dst").glob("*.safetensors")) for n, t in load_file(f).items()
              if n.endswith("weight_scale")}
    hidden = shapes["model.layers.0.self_attn.q_proj.weight_scale"][1] * 64
    assert shapes["model.layers.0.mlp.gate_proj.weight_scale"][1] == hidden // 128  # group_1, by its regex
    assert shapes["model.layers.0.self_attn.o_proj.weight_scale"][1] == hidden // 64  # group_0, by its class
    for engine in ("sglang", "vllm"):
        assert verify(tmp_path / "dst", engine=engine, smoke=False).passed, engine
