"""Gate reports: a verdict JSON, Markdown, and a self-contained HTML page with a forest plot."""

from __future__ import annotations

import base64
import html
from pathlib import Path

from quantkit.charts import figure
from quantkit.checkpoint.writer import write_bytes_atomic
from quantkit.inert import visible


def forest_plot(report, path: Path) -> Path:
    tasks = report.tasks
    with figure(path, figsize=(6.5, 0.6 * len(tasks) + 1.4)) as (_, ax):
        _forest(ax, report)
    return path


def _forest(ax, report) -> None:
    tasks = report.tasks
    for y, t in enumerate(reversed(tasks)):
        color = "#2a9d4b" if t.passed else "#c0392b"
        ax.plot([t.low, t.high], [y, y], color=color, lw=2)
        ax.plot([t.delta], [y], "o", color=color)
        ax.plot([-t.margin], [y], "|", color="#555", ms=14)
    ax.axvline(0, color="#999", lw=1)
    ax.set_yticks(range(len(tasks)), [f"{t.task} (n={t.n})" for t in reversed(tasks)])
    ax.set_xlabel(f"candidate - baseline, accuracy points ({report.confidence:.1%} CI; | = -margin)")
    ax.set_title({"pass": "PASS", "fail": "FAIL", "continue": "UNDECIDED"}[report.decision])


def length_plot(report, path: Path) -> Path | None:
    """Histograms of tokens per answer, baseline and candidate, one panel per generative task."""
    checks = [c for c in report.behaviour if c.check == "output length"]
    if not checks:
        return None
    with figure(path, nrows=len(checks), ncols=1, figsize=(6.5, 2.4 * len(checks) + 0.6), squeeze=False) as (_, axes):
        for ax, c in zip(axes[:, 0], checks, strict=False):
            _lengths(ax, c)
    return path


