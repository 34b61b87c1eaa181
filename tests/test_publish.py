"""publish: only what was gated ships; the card tells the truth; the token never shows."""

import json
import os
import shutil

import pytest
import yaml
from typer.testing import CliRunner

from helpers import passing_verdict, suite, write_generations, write_run
from quantkit.checkpoint.inspection import inspect_checkpoint
from quantkit.cli import app
from quantkit.convert import convert
from quantkit.release.gate import gate
from quantkit.release.publish import PublishRefused, publish
from pathlib import Path
from conftest import tree_bytes
from helpers import one_line_error, quantkit
import shlex

SECRET = "hf_quantkitTESTtoken0123456789abcdef"


@pytest.fixture
def gated(synthetic, tmp_path):
    """A converted GLM-5-shaped checkpoint and a passing gate verdict over its shards."""
    dst = tmp_path / "int4"
    convert(synthetic["glm_moe_dsa"], dst, "glm5-int4-experts-g32", device="cpu")
    return dst, passing_verdict(dst, tmp_path)


def test_publish_to_a_local_folder_with_a_truthful_card(gated, synthetic, tmp_path):
    dst, verdict = gated
    target = tmp_path / "hub" / "org" / "glm5-int4"
    result = publish(dst, f"file://{target}", gate=verdict, base_model="zai-org/GLM-5.2")
    shipped = sorted(p.relative_to(target).as_posix() for p in target.rglob("*") if p.is_file())
    assert shipped == sorted(f["name"] for f in result.files)
    assert "README.md" in shipped and "quantkit-manifest.json" in shipped and "config.json" in shipped
    for name in shipped:
        assert (target / name).read_bytes() == (dst / name).read_bytes()

    card = (target / "README.md").read_text()
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["base_model"] == "zai-org/GLM-5.2" and "int4" in meta["tags"]
    assert meta["model-index"][0]["results"][0]["metrics"][0] == {"type": "accuracy", "value": 75.0}
    assert "| arc_easy | 200 | 75.00 | 75.00 | +0.00 |" in card
    assert "python -m sglang.launch_server --model-path glm5-int4 --tp-size 1" in card
    assert "vllm serve glm5-int4" in card
    assert f"| this checkpoint | {inspect_checkpoint(dst).total_params:,} |" in card
    assert f"| source | {inspect_checkpoint(synthetic['glm_moe_dsa']).total_params:,} |" in card
    assert "recipe `glm5-int4-experts-g32`" in card

    before = {p: p.stat().st_mtime_ns for p in target.rglob("*")}
    publish(dst, f"file://{target}", gate=verdict, base_model="zai-org/GLM-5.2")  # a re-run copies nothing again
    assert {p: p.stat().st_mtime_ns for p in target.rglob("*")} == before


