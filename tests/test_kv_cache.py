"""calibrate-kv: scales of exactly what the engine caches, layer by layer, and FP8 KV emulation."""

import json
import shutil

import pytest
import torch
from conftest import RECIPE_FOR
from transformers import DynamicCache
from typer.testing import CliRunner

from quantkit.checkpoint.reader import open_checkpoint
from quantkit.checkpoint.writer import write_safetensors
from quantkit.cli import app
from quantkit.convert import convert
from quantkit.errors import QuantkitError
from quantkit.kv.calibrate import calibrate_kv, layerwise_observe, whole_model_observe
from quantkit.kv.hooks import KVObserver, fake_fp8, kv_hooks, kv_scales_of
from quantkit.modeling import dequantized_state_dict, load_model
from conftest import tree_bytes
from helpers import one_line_error, quantkit


def batches(vocab=512, n=3, seq=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (2, seq), generator=g) for _ in range(n)]


def cached_absmax(model, batch):
    """What transformers' own cache stores for this batch, per layer: (max|keys|, max|values|)."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=batch, past_key_values=cache, use_cache=True)
    return [(float(layer.keys.abs().max()), float(layer.values.abs().max())) for layer in cache.layers]


def test_observer_keeps_the_running_max():
    obs = KVObserver()
    obs.observe(0, torch.tensor([-10.0, 1.0]), torch.tensor([2.0]))
    obs.observe(0, torch.tensor([1.0]), torch.tensor([-3.0]))
    assert obs.scales() == {0: (pytest.approx(10 / 448), pytest.approx(3 / 448))}
    assert obs.scales()[0][0] == float(torch.tensor(10.0) / 448)


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_scales_equal_absmax_of_the_cached_tensors_with_the_max_in_the_first_batch(synthetic, family):
    # transformers' cache holds exactly what the engines cache for these two: post-RoPE K and V
    # (llama), the MLA latent kv_c_normed as keys and k_pe as values (deepseek_v3)
    model = load_model(synthetic[family])
    data = batches()
    per_batch = [cached_absmax(model, b) for b in data]
    order = sorted(range(len(data)), key=lambda i: -max(k for k, _ in per_batch[i]))
    data, per_batch = [data[i] for i in order], [per_batch[i] for i in order]  # the max comes first
    observed = whole_model_observe(synthetic[family], data)
    for layer, (k_scale, v_scale) in observed.scales().items():
        k_max = max(pb[layer][0] for pb in per_batch)
        v_max = max(pb[layer][1] for pb in per_batch)
        if family == "llama":
            assert (k_scale, v_scale) == (pytest.approx(k_max / 448, rel=1e-6), pytest.approx(v_max / 448, rel=1e-6))
        else:  # one scale for the whole latent
            assert k_scale == v_scale == pytest.approx(max(k_max, v_max) / 448, rel=1e-6)
    assert max(k for k, _ in per_batch[-1]) < max(k for k, _ in per_batch[0])  # a last-batch observer would fail


def test_mla_scale_covers_k_pe_when_it_holds_the_max(synthetic, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(synthetic["deepseek_v3"], src)
    # make the RoPE part of the latent (the last qk_rope_head_dim rows of kv_a_proj_with_mqa) large
    state = dequantized_state_dict(src)
    name = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
    w = state[name].clone()
    w[128:] *= 50
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shard = src / index["weight_map"][name]
    from safetensors.torch import load_file

    tensors = load_file(shard)
    tensors[name] = w
    tensors.pop(name.replace(".weight", ".weight_scale_inv"))
    write_safetensors(shard, tensors)
    index["weight_map"].pop(name.replace(".weight", ".weight_scale_inv"))
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    model = load_model(src)
    data = batches()
    k_pe = max(cached_absmax(model, b)[1][1] for b in data)
    kv_c = max(cached_absmax(model, b)[1][0] for b in data)
    assert k_pe > 2 * kv_c
    scales = layerwise_observe(open_checkpoint(src), data)[0].scales()
    assert scales[1][0] == pytest.approx(k_pe / 448, rel=1e-6)


@pytest.mark.parametrize("family", ["llama", "deepseek_v3", "glm_moe_dsa"])
def test_layer_by_layer_equals_whole_model(synthetic, tmp_path, family):
    convert(synthetic[family], tmp_path / "int4", RECIPE_FOR[family], device="cpu")
    for path in (synthetic[family], tmp_path / "int4"):
        data = batches()
        layerwise, peak = layerwise_observe(open_checkpoint(path), data)
        assert layerwise.scales() == whole_model_observe(path, data).scales()
        decoded = sum(t.numel() * t.element_size() for t in dequantized_state_dict(path).values())
        assert 0 < peak < decoded / 2  # one decoder layer's weights at a time, not the model


def test_fp8_emulation_error_by_value_range():
    """What an FP8 (e4m3) cache does to a value x at scale s, by range of x / s: within 2^-4 of x in
    the normal range [2^-6, 448] (3 mantissa bits), within half a subnormal step (2^-10 s) below it,
    and saturated at 448 s above it. (Whether calibrated scales beat scale 1.0 on a model whose K/V
    already sit inside FP8's range is not a property: measured both ways on SmolLM2, 0.285 vs 0.292 and
    0.329 vs 0.300 mean |logit change|, so no test asserts it.)"""
    from quantkit.kv.hooks import fake_fp8

    s = 0.37
    magnitudes = torch.logspace(-14, 10, 4001, base=2.0, dtype=torch.float32)
    x = torch.cat([magnitudes, -magnitudes]) * s
    y = fake_fp8(x, s)
    r = (x / s).abs()
    normal, sub, over = (r >= 2**-6) & (r <= 448), r < 2**-6, r > 448
    assert bool(((y - x).abs() <= 2**-4 * x.abs() * (1 + 1e-6))[normal].all())
    assert bool(((y - x).abs() <= 2**-10 * s * (1 + 1e-6))[sub].all())
    assert bool((y[over] == torch.sign(x[over]) * 448 * torch.tensor(s, dtype=torch.float32)).all())


def test_fp8_emulation_where_scale_one_saturates(smollm2_bf16, tmp_path):
    """On a model whose keys exceed FP8's range, scale 1.0 saturates them and calibrated scales do not:
    the calibrated emulation changes the logits far less."""
    ids = torch.randint(0, 49152, (1, 64), generator=torch.Generator().manual_seed(0))

    def logit_error(path, scales):
        model = load_model(path)
        with torch.no_grad():
            ref = model(ids).logits.float()
            with kv_hooks(model, "gqa", scales=scales):
                emu = model(ids).logits.float()
        return float((emu - ref).abs().mean())

    outlier = tmp_path / "outlier"
    shutil.copytree(smollm2_bf16, outlier)
    from safetensors.torch import load_file

    shard = next(outlier.glob("*.safetensors"))
    tensors = load_file(shard)
    tensors["model.layers.0.self_attn.k_proj.weight"] = tensors["model.layers.0.self_attn.k_proj.weight"] * 200
    write_safetensors(shard, tensors)
    planted = calibrate_kv(outlier, out=tmp_path / "outlier-kv", samples=8, seq_len=256)
    assert planted.scales[0][0] > 1.0  # keys beyond 448: scale 1.0 would saturate them
    ones = {i: (1.0, 1.0) for i in planted.scales}
    err_cal, err_one = logit_error(outlier, planted.scales), logit_error(outlier, ones)
    print(f"planted outlier: calibrated {err_cal:.4f}, scale 1.0 {err_one:.4f}")
    assert err_cal < err_one / 2


def test_output_layout_and_cli(smollm2_bf16, tmp_path):
    dst = tmp_path / "kv"
    r = CliRunner().invoke(app, ["calibrate-kv", str(smollm2_bf16), "--out", str(dst), "--samples", "4", "--seq-len", "128", "--json"])
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout)
    assert result["layers"] == 30 and result["attention"] == "gqa"
    ckpt = open_checkpoint(dst)
    k7 = ckpt.tensors["model.layers.7.self_attn.k_proj.k_scale"]  # the names the engines load (docs/FORMATS-engines.md)
    assert k7.dtype == "F32" and k7.shape == ()
    assert ckpt.config.quantization_config["kv_cache_scheme"]["type"] == "float"
    assert json.loads((dst / "kv_scales.json").read_text())["layers"]["7"]["k_scale"] == pytest.approx(result["scales"]["7"][0])
    assert (dst / "kv_scales.png").read_bytes()[:4] == b"\x89PNG"
    assert "quantization_config" not in json.loads((smollm2_bf16 / "config.json").read_text())  # source untouched
    assert kv_scales_of(dst) == {int(k): tuple(v) for k, v in result["scales"].items()}
    # per engine, where the scales load and which attention backends use them (tests/test_engine_names.py)
    assert result["engines"]["sglang 0.5.23"] .startswith("loaded into model.layers.N.self_attn.attn.k|v_scale; used by fa3, triton; SGLang 0.5.17")
    human = CliRunner().invoke(app, ["calibrate-kv", str(smollm2_bf16), "--out", str(tmp_path / "kv2"), "--samples", "2",
                                     "--seq-len", "64"])
    assert "  sglang 0.5.23: loaded into model.layers.N.self_attn.attn.k|v_scale; used by fa3, triton" in human.stdout


def test_in_place_updates_the_manifest(synthetic, tmp_path):
    out = tmp_path / "int4"
    convert(synthetic["llama"], out, "dense-w4a16-g128", device="cpu")
    from quantkit.kv.calibrate import write_scales

    write_scales(open_checkpoint(out), out, {0: (0.01, 0.02), 1: (0.03, 0.04)}, "gqa", copy=False)
    from quantkit.verify import verify

    report = verify(out, source=synthetic["llama"])
    assert report.passed, report.findings
    assert report.checked["shards hashed"] == 2  # the scales shard is recorded too


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda d: (d / "empty.jsonl").write_text(""), "empty"),
        (lambda d: (d / "short.txt").write_text("too short"), "too short"),
        (lambda d: (d / "bad.jsonl").write_text('{"body": "x"}\n'), "no field 'text'"),
    ],
)
def test_bad_data(smollm2_bf16, tmp_path, make, message):
    make(tmp_path)
    data = next(p for p in tmp_path.iterdir() if p.is_file())
    with pytest.raises(QuantkitError, match=message):
        calibrate_kv(smollm2_bf16, out=tmp_path / "o", data=data, samples=4, seq_len=128)


def test_bad_models(smollm2_bf16, synthetic, tmp_path):
    with pytest.raises(QuantkitError, match="exceeds the model's context"):
        calibrate_kv(smollm2_bf16, out=tmp_path / "o", seq_len=10**6)
    odd = tmp_path / "odd"
    shutil.copytree(synthetic["llama"], odd)
    config = json.loads((odd / "config.json").read_text())
    config = {"model_type": "mamba", "hidden_size": config["hidden_size"]}
    (odd / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantkitError, match="no attention layers quantkit knows"):
        calibrate_kv(odd, out=tmp_path / "o2", batches=batches())
    nan = tmp_path / "nan"
    shutil.copytree(synthetic["llama"], nan)
    from safetensors.torch import load_file

    for shard in nan.glob("*.safetensors"):
        tensors = load_file(shard)
        if "model.layers.0.input_layernorm.weight" in tensors:
            tensors["model.layers.0.input_layernorm.weight"] = tensors["model.layers.0.input_layernorm.weight"] * float("nan")
            write_safetensors(shard, tensors)
    with pytest.raises(QuantkitError, match="NaN"):
        calibrate_kv(nan, out=tmp_path / "o3", batches=batches())


def test_fake_fp8_saturates_and_rounds():
    x = torch.tensor([0.0, 1.0, 448.0, 1000.0, -1000.0])
    assert fake_fp8(x, 1.0).tolist() == [0.0, 1.0, 448.0, 448.0, -448.0]
    assert fake_fp8(x, 1000 / 448).tolist()[3] == pytest.approx(1000.0)


def test_emulated_fp8_kv_keeps_the_padding_mask(synthetic):
    """A left-padded batch under FP8 KV emulation gives each prompt what it gives alone (transformers builds no mask
    for an attention implementation without a mask function: the padding was attended to)."""
    model = load_model(synthetic["llama"], torch.float32).eval()
    short, long = [5, 9, 13, 17], [3, 1, 4, 1, 5, 9, 2, 6]
    ids = torch.tensor([[0] * (len(long) - len(short)) + short, long])
    mask = torch.tensor([[0] * (len(long) - len(short)) + [1] * len(short), [1] * len(long)])
    layers = model.config.num_hidden_layers
    with torch.no_grad(), kv_hooks(model, "gqa", scales={i: (0.01, 0.01) for i in range(layers)}):
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate gives a left-padded batch
        batched = model(ids, attention_mask=mask, position_ids=positions).logits[:, -1]
        alone = model(torch.tensor([short])).logits[0, -1]
    assert torch.allclose(batched[0], alone, atol=1e-4)


def test_calibrate_kv_in_place_never_writes_its_plot_through_a_link_in_the_model(synthetic, tmp_path):
    import torch

    from quantkit.kv.calibrate import calibrate_kv

    out = tmp_path / "int4"
    convert(synthetic["llama"], out, "dense-w4a16-g128", device="cpu")
    tokenizer = out / "tokenizer_config.json"
    before = tokenizer.read_bytes()
    (out / "kv_scales.png").symlink_to(tokenizer.name)  # inside the model, pointing at its tokenizer
    calibrate_kv(out, in_place=True, batches=[torch.randint(0, 512, (1, 16)) for _ in range(2)], device="cpu")
    assert tokenizer.read_bytes() == before
    assert not (out / "kv_scales.png").is_symlink() and (out / "kv_scales.png").read_bytes()[:4] == b"\x89PNG"
    assert open_checkpoint(out).config.quantization_config["kv_cache_scheme"]


def test_calibrate_kv_refuses_before_writing_a_byte(synthetic, tmp_path):
    source = tmp_path / "fp8-source"  # a block-FP8 release, as GLM 5.x ships
    shutil.copytree(synthetic["glm_moe_dsa"], source)
    before = tree_bytes(source)
    add = ["--samples", "2", "--seq-len", "32", "--device", "cpu"]
    one_line_error(quantkit("calibrate-kv", source, "--in-place", *add), "config.json", "convert first")
    one_line_error(quantkit("calibrate-kv", source, "--out", source / "scaled", *add), "the model folder or inside it")
    assert tree_bytes(source) == before and not (source / "scaled").exists()
    one_line_error(quantkit("calibrate-kv", source, "--out", tmp_path / "copy", *add), "convert first")
    assert not (tmp_path / "copy").exists()


@pytest.mark.parametrize("row,message", [
    ({"text": None}, "line 1: 'text' is null, not a text"),
    ({"input_ids": [10**30] * 64}, "line 1: input_ids must be"),
    ({"input_ids": [True] * 64}, "line 1: input_ids must be"),
    ({"input_ids": [600] * 64}, "outside the model's vocabulary"),
])
def test_bad_calibration_rows_are_refused(llama_pair, tmp_path, row, message):
    _, cand = llama_pair
    data = tmp_path / "cal.jsonl"
    data.write_text(json.dumps(row) + "\n")
    r = quantkit("calibrate-kv", cand, "--out", tmp_path / "o", "--data", data, "--samples", "1", "--seq-len", "64",
                 "--device", "cpu")
    one_line_error(r, "cal.jsonl", message)
    assert not (tmp_path / "o").exists()


def test_a_huge_paragraph_is_tokenized_only_as_far_as_the_samples_need(tmp_path):
    from quantkit.calibration_data import read_rows, token_batches

    data = tmp_path / "one-paragraph.txt"
    data.write_text("word " * 8_000_000)  # 40 MB, no blank line
    seen = []

    class Counting:
        eos_token_id = 0

        def encode(self, text):
            raise AssertionError("not used")

        def __call__(self, text, add_special_tokens=False):
            seen.append(len(text))
            return {"input_ids": [7] * len(text.split())}

    batches = token_batches(Counting(), read_rows(data), 8, 64, 4, data)
    assert [tuple(b.shape) for b in batches] == [(4, 64), (4, 64)]
    assert sum(seen) <= 1 << 17  # two pieces at most, not 40 MB
