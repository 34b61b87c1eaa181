"""The second adversarial pass, one test per finding: a release certifies only what it measured, nothing is
written outside the folder the user named, what reaches a terminal or a card is inert, bad data is one line,
and what a new user meets is quiet and true.

Each test plants what the finding describes and asserts the outcome the finding asked for.
"""

import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import shard_of, tree_bytes
from helpers import add_word_tokenizer, gptq_recipe, one_line_error, quantkit
from safetensors.torch import load_file, save_file

from quantkit.checkpoint.manifest import Manifest, ShardRecord
from quantkit.checkpoint.writer import folder_lock
from quantkit.convert import convert
from quantkit.convert.calibrated.walk import LEGACY_WORK_DIR, WORK_DIR
from quantkit.errors import QuantkitError
from quantkit.evaluation import RunRecord, cache_binding, evaluate
from quantkit.evaluation.request_cache import RequestCache
from quantkit.examples.demo import DATA

@pytest.fixture(scope="module")
def models(synthetic, tmp_path_factory):
    """A synthetic Llama with a real (word-level) tokenizer, and its INT4 conversion: a baseline and a candidate."""
    root = tmp_path_factory.mktemp("models")
    base = root / "base"
    shutil.copytree(synthetic["llama"], base)
    add_word_tokenizer(base)
    cand = root / "int4"
    convert(base, cand, "dense-w4a16-g128", device="cpu")
    return base, cand


def evaluate_small(model, out, **kw):
    return evaluate(model, tasks=["arc_easy"], data_dir=DATA, limit=4, out=out, batch_size=4, device="cpu", **kw)


# --- 1. Evaluation evidence is bound to the model it measured ------------------------------------------------------


def test_a_candidate_evaluated_into_a_folder_seeded_with_the_baselines_cache_is_refused(models, tmp_path):
    base, cand = models
    evaluate_small(base, tmp_path / "baseline")
    seeded = tmp_path / "candidate"
    (seeded / "cache").mkdir(parents=True)
    shutil.copy(tmp_path / "baseline" / "cache" / "requests.jsonl", seeded / "cache")  # no run.json: nothing else binds it
    with pytest.raises(QuantkitError, match=r"requests.jsonl: holds \d+ answer\(s\) of another model or engine setup"):
        evaluate_small(cand, seeded)
    assert not (seeded / "run.json").exists() and not (seeded / "results.json").exists()

    # the same model again resumes from its own cache
    again = evaluate_small(base, tmp_path / "baseline")
    assert again.scores["arc_easy"]["n"] == 4


def test_unbound_answers_and_a_copied_first_pass_are_refused(tmp_path):
    record = RunRecord(model="m", model_checksums={"a": "0" * 64}, tasks={}, engine={"name": "hf", "version": "1"})
    first, second = cache_binding(record, 1), cache_binding(record, 2)
    assert first != second  # the repeat that measures engine noise cannot be a copy of the first pass
    path = tmp_path / "requests.jsonl"
    RequestCache(path, first).add_partial("loglikelihood", ("Q", " A"), (-1.0, True))
    assert RequestCache(path, first).get("loglikelihood", ("Q", " A")) == (-1.0, True)
    with pytest.raises(QuantkitError, match="1 answer.s. of another model or engine setup"):
        RequestCache(path, second)
    row = json.loads(path.read_text())
    del row["binding"]  # what a cache written before binding looks like
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(QuantkitError, match="bound to no model"):
        RequestCache(path, first)
    other = dict(record.model_dump(), model_checksums={"a": "1" * 64})
    assert cache_binding(RunRecord(**other), 1) != first


def test_work_folders_are_locked_and_the_refusal_names_the_holder(models, tmp_path):
    base, cand = models
    (tmp_path / "run").mkdir()
    with folder_lock(tmp_path / "run"):
        with pytest.raises(QuantkitError, match=rf"in use by another quantkit process \(pid {os.getpid()} on "):
            evaluate_small(base, tmp_path / "run")
    copy = tmp_path / "cand"
    shutil.copytree(cand, copy)
    with folder_lock(copy):
        r = quantkit("calibrate-kv", copy, "--in-place", "--samples", "2", "--seq-len", "32", "--device", "cpu")
    one_line_error(r, str(copy), f"pid {os.getpid()}")
    assert tree_bytes(copy) == tree_bytes(cand) | {".quantkit.lock": (copy / ".quantkit.lock").read_bytes()}