def test_a_shard_changed_after_gating_is_refused(gated, tmp_path):
    dst, verdict = gated
    shard = sorted(dst.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(PublishRefused, match=f"{shard.name}: changed since it was gated"):
        publish(dst, f"file://{tmp_path / 'out'}", gate=verdict)
    assert not (tmp_path / "out").exists()


def test_ungated_failed_or_foreign_verdicts_are_refused(gated, synthetic, tmp_path):
    dst, verdict = gated
    with pytest.raises(PublishRefused, match="no gate verdict given"):
        publish(dst, f"file://{tmp_path / 'out'}")
    runs = json.loads(verdict.read_text())
    tight = tmp_path / "tight"
    tight.mkdir()  # a 0-point margin: the interval [0, 0] of two equal runs does not clear it
    gate(runs["baseline"], runs["candidate"], suite=suite(tight, ["arc_easy"], margin=0.0), report_dir=tight / "gate")
    with pytest.raises(PublishRefused, match=r"the gate failed \(arc_easy\)"):
        publish(dst, f"file://{tmp_path / 'out'}", gate=tight / "gate" / "verdict.json")
    other = tmp_path / "other"
    convert(synthetic["glm_moe_dsa"], other, "glm5-int4-experts-g128-fp8", device="cpu")
    with pytest.raises(PublishRefused, match="changed since it was gated"):
        publish(other, f"file://{tmp_path / 'out'}", gate=verdict)
    assert not (tmp_path / "out").exists()

    result = publish(dst, f"file://{tmp_path / 'out'}", force_ungated=True)
    assert not result.gated and "**Not gated.**" in (tmp_path / "out" / "README.md").read_text()


class RecordingHub:
    """Stands in for huggingface_hub.HfApi at the network boundary: records what would be sent."""

    def __init__(self):
        self.calls = []

    def create_repo(self, repo_id, **kw):
        self.calls.append(("create_repo", repo_id, kw))

    def create_branch(self, repo_id, **kw):
        self.calls.append(("create_branch", repo_id, kw))

    def upload_large_folder(self, repo_id, folder_path, **kw):
        """The files huggingface_hub would send: its own filter over the folder, with the patterns given."""
        from huggingface_hub.utils import filter_repo_objects

        every = sorted(p.relative_to(folder_path).as_posix() for p in __import__("pathlib").Path(folder_path).rglob("*")
                       if p.is_file())
        files = list(filter_repo_objects(every, allow_patterns=kw.get("allow_patterns"),
                                         ignore_patterns=kw.get("ignore_patterns")))
        self.calls.append(("upload_large_folder", repo_id, dict(kw, files=files)))


def test_hub_upload_calls_in_order_and_the_token_never_shows(gated, tmp_path, capsys, monkeypatch):
    dst, verdict = gated
    monkeypatch.setenv("HF_TOKEN", SECRET)
    hub = RecordingHub()
    result = publish(dst, "org/glm5-int4", gate=verdict, private=True, revision="int4-g32", api=hub)
    assert [c[0] for c in hub.calls] == ["create_repo", "create_branch", "upload_large_folder"]
    assert hub.calls[0][2] == {"repo_type": "model", "private": True, "exist_ok": True}
    assert hub.calls[1][2]["branch"] == "int4-g32"
    upload = hub.calls[2][2]
    assert upload["revision"] == "int4-g32" and upload["repo_type"] == "model"
    assert "README.md" in upload["files"] and {f["name"] for f in result.files} <= set(upload["files"])

    out = CliRunner().invoke(app, ["publish", str(dst), "--repo", "org/glm5-int4", "--gate", str(verdict), "--dry-run"],
                             env={"HF_TOKEN": SECRET})
    assert out.exit_code == 0, out.output
    assert "dry run" in out.output and "model-index" in out.output and "model-00001-of-00001.safetensors" in out.output
    captured = capsys.readouterr()
    for text in (out.output, captured.out, captured.err):
        assert SECRET not in text
    for path in dst.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path


def test_dry_run_changes_nothing_and_oversized_files_are_refused(gated, tmp_path):
    dst, verdict = gated
    (dst / "README.md").unlink(missing_ok=True)
    result = publish(dst, "org/x", gate=verdict, dry_run=True)
    assert result.dry_run and "README.md" in {f["name"] for f in result.files}
    assert not (dst / "README.md").exists()
    copy = tmp_path / "big"
    shutil.copytree(dst, copy)
    with open(copy / "extra.bin", "wb") as f:  # sparse: no disk is used
        f.truncate(50 * 10**9 + 1)
    with pytest.raises(Exception, match="extra.bin: 50.0 GB is over the hub's 50 GB file limit"):
        publish(copy, "org/x", force_ungated=True, dry_run=True)
    os.remove(copy / "extra.bin")


def test_the_hub_gets_exactly_the_files_the_gate_bound(gated):
    dst, verdict = gated
    (dst / "extra").mkdir()
    (dst / "extra" / ".hidden").write_text("added after the gate")  # not bound by the gate: skipped as hidden
    (dst / "[weird]*.json").write_text("{}")  # bound below: a name that is a pattern matches only itself
    from quantkit.evaluation import model_checksums

    verdict_data = json.loads(verdict.read_text())
    assert "extra/.hidden" not in model_checksums(dst)
    hub = RecordingHub()
    with pytest.raises(PublishRefused, match="was not gated"):
        publish(dst, "org/glm5-int4", gate=verdict, api=hub)
    (dst / "[weird]*.json").unlink()
    result = publish(dst, "org/glm5-int4", gate=verdict, api=hub)
    uploaded = hub.calls[-1][2]["files"]
    assert sorted(uploaded) == sorted(f["name"] for f in result.files)
    assert set(uploaded) == set(verdict_data["candidate_checksums"]) | {"README.md"}  # the bound files and the card


def test_a_verdict_whose_baseline_is_not_the_models_source_is_refused(gated, synthetic, tmp_path):
    """`gate RUN RUN` passes at delta 0; the card would then say the release was tested against the original."""
    dst, verdict = gated
    cand = tmp_path / "cand"
    gate(cand, cand, suite=tmp_path / "suite.yaml", report_dir=tmp_path / "self")
    with pytest.raises(PublishRefused, match="baseline run evaluated .*not .*converted from"):
        publish(dst, "file://" + str(tmp_path / "out-self"), gate=tmp_path / "self" / "verdict.json")
    # a baseline of another model: the DeepSeek-V3 synthetic checkpoint's fingerprint
    from quantkit.checkpoint.reader import open_checkpoint

    base = json.loads((tmp_path / "base" / "run.json").read_text())
    base["model_fingerprint"] = open_checkpoint(synthetic["deepseek_v3"]).fingerprint()
    (tmp_path / "base" / "run.json").write_text(json.dumps(base))
    gate(tmp_path / "base", cand, suite=tmp_path / "suite.yaml", report_dir=tmp_path / "other")
    with pytest.raises(PublishRefused, match="not .*the model this checkpoint was converted from"):
        publish(dst, "file://" + str(tmp_path / "out-other"), gate=tmp_path / "other" / "verdict.json")
    assert not (tmp_path / "out-self").exists() and not (tmp_path / "out-other").exists()


def test_a_candidate_run_copied_from_the_baseline_with_the_models_checksums_is_refused(gated, tmp_path):
    """A forged candidate: the baseline's run folder copied, DST's checksums written into its run.json, no
    evaluation of DST at all. It gates (the same answers pass), and publish refuses it: the run records the source's
    checkpoint, not DST's."""
    from quantkit.evaluation import model_checksums

    dst, _ = gated
    forged = tmp_path / "forged"
    shutil.copytree(tmp_path / "base", forged)
    meta = json.loads((forged / "run.json").read_text())
    meta["model_checksums"] = model_checksums(dst)
    (forged / "run.json").write_text(json.dumps(meta))
    gate(tmp_path / "base", forged, suite=tmp_path / "suite.yaml", report_dir=tmp_path / "forged-gate")
    with pytest.raises(PublishRefused, match="candidate run does not record an evaluation of this checkpoint"):
        publish(dst, "file://" + str(tmp_path / "out"), gate=tmp_path / "forged-gate" / "verdict.json")
    assert not (tmp_path / "out").exists()


def _bind(base, cand, dst):
    """The baseline run records the model DST was converted from, the candidate run DST itself (its fingerprint and
    checksums): what an honest evaluation of each writes."""
    from quantkit.checkpoint.manifest import load_manifest
    from quantkit.checkpoint.reader import open_checkpoint
    from quantkit.evaluation import model_checksums

    for run, fingerprint in ((base, load_manifest(dst).source_fingerprint), (cand, open_checkpoint(dst).fingerprint())):
        meta = json.loads((run / "run.json").read_text())
        meta["model_fingerprint"] = fingerprint
        if run == cand:
            meta["model_checksums"] = model_checksums(dst)
        (run / "run.json").write_text(json.dumps(meta))


def _logprob_runs(folder, dst, candidate_logprobs):
    """A baseline run of the model DST was converted from and a candidate run recording DST, both scoring 200
    ARC-Easy items by log-likelihood, gated; the candidate's log-probabilities as given."""
    outcomes = {"arc_easy": [1, 0, 1, 1] * 50}
    base_lp = {"arc_easy": [[-1.0 - i / 1000, -2.0] for i in range(200)]}
    base = write_run(folder / "base", outcomes, logprobs=base_lp)
    cand = write_run(folder / "cand", outcomes, logprobs={"arc_easy": candidate_logprobs(base_lp["arc_easy"])})
    _bind(base, cand, dst)
    gate(base, cand, suite=suite(folder, ["arc_easy"], margin=5.0), report_dir=folder / "gate")
    return folder / "gate" / "verdict.json"


def test_a_candidate_run_with_the_baselines_answers_to_the_last_digit_is_refused_even_with_dsts_fingerprint(
        synthetic, tmp_path):
    """The whole forgery: the baseline's run copied with DST's checksums and fingerprint written in. Its answers are
    the baseline's to the last digit on every item, which no evaluation of a converted model gives; an evaluation of
    DST, whose log-probabilities differ in the last digits, publishes."""
    dst = tmp_path / "int4"
    convert(synthetic["glm_moe_dsa"], dst, "glm5-int4-experts-g32", device="cpu")
    copied = _logprob_runs(tmp_path / "copied", dst, lambda lp: [list(pair) for pair in lp])
    with pytest.raises(PublishRefused, match="baseline run's answers on every item .log-probabilities to the last"):
        publish(dst, "file://" + str(tmp_path / "out-copied"), gate=copied)
    assert not (tmp_path / "out-copied").exists()
    evaluated = _logprob_runs(tmp_path / "evaluated", dst, lambda lp: [[a * 1.0001, b] for a, b in lp])
    publish(dst, "file://" + str(tmp_path / "out-evaluated"), gate=evaluated)
    assert (tmp_path / "out-evaluated" / "config.json").is_file()


def _generation_runs(folder, dst, base_texts, cand_texts, margin=5.0):
    """_logprob_runs for a generative suite: GSM8K answers with the texts given, all correct, gated."""
    runs = []
    for name, texts in (("base", base_texts), ("cand", cand_texts)):
        run = write_generations(folder / name, [40] * len(texts))
        rows = [json.loads(line) for line in (run / "samples" / "gsm8k.jsonl").read_text().splitlines()]
        (run / "samples" / "gsm8k.jsonl").write_text(
            "".join(json.dumps(dict(row, generation=text)) + "\n" for row, text in zip(rows, texts, strict=True)))
        runs.append(run)
    _bind(*runs, dst)
    gate(*runs, suite=suite(folder, ["gsm8k"], margin=margin), report_dir=folder / "gate")
    return folder / "gate" / "verdict.json"


def test_a_generative_candidate_run_with_the_baselines_text_on_every_item_is_refused(synthetic, tmp_path):
    """A generative suite has no log-probabilities to compare: a copied run gives the baseline's text word for word
    on every answer, COPIED_GENERATIONS or more, which no converted model does; one answer that parts, or fewer
    answers than that, publish."""
    from quantkit.release.publish import COPIED_GENERATIONS

    dst = tmp_path / "int4"
    convert(synthetic["glm_moe_dsa"], dst, "glm5-int4-experts-g32", device="cpu")
    texts = [f"{i} apples and {i + 1} pears make {2 * i + 1} fruits. #### {2 * i + 1}" for i in range(200)]
    copied = _generation_runs(tmp_path / "copied", dst, texts, texts)
    with pytest.raises(PublishRefused, match="generated text word for word"):
        publish(dst, "file://" + str(tmp_path / "out-copied"), gate=copied)
    parted = _generation_runs(tmp_path / "parted", dst, texts, texts[:-1] + [texts[-1].replace("make", "are")])
    publish(dst, "file://" + str(tmp_path / "out-parted"), gate=parted)
    few = texts[:COPIED_GENERATIONS - 1]
    few = _generation_runs(tmp_path / "few", dst, few, few, margin=50.0)
    publish(dst, "file://" + str(tmp_path / "out-few"), gate=few)
    assert (tmp_path / "out-parted" / "config.json").is_file() and (tmp_path / "out-few" / "config.json").is_file()
    assert not (tmp_path / "out-copied").exists()


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
def gated_llama(llama_int4, tmp_path):
    """DST with a passing verdict whose checksums are DST's files now."""

    return llama_int4, passing_verdict(llama_int4, tmp_path)


@pytest.mark.parametrize("change, name", [
    (lambda d: (d / "config.json").write_text((d / "config.json").read_text().replace("llama", "llama ")), "config.json"),
    (lambda d: (d / "modeling_evil.py").write_text("import os\n"), "modeling_evil.py"),
    (lambda d: (d / "tokenizer_config.json").write_text("{}"), "tokenizer_config.json"),
])
def test_publish_ships_only_files_the_gate_saw(gated_llama, tmp_path, change, name):
    dst, verdict = gated_llama
    change(dst)
    r = quantkit("publish", dst, "--repo", f"file://{tmp_path / 'out'}", "--gate", verdict)
    one_line_error(r, name)
    assert not (tmp_path / "out").exists()


def test_a_forged_verdict_is_refused(gated_llama, tmp_path):
    dst, verdict = gated_llama
    forged = json.loads(verdict.read_text())
    del forged["tasks"][0]["margin"]
    verdict.write_text(json.dumps(forged))
    r = quantkit("publish", dst, "--repo", f"file://{tmp_path / 'out'}", "--gate", verdict)
    one_line_error(r, "not a gate verdict (tasks.0.margin: Field required)")
    r = quantkit("publish", dst, "--repo", "not a repo id", "--force-ungated")
    one_line_error(r, "invalid repo id")


def test_publish_gates_again_instead_of_trusting_the_verdicts_flag(gated_llama, tmp_path):
    """A failing verdict edited to say pass, or a candidate run changed after the gate, gives another verdict when
    publish gates the runs the verdict names again: refused, nothing shipped."""
    dst, verdict = gated_llama
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


def test_a_link_inside_dst_is_not_published(llama_int4, tmp_path):
    outside = tmp_path / "private.key"
    outside.write_text("secret")
    (llama_int4 / "extra.txt").symlink_to(outside)
    r = quantkit("publish", llama_int4, "--repo", f"file://{tmp_path / 'out'}", "--force-ungated", "--dry-run")
    one_line_error(r, "extra.txt", "outside the model's folder")


def test_card_fields_are_validated_and_escaped(llama_pair, tmp_path):
    _, cand = llama_pair
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


def test_publish_to_a_crowded_folder_refuses_at_the_first_foreign_entry(llama_pair, tmp_path, monkeypatch):
    _, cand = llama_pair
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
