"""Bad input: a one-line error naming the file and the tensor, a non-zero exit, SRC untouched,
and never a partial file under a final name."""

import errno
import json
import shutil
import subprocess
import uuid

import pytest
import torch
from conftest import shard_of, tree_bytes
from helpers import one_line_error, quantkit

from quantkit.checkpoint.reader import read_shard_header
from quantkit.checkpoint.writer import write_safetensors
import os
import sys
from safetensors.torch import load_file
from safetensors.torch import save_file

def rewrite(src, tensor, fn):
    """Rewrite the shard holding ``tensor`` with fn applied to its tensor dict."""
    from safetensors.torch import load_file

    path = shard_of(src, tensor)
    tensors = load_file(path)
    fn(tensors)
    write_safetensors(path, tensors)
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k in tensors or v != path.name}
    index["weight_map"].update({k: path.name for k in tensors})
    index_path.write_text(json.dumps(index))


def assert_clean_failure(result, src, before, *fragments, dst=None):
    one_line_error(result, *fragments, code=None)
    assert tree_bytes(src) == before
    if dst is not None and dst.exists():
        assert not list(dst.glob("model-*.safetensors")) or (dst / "quantkit-manifest.json").exists()
        assert not (dst / "config.json").exists()


ATTN = "model.layers.1.self_attn.o_proj"
EXPERT = "model.layers.2.mlp.experts.3.up_proj"


def convert_args(src, dst, recipe="glm5-int4-experts-g32"):
    return ("convert", src, dst, "--recipe", recipe, "--device", "cpu")


def test_truncated_shard(glm_copy, tmp_path):
    path = shard_of(glm_copy, ATTN + ".weight")
    path.write_bytes(path.read_bytes()[:-100])
    before = tree_bytes(glm_copy)
    r = quantkit(*convert_args(glm_copy, tmp_path / "dst"))
    assert_clean_failure(r, glm_copy, before, path.name, "truncated")


def test_header_lies_about_sizes(glm_copy, tmp_path):
    path = shard_of(glm_copy, ATTN + ".weight")
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header[ATTN + ".weight"]["shape"] = [256, 512]  # claims twice the bytes its offsets span
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n :])
    before = tree_bytes(glm_copy)
    r = quantkit(*convert_args(glm_copy, tmp_path / "dst"))
    assert_clean_failure(r, glm_copy, before, path.name, ATTN + ".weight", "header lies")


def test_fp8_weight_without_its_scale(glm_copy, tmp_path):
    rewrite(glm_copy, ATTN + ".weight", lambda t: t.pop(ATTN + ".weight_scale_inv"))
    before = tree_bytes(glm_copy)
    r = quantkit(*convert_args(glm_copy, tmp_path / "dst"))
    assert_clean_failure(r, glm_copy, before, ATTN + ".weight", "without its scale")


def test_scale_of_the_wrong_shape(glm_copy, tmp_path):
    rewrite(glm_copy, ATTN + ".weight", lambda t: t.update({ATTN + ".weight_scale_inv": torch.ones(3, 3)}))
    before = tree_bytes(glm_copy)
    r = quantkit(*convert_args(glm_copy, tmp_path / "dst"))
    assert_clean_failure(r, glm_copy, before, ATTN + ".weight_scale_inv", "wrong shape")


@pytest.mark.parametrize(
    "tensor,value",
    [(EXPERT + ".weight_scale_inv", float("inf")), (EXPERT + ".weight_scale_inv", float("nan")),
     ("model.layers.1.mlp.gate.weight", float("nan")), (EXPERT + ".weight", float("nan"))],
)
def test_nan_or_inf_in_weights_or_scales(glm_copy, tmp_path, tensor, value):
    def plant(t):
        x = t[tensor]
        if x.dtype == torch.float8_e4m3fn:
            x = x.clone().view(torch.uint8)
            x[0, 0] = 0x7F  # the e4m3fn NaN
            t[tensor] = x.view(torch.float8_e4m3fn)
        else:
            x = x.clone()
            x.view(-1)[0] = value
            t[tensor] = x

    rewrite(glm_copy, tensor, plant)
    before = tree_bytes(glm_copy)
    dst = tmp_path / "dst"
    r = quantkit(*convert_args(glm_copy, dst))
    assert_clean_failure(r, glm_copy, before, tensor, "NaN", dst=dst)
    assert not list(dst.glob(".*.partial"))


