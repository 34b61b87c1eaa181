"""Gate reports: a verdict JSON, Markdown, and a self-contained HTML page with a forest plot."""

from __future__ import annotations

import base64
import html
from pathlib import Path

from quantkit.checkpoint.writer import write_bytes_atomic
from quantkit.inert import visible


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


def length_plot(report, path: Path) -> Path | None:
    """Histograms of tokens per answer, baseline and candidate, one panel per generative task."""
    checks = [c for c in report.behaviour if c.check == "output length"]
    if not checks:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(checks), 1, figsize=(6.5, 2.4 * len(checks) + 0.6), squeeze=False)
    for ax, c in zip(axes[:, 0], checks):
        top = max(c.baseline_tokens + c.candidate_tokens + [1])
        bins = range(0, top + max(1, top // 30), max(1, top // 30))
        ax.hist(c.baseline_tokens, bins=bins, alpha=0.55, label=f"baseline (mean {c.baseline:.1f})", color="#4c72b0")
        ax.hist(c.candidate_tokens, bins=bins, alpha=0.55, label=f"candidate (mean {c.candidate:.1f})", color="#dd8452")
        ax.set_title(f"{c.task}: x{c.estimate:.2f} [{c.low:.2f}, {c.high:.2f}] tokens per answer, "
                     f"{'pass' if c.passed else 'FAIL'}", fontsize=9)
        ax.set_xlabel("generated tokens")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def markdown(report) -> str:
    lines = [
        f"# Release gate: {'PASS' if report.passed else 'FAIL'}",
        "",
        f"Baseline `{visible(report.baseline)}`, candidate `{visible(report.candidate)}`; intervals at {report.confidence:.2%} "
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
    if report.behaviour:
        lines += ["", "## Behaviour of generated answers", "",
                  "| task | check | n | baseline | candidate | estimate | interval | limit | verdict |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for c in report.behaviour:
            if c.check == "output length":
                base, cand = f"{c.baseline:.1f} tokens", f"{c.candidate:.1f} tokens"
                estimate = f"x{c.estimate:.3f} (median x{c.median_ratio:.3f})"
                interval, limit = f"[x{c.low:.3f}, x{c.high:.3f}]", f"x{c.limit:.2f}"
            else:
                base, cand = f"{c.baseline:.1f} %", f"{c.candidate:.1f} %"
                estimate, interval, limit = f"{c.estimate:+.2f} pts", f"[{c.low:+.2f}, {c.high:+.2f}]", f"+{c.limit:g} pts"
            lines.append(f"| {c.task} | {c.check} | {c.n} | {base} | {cand} | {estimate} | {interval} | {limit} | "
                         f"{'pass' if c.passed else 'FAIL'} |")
    if report.noise_run:
        lines += ["", f"## Engine noise (A/A: `{visible(report.noise_run)}`)", ""]
        by_task = {t.task: t for t in report.tasks}
        for f in report.noise:
            t = by_task[f.task]
            label = t.engine_noise + ("" if t.passed else (": a regression" if t.regression else ": not a regression"))
            changed = "" if f.changed_answers is None else f", changes {f.changed_answers:.1f} % of its answers"
            lines.append(f"- {f.task}: the baseline's model flips {f.flip_rate:.1f} % of items against itself (delta "
                         f"{f.delta:+.2f}{changed}); the candidate flips {t.flip_rate:.1f} %: {label}")
    lines.append("")
    lines.append(f"Decided by: {', '.join(report.tasks[0].decided_by) if report.tasks else '-'}"
                 f"{' and the behaviour checks' if report.behaviour else ''}.")
    if report.allowed_differences:
        lines.append(f"The candidate also differs, as the suite allows, in: {visible('; '.join(report.allowed_differences))}.")
    return "\n".join(lines) + "\n"


def write_gate_report(report, folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    verdict = folder / "verdict.json"
    write_bytes_atomic(verdict, (report.model_dump_json(indent=2) + "\n").encode())
    md = folder / "report.md"
    write_bytes_atomic(md, markdown(report).encode())
    pngs = [forest_plot(report, folder / "forest.png")]
    lengths = length_plot(report, folder / "lengths.png")
    pngs += [lengths] if lengths is not None else []
    images = "".join(f"<img alt='{p.stem}' src='data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}'>"
                     for p in pngs)
    page = folder / "report.html"
    body = html.escape(markdown(report))
    write_bytes_atomic(page, (
        "<!doctype html><html><head><meta charset='utf-8'><title>quantkit gate</title></head><body>"
        f"{images}<pre>{body}</pre></body></html>\n"
    ).encode())
    return [verdict, md, *pngs, page]
