"""Commands that only read headers and configs start at once: they import no torch, transformers,
compressed-tensors or lm-eval (docs/benchmarks.md has the timings)."""

import json
import shutil
import subprocess
import sys

import pytest

from quantkit.convert import convert

HEAVY = ("torch", "transformers", "compressed_tensors", "lm_eval", "llmcompressor", "datasets")
PROBE = """
import json, sys
sys.argv = ["quantkit"] + json.loads(sys.argv[1])
from quantkit.cli import app
try:
    app()
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "heavy": sorted(m for m in %r if m in sys.modules)}), file=sys.stderr)
""" % (HEAVY,)


def imported(*args: str) -> list[str]:
    """The heavy libraries a fresh interpreter holds after running ``quantkit ARGS`` (which must run to its
    verdict: exit 0, or 1 for a verify that finds something, never an internal error)."""
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps([str(a) for a in args])],
                          capture_output=True, text=True, timeout=120)
    result = json.loads(done.stderr.strip().splitlines()[-1])
    assert result["code"] in (0, None, 1) and "internal error" not in done.stderr, done.stdout + done.stderr
    return result["heavy"]


@pytest.fixture(scope="module")
def checkpoints(synthetic, tmp_path_factory):
    root = tmp_path_factory.mktemp("startup")
    config_only = root / "config-only"
    config_only.mkdir()
    shutil.copy(synthetic["glm_moe_dsa"] / "config.json", config_only)
    convert(synthetic["glm_moe_dsa"], root / "int4", "glm5-int4-experts-g32", device="cpu")
    return {"source": synthetic["glm_moe_dsa"], "config": config_only, "int4": root / "int4", "chart": root / "c.png"}


@pytest.mark.parametrize("args", [
    ["--help"],
    ["inspect", "{source}"],
    ["inspect", "{int4}", "--json"],
    ["plan", "{source}"],
    ["plan", "{source}", "--recipe", "glm5-int4-experts-g32", "--json"],
    ["plan", "{source}", "--recipe", "glm5-int4-experts-g32", "--deploy", "--chart", "{chart}"],  # matplotlib only
    ["plan", "{config}", "--recipe", "glm5-int4-experts-g32", "--tp", "8"],
    ["verify", "{source}", "--no-smoke"],
    ["verify", "{int4}", "--no-smoke", "--engine", "sglang"],
    ["verify", "{int4}", "--no-smoke", "--engine", "vllm", "--json"],
], ids=lambda a: " ".join(a).replace("{", "").replace("}", ""))
def test_reading_commands_import_nothing_heavy(checkpoints, args):
    assert imported(*(a.format(**checkpoints) for a in args)) == []


def test_the_probe_sees_a_heavy_import(checkpoints):
    # verify with --source compares numbers and needs torch: the probe must report it
    assert "torch" in imported("verify", checkpoints["int4"], "--no-smoke", "--source", checkpoints["source"])