def _lengths(ax, c) -> None:
    top = max(c.baseline_tokens + c.candidate_tokens + [1])
    bins = range(0, top + max(1, top // 30), max(1, top // 30))
    ax.hist(c.baseline_tokens, bins=bins, alpha=0.55, label=f"baseline (mean {c.baseline:.1f})", color="#4c72b0")
    ax.hist(c.candidate_tokens, bins=bins, alpha=0.55, label=f"candidate (mean {c.candidate:.1f})", color="#dd8452")
    ax.set_title(f"{c.task}: x{c.estimate:.2f} [{c.low:.2f}, {c.high:.2f}] tokens per answer, "
                 f"{'pass' if c.passed else 'FAIL'}", fontsize=9)
    ax.set_xlabel("generated tokens")
    ax.legend(fontsize=8)


# what each column of the task table means, on the page beside it (a reader of the report has only the page)
COLUMNS = [
    "n: the items both models answered, paired item by item.",
    "baseline, candidate: each model's score on those items, in percent.",
    "delta: candidate minus baseline, in points (negative: the candidate lost items).",
    "interval: where the true delta lies at the stated confidence (Tango's score interval for paired outcomes); the "
    "candidate passes when its low end is above minus the margin.",
    "margin: the loss in points the suite accepts for this task.",
    "verdict: pass, FAIL, or continue (a sequential look that has not decided yet).",
    "flips: the share of items one model answers right and the other wrong, in either direction; more flips make "
    "the interval wider for the same delta.",
    "certifiable margin: the smallest margin these n items could certify if the candidate flipped this share of items "
    "with no loss on balance (true delta 0); in brackets, the items that would certify the suite's margin at this "
    "flip rate. A margin smaller than the certifiable one cannot pass on these items, whatever the candidate.",
]


def _blocks(report) -> list[tuple]:
    """The report as blocks both renderings share: ("h1"|"h2"|"p", text), ("table", headers, rows), ("ul", items).
    Text from the runs (paths, differences) is made visible here; each renderer escapes for its own format."""
    title = {"pass": "PASS", "fail": "FAIL", "continue": "UNDECIDED: evaluate the next look"}[report.decision]
    blocks: list[tuple] = [("h1", f"Release gate: {title}"),
                           ("p", f"Baseline {visible(report.baseline)}, candidate {visible(report.candidate)}; "
                                 f"intervals at {report.confidence:.2%} per task ({report.correction}; Tango's score "
                                 "interval for paired outcomes).")]
    if report.gated:
        blocks.append(("p", report.gated[0].upper() + report.gated[1:] + "."))
    look = report.sequential
    if look is not None:
        saved = 1 - look.items / look.population
        blocks.append(("p", f"Sequential: look {look.look} of {look.looks}, the candidate evaluated on "
                            f"{look.items:,} of {look.population:,} items ({look.fraction:.0%}); this look tests at a "
                            f"one-sided alpha of {look.alpha:.2g} per task (alpha spent over the looks); "
                            f"{saved:.0%} of the candidate's items not evaluated."))
    rows = []
    for t in report.tasks:
        cluster = f" x{t.design_effect:.2f} ({t.clusters} clusters)" if t.clusters else ""
        rows.append([t.task, f"{t.n:,}", f"{t.baseline:.1f}", f"{t.candidate:.1f}", f"{t.delta:+.2f}",
                     f"[{t.low:+.2f}, {t.high:+.2f}]{cluster}", f"-{t.margin:g}",
                     {"pass": "pass", "fail": "FAIL", "continue": "continue"}[t.decision], f"{t.flip_rate:.1f} %",
                     f"{t.certifiable_margin:.2f} ({t.items_for_margin:,} items for {t.margin:g})"])
    blocks.append(("table", ["task", "n", "baseline", "candidate", "delta", "interval", "margin", "verdict", "flips",
                             "certifiable margin"], rows))
    blocks.append(("ul", COLUMNS))
    items = [f"{t.task}: {t.note}" for t in report.tasks if t.note]
    items += [f"{t.task}: {s.name} {s.estimate:+.3f}{'' if s.low is None else f' [{s.low:+.3f}, {s.high:+.3f}]'} "
              f"{s.unit}" for t in report.tasks for s in t.signals]
    if items:
        blocks.append(("ul", items))
    if report.behaviour:
        rows = []
        for c in report.behaviour:
            if c.check == "output length":
                base, cand = f"{c.baseline:.1f} tokens", f"{c.candidate:.1f} tokens"
                estimate = f"x{c.estimate:.3f} (median x{c.median_ratio:.3f})"
                interval, limit = f"[x{c.low:.3f}, x{c.high:.3f}]", f"x{c.limit:.2f}"
            else:
                base, cand = f"{c.baseline:.1f} %", f"{c.candidate:.1f} %"
                estimate, limit = f"{c.estimate:+.2f} pts", f"+{c.limit:g} pts"
                interval = f"[{c.low:+.2f}, {c.high:+.2f}]"
            rows.append([c.task, c.check, f"{c.n:,}", base, cand, estimate, interval, limit,
                         "pass" if c.passed else "FAIL"])
        blocks += [("h2", "Behaviour of generated answers"),
                   ("table", ["task", "check", "n", "baseline", "candidate", "estimate", "interval", "limit",
                              "verdict"], rows)]
    if report.noise_run:
        by_task = {t.task: t for t in report.tasks}
        items = []
        for f in report.noise:
            t = by_task[f.task]
            label = t.engine_noise + ("" if t.passed else (": a regression" if t.regression else ": not a regression"))
            changed = "" if f.changed_answers is None else f", changes {f.changed_answers:.1f} % of its answers"
            items.append(f"{f.task}: the baseline's model flips {f.flip_rate:.1f} % of items against itself (delta "
                         f"{f.delta:+.2f}{changed}); the candidate flips {t.flip_rate:.1f} %: {label}")
        blocks += [("h2", f"Engine noise (A/A: {visible(report.noise_run)})"), ("ul", items)]
    decided = (f"Decided by: {', '.join(report.tasks[0].decided_by) if report.tasks else '-'}"
               f"{' and the behaviour checks' if report.behaviour else ''}.")
    if report.allowed_differences:
        allowed = visible("; ".join(report.allowed_differences))
        decided += f" The candidate also differs, as the suite allows, in: {allowed}."
    return blocks + [("p", decided)]


def markdown(report) -> str:
    lines: list[str] = []
    for block in _blocks(report):
        kind = block[0]
        if kind in ("h1", "h2"):
            lines += [("# " if kind == "h1" else "## ") + block[1], ""]
        elif kind == "p":
            lines += [block[1], ""]
        elif kind == "table":
            _, headers, rows = block
            lines += ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
            lines += ["| " + " | ".join(row) + " |" for row in rows] + [""]
        else:
            lines += [f"- {item}" for item in block[1]] + [""]
    return "\n".join(lines).rstrip() + "\n"


def html_page(report, images: list[Path]) -> str:
    """The report as an HTML page: headings, real tables, lists, the plots embedded (one self-contained file)."""
    e = html.escape
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>quantkit release gate</title><style>"
             "body{font-family:sans-serif;max-width:70em;margin:2em auto}table{border-collapse:collapse}"
             "td,th{border:1px solid #bbb;padding:.25em .6em;text-align:right}td:first-child{text-align:left}"
             "</style></head><body>"]
    for block in _blocks(report):
        kind = block[0]
        if kind in ("h1", "h2", "p"):
            parts.append(f"<{kind}>{e(block[1])}</{kind}>")
        elif kind == "table":
            _, headers, rows = block
            parts.append("<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in headers) + "</tr>"
                         + "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in rows)
                         + "</table>")
        else:
            parts.append("<ul>" + "".join(f"<li>{e(item)}</li>" for item in block[1]) + "</ul>")
    for path in images:
        data = base64.b64encode(path.read_bytes()).decode()
        parts.append(f"<p><img alt='{e(path.stem)}' src='data:image/png;base64,{data}'></p>")
    return "".join(parts) + "</body></html>\n"


def write_gate_report(report, folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    verdict = folder / "verdict.json"
    write_bytes_atomic(verdict, (report.model_dump_json(indent=2) + "\n").encode())
    md = folder / "report.md"
    write_bytes_atomic(md, markdown(report).encode())
    pngs = [forest_plot(report, folder / "forest.png")]
    lengths = length_plot(report, folder / "lengths.png")
    pngs += [lengths] if lengths is not None else []
    page = folder / "report.html"
    write_bytes_atomic(page, html_page(report, pngs).encode())
    return [verdict, md, *pngs, page]
