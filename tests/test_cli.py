"""The CLI: parses, calls one function, prints; JSON for machines; fast help."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from typer.testing import CliRunner

from quantkit.cli import app
from helpers import one_line_error, quantkit
import shutil
from helpers import add_word_tokenizer, gptq_recipe
from quantkit.examples.demo import DATA

runner = CliRunner()


def test_help_is_fast_and_imports_no_heavy_library():
    t0 = time.perf_counter()
    code = "import sys; from quantkit import cli; cli.app(['--help'], standalone_mode=False); print(sorted(m for m in ('torch', 'transformers', 'compressed_tensors') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
    assert time.perf_counter() - t0 < 10


def test_the_checkouts_cli_py_runs_the_same_app_from_this_folders_package(tmp_path):
    """``python cli.py`` from a checkout, with no installed quantkit to fall back on: the app, every command, this
    folder's code."""
    root = Path(__file__).resolve().parents[1]
    code = ("import runpy, sys; sys.argv = ['cli.py', '--help']; sys.modules.pop('quantkit', None); "
            f"runpy.run_path({str(root / 'cli.py')!r}, run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": "", "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    listed = {name for name in re.findall(r"^│ ([a-z][a-z-]*) ", done.stdout, flags=re.M)}
    assert listed == {c.name for c in app.registered_commands}
    where = subprocess.run([sys.executable, str(root / "cli.py"), "--version"], capture_output=True, text=True,
                           cwd=tmp_path)
    assert where.returncode == 0 and where.stdout.startswith("quantkit "), where.stderr


def test_convert_and_inspect_json(synthetic, tmp_path):
    dst = tmp_path / "out"
    r = runner.invoke(app, ["convert", str(synthetic["deepseek_v3"]), str(dst), "-r", "deepseek-v3-int4-experts-g32", "--json"])
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout)
    assert result["shards_written"] == result["shards_total"] >= 1
    assert result["tensors_by_kind"]["int4"] == 3 * 8 * 3
    assert set(result["stage_seconds"]) == {"read", "decode", "quantize", "pack", "write"}
    r = runner.invoke(app, ["inspect", str(dst), "--json"])
    report = json.loads(r.stdout)
    assert report["family"] == "deepseek_v3" and report["components"]["routed_experts"]["encodings"] == {"int4 g32": 2 * 8 * 3 * 128 * 256}  # MTP experts count as mtp


def test_human_output(synthetic, tmp_path):
    r = runner.invoke(app, ["inspect", str(synthetic["llama"])])
    assert r.exit_code == 0 and "dense_mlp" in r.output and "GiB" in r.output and "GB)" in r.output
    r = runner.invoke(app, ["convert", str(synthetic["llama"]), str(tmp_path / "o"), "-r", "dense-w4a16-g128"])
    assert r.exit_code == 0 and "done" in r.output


def test_synth_writes_a_checkpoint(tmp_path):
    r = runner.invoke(app, ["synth", "deepseek_v3", str(tmp_path / "s"), "--experts", "4", "--layers", "2"])
    assert r.exit_code == 0, r.output
    config = json.loads((tmp_path / "s" / "config.json").read_text())
    assert config["n_routed_experts"] == 4 and config["quantization_config"]["quant_method"] == "fp8"
    r = runner.invoke(app, ["synth", "nope", str(tmp_path / "x")])
    assert r.exit_code == 1 and "unknown synthetic family" in r.output


def test_publish_and_release_errors_are_one_line_with_a_nonzero_exit(synthetic, tmp_path):
    from quantkit.convert import convert

    dst = tmp_path / "int4"
    convert(synthetic["llama"], dst, "dense-w4a16-g128", device="cpu")
    result = runner.invoke(app, ["publish", str(dst), "--repo", f"file://{tmp_path / 'out'}"])
    assert result.exit_code == 1
    assert "no gate verdict given" in result.output and str(dst) in result.output
    assert not (tmp_path / "out").exists()
    result = runner.invoke(app, ["publish", str(dst), "--repo", "org/x", "--force-ungated", "--dry-run", "--json"])
    assert result.exit_code == 0 and json.loads(result.output)["dry_run"] is True
    config = tmp_path / "r.yaml"
    config.write_text(f"source: {tmp_path / 'nowhere'}\nrecipe: dense-w4a16-g128\npublish: {{repo: org/x}}\n")
    result = runner.invoke(app, ["release", str(config)])
    assert result.exit_code == 1
    assert "release stopped at stage plan" in result.output and "--resume" in result.output


def test_evals_options_are_named_as_the_library_names_its_settings():
    """A user who reads ``EvalSettings`` (the release config's eval section) finds each field under its own name on
    the command line: --engine-timeout set ``health_timeout`` until the two names drifted apart."""
    import typer.main

    from quantkit.settings import EvalSettings

    command = typer.main.get_command(app).commands["eval"]
    options = {p.name: p.opts for p in command.params if p.param_type_name == "option"}
    library = set(EvalSettings.model_fields) | {"out", "order", "fraction"}
    cli_only = {"out_dir": "--out", "json_out": "--json", "tasks": "--tasks", "data_dir": "--data-dir"}
    for name, opts in options.items():
        spelled = cli_only.get(name, "--" + name.replace("_", "-"))
        assert spelled in opts, (name, opts)
        assert name in library or name in cli_only, name
    assert "--health-timeout" in options["health_timeout"] and len(options) >= 19


def test_plans_options_are_named_as_the_library_names_its_settings():
    import typer.main

    from quantkit.settings import PlanSettings

    command = typer.main.get_command(app).commands["plan"]
    options = {p.name: p.opts for p in command.params if p.param_type_name == "option"}
    cli_only = {"recipe": "--recipe", "deploy": "--deploy", "chart": "--chart", "json_out": "--json",
                "prefill_recipe": "--prefill-recipe"}
    for name, opts in options.items():
        assert cli_only.get(name, "--" + name.replace("_", "-")) in opts, (name, opts)
        assert name in PlanSettings.model_fields or name in cli_only, name
    assert set(PlanSettings.model_fields) <= set(options)


def test_converts_help_names_every_calibrated_algorithm_the_registry_holds():
    from quantkit.commands.common import ALGORITHM_NAMES
    from quantkit.convert.calibrated import QUANTIZERS

    assert set(ALGORITHM_NAMES) == set(QUANTIZERS)
    shown = runner.invoke(app, ["convert", "--help"], terminal_width=200).output
    for name in ALGORITHM_NAMES.values():
        assert name in shown, name


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


def test_markup_and_control_characters_in_user_text_are_shown_not_obeyed(tmp_path):
    for name in ("x[/x]", "y[bold red]z", "esc\x1b[2Jname"):
        r = quantkit("inspect", tmp_path / name)
        line = one_line_error(r, "not a checkpoint folder")
        assert name.replace("\x1b", "\\x1b") in line and "\x1b" not in r.output and "MarkupError" not in r.output


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
