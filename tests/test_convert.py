"""convert end to end on synthetic GLM-5, DeepSeek-V3 and Llama checkpoints."""

import json
import re

import pytest
import torch
from conftest import RECIPE_FOR, tree_bytes
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from quantkit.checkpoint.inspection import inspect_checkpoint
from quantkit.checkpoint.reader import open_checkpoint, read_config
from quantkit.convert import convert
from quantkit.errors import QuantkitError
from quantkit.checkpoint.describe import config_mismatches
from quantkit.formats.int4 import fake_quantize_int4
from quantkit.modeling import dequantized_state_dict, fuse_experts, load_model, model_config
import os
import shutil
from helpers import quantkit
from quantkit.checkpoint.manifest import Manifest, ShardRecord

EXPERT = re.compile(r".*\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
LINEAR = re.compile(r"^model\.layers\.\d+\..*_proj\.weight$")


def logits(model, seed=0):
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits.float()


def fake_quant_reference(src, family, group_size):
    """The source model with its targeted weights quantized-dequantized in place."""
    config = read_config(src)
    pattern = EXPERT if family != "llama" else LINEAR
    state = {k: fake_quantize_int4(v, group_size) if pattern.match(k) else v for k, v in dequantized_state_dict(src).items()}
    model = AutoModelForCausalLM.from_config(model_config(config), dtype=torch.bfloat16)
    model.load_state_dict(fuse_experts(state, config), strict=True)
    return model.eval()


@pytest.mark.parametrize("family,group_size", [("glm_moe_dsa", 32), ("deepseek_v3", 32), ("llama", 128)])
def test_converted_logits_equal_fake_quantized_source(synthetic, tmp_path, family, group_size):
    src = synthetic[family]
    convert(src, tmp_path / "out", RECIPE_FOR[family], device="cpu")
    got = logits(load_model(tmp_path / "out"))
    want = logits(fake_quant_reference(src, family, group_size))
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
    # and quantization did something: the unquantized source differs
    assert not torch.allclose(got, logits(load_model(src)), atol=1e-3)


def test_dense_output_loads_through_transformers_compressed_tensors(synthetic, tmp_path):
    convert(synthetic["llama"], tmp_path / "out", "dense-w4a16-g128", device="cpu")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.bfloat16).eval()
    assert torch.equal(logits(theirs), logits(load_model(tmp_path / "out")))


def test_loader_refuses_a_checkpoint_whose_experts_would_be_dropped(synthetic, tmp_path):
    """The silent-drop failure: experts that do not reach the model must be an error, not random weights."""
    out = tmp_path / "out"
    convert(synthetic["glm_moe_dsa"], out, "glm5-int4-experts-g32", device="cpu")
    shard = next(f for f in sorted(out.glob("*.safetensors")) if any(".experts.0." in k for k in load_file(f)))
    tensors = load_file(shard)
    renamed = {k.replace(".experts.0.", ".experts_unused.0."): v for k, v in tensors.items()}
    from quantkit.checkpoint.writer import write_safetensors

    write_safetensors(shard, renamed)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k.replace(".experts.0.", ".experts_unused.0."): v for k, v in index["weight_map"].items()}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(QuantkitError, match="incomplete experts|does not fit"):
        load_model(out)


