"""plan: exact output sizes, capacity arithmetic, the two-pool deployment."""

import shutil

import pytest
from helpers import one_line_error, plant_link, quantkit, replaced_by_a_picture
from typer.testing import CliRunner

from quantkit.checkpoint.config import ModelConfig
from quantkit.checkpoint.families import detect_family
from quantkit.cli import app
from quantkit.convert import convert
from quantkit.packaged import recipes_dir
from quantkit.plan import GIB, kv_bytes_per_token, kv_tokens, plan, weights_per_gpu

FAMILY_OF = {"glm5": "glm_moe_dsa", "deepseek": "deepseek_v3", "dense": "llama"}


def output_bytes(folder):
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


@pytest.mark.parametrize("recipe", sorted(p.stem for p in recipes_dir().glob("*.yaml")))
def test_prediction_equals_convert_for_every_recipe(synthetic, tmp_path, recipe):
    family = next(f for prefix, f in FAMILY_OF.items() if recipe.startswith(prefix))
    src = synthetic[family]
    # A GPTQ or SignRound recipe writes its RTN twin's exact format (tests/test_gptq.py, test_signround.py), and the
    # synthetic models have no tokenizer to calibrate with: the twin's output is what the plan must predict.
    convert(src, tmp_path / "out", recipe.replace("-gptq", "").replace("-signround", ""), device="cpu",
            max_shard_size="1MB")
    real = output_bytes(tmp_path / "out")
    from_headers = plan(src, recipe, max_shard_size="1MB")
    assert from_headers.from_headers and from_headers.bytes_after == real  # exact: the same plan
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(src / "config.json", config_only)
    from_config = plan(config_only, recipe, max_shard_size="1MB")
    assert not from_config.from_headers
    assert abs(from_config.bytes_after - real) / real < 0.005


def test_kv_bytes_per_token_by_attention_type():
    mla = ModelConfig.read({"model_type": "deepseek_v3", "num_hidden_layers": 78, "kv_lora_rank": 512,
                            "qk_rope_head_dim": 64})
    assert kv_bytes_per_token(mla, detect_family(mla), 8, 2) == 78 * 576 * 2
    dsa = ModelConfig.read(mla.raw | {"model_type": "glm_moe_dsa", "index_head_dim": 128})
    # the DSA indexer adds 128 FP8 bytes + one fp32 scale per token and layer; replicated, tp does not divide it
    assert kv_bytes_per_token(dsa, detect_family(dsa), 8, 1) == 78 * (576 + 132)
    gqa = ModelConfig.read({"model_type": "llama", "num_hidden_layers": 30, "num_attention_heads": 9,
                            "num_key_value_heads": 3, "hidden_size": 576})
    llama = detect_family(gqa)
    assert kv_bytes_per_token(gqa, llama, 1, 2) == 2 * 3 * 64 * 2 * 30
    assert kv_bytes_per_token(gqa, llama, 8, 2) == 2 * 1 * 64 * 2 * 30  # at least one KV head per rank


def test_capacity_arithmetic():
    assert weights_per_gpu({"routed_experts": 800, "norms": 10, "router": 6}, 8) == 100 + 10 + 6
    # 100 GiB usable - 60 GiB weights = 40 GiB of KV at 1 MiB per token, in pages of 64
    assert kv_tokens(125 * GIB, 0.8, 60 * GIB, 2**20, 64) == 40960
    assert kv_tokens(10 * GIB, 0.5, 6 * GIB, 1000, 64) == 0


def test_fp8_kv_doubles_capacity(synthetic):
    bf16 = plan(synthetic["glm_moe_dsa"], "glm5-int4-experts-g32", kv_dtype="bf16", gpu_mem_gib=1)
    fp8 = plan(synthetic["glm_moe_dsa"], "glm5-int4-experts-g32", kv_dtype="fp8_e4m3", gpu_mem_gib=1)
    assert fp8.kv_bytes_per_token < bf16.kv_bytes_per_token
    assert fp8.kv_tokens_per_gpu > 1.5 * bf16.kv_tokens_per_gpu


def test_deploy_pools_and_chart(synthetic, tmp_path):
    chart = tmp_path / "memory.png"
    report = plan(synthetic["glm_moe_dsa"], "glm5-int4-experts-g128-fp8", tp=2, gpu_mem_gib=1, deploy=True, chart=chart)
    prefill, decode = report.pools
    assert prefill.kv_dtype == "bf16" and decode.kv_dtype == "fp8_e4m3"
    assert decode.weights_per_gpu < prefill.weights_per_gpu  # g128 INT4 experts beat FP8 ones
    assert decode.kv_tokens_per_gpu > prefill.kv_tokens_per_gpu
    assert "--disaggregation-mode prefill" in prefill.launch and "--kv-cache-dtype fp8_e4m3" in decode.launch
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli(synthetic, tmp_path):
    r = CliRunner().invoke(app, ["plan", str(synthetic["deepseek_v3"]), "-r", "deepseek-v3-int4-experts-g32", "--tp", "2"])
    assert r.exit_code == 0, r.output
    assert "routed_experts" in r.output and "tokens per GPU" in r.output
    r = CliRunner().invoke(app, ["plan", str(synthetic["llama"]), "--gpu", "a100"])
    assert r.exit_code == 1 and "unknown GPU" in r.output


