"""The gate's report and the model card as a person reads them: rendered by a real browser (headless Chromium), with
the text needed to read the verdict on the page, the forest plot loaded, and the card's Markdown rendered as the hub
renders Markdown (CommonMark with tables, markdown-it-py)."""

import base64
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from helpers import passing_verdict, suite, write_run
from quantkit.convert import convert
from quantkit.release.gate import gate
from quantkit.release.report import COLUMNS

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium: `apt-get install chromium` (CI installs it)")


class _Text(HTMLParser):
    """The page's visible text, one string (what a person reads, scripts and styles left out), and its images."""

    def __init__(self):
        super().__init__()
        self.parts: list[str] = []
        self.images: list[dict] = []
        self._hidden = 0

    def handle_starttag(self, tag, attrs):
        self._hidden += tag in ("script", "style", "head")
        if tag == "img":
            self.images.append(dict(attrs))

    def handle_endtag(self, tag):
        self._hidden -= tag in ("script", "style", "head")

    def handle_data(self, data):
        if not self._hidden:
            self.parts.append(data)


def browse(page: Path, tmp_path: Path) -> tuple[str, list[dict], int]:
    """What Chromium built from PAGE (its DOM, as text and images) and how many colours its screenshot holds."""
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1200,1600"]
    dom = subprocess.run(flags + ["--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=180)
    assert dom.returncode == 0, dom.stderr
    shot = tmp_path / f"{page.stem}.png"
    done = subprocess.run(flags + [f"--screenshot={shot}", page.as_uri()], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and shot.is_file(), done.stderr
    parsed = _Text()
    parsed.feed(dom.stdout)
    return " ".join(" ".join(parsed.parts).split()), parsed.images, _colours(shot)


def _colours(png: Path) -> int:
    """Distinct pixel values of a screenshot (a blank page has one)."""
    from PIL import Image

    with Image.open(png) as image:
        return len(image.convert("RGB").getcolors(1 << 24) or [])


def test_the_gate_report_reads_as_a_page_that_explains_every_column(tmp_path):
    base = [1, 0, 1, 1] * 75  # 300 items; the candidate loses 9 and gains 3
    cand = list(base)
    for i in range(0, 36, 4):
        cand[i] = 0
    for i in (1, 5, 9):
        cand[i] = 1
    b = write_run(tmp_path / "base", {"arc_easy": base})
    c = write_run(tmp_path / "cand", {"arc_easy": cand}, model="n")
    report = gate(b, c, suite=suite(tmp_path, ["arc_easy"], margin=4.0), report_dir=tmp_path / "gate")
    text, images, colours = browse(tmp_path / "gate" / "report.html", tmp_path)

    t = report.tasks[0]
    assert f"{t.delta:+.2f}" in text and f"[{t.low:+.2f}, {t.high:+.2f}]" in text and "arc_easy" in text
    assert ("PASS" if report.passed else "FAIL") in text
    for sentence in COLUMNS:  # every column is explained on the page itself
        assert " ".join(sentence.split()) in text, sentence
    # the forest plot travels inside the page, so a report mailed or copied alone still shows it
    assert len(images) == 1 and images[0]["src"].startswith("data:image/png;base64,")
    assert base64.b64decode(images[0]["src"].split(",", 1)[1]) == (tmp_path / "gate" / "forest.png").read_bytes()
    assert colours > 8  # the screenshot is a drawn page, not a blank one


def test_a_pool_card_reads_as_a_page_with_the_pools_formats_and_gate(synthetic, tmp_path):
    from markdown_it import MarkdownIt

    from quantkit.release.card import model_card, pools_section
    from quantkit.release.pools import PoolResult
    from quantkit.release.verdict import GateReport

    dst = tmp_path / "decode"
    convert(synthetic["glm_moe_dsa"], dst, "glm5-int4-experts-g32", device="cpu")
    verdict_path = passing_verdict(dst, tmp_path)
    verdict = GateReport.model_validate_json(verdict_path.read_bytes())
    pools = [PoolResult("prefill", None, str(synthetic["glm_moe_dsa"]), "auto", published="zai-org/GLM-5.2-FP8"),
             PoolResult("decode", "glm5-int4-experts-g32", str(dst), "auto", published="org/GLM-5.2-decode")]
    card = model_card(dst, "org/GLM-5.2-decode", verdict, "zai-org/GLM-5.2-FP8",
                      pools_section(pools, {"decode": verdict}))
    body = card.split("\n---\n", 1)[1]  # the hub shows the YAML header as metadata, not as text
    page = tmp_path / "card.html"
    page.write_text("<!doctype html><meta charset=utf-8><body>"
                    + MarkdownIt("commonmark").enable("table").render(body) + "</body>")
    text, _, colours = browse(page, tmp_path)

    assert "The deployment's two pools" in text
    assert "prefill zai-org/GLM-5.2-FP8 as released (fp8 block [128, 128])" in text
    assert "FP8 dynamic per token, in groups of 128 BF16" in text
    assert "decode org/GLM-5.2-decode INT4 symmetric, group 32 model dtype (weight-only) BF16" in text
    assert "none: the source as released is the baseline itself" in text
    assert "pass: arc_easy +0.00 [" in text
    assert "Formats" in text and "Release gate: PASS" in text and "arc_easy 200 75.00 75.00 +0.00" in text
    assert "|---" not in text and "| pool |" not in text  # every table rendered as a table, no Markdown left
    kept = text.split("Left in the model's dtype: ", 1)[1].split(" Release gate", 1)[0]
    assert "model.layers.*.self_attn.indexer.wk" in kept and "layers.1." not in kept  # one entry per module of a layer
    assert len(kept.split(", ")) <= 13 and kept.endswith("more.")
    assert colours > 8