def test_group_size_not_dividing_in_features(glm_copy, tmp_path):
    recipe = tmp_path / "g96.yaml"
    text = (open_recipe_text("glm5-int4-experts-g32")).replace("group_size: 32", "group_size: 96")
    recipe.write_text(text)
    before = tree_bytes(glm_copy)
    r = quantkit(*convert_args(glm_copy, tmp_path / "dst", recipe))
    assert_clean_failure(r, glm_copy, before, "experts", "group size 96 does not divide in_features")


def open_recipe_text(name):
    from quantkit.packaged import recipe_path

    return recipe_path(name).read_text()


def point_index(src, tensor, file):
    """Make the index say ``tensor`` lives in ``file``."""
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"][tensor] = file
    index_path.write_text(json.dumps(index))


def test_index_naming_a_missing_file(glm_copy, tmp_path):
    point_index(glm_copy, ATTN + ".weight", "model-00009-of-00009.safetensors")
    before = tree_bytes(glm_copy)
    r = quantkit(*convert_args(glm_copy, tmp_path / "dst"))
    assert_clean_failure(r, glm_copy, before, "model.safetensors.index.json", "missing file", ATTN)


def test_index_path_escaping_the_folder(glm_copy, tmp_path):
    outside = tmp_path / "evil.safetensors"
    shutil.copy(shard_of(glm_copy, ATTN + ".weight"), outside)
    point_index(glm_copy, ATTN + ".weight", "../evil.safetensors")
    before = tree_bytes(glm_copy)
    r = quantkit(*convert_args(glm_copy, tmp_path / "dst"))
    assert_clean_failure(r, glm_copy, before, "escapes the checkpoint folder")


def test_pickle_only_checkpoint_is_refused(tmp_path):
    src = tmp_path / "pickled"
    src.mkdir()
    (src / "config.json").write_text('{"model_type": "llama"}')
    marker = tmp_path / f"unpickled-{uuid.uuid4().hex}"
    # A pickle that would create a file if anything loaded it.
    import pickle

    class Boom:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (src / "pytorch_model.bin").write_bytes(pickle.dumps(Boom()))
    before = tree_bytes(src)
    r = quantkit(*convert_args(src, tmp_path / "dst"))
    assert_clean_failure(r, src, before, "pytorch_model.bin", "never unpickles")
    assert not marker.exists()


@pytest.mark.parametrize("where", ["same", "inside"])
def test_dst_equal_to_or_inside_src(glm_copy, where):
    dst = glm_copy if where == "same" else glm_copy / "out"
    before = tree_bytes(glm_copy)
    r = quantkit(*convert_args(glm_copy, dst))
    assert_clean_failure(r, glm_copy, before, "must not be the source folder or inside it")
    assert not (glm_copy / "out").exists()


def test_dst_holding_something_else(glm_copy, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "notes.txt").write_text("mine")
    before = tree_bytes(glm_copy)
    r = quantkit(*convert_args(glm_copy, dst))
    assert_clean_failure(r, glm_copy, before, "not a quantkit output")
    assert (dst / "notes.txt").read_text() == "mine"


def test_dst_holding_another_run(synthetic, glm_copy, tmp_path):
    dst = tmp_path / "dst"
    assert quantkit(*convert_args(synthetic["deepseek_v3"], dst, "deepseek-v3-int4-experts-g32")).exit_code == 0
    before = tree_bytes(glm_copy)
    r = quantkit(*convert_args(glm_copy, dst), "--resume")
    assert_clean_failure(r, glm_copy, before, "holds another run", "source")


def _tmpfs(path, size):
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return done.returncode == 0


