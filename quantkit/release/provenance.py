"""What two evaluation runs' provenance (run.json) differ in, beyond the model they measured.

Below the gate and its behaviour checks, which both compare runs: a candidate against its baseline, an A/A
noise run against the baseline.
"""

from __future__ import annotations

# Provenance fields allowed to differ between baseline and candidate: what is compared and where it was served.
MODEL_FIELDS = ("model", "model_checksums", "model_fingerprint", "created", "server", "probe")


def provenance_differences(a: dict, b: dict, prefix: str = "") -> list[str]:
    """Every field (dotted path) whose value differs, the model's own fields aside; for another engine, its name."""
    diffs = []
    for key in sorted(set(a) | set(b)):
        if not prefix and key in MODEL_FIELDS:
            continue
        va, vb = a.get(key), b.get(key)
        if isinstance(va, dict) and isinstance(vb, dict):
            if va.get("name") != vb.get("name"):  # another engine: its settings differ as a matter of course
                diffs.append(f"{prefix}{key}.name: {va.get('name')!r} vs {vb.get('name')!r}")
                continue
            diffs += provenance_differences(va, vb, f"{prefix}{key}.")
        elif va != vb:
            diffs.append(f"{prefix}{key}: {va!r} vs {vb!r}")
    return diffs