@pytest.mark.parametrize("name, shape", [
    ("model.layers.77.mlp.experts.255.down_proj.weight_packed", (6144, 256)),
    ("lm_head.weight", (154880, 6144)),
    ("model.layers.3.self_attn.k_scale", ()),
    ('odd "quoted" \\ name\twith ünïcode', (1, 2, 3)),
])
def test_the_header_bound_is_the_json_length_it_stands_for(name, shape):
    import json

    from quantkit.convert.tensor_plan import _header_bound, output_tensor

    for dtype in ("I32", "BF16", "F8_E4M3"):
        o = output_tensor(name, dtype, shape)
        assert _header_bound(o) == len(json.dumps({name: {"dtype": dtype, "shape": list(shape), "data_offsets": [0, 0]}})) + 40


def test_planning_runs_with_the_cyclic_collector_paused_and_leaves_it_as_found(synthetic, monkeypatch):
    """Planning a 700 GB checkpoint builds some 300,000 records and no cycles; the collector rescanning them as
    they pile up took a third of plan's time. It is off while the plan is made, back as it was after, errors
    included."""
    import gc

    from quantkit.convert import tensor_plan
    from quantkit.gc_pause import gc_paused

    seen = []
    real = tensor_plan._assign_shards
    monkeypatch.setattr(tensor_plan, "_assign_shards", lambda *a: (seen.append(gc.isenabled()), real(*a))[1])
    assert gc.isenabled()
    plan(synthetic["glm_moe_dsa"], "glm5-int4-experts-g32")
    assert seen == [False] and gc.isenabled()

    @gc_paused
    def fails():
        seen.append(gc.isenabled())
        raise ValueError("stop")

    with pytest.raises(ValueError):
        fails()
    assert seen[-1] is False and gc.isenabled()
    gc.disable()
    try:
        gc_paused(lambda: None)()
        assert not gc.isenabled()  # off before, off after: a nested pause does not switch it on
    finally:
        gc.enable()


def test_plan_with_infinite_gpu_memory_is_one_line(synthetic):
    one_line_error(quantkit("plan", synthetic["llama"], "--gpu-mem-gib", "inf"), "--gpu-mem-gib must be a GPU's memory", code=None)


def test_plan_deploys_chart_is_not_written_through_a_link(synthetic, tmp_path):
    chart = tmp_path / "plan-memory.png"
    target = plant_link(chart, tmp_path)
    result = quantkit("plan", synthetic["glm_moe_dsa"], "--recipe", "glm5-int4-experts-g32", "--deploy",
                      "--gpu-mem-gib", 1, "--chart", chart)
    assert result.exit_code == 0, result.output
    assert replaced_by_a_picture(chart, target)


def test_a_chart_path_matplotlib_cannot_write_is_one_line(synthetic, tmp_path):
    result = quantkit("plan", synthetic["glm_moe_dsa"], "--recipe", "glm5-int4-experts-g32", "--deploy",
                      "--gpu-mem", 1, "--chart", tmp_path / "chart.txt")
    one_line_error(result, "a chart is written as .png", code=None)
    assert "internal error" not in result.output and not (tmp_path / "chart.txt").exists()


def glm_config_only(synthetic, tmp_path, **fields):
    import json

    config = json.loads((synthetic["glm_moe_dsa"] / "config.json").read_text())
    config.pop("indexer_types", None)
    config.update(fields)
    folder = tmp_path / "config-only"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder, config


def test_plan_reads_glm5s_index_topk_pattern_with_its_mtp_layer(synthetic, tmp_path):
    from quantkit.plan import plan

    n = 3
    folder, _ = glm_config_only(synthetic, tmp_path, num_hidden_layers=n, index_topk_pattern="FFF")
    assert plan(folder).total_params == plan(synthetic["glm_moe_dsa"]).total_params  # every layer "full" there too
    (tmp_path / "b").mkdir()
    shared, _ = glm_config_only(synthetic, tmp_path / "b", num_hidden_layers=n, index_topk_pattern="FSF")
    assert plan(shared).total_params < plan(folder).total_params  # a shared layer holds no indexer weights


@pytest.mark.parametrize("fields, says", [
    (dict(index_topk_freq="x"), "index_topk_freq = 'x': expected an integer"),
    (dict(index_skip_topk_offset=[1]), "index_skip_topk_offset = [1]: expected an integer"),
    (dict(index_topk_pattern="FX"), "index_topk_pattern: expected a string of F and S"),
    (dict(index_topk_pattern="FF"), "index_topk_pattern has 2 entries for num_hidden_layers = 3"),
])
def test_plan_refuses_indexer_fields_it_cannot_read_in_one_line(synthetic, tmp_path, fields, says):
    folder, _ = glm_config_only(synthetic, tmp_path, **fields)
    one_line_error(quantkit("plan", folder), says, code=None)