def test_disk_full_while_writing(glm_copy, tmp_path, monkeypatch):
    mnt = tmp_path / "small"
    mounted = _tmpfs(mnt, "3m")  # the output needs ~6.5 MB
    if not mounted:
        # No permission to mount here: make every write past 3 MB fail the way a full disk does.
        import quantkit.checkpoint.writer as sw

        real_emit = sw.ShardWriter._emit
        budget = {"left": 3 << 20}

        def emit(self, chunk):
            budget["left"] -= len(chunk)
            if budget["left"] < 0:
                self._guard(lambda: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")))
            real_emit(self, chunk)

        monkeypatch.setattr(sw.ShardWriter, "_emit", emit)
    try:
        dst = mnt / "dst"
        before = tree_bytes(glm_copy)
        r = quantkit(*convert_args(glm_copy, dst), "--max-shard-size", "1MB")
        assert_clean_failure(r, glm_copy, before, "disk full", dst=dst)
        assert not list(dst.glob(".*.partial"))
        # every file under a final name is complete and recorded
        manifest = json.loads((dst / "quantkit-manifest.json").read_text())
        finals = sorted(p.name for p in dst.glob("model-*.safetensors"))
        assert set(finals) <= set(manifest["shards"]) or not finals
        for name in finals:
            read_shard_header(dst, name)  # a complete, self-consistent safetensors file
            assert (dst / name).stat().st_size == manifest["shards"][name]["size"]
    finally:
        if mounted:
            subprocess.run(["umount", str(mnt)])


def test_resume_and_force_together_are_refused(glm_copy, tmp_path):
    r = quantkit(*convert_args(glm_copy, tmp_path / "dst"), "--resume", "--force")
    assert r.exit_code != 0 and "exclude each other" in r.output


def edit_header(src, tensor, fn):
    """Rewrite the safetensors header of the shard holding ``tensor`` (data bytes untouched)."""
    path = shard_of(src, tensor)
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    fn(header[tensor])
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n :])
    return path.name


def edit_json(path, fn):
    data = json.loads(path.read_text())
    path.write_text(json.dumps(fn(data)))
    return path.name


def set_key(key, value):
    def fn(data):
        data[key] = value
        return data

    return fn


def set_block(value):
    def fn(config):
        config["quantization_config"]["weight_block_size"] = value
        return config

    return fn


def shard_as_folder(src):
    path = shard_of(src, ATTN + ".weight")
    path.unlink()
    path.mkdir()
    return path.name


# (what is damaged, the damage -> the file name the error must name, the message fragment)
BOUNDARIES = {
    "header: dtype a list": (lambda s: edit_header(s, ATTN + ".weight", set_key("dtype", ["BF16"])), "unsupported dtype"),
    "header: offsets strings": (lambda s: edit_header(s, ATTN + ".weight", set_key("data_offsets", ["0", "8"])),
                                "malformed data_offsets"),
    "header: offsets floats": (lambda s: edit_header(s, ATTN + ".weight", set_key("data_offsets", [0.0, 8.5])),
                               "malformed data_offsets"),
    "header: negative dims": (lambda s: edit_header(s, ATTN + ".weight", set_key("shape", [-1, 256])), "malformed shape"),
    "header: an entry that is a list": (lambda s: edit_header(s, ATTN + ".weight", lambda e: e.clear()),
                                        "malformed header entry"),
    "shard: a folder": (shard_as_folder, "not a regular file"),
    "index: a value of the wrong type": (lambda s: edit_json(s / "model.safetensors.index.json", lambda i: dict(
        i, weight_map=dict(i["weight_map"], **{ATTN + ".weight": 7}))), "is not a file name"),
    "index: a list": (lambda s: edit_json(s / "model.safetensors.index.json", lambda i: [i]), "invalid index"),
    "config: a list": (lambda s: edit_json(s / "config.json", lambda c: [c]), "not a JSON object"),
    "config: null": (lambda s: edit_json(s / "config.json", lambda c: None), "not a JSON object"),
    "config: block size 0": (lambda s: edit_json(s / "config.json", set_block([0, 128])), "weight_block_size"),
    "config: block size one item": (lambda s: edit_json(s / "config.json", set_block([128])), "weight_block_size"),
    "config: block size a string": (lambda s: edit_json(s / "config.json", set_block("128")), "weight_block_size"),
    "config: quantization_config a string": (lambda s: edit_json(s / "config.json", set_key("quantization_config", "fp8")),
                                             "quantization_config is a str"),
    "config: not JSON": (lambda s: (s / "config.json").write_text("{oops") and "config.json", "invalid JSON"),
    # fields ModelConfig types that check_config does not bound
    "config: tie_word_embeddings a word": (lambda s: edit_json(s / "config.json", set_key("tie_word_embeddings", "maybe")),
                                           "tie_word_embeddings: Input should be a valid boolean"),
    "config: architectures a number": (lambda s: edit_json(s / "config.json", set_key("architectures", 3)),
                                       "architectures: Input should be a valid list"),
}


