"""Shared fixtures: synthetic checkpoints built once per session, converted copies on demand."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

RECIPE_FOR = {
    "glm_moe_dsa": "glm5-int4-experts-g32",
    "deepseek_v3": "deepseek-v3-int4-experts-g32",
    "llama": "dense-w4a16-g128",
}


@pytest.fixture(scope="session")
def synthetic(tmp_path_factory):
    """family -> path of a pristine synthetic checkpoint (tests must copy before damaging one)."""
    from quantkit.examples.synthetic import build_synthetic  # torch: only for the tests that build checkpoints

    root = tmp_path_factory.mktemp("synthetic")
    return {family: build_synthetic(family, root / family, seed=1) for family in RECIPE_FOR}


@pytest.fixture(scope="session")
def smollm2_bf16(tmp_path_factory):
    """The real SmolLM2-135M-Instruct as a BF16 safetensors checkpoint (built once per session)."""
    from quantkit.examples.smollm2 import smollm2_checkpoint

    return smollm2_checkpoint(tmp_path_factory.mktemp("smollm2") / "bf16")


@pytest.fixture
def glm_copy(synthetic, tmp_path) -> Path:
    """A private copy of the synthetic GLM-5 checkpoint, free to damage."""
    dst = tmp_path / "src"
    shutil.copytree(synthetic["glm_moe_dsa"], dst)
    return dst


@pytest.fixture
def llama_int4(synthetic, tmp_path) -> Path:
    """The synthetic Llama converted to INT4 (dense-w4a16-g128), free to damage."""
    from quantkit.convert import convert

    dst = tmp_path / "int4"
    convert(synthetic["llama"], dst, "dense-w4a16-g128", device="cpu")
    return dst


@pytest.fixture(scope="session")
def llama_pair(synthetic, tmp_path_factory) -> tuple[Path, Path]:
    """A synthetic Llama with a real (word-level) tokenizer, and its INT4 conversion: a baseline and a candidate
    (shared: copy before damaging either)."""
    from helpers import add_word_tokenizer

    from quantkit.convert import convert

    root = tmp_path_factory.mktemp("llama-pair")
    base = root / "base"
    shutil.copytree(synthetic["llama"], base)
    add_word_tokenizer(base)
    cand = root / "int4"
    convert(base, cand, "dense-w4a16-g128", device="cpu")
    return base, cand


class FileBytes(bytes):
    """A file's bytes, shown as their size and digest: a failed comparison of two folders names the files that
    differ instead of printing megabytes (a CI log keeps only its tail, and a whole tokenizer.json there hid which
    test had failed; pytest's full diff of such values on CI took minutes)."""

    def __repr__(self) -> str:
        return f"<{len(self):,} bytes, sha256 {hashlib.sha256(self).hexdigest()[:16]}>"


def tree_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): FileBytes(p.read_bytes()) for p in sorted(folder.rglob("*")) if p.is_file()}


def shard_of(folder: Path, tensor: str) -> Path:
    """The shard file the index says holds ``tensor``."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return folder / index["weight_map"][tensor]
