"""Smoke: a small model loads into its transformers class and a forward pass gives finite logits; a large one is
checked against the class on the meta device."""

from __future__ import annotations

from quantkit.checkpoint.reader import Checkpoint
from quantkit.errors import QuantkitError
from quantkit.verify.findings import Finding

SMOKE_MAX_PARAMS = 2_000_000_000


def smoke_findings(ckpt: Checkpoint, checked: dict[str, int]) -> list[Finding]:
    import torch

    from quantkit.checkpoint.inspection import inspect_checkpoint
    from quantkit.modeling import load_model, meta_structure_mismatches

    try:
        if inspect_checkpoint(ckpt.root).total_params > SMOKE_MAX_PARAMS:
            problems = meta_structure_mismatches(ckpt)
            checked["meta structure check"] = 1
            return [Finding("smoke", "fits the model class (meta device)", p) for p in problems[:10]]
        model = load_model(ckpt.root)
        ids = torch.arange(16).unsqueeze(0) % (ckpt.config.vocab_size or 16)
        with torch.no_grad():
            logits = model(ids).logits
        checked["forward pass"] = 1
        if not bool(torch.isfinite(logits).all()):
            return [Finding("smoke", "a forward pass gives finite logits", "NaN or Inf in logits")]
    except QuantkitError as exc:
        return [Finding("smoke", "loads into its transformers model", exc.message, exc.tensor, exc.file)]
    except Exception as exc:  # noqa: BLE001 - any failure to build or run the model is the finding
        return [Finding("smoke", "loads into its transformers model", f"{type(exc).__name__}: {exc}".splitlines()[0])]
    return []