@pytest.mark.parametrize("family", ["glm_moe_dsa", "deepseek_v3", "llama"])
def test_output_layout_and_config(synthetic, tmp_path, family):
    src, out = synthetic[family], tmp_path / "out"
    convert(src, out, RECIPE_FOR[family], device="cpu", max_shard_size="1MB")
    ckpt = open_checkpoint(out)
    qc = ckpt.config.quantization_config
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert qc["quantization_status"] == "compressed"
    assert config_mismatches(ckpt) == []
    assert not any(n.endswith("weight_scale_inv") for n in ckpt.tensors)
    for s in ckpt.shards:
        assert s.size <= 1_000_000 or len(s.tensors) == 1
    for name in ("tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    packed = [n for n in ckpt.tensors if n.endswith("weight_packed")]
    assert packed
    for name in packed:
        m = name.removesuffix(".weight_packed")
        info, scale = ckpt.tensors[name], ckpt.tensors[f"{m}.weight_scale"]
        assert info.dtype == "I32" and scale.dtype == "BF16" and ckpt.tensors[f"{m}.weight_shape"].dtype == "I64"
    if family != "llama":  # the MTP layer's experts are converted, its eh_proj is kept
        n = ckpt.config.num_hidden_layers
        assert f"model.layers.{n}.mlp.experts.0.up_proj.weight_packed" in ckpt.tensors
        assert ckpt.tensors[f"model.layers.{n}.eh_proj.weight"].dtype == "BF16"
        assert ckpt.tensors["model.layers.1.mlp.gate.weight"].dtype == "BF16"
        assert ckpt.tensors["model.layers.1.self_attn.kv_b_proj.weight"].dtype == "BF16"


def test_inspect_counts_components_from_headers(synthetic, tmp_path):
    report = inspect_checkpoint(synthetic["glm_moe_dsa"])
    assert report.family == "glm_moe_dsa" and report.mtp_layers == 1
    c = report.components
    # 2 MoE layers x 8 experts x 3 projections of 128x256
    assert c["routed_experts"].params == 2 * 8 * 3 * 128 * 256
    assert c["routed_experts"].encodings == {"fp8 block": 2 * 8 * 3 * 128 * 256}
    assert c["indexer"].params > 0 and c["router"].params > 0 and c["mtp"].params > 0
    convert(synthetic["glm_moe_dsa"], tmp_path / "out", "glm5-int4-experts-g32", device="cpu")
    after = inspect_checkpoint(tmp_path / "out")
    assert after.total_params == report.total_params  # packed INT4 counts its true parameters
    assert after.components["routed_experts"].encodings == {"int4 g32": 2 * 8 * 3 * 128 * 256}


def test_mixed_recipe_keeps_fp8_block_linears(synthetic, tmp_path):
    src, out = synthetic["glm_moe_dsa"], tmp_path / "out"
    convert(src, out, "glm5-int4-experts-g128-fp8", device="cpu")
    ckpt = open_checkpoint(out)
    qc = ckpt.config.quantization_config
    assert qc["format"] == "mixed-precision"
    assert qc["config_groups"]["fp8_block"]["format"] == "float-quantized"
    assert config_mismatches(ckpt) == []
    o_proj = "model.layers.1.self_attn.o_proj"
    ours, source = load_file_all(out), load_file_all(src)
    assert torch.equal(ours[f"{o_proj}.weight"].view(torch.uint8), source[f"{o_proj}.weight"].view(torch.uint8))
    assert torch.equal(ours[f"{o_proj}.weight_scale"], source[f"{o_proj}.weight_scale_inv"])
    assert ours["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16  # router ignored
    assert ours["model.layers.1.mlp.experts.3.down_proj.weight_scale"].shape == (256, 1)  # g128 over 128 inputs
    want = logits(fake_quant_reference(src, "glm_moe_dsa", 128))
    assert torch.allclose(logits(load_model(out)), want, atol=1e-5, rtol=0)


def load_file_all(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_int4_source_with_the_same_scheme_passes_through_bit_for_bit(synthetic, tmp_path):
    """A Kimi K2 Thinking-style source (compressed-tensors INT4 experts) re-run with its own recipe."""
    first, second = tmp_path / "first", tmp_path / "second"
    convert(synthetic["glm_moe_dsa"], first, "glm5-int4-experts-g32", device="cpu")
    result = convert(first, second, "glm5-int4-experts-g32", device="cpu")
    assert result.tensors_by_kind.get("int4_keep") == 72 and "int4" not in result.tensors_by_kind
    a, b = load_file_all(first), load_file_all(second)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_int4_source_requantizes_to_another_group_size(synthetic, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    convert(synthetic["glm_moe_dsa"], first, "glm5-int4-experts-g32", device="cpu")
    result = convert(first, second, "glm5-int4-experts-g128-fp8", device="cpu")
    assert result.tensors_by_kind["int4_requant"] == 72
    ours = load_file_all(second)
    assert ours["model.layers.2.mlp.experts.5.gate_proj.weight_scale"].shape == (128, 2)


def test_output_is_identical_across_worker_counts_and_shard_sizes_hold(synthetic, tmp_path):
    src = synthetic["deepseek_v3"]
    convert(src, tmp_path / "w1", "deepseek-v3-int4-experts-g32", device="cpu", workers=1, max_shard_size="700KB")
    convert(src, tmp_path / "w3", "deepseek-v3-int4-experts-g32", device="cpu", workers=3, max_shard_size="700KB")
    a, b = tree_bytes(tmp_path / "w1"), tree_bytes(tmp_path / "w3")
    a.pop("quantkit-manifest.json"), b.pop("quantkit-manifest.json")
    assert a == b


def test_worker_processes_write_what_worker_threads_write(synthetic, tmp_path, monkeypatch):
    """On GPUs each worker is a process (convert/processes.py); made so on a CPU, the output is the same bytes, every
    shard is in the manifest, and every source byte reaches the progress bar."""
    import quantkit.convert as qc

    src, recipe = synthetic["glm_moe_dsa"], "glm5-int4-experts-g32"
    convert(src, tmp_path / "threads", recipe, device="cpu", workers=2, max_shard_size="700KB")
    monkeypatch.setattr(qc, "uses_processes", lambda devices, workers, todo_bytes: True)
    seen: list[tuple[int, int]] = []
    result = convert(src, tmp_path / "processes", recipe, device="cpu", workers=2, max_shard_size="700KB",
                     on_progress=lambda done, total: seen.append((done, total)))
    a, b = tree_bytes(tmp_path / "threads"), tree_bytes(tmp_path / "processes")
    manifests = [json.loads(x.pop("quantkit-manifest.json")) for x in (a, b)]
    assert a == b and manifests[0]["shards"] == manifests[1]["shards"] and result.shards_total > 2
    assert seen[-1][0] == seen[-1][1] and len(seen) > result.shards_total
    assert result.stage_seconds["write"] > 0


def test_a_worker_process_failure_is_the_one_line_error_and_nothing_partial_stays(glm_copy, tmp_path, monkeypatch):
    import quantkit.convert as qc
    from conftest import shard_of

    tensor = "model.layers.1.mlp.experts.0.down_proj.weight_scale_inv"
    path = shard_of(glm_copy, tensor)
    tensors = load_file(path)
    tensors[tensor] = tensors[tensor].clone().fill_(float("nan"))
    from safetensors.torch import save_file

    save_file(tensors, path, metadata={"format": "pt"})
    monkeypatch.setattr(qc, "uses_processes", lambda devices, workers, todo_bytes: True)
    with pytest.raises(QuantkitError, match="NaN") as failure:
        convert(glm_copy, tmp_path / "dst", "glm5-int4-experts-g32", device="cpu", workers=2, max_shard_size="700KB")
    assert failure.value.tensor == tensor and failure.value.file == str(path)
    assert not list((tmp_path / "dst").glob(".*.partial"))
    assert json.loads((tmp_path / "dst" / "quantkit-manifest.json").read_text())["status"] != "complete"


def test_worker_processes_with_no_shard_to_convert_start_none():
    """A finished run resumed converts nothing: no pool of zero workers (a ValueError), no forkserver."""
    from quantkit.convert.pipeline import Job
    from quantkit.convert.processes import run_in_processes

    run_in_processes(Job(work=None, manifest=None, stats=None, progress=None), [], 4, ["cuda:0"])


def test_a_worker_process_setup_holds_no_shard_and_only_the_tensors_graphs_need(synthetic, tmp_path):
    """The pool pickles its workers' setup once for each worker, one after another (GLM 5.2's whole plan and tensor
    list: 1.6 s each): the setup holds the plan less its shards and the tensors its CUDA graphs are captured from;
    each job brings its shard and that shard's source tensors."""
    from quantkit.convert.pipeline import ShardWork
    from quantkit.convert.processes import _for_workers, _sources
    from quantkit.convert.tensor_plan import plan_conversion
    from quantkit.formats.recipe import load_recipe

    ckpt = open_checkpoint(synthetic["glm_moe_dsa"])
    plan = plan_conversion(ckpt, load_recipe("glm5-int4-experts-g32"), 700_000)
    work = ShardWork(plan, ckpt, tmp_path)
    frequent = work.graphed(plan.shards)
    setup = _for_workers(work, frequent)
    assert frequent and setup.plan.shards == [] and len(plan.shards) > 2
    assert set(setup.ckpt.tensors) == {name for a in frequent for name in a.sources}
    assert len(setup.ckpt.tensors) * 10 < len(ckpt.tensors)
    for shard in plan.shards:
        assert set(_sources(ckpt, shard.actions).tensors) == {name for a in shard.actions for name in a.sources}


KILLED_MID_WAY = """
import os, signal, sys
from pathlib import Path
import quantkit.convert as qc

qc.uses_processes = lambda devices, workers, todo_bytes: True


def descendants(pid):
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            child = int(stat.parent.name)
            out += [child] + descendants(child)
    return out


def die(done, total):
    if done:  # the workers are running
        Path(sys.argv[3]).write_text(" ".join(map(str, descendants(os.getpid()))))
        os.kill(os.getpid(), signal.SIGKILL)


qc.convert(sys.argv[1], sys.argv[2], "glm5-int4-experts-g32", device="cpu", workers=2, max_shard_size="700KB",
           on_progress=die)
"""


def test_worker_processes_die_with_the_conversion(synthetic, tmp_path):
    """kill -9 of a conversion takes its workers with it: none goes on writing into DST, whose lock is gone."""
    import subprocess
    import sys
    import time

    pids = tmp_path / "pids"
    r = subprocess.run([sys.executable, "-c", KILLED_MID_WAY, str(synthetic["glm_moe_dsa"]), str(tmp_path / "dst"),
                        str(pids)], capture_output=True, text=True, timeout=120)
    assert r.returncode == -9, r.stderr
    workers = [int(p) for p in pids.read_text().split()]
    assert len(workers) >= 3  # the forkserver and two workers

    def alive(pid):
        try:
            return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    deadline = time.monotonic() + 10
    while any(alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in workers if alive(p)]


def test_source_is_never_modified(synthetic, tmp_path):
    before = tree_bytes(synthetic["glm_moe_dsa"])
    convert(synthetic["glm_moe_dsa"], tmp_path / "out", "glm5-int4-experts-g32", device="cpu")
    assert tree_bytes(synthetic["glm_moe_dsa"]) == before


def test_convert_leaves_the_process_thread_count_as_it_found_it(synthetic, tmp_path):
    """Its per-worker thread split must not slow whatever runs next in the process (eval, release)."""
    import torch

    before = torch.get_num_threads()
    convert(synthetic["llama"], tmp_path / "out", "dense-w4a16-g128", device="cpu", workers=2)
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("family,recipe,graphed", [
    ("glm_moe_dsa", "glm5-int4-experts-g32", {"down_proj", "gate_proj"}),  # gate and up share a shape
    ("llama", "dense-w4a16-g128", set()),  # 2 layers: no computation 16 tensors share
])
def test_cuda_graphs_are_made_for_the_computations_many_tensors_share(synthetic, tmp_path, family, recipe, graphed):
    from quantkit.convert.actions import GRAPH_MIN_TENSORS, frequent_computations
    from quantkit.convert.tensor_plan import plan_conversion
    from quantkit.formats.recipe import load_recipe

    ckpt = open_checkpoint(synthetic[family])
    plan = plan_conversion(ckpt, load_recipe(recipe), 5 * 10**9)
    actions = [a for s in plan.shards for a in s.actions]
    frequent = frequent_computations(actions, plan, ckpt)
    assert {a.module.rsplit(".", 1)[1] for a in frequent} == graphed
    for a in frequent:
        shape = ckpt.tensors[a.sources[0]].shape
        alike = [b for b in actions if b.kind == a.kind and ckpt.tensors[b.sources[0]].shape == shape]
        assert len(alike) >= GRAPH_MIN_TENSORS


@pytest.mark.parametrize("recipe", ["dense-w4a16-g128", "dense-mlp-w4a16-asym-g32", "dense-fp8-block",
                                    "dense-mlp-fp8-block"])
def test_transformers_loads_an_output_without_a_word_about_targets(synthetic, tmp_path, recipe, caplog):
    """compressed-tensors in transformers credits each module to the first target of the config it matches, and
    warns about a target credited with none: the engines' fused names (convert/dst.py engine_names) come before a
    group's ``Linear``, or every user would see "Could not match re:(...gate_up_proj...)" on every load."""
    import logging

    convert(synthetic["llama"], tmp_path / "out", recipe, device="cpu")
    with caplog.at_level(logging.WARNING):
        AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert [r.getMessage() for r in caplog.records if "Could not match" in r.getMessage()] == []


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


def test_each_group_reports_what_it_took(synthetic, tmp_path):
    r = quantkit("convert", synthetic["deepseek_v3"], tmp_path / "dst", "-r", "deepseek-v3-int4-experts-g32", "--json")
    result = json.loads(r.stdout)
    assert list(result["tensors_by_group"].values()) == [result["tensors_by_kind"]["int4"]] == [3 * 8 * 3]


def test_an_unindexed_weight_file_is_not_copied(glm_copy, tmp_path):
    shutil.copyfile(sorted(glm_copy.glob("model-*.safetensors"))[0], glm_copy / "consolidated.safetensors")
    r = quantkit("convert", glm_copy, tmp_path / "dst", "-r", "glm5-int4-experts-g32", "--device", "cpu")
    assert r.exit_code == 0 and "not copied" in r.output and "consolidated.safetensors" in r.output
    assert not (tmp_path / "dst" / "consolidated.safetensors").exists()


def test_the_manifest_is_written_in_one_order(synthetic, tmp_path):
    manifest = Manifest(quantkit_version="0", source_path="s", source_fingerprint="f", recipe_name="r",
                        recipe_sha256="x", plan_sha256="p", max_shard_size=1)
    for name in ("model-00003.safetensors", "model-00001.safetensors", "model-00002.safetensors"):
        manifest.shards[name] = ShardRecord(sha256="0" * 64, size=1)
    manifest.save(tmp_path)
    assert list(json.loads((tmp_path / "quantkit-manifest.json").read_text())["shards"]) == sorted(manifest.shards)
    for i in range(2):
        convert(synthetic["glm_moe_dsa"], tmp_path / f"run{i}", "glm5-int4-experts-g32", device="cpu", workers=4,
                max_shard_size="200KB")
    a, b = (tmp_path / f"run{i}" / "quantkit-manifest.json" for i in range(2))
    assert json.loads(a.read_text())["source_path"] == json.loads(b.read_text())["source_path"]
    assert a.read_bytes() == b.read_bytes()