@pytest.mark.parametrize("case", list(BOUNDARIES))
@pytest.mark.parametrize("command", ["inspect", "plan", "convert"])
def test_every_boundary_gives_one_line_naming_the_file(glm_copy, tmp_path, case, command):
    damage, fragment = BOUNDARIES[case]
    name = damage(glm_copy)
    before = tree_bytes(glm_copy)
    args = {"inspect": ("inspect", glm_copy), "plan": ("plan", glm_copy, "-r", "glm5-int4-experts-g32"),
            "convert": convert_args(glm_copy, tmp_path / "dst")}[command]
    r = quantkit(*args)
    assert_clean_failure(r, glm_copy, before, name, fragment, dst=tmp_path / "dst")
    assert "Traceback" not in r.output


@pytest.mark.parametrize("damage, fragment", [
    (lambda m: dict(m, shards=[]), "shards: Input should be an object"),
    (lambda m: dict(m, status="done"), "status: Input should be 'running' or 'complete'"),
    (lambda m: {k: v for k, v in m.items() if k != "recipe_sha256"}, "recipe_sha256: Field required"),
])
def test_a_corrupt_manifest_is_one_line(synthetic, tmp_path, damage, fragment):
    from quantkit.convert import convert

    dst = tmp_path / "dst"
    convert(synthetic["llama"], dst, "dense-w4a16-g128", device="cpu")
    manifest = dst / "quantkit-manifest.json"
    manifest.write_text(json.dumps(damage(json.loads(manifest.read_text()))))
    for args in (("verify", dst, "--no-smoke"), ("convert", synthetic["llama"], dst, "-r", "dense-w4a16-g128", "--resume"),
                 ("publish", dst, "--repo", f"file://{tmp_path / 'out'}", "--force-ungated")):
        r = quantkit(*args)
        one_line_error(r, "quantkit-manifest.json", fragment)
    manifest.write_text("{not json")
    r = quantkit("verify", dst, "--no-smoke")
    one_line_error(r, "unreadable manifest")


def test_options_out_of_range_are_usage_errors(glm_copy, tmp_path):
    r = quantkit("convert", glm_copy, tmp_path / "dst", "-r", "glm5-int4-experts-g32", "--workers", "-1")
    assert r.exit_code == 2 and "Invalid value for '--workers'" in r.output and "Traceback" not in r.output


def test_disk_full_while_copying_side_files(glm_copy, tmp_path, monkeypatch):
    import quantkit.checkpoint.writer as shard_writer

    real = shard_writer.open_exclusive

    def full(tmp):
        if "tokenizer" in tmp.name or "chat_template" in tmp.name or "generation" in tmp.name:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(tmp)

    monkeypatch.setattr(shard_writer, "open_exclusive", full)
    before = tree_bytes(glm_copy)
    dst = tmp_path / "dst"
    r = quantkit(*convert_args(glm_copy, dst))
    assert_clean_failure(r, glm_copy, before, "disk full", dst=dst)


def test_dst_on_a_read_only_file_system(glm_copy, tmp_path, monkeypatch):
    from pathlib import Path

    real = Path.mkdir

    def read_only(self, *args, **kwargs):
        if self == tmp_path / "ro" / "dst":
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only)
    before = tree_bytes(glm_copy)
    r = quantkit(*convert_args(glm_copy, tmp_path / "ro" / "dst"))
    assert_clean_failure(r, glm_copy, before, "dst", "Read-only file system")


