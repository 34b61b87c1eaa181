"""eval (hf engine) on the real SmolLM2 over local benchmark data, feeding the gate."""

import json
from pathlib import Path

import pytest
import torch
from helpers import evaldata, one_line_error, quantkit

from quantkit.errors import QuantkitError
from quantkit.evaluation import evaluate
from quantkit.kv.calibrate import calibrate_kv
from quantkit.release.gate import CannotCompare, gate
from helpers import gptq_recipe
from quantkit.convert import convert
from quantkit.convert.calibrated.walk import LEGACY_WORK_DIR, WORK_DIR
from helpers import evaluate_small

pytestmark = pytest.mark.slow  # real-model end-to-end: `pytest -m "not slow"` skips it in the edit loop

DATA = evaldata("arc_easy", "gsm8k")


@pytest.fixture(scope="module")
def arc_run(smollm2_bf16, tmp_path_factory):
    run = tmp_path_factory.mktemp("runs") / "bf16"
    return evaluate(smollm2_bf16, tasks=["arc_easy", "gsm8k"], data_dir=DATA, limit=6, out=run, batch_size=8)


def test_run_directory_holds_items_scores_and_provenance(arc_run):
    run = Path(arc_run.run_dir)
    arc = [json.loads(line) for line in (run / "samples" / "arc_easy.jsonl").read_text().splitlines()]
    assert [r["item_id"] for r in arc] == [f"arc_easy-{i}" for i in range(6)]
    assert all(len(r["choice_logprobs"]) >= 3 and r["correct"] in (0, 1) and r["prompt_hash"] for r in arc)
    assert sum(r["correct"] for r in arc) == round(arc_run.scores["arc_easy"]["score"] * 6 / 100)
    gsm = [json.loads(line) for line in (run / "samples" / "gsm8k.jsonl").read_text().splitlines()]
    assert len(gsm) == 6 and all("response" in r for r in gsm)
    meta = json.loads((run / "run.json").read_text())
    assert set(meta) >= {"model_checksums", "engine", "lm_eval_version", "tasks", "chat_template_sha256", "seeds"}
    assert meta["tasks"]["arc_easy"]["num_fewshot"] == 0 and len(meta["tasks"]["arc_easy"]["config_sha256"]) == 64
    assert json.loads((run / "results.json").read_text())["arc_easy"]["n"] == 6


def test_rerun_resumes_from_cached_requests(arc_run, smollm2_bf16):
    run = Path(arc_run.run_dir)
    cache = run / "cache" / "requests.jsonl"
    rows = [json.loads(line) for line in cache.read_text().splitlines()]
    assert len(rows) >= 6 * 4 + 6  # every loglikelihood and generation request of the first run, as JSON
    again = evaluate(smollm2_bf16, tasks=["arc_easy", "gsm8k"], data_dir=DATA, limit=6, out=run, batch_size=8)
    assert again.scores == arc_run.scores
    assert len(cache.read_text().splitlines()) == len(rows)  # nothing was asked of the model again


