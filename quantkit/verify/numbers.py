"""Numbers: each output tensor decoded against the decoded source it was made from (``--source``, which must be the
source the manifest records), one module at a time."""

from __future__ import annotations

from quantkit.checkpoint.manifest import load_manifest
from quantkit.checkpoint.reader import Checkpoint, TensorReader
from quantkit.verify.findings import Finding, TensorError, tensor_error

# Relative error ||w' - w|| / ||w|| above which a quantized tensor is broken, not just INT4:
# healthy symmetric INT4 RTN sits near 0.1 (g32) to 0.13 (g128) on real and Gaussian weights;
# a scale off by 2x gives ~1, a scrambled pack more than 1.
MAX_RELATIVE_ERROR = 0.3
KV_SCALES = (".k_scale", ".v_scale")


def not_the_source(src: Checkpoint, dst: Checkpoint) -> Finding | None:
    """Numbers compared against anything but the checkpoint DST was made from prove nothing (DST against itself
    always passes): ``--source`` must be DST's source as its manifest recorded it (fingerprint of config and
    headers)."""
    rule = "--source is the checkpoint the manifest says DST was converted from"
    if src.root.resolve() == dst.root.resolve():
        return Finding("structure", rule, "--source is DST itself", file=str(src.root))
    manifest = load_manifest(dst.root)
    if manifest is not None and manifest.source_fingerprint != src.fingerprint():
        return Finding("structure", rule, f"its config and headers differ from those of the recorded source "
                       f"({manifest.source_path})", file=str(src.root))
    return None


def kv_scale_values(ckpt: Checkpoint, checked: dict[str, int]) -> list[Finding]:
    """Every FP8 KV-cache scale finite and above zero: the engine divides by it when it writes the cache and
    multiplies by it when it reads, so a NaN, zero, negative or infinite scale garbles every token it caches."""
    names = sorted(n for n in ckpt.tensors if n.endswith(KV_SCALES))
    if not names:
        return []  # and torch stays unimported: reading commands start fast (tests/test_startup.py)
    import torch

    found = []
    with TensorReader(ckpt) as reader:
        for name in names:
            value = reader.read(name).float()
            if not bool((torch.isfinite(value) & (value > 0)).all()):
                bad = value[~(torch.isfinite(value) & (value > 0))].flatten()[0].item()
                found.append(Finding("numbers", "KV-cache scales are finite and above zero", f"holds {bad}", name,
                                     ckpt.tensors[name].file))
    checked["kv scales"] = len(names)
    return found


def _param_key(name: str) -> str:
    module, _, param = name.rpartition(".")
    return module if param in ("weight", "weight_packed", "weight_scale", "weight_shape", "weight_scale_inv",
                               "weight_zero_point") else name


def same_modules(src: Checkpoint, dst: Checkpoint) -> list[Finding]:
    a, b = {_param_key(n) for n in src.tensors}, {_param_key(n) for n in dst.tensors}
    found = [Finding("structure", "every source tensor is in the "
                                  "output", "missing", name) for name in sorted(a - b)[:20]]
    added = {n for n in b - a if n.endswith(KV_SCALES)}  # calibrate-kv's additions are expected
    found += [Finding("structure", "the output holds nothing the source "
                                   "lacks", "stray", name) for name in sorted(b - a - added)[:20]]
    return found


def numbers(src: Checkpoint, dst: Checkpoint, findings: list[Finding], checked: dict[str, int]) -> list[TensorError]:
    import torch

    from quantkit.modeling import read_weight

    errors: list[TensorError] = []
    src_modules = {n.rpartition(".")[0] for n in src.tensors if n.endswith((".weight", ".weight_packed"))}
    with TensorReader(src) as rs, TensorReader(dst) as rd:
        for module in sorted(src_modules):
            if f"{module}.weight" not in dst.tensors and f"{module}.weight_packed" not in dst.tensors:
                continue
            a, b = read_weight(src, rs, module), read_weight(dst, rd, module)
            name = f"{module}.weight_packed" if f"{module}.weight_packed" in dst.tensors else f"{module}.weight"
            file = dst.tensors[name].file
            if a.shape != b.shape:
                findings.append(Finding("numbers", "same shape as the source", f"{list(b.shape)} vs "
                        f"{list(a.shape)}", name, file))
                continue
            if not bool(torch.isfinite(b).all()):
                findings.append(Finding("numbers", "no NaN or Inf", "non-finite values", name, file))
                continue
            checked["tensors compared"] += 1
            a, b = a.float(), b.float()
            if torch.equal(a, b):
                continue
            source_weight = src.tensors.get(f"{module}.weight")
            was_fp8 = source_weight is not None and source_weight.dtype.startswith("F8")
            newly_fp8 = dst.tensors[name].dtype.startswith("F8") and (not was_fp8 or _rescaled(src, dst, module))
            quantized = name.endswith("weight_packed") or newly_fp8
            error = tensor_error(name, a, b)
            rel, snr = error.relative_error, error.snr_db
            errors.append(error)
            if not quantized:
                findings.append(Finding("numbers", "tensors no group targets equal the (dequantized) source",
                                        f"differs: relative error {rel:.3g}", name, file))
            elif rel > MAX_RELATIVE_ERROR:
                findings.append(Finding("numbers", f"relative error <= {MAX_RELATIVE_ERROR} (healthy INT4 is ~0.1)",
                                        f"relative error {rel:.3g}, SNR {snr:.1f} dB: a wrong scale or a scrambled "
                                        f"pack", name, file))
    return sorted(errors, key=lambda e: -e.relative_error)


def _scale_shape(ckpt: Checkpoint, module: str) -> tuple[int, ...] | None:
    name = next((n for n in (f"{module}.weight_scale", f"{module}.weight_scale_inv") if n in ckpt.tensors), None)
    return tuple(ckpt.tensors[name].shape) if name else None


def _rescaled(src: Checkpoint, dst: Checkpoint, module: str) -> bool:
    """An FP8 weight quantized again in another FP8 scheme (block-FP8 to a scale per row): its own rounding, not a
    copy of the source's."""
    return _scale_shape(src, module) != _scale_shape(dst, module)
