"""A wheel built from the repository works on its own: recipes and suites inside, the command installed."""

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_a_built_wheel_converts_with_a_built_in_recipe(synthetic, tmp_path):
    # Built from a copy: setuptools leaves build/ behind, and a stale build/lib would leak into later wheels.
    source = tmp_path / "src"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "__pycache__",
                                                                 ".pytest_cache", "runs", "quantkit-demo"))
    built = tmp_path / "dist"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
                            "-v", "-w", str(built)], check=True, capture_output=True, text=True)
    # setuptools warns when a data folder is importable but not declared: the install must say nothing of the kind
    assert "absent from the `packages` configuration" not in build.stdout + build.stderr
    wheel = next(built.glob("quantkit-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "quantkit/recipes/glm5-int4-experts-g32.yaml" in names and "quantkit/suites/release.yaml" in names
    for data in ("calibration.jsonl", "evaldata/arc_easy/test.jsonl", "evaldata/gsm8k/test.jsonl"):
        assert f"quantkit/data/{data}" in names
    assert "cli.py" not in names  # no bare top-level module

    # A fresh environment: the wheel in its own site-packages, the dependencies borrowed read-only
    # from this one (a .pth path line: no editable finder of the checkout comes along).
    fresh = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(fresh)], check=True)
    site = Path(subprocess.run([str(fresh / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site),
                    str(wheel)], check=True, capture_output=True)
    (site / "borrowed-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run = subprocess.run([str(fresh / "bin" / "python"), "-m", "quantkit", "convert", str(synthetic["glm_moe_dsa"]),
                          str(tmp_path / "out"), "--recipe", "glm5-int4-experts-g32", "--device", "cpu"],
                         cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    where = subprocess.run([str(fresh / "bin" / "python"), "-c", "import quantkit.packaged as p; print(p.recipes_dir())"],
                           cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where).is_relative_to(site)


def test_a_fresh_clone_with_nothing_beside_it_collects_every_test_without_skipping_a_module(tmp_path):
    """A newcomer's checkout has no ../shared: the evaluation tests take the test sets quantkit ships, so every module
    that reads benchmark data is collected in full, none skipped for want of a folder beside the repository."""
    source = Path(__file__).resolve().parents[1]
    clone = tmp_path / "alone" / "quantkit"  # tmp_path/alone holds nothing else: no shared/ beside the clone
    subprocess.run(["git", "clone", "-q", str(source), str(clone)], check=True)
    modules = ["tests/test_evaluation.py", "tests/test_behaviour.py", "tests/test_engines.py", "tests/test_release.py",
               "tests/test_shared_context.py"]

    def collected(root: Path) -> str:
        run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-rs", "-p", "no:cacheprovider",
                              *modules], cwd=root, capture_output=True, text=True, env={**os.environ,
                              "PYTHONPATH": str(root)})
        assert run.returncode == 0 and "SKIPPED" not in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]
        return run.stdout.strip().splitlines()[-1].split(" in ")[0]  # "40 tests collected"

    assert not (clone.parent.parent / "shared").exists()
    assert collected(clone) == collected(source)