@pytest.mark.parametrize("kind", ["suite", "recipe", "release config"])
def test_a_key_named_twice_is_refused_naming_the_file_and_key(synthetic, tmp_path, kind):
    if kind == "suite":
        path = tmp_path / "s.yaml"
        path.write_text("tasks:\n  arc_easy: {margin: 1}\nalpha: 0.05\ntasks:\n  gsm8k: {margin: 50}\n")
        result = quantkit("gate", tmp_path, tmp_path, "--suite", path)
    elif kind == "recipe":
        path = tmp_path / "r.yaml"
        path.write_text("quant_stage:\n  quant_modifiers: {}\nquant_stage:\n  quant_modifiers: {}\n")
        result = quantkit("convert", synthetic["llama"], tmp_path / "out", "-r", path)
    else:
        path = tmp_path / "release.yaml"
        path.write_text("source: a\nrecipe: b\npublish: null\nrecipe: c\n")
        result = quantkit("release", path)
    line = one_line_error(result, str(path), code=None)
    key = "tasks" if kind == "suite" else "quant_stage" if kind == "recipe" else "recipe"
    assert f"invalid YAML at line {3 if kind == 'recipe' else 4}: duplicate key '{key}'" in line


def test_a_merge_key_may_still_be_overridden(tmp_path):
    from quantkit.yaml_file import load_yaml

    path = tmp_path / "m.yaml"
    path.write_text("base: &b {margin: 1, cluster: null}\ntasks:\n  arc_easy:\n    <<: *b\n    margin: 3\n")
    assert load_yaml(path, "suite")["tasks"]["arc_easy"] == {"margin": 3, "cluster": None}


@pytest.mark.parametrize("extra, says", [(lambda: "[" * 100_000 + "]" * 100_000, "maximum recursion depth"),
                                         (lambda: "9" * 5000, "Exceeds the limit (4300 digits)")])
def test_a_config_json_python_cannot_parse_is_one_line_naming_it(synthetic, tmp_path, extra, says):
    model = tmp_path / "model"
    shutil.copytree(synthetic["llama"], model)
    text = (model / "config.json").read_text().rstrip().removesuffix("}")
    (model / "config.json").write_text(text + ', "x": ' + extra() + "}")
    for command in (("inspect", model), ("plan", model)):
        line = one_line_error(quantkit(*command), says, code=None)
        assert "config.json: invalid JSON" in line
    checked = quantkit("verify", model)  # verify reports it as a finding, as it does any unreadable checkpoint
    assert checked.exit_code == 1 and "readable checkpoint: invalid JSON: " + says in checked.output


@pytest.mark.parametrize("row, says", [
    ('{"input_ids": ' + "[" * 100_000 + "]" * 100_000 + "}", "line 1: nested deeper than JSON is read here"),
    ('{"input_ids": [' + "9" * 5000 + "]}", "line 1: invalid JSON"),
])
def test_calibration_rows_json_cannot_read_are_one_line_naming_the_file(synthetic, tmp_path, row, says):
    (tmp_path / "rows.jsonl").write_text(row + "\n")
    result = quantkit("calibrate-kv", synthetic["llama"], "--out", tmp_path / "out", "--data", tmp_path / "rows.jsonl",
                      "--seq-len", 64)
    line = one_line_error(result, says, code=None)
    assert "rows.jsonl" in line and "internal error" not in result.output


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


def test_a_fifo_in_place_of_a_shard_ends_at_once(synthetic, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(synthetic["llama"], src)
    shard = sorted(src.glob("*.safetensors"))[0]
    shard.unlink()
    os.mkfifo(shard)
    done = subprocess.run([sys.executable, "-m", "quantkit", "inspect", str(src)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1 and shard.name in done.stderr and "not a regular file" in done.stderr


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


def test_a_tensor_name_with_thousands_of_digits_is_one_line(synthetic, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(synthetic["llama"], src)
    name = "model.layers.0.mlp.down_proj.weight"
    shard = shard_of(src, name)
    tensors = load_file(shard)
    long_name = "model.layers." + "9" * 5000 + ".mlp.down_proj.weight"
    tensors[long_name] = tensors.pop(name)
    save_file(tensors, shard, {"format": "pt"})
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"][long_name] = index["weight_map"].pop(name)
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    for command in (["inspect", src], ["convert", src, tmp_path / "o", "-r", "dense-w4a16-g128", "--device", "cpu"]):
        one_line_error(quantkit(*command), "more than 9 digits")
    one_line_error(quantkit("convert", synthetic["llama"], tmp_path / "p", "-r", "dense-w4a16-g128",
                            "--max-shard-size", "9" * 5000 + "GB"), "cannot read size")