def test_verify_against_itself_or_another_source_fails(models, synthetic, tmp_path):
    _, cand = models
    r = quantkit("verify", cand, "--source", cand, "--no-smoke")
    assert r.exit_code == 1 and "--source is DST itself" in r.output
    r = quantkit("verify", cand, "--source", synthetic["glm_moe_dsa"], "--no-smoke")
    assert r.exit_code == 1 and "differ from those of the recorded source" in r.output


def test_a_needle_task_without_a_context_length_is_refused(models, tmp_path):
    base, _ = models
    model = tmp_path / "no-context"
    shutil.copytree(base, model)
    config = json.loads((model / "config.json").read_text())
    del config["max_position_embeddings"]
    (model / "config.json").write_text(json.dumps(config))
    r = quantkit("eval", model, "--tasks", "needle_1k", "--device", "cpu", "--out", tmp_path / "run")
    one_line_error(r, "config.json", "no max_position_embeddings")
    r = quantkit("eval", model, "--tasks", "needle_" + "9" * 5000 + "k", "--out", tmp_path / "run")
    one_line_error(r, "unknown task")


# --- 2. Nothing is written outside the named folder; nothing is written before a refusal ---------------------------


def test_a_link_at_a_work_subfolder_is_refused_and_nothing_lands_outside(models, synthetic, tmp_path):
    base, _ = models
    outside = tmp_path / "outside"
    outside.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    (run / "cache").symlink_to(outside)
    with pytest.raises(QuantkitError, match="cache: is a link: refused"):
        evaluate_small(base, run)
    assert not list(outside.iterdir())

    dst = tmp_path / "gptq"
    recipe = gptq_recipe(tmp_path)
    convert(synthetic["glm_moe_dsa"], dst, recipe, device="cpu")
    shard = next(dst.glob("model-*.safetensors"))
    shard.unlink()  # a shard to redo: --resume runs GPTQ again, in DST/.quantkit-calibrated
    (dst / WORK_DIR).symlink_to(outside)
    with pytest.raises(QuantkitError, match=r"\.quantkit-calibrated: is a link: refused"):
        convert(synthetic["glm_moe_dsa"], dst, recipe, device="cpu", resume=True)
    (dst / WORK_DIR).unlink()
    (dst / LEGACY_WORK_DIR).symlink_to(outside)  # the folder's older name is not followed either
    convert(synthetic["glm_moe_dsa"], dst, recipe, device="cpu", resume=True)
    assert not list(outside.iterdir())


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


def test_a_release_resumed_after_its_published_folder_was_deleted_publishes_again(models, tmp_path):
    base, _ = models
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


# --- 3. What reaches the terminal and the model card is inert ------------------------------------------------------


def test_markup_and_control_characters_in_user_text_are_shown_not_obeyed(tmp_path):
    for name in ("x[/x]", "y[bold red]z", "esc\x1b[2Jname"):
        r = quantkit("inspect", tmp_path / name)
        line = one_line_error(r, "not a checkpoint folder")
        assert name.replace("\x1b", "\\x1b") in line and "\x1b" not in r.output and "MarkupError" not in r.output


def test_a_tensor_name_with_a_newline_cannot_print_a_fake_pass(models, tmp_path):
    _, cand = models
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


def test_card_fields_are_validated_and_escaped(models, tmp_path):
    _, cand = models
    injected = "org/name\n```bash\nrm -rf ~\n```"
    r = quantkit("publish", cand, "--repo", f"file://{tmp_path / 'out'}", "--force-ungated", "--base-model", injected)
    one_line_error(r, "is not a hub model id")
    assert not (tmp_path / "out").exists()
    name = "name `x` $(id) [link](e)"
    r = quantkit("publish", cand, "--repo", f"file://{tmp_path / name}", "--force-ungated", "--dry-run", "--json")
    card = json.loads(r.stdout)["card"].splitlines()
    assert "# name \\`x\\` $(id) \\[link\\](e)" in card  # literal text, no code span, no link
    serve = next(line for line in card if line.startswith("python -m sglang.launch_server"))
    assert shlex.split(serve)[4] == name  # one shell word: nothing runs when it is pasted


# --- 4. Bad data: one clear line naming file and line, bounded work ------------------------------------------------