class Poison:
    """Unpickling this runs code: it leaves a file behind."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path(self.marker).touch, ())


def test_a_poisoned_run_directory_runs_no_code(arc_run, smollm2_bf16, tmp_path):
    """lm-eval's own cache is a SqliteDict of pickles and its task folder may hold Python: a shared
    RUN_DIR must be data only. Both are planted; the run must neither execute them nor read them."""
    import shutil

    from sqlitedict import SqliteDict

    run = tmp_path / "shared-run"
    shutil.copytree(arc_run.run_dir, run)
    marker = tmp_path / "pwned"
    db = SqliteDict(str(run / "cache" / "requests_rank0.db"), autocommit=True)
    for key in [json.loads(line)["key"] for line in (run / "cache" / "requests.jsonl").read_text().splitlines()]:
        db[key] = Poison(marker)
    db.close()
    (run / "tasks").mkdir()
    (run / "tasks" / "evil.py").write_text(f"from pathlib import Path\nPath({str(marker)!r}).touch()\n")
    (run / "tasks" / "quantkit_arc_easy.yaml").write_text("task: quantkit_arc_easy\nprocess_docs: !function evil.run\n")
    (run / "cache" / "requests.jsonl").unlink()
    again = evaluate(smollm2_bf16, tasks=["arc_easy", "gsm8k"], data_dir=DATA, limit=6, out=run, batch_size=8)
    assert again.scores == arc_run.scores and not marker.exists()


def test_identical_runs_gate_and_other_settings_do_not(arc_run, smollm2_bf16, tmp_path):
    same = evaluate(smollm2_bf16, tasks=["arc_easy", "gsm8k"], data_dir=DATA, limit=6, out=tmp_path / "same")
    suite = tmp_path / "suite.yaml"
    # Six identical items certify a wide margin only: two-sided 97.5 % (Bonferroni over two tasks) reaches 45.6 points.
    suite.write_text("correction: bonferroni\ntasks:\n  arc_easy: {margin: 50.0}\n  gsm8k: {margin: 50.0}\n")
    report = gate(arc_run.run_dir, same.run_dir, suite=suite)
    assert report.passed and all(t.delta == 0 for t in report.tasks)
    narrow = suite.with_name("narrow.yaml")
    narrow.write_text("correction: bonferroni\ntasks:\n  arc_easy: {margin: 1.0}\n  gsm8k: {margin: 1.0}\n")
    assert not gate(arc_run.run_dir, same.run_dir, suite=narrow).passed  # 0 of 6 flipped certifies no 1-point margin
    calibrated = calibrate_kv(smollm2_bf16, out=tmp_path / "kv", samples=4, seq_len=128)
    fp8 = evaluate(calibrated.out, tasks=["arc_easy", "gsm8k"], data_dir=DATA, limit=6, out=tmp_path / "fp8",
                   kv_cache_dtype="fp8_e4m3")
    assert fp8.scores["arc_easy"]["n"] == 6
    with pytest.raises(CannotCompare, match="kv_cache_dtype"):
        gate(arc_run.run_dir, fp8.run_dir, suite=suite)


def test_the_dtype_computed_in_is_recorded_and_runs_in_different_ones_are_not_compared(smollm2_bf16, tmp_path):
    from quantkit.compute_dtype import dtype_name, faster_on_cpu

    auto = evaluate(smollm2_bf16, tasks=["arc_easy"], data_dir=DATA, limit=2, out=tmp_path / "auto")
    bf16 = evaluate(smollm2_bf16, tasks=["arc_easy"], data_dir=DATA, limit=2, out=tmp_path / "bf16", dtype="bf16")
    recorded = [json.loads((Path(r.run_dir) / "run.json").read_text())["engine"]["args"]["dtype"] for r in (auto, bf16)]
    assert recorded == [dtype_name(faster_on_cpu(torch.bfloat16)), "bfloat16"]
    if recorded[0] != recorded[1]:  # on a CPU where BF16 is slower, auto computes in FP32 and the gate refuses the pair
        suite = tmp_path / "suite.yaml"
        suite.write_text("tasks:\n  arc_easy: {margin: 50.0}\n")
        with pytest.raises(CannotCompare, match="engine.args.dtype: 'float32' vs 'bfloat16'"):
            gate(auto.run_dir, bf16.run_dir, suite=suite)
    with pytest.raises(QuantkitError, match="unknown compute dtype 'int8'"):
        evaluate(smollm2_bf16, tasks=["arc_easy"], data_dir=DATA, limit=2, out=tmp_path / "x", dtype="int8")
    assert not (tmp_path / "x").exists()


def test_bad_input(smollm2_bf16, arc_run, tmp_path, synthetic):
    with pytest.raises(QuantkitError, match="unknown task hellaswag"):
        evaluate(smollm2_bf16, tasks=["hellaswag"], data_dir=DATA, out=tmp_path / "a")
    with pytest.raises(QuantkitError, match="missing data file for task arc_easy"):
        evaluate(smollm2_bf16, tasks=["arc_easy"], data_dir=tmp_path, out=tmp_path / "b")
    with pytest.raises(QuantkitError, match="no k_scale/v_scale"):
        evaluate(smollm2_bf16, tasks=["arc_easy"], data_dir=DATA, limit=2, out=tmp_path / "c", kv_cache_dtype="fp8_e4m3")
    from quantkit.convert import convert

    other = tmp_path / "int4"
    convert(smollm2_bf16, other, "dense-w4a16-g32", device="cpu")
    with pytest.raises(QuantkitError, match="holds a run with a different model"):
        evaluate(other, tasks=["arc_easy", "gsm8k"], data_dir=DATA, limit=6, out=arc_run.run_dir)


def test_eval_never_writes_its_run_into_the_model(synthetic, tmp_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(synthetic["llama"], model)
    before = sorted(p.name for p in model.rglob("*"))
    for out in (model, model / "runs"):
        result = quantkit("eval", model, "--tasks", "arc_easy", "--limit", 2, "--out", out)
        one_line_error(result, "RUN_DIR must not be the model folder or inside it", code=None)
    assert sorted(p.name for p in model.rglob("*")) == before


def test_a_link_at_a_work_subfolder_is_refused_and_nothing_lands_outside(llama_pair, synthetic, tmp_path):
    base, _ = llama_pair
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
