"""Charts: matplotlib set up once, headless, and each picture written as quantkit writes any file: under a temporary
name in its folder, then renamed over the path, so nothing is written through a link planted there and no half
picture is left under the final name."""

from __future__ import annotations

import io
from contextlib import contextmanager
from pathlib import Path

from quantkit.checkpoint.writer import write_bytes_atomic
from quantkit.errors import QuantkitError

FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf"}


def check_chart_path(path: Path) -> None:
    """Refuse, before any work, a chart path matplotlib would not know how to write."""
    if path.suffix.lower() not in FORMATS:
        raise QuantkitError(f"a chart is written as {', '.join(FORMATS)}, not {path.suffix or 'a name without one'!r}",
                            path)


@contextmanager
def figure(path: Path, **subplots):
    """``(fig, axes)`` of ``plt.subplots(**subplots)``; leaving the block without an error writes the figure to
    ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    check_chart_path(path)
    fig, axes = plt.subplots(**subplots)
    try:
        yield fig, axes
        fig.tight_layout()
        picture = io.BytesIO()
        fig.savefig(picture, format=FORMATS[path.suffix.lower()], dpi=110)
        write_bytes_atomic(path, picture.getvalue())
    finally:
        plt.close(fig)
