"""Gate reports: a verdict JSON, Markdown, and a self-contained HTML page with a forest plot."""

from __future__ import annotations

import base64
import html
from pathlib import Path

from quantkit.checkpoint.writer import write_bytes_atomic


def forest_plot(report, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = report.tasks
    fig, ax = plt.subplots(figsize=(6.5, 0.6 * len(tasks) + 1.4))
    for y, t in enumerate(reversed(tasks)):
        color = "#2a9d4b" if t.passed else "#c0392b"
        ax.plot([t.low, t.high], [y, y], color=color, lw=2)
        ax.plot([t.delta], [y], "o", color=color)
        ax.plot([-t.margin], [y], "|", color="#555", ms=14)
    ax.axvline(0, color="#999", lw=1)
    ax.set_yticks(range(len(tasks)), [f"{t.task} (n={t.n})" for t in reversed(tasks)])
    ax.set_xlabel(f"candidate - baseline, accuracy points ({report.confidence:.1%} CI; | = -margin)")
    ax.set_title("PASS" if report.passed else "FAIL")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def markdown(report) -> str:
    lines = [
        f"# Release gate: {'PASS' if report.passed else 'FAIL'}",
        "",
        f"Baseline `{report.baseline}`, candidate `{report.candidate}`; intervals at {report.confidence:.2%} "
        f"per task ({report.correction}).",
        "",
        "| task | n | baseline | candidate | delta | interval | margin | verdict | flips | certifiable margin |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in report.tasks:
        lines.append(
            f"| {t.task} | {t.n} | {t.baseline:.1f} | {t.candidate:.1f} | {t.delta:+.2f} | [{t.low:+.2f}, {t.high:+.2f}] | "
            f"-{t.margin:g} | {'pass' if t.passed else 'FAIL'} | {t.flip_rate:.1f} % | {t.certifiable_margin:.2f} "
            f"({t.items_for_margin:,} items for {t.margin:g}) |"
        )
    for t in report.tasks:
        for s in t.signals:
            interval = "" if s.low is None else f" [{s.low:+.3f}, {s.high:+.3f}]"
            lines.append(f"- {t.task}: {s.name} {s.estimate:+.3f}{interval} {s.unit}")
    lines.append("")
    lines.append(f"Decided by: {', '.join(report.tasks[0].decided_by) if report.tasks else '-'}.")
    if report.allowed_differences:
        lines.append(f"The candidate also differs, as the suite allows, in: {'; '.join(report.allowed_differences)}.")
    return "\n".join(lines) + "\n"


def write_gate_report(report, folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    verdict = folder / "verdict.json"
    write_bytes_atomic(verdict, (report.model_dump_json(indent=2) + "\n").encode())
    md = folder / "report.md"
    write_bytes_atomic(md, markdown(report).encode())
    png = forest_plot(report, folder / "forest.png")
    image = base64.b64encode(png.read_bytes()).decode()
    page = folder / "report.html"
    body = html.escape(markdown(report))
    write_bytes_atomic(page, (
        "<!doctype html><html><head><meta charset='utf-8'><title>quantkit gate</title></head><body>"
        f"<img alt='forest plot' src='data:image/png;base64,{image}'><pre>{body}</pre></body></html>\n"
    ).encode())
    return [verdict, md, png, page]