@pytest.mark.parametrize("content,message", [
    ('{"question": "q"\n', "line 1: not JSON"),
    ('{"question": "q", "choices": {"text": ["a", "b"], "label": ["A", "B"]}}\n', "line 1: 'answerKey' None"),
    ("\n\n", "no items"),
    ('{"question": "q", "choices": {"text": ["a"], "label": ["A", "B"]}, "answerKey": "A"}\n', "line 1: 'choices'"),
])
def test_bad_benchmark_data_is_one_line_naming_file_and_line(models, tmp_path, content, message):
    base, _ = models
    (tmp_path / "data" / "arc_easy").mkdir(parents=True)
    (tmp_path / "data" / "arc_easy" / "test.jsonl").write_text(content)
    r = quantkit("eval", base, "--tasks", "arc_easy", "--data-dir", tmp_path / "data", "--device", "cpu",
                 "--out", tmp_path / "run")
    one_line_error(r, "arc_easy/test.jsonl", message)


@pytest.mark.parametrize("row,message", [
    ({"text": None}, "line 1: 'text' is null, not a text"),
    ({"input_ids": [10**30] * 64}, "line 1: input_ids must be"),
    ({"input_ids": [True] * 64}, "line 1: input_ids must be"),
    ({"input_ids": [600] * 64}, "outside the model's vocabulary"),
])
def test_bad_calibration_rows_are_refused(models, tmp_path, row, message):
    _, cand = models
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


def test_publish_to_a_crowded_folder_refuses_at_the_first_foreign_entry(models, tmp_path, monkeypatch):
    _, cand = models
    home = tmp_path / "home"
    for i in range(50):
        (home / f"dir{i}" / "deeper").mkdir(parents=True)
    (home / "a-file").write_text("mine")
    import quantkit.release.publish as publish_module

    listed = []
    real = os.scandir
    monkeypatch.setattr(publish_module.os, "scandir", lambda path=".": listed.append(str(path)) or real(path))
    r = quantkit("publish", cand, "--repo", f"file://{home}", "--force-ungated")
    one_line_error(r, "holds a-file, which is not part of this model")
    assert [p for p in listed if p.startswith(str(home))] == [str(home)]  # one folder listed, none walked


# --- 5. The device a user names reaches torch with an index --------------------------------------------------------


def test_cuda_without_an_index_becomes_the_current_device(monkeypatch):
    from quantkit.devices import resolve_device, resolve_devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert resolve_devices("cuda") == ["cuda:0"] and resolve_device("auto") == "cuda:0"
    assert resolve_devices("cuda:1, cuda:0") == ["cuda:1", "cuda:0"]
    for bad, message in (("cuda:2", "has 2 GPU"), ("cuda:0,cuda", "named twice"), ("gpu", "unknown device"),
                         ("cuda:" + "1" * 4000, "unknown device")):
        with pytest.raises(QuantkitError, match=message):
            resolve_devices(bad)


# --- 6. What a new user meets ----------------------------------------------------------------------------------------


def test_version_and_the_demos_help_say_what_is_true():
    from quantkit import __version__

    r = quantkit("--version")
    assert r.exit_code == 0 and r.output.strip() == f"quantkit {__version__}"
    from quantkit.examples.demo import CANDIDATES

    r = quantkit("demo", "--help")
    said = " ".join(r.output.split())
    assert "two pools" in said and len(CANDIDATES) == 2
    assert all(f"{c.pool} (" in said for c in CANDIDATES.values()), said


def test_eval_and_gptq_print_nothing_from_libraries(synthetic, tmp_path):
    base = tmp_path / "bpe"  # a BPE tokenizer that asks for clean-up: transformers warned on every decode
    shutil.copytree(synthetic["llama"], base)
    add_word_tokenizer(base, bpe=True)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps(dict(config, max_position_embeddings=1024)))
    env = dict(os.environ)
    eval_run = subprocess.run([sys.executable, "-m", "quantkit", "eval", str(base), "--tasks", "arc_easy,gsm8k",
                               "--limit", "2", "--data-dir", str(DATA), "--device", "cpu", "--out", str(tmp_path / "r")],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert eval_run.returncode == 0, eval_run.stderr
    assert eval_run.stderr == "", eval_run.stderr  # no git "fatal", no tokenizer or lm-eval warnings
    convert_run = subprocess.run([sys.executable, "-m", "quantkit", "convert", str(synthetic["glm_moe_dsa"]),
                                  str(tmp_path / "g"), "-r", str(gptq_recipe(tmp_path)), "--device", "cpu"],
                                 cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert convert_run.returncode == 0, convert_run.stderr
    assert all(line.startswith("GPTQ layer") for line in convert_run.stderr.splitlines()), convert_run.stderr


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
