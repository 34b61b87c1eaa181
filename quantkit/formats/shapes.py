"""What the stored formats' tensors measure: arithmetic only, so planning runs without torch."""

from __future__ import annotations

import math


def check_group_size(in_features: int, group_size: int) -> str | None:
    """Why INT4 groups of ``group_size`` cannot pack rows of ``in_features``, or None."""
    if in_features % group_size:
        return f"group size {group_size} does not divide in_features {in_features}"
    if in_features % 8:
        return f"in_features {in_features} is not a multiple of 8 (INT4 packs 8 per int32)"
    return None


def expected_scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """Block-FP8's ``weight_scale_inv`` shape: one scale per block, edge blocks partial."""
    return (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
