"""The gate's statistics: the published numbers of the paired-proportions literature, exact coverage at any n,
clusters, and sequential looks whose error rates hold (by seeded simulation)."""

import json
import math
import random

import numpy as np
import pytest
from scipy.special import gammaln

from helpers import write_seeded
from quantkit.release.gate import gate
from quantkit.release.stats import (
    bootstrap_interval,
    certifiable_margin,
    design_effect,
    items_for_margin,
    look_alphas,
    paired_binary_interval,
    spent,
    tango_interval,
    z_of,
)

Z95 = z_of(0.025)


def test_tango_reproduces_fagerland_lydersen_laake():
    """Cavo et al. (2012), complete response before and after consolidation therapy, n11 59, n12 6, n21 16, n22 80:
    Tango's interval -0.1240 to -0.0054 for delta = pi_1+ - pi_+1 = -0.0621 (Fagerland, Lydersen and Laake 2014,
    and their contingencytables package, whose tests print these digits)."""
    estimate, low, high = tango_interval(6, 16, 161, Z95)
    assert round(float(estimate), 4) == -0.0621
    assert (round(float(low), 4), round(float(high), 4)) == (-0.1240, -0.0054)


def test_nothing_flipped_is_not_a_zero_width_interval():
    """16 items, nothing flips: the Wald interval was [0, 0] (any margin 'passed'); the score interval is about
    +-19 points at 95 %, z^2 / (n + z^2) either side."""
    _, low, high = paired_binary_interval([1] * 8 + [0] * 8, [1] * 8 + [0] * 8, Z95)
    assert low == pytest.approx(-100 * Z95 ** 2 / (16 + Z95 ** 2)) and high == pytest.approx(-low)
    assert certifiable_margin(16, 0.0, Z95) > 4 and items_for_margin(4, 0.0, Z95) == 93


def _coverage(n: int, gain: float, lose: float, z: float) -> float:
    """Exact coverage: the probability, over every table of n pairs (multinomial), that the interval holds the true
    difference. No simulation noise."""
    g, l = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    keep = g + l <= n
    g, l = g[keep], l[keep]
    with np.errstate(divide="ignore"):
        logp = (gammaln(n + 1) - gammaln(g + 1) - gammaln(l + 1) - gammaln(n - g - l + 1) + g * np.log(gain or 1e-300)
                + l * np.log(lose or 1e-300) + (n - g - l) * np.log(1 - gain - lose))
    p = np.exp(logp) * ((g == 0) | (gain > 0)) * ((l == 0) | (lose > 0))
    likely = p > 1e-12
    g, l, p = g[likely], l[likely], p[likely]
    _, low, high = tango_interval(g, l, np.full(g.shape, n), z)
    truth = gain - lose
    return float((p * ((low <= truth + 1e-12) & (truth - 1e-12 <= high))).sum() / p.sum())


@pytest.mark.parametrize("n", [16, 50, 200, 2000])
def test_coverage_is_near_nominal_and_never_far_below(n):
    for flips in (0.0, 0.01, 0.05, 0.1, 0.2):  # the share of items whose correctness changes
        for net_loss in (0.0, 0.5):  # how lopsided the flips are: 0.5 loses three items for each one gained
            lose = flips / 2 * (1 + net_loss)
            coverage = _coverage(n, flips - lose, lose, Z95)
            assert coverage >= 0.95 - 0.015, (n, flips, net_loss, coverage)
            if n * flips >= 10:  # enough flips to measure: within a point of nominal
                assert abs(coverage - 0.95) <= 0.01, (n, flips, net_loss, coverage)


def test_design_effect_of_clustered_and_independent_items():
    rng = random.Random(0)
    independent = [rng.choice((-1, 0, 0, 0, 1)) for _ in range(600)]
    assert design_effect(independent, [str(i % 57) for i in range(600)]) == pytest.approx(1, abs=0.2)
    shared = [v for c in range(30) for v in [rng.choice((-1, 0, 1))] * 20]  # whole subjects move together
    assert design_effect(shared, [str(i // 20) for i in range(600)]) > 10
    low1 = paired_binary_interval([1] * 300 + [0] * 300, [1] * 290 + [0] * 310, Z95)[1]
    low4 = paired_binary_interval([1] * 300 + [0] * 300, [1] * 290 + [0] * 310, Z95, design_effect=4)[1]
    delta = -10 / 6
    assert delta - low4 == pytest.approx(2 * (delta - low1))


def test_bootstrap_interval_is_seeded_and_numpy():
    values = list(np.random.default_rng(1).normal(1.0, 0.2, 500))
    a, b = bootstrap_interval(values, 0.95, 2000, "t"), bootstrap_interval(values, 0.95, 2000, "t")
    assert a == b and a[0] < 1.0 < a[1]


def test_alpha_spending():
    for spending in ("obrien-fleming", "pocock"):
        alphas = look_alphas(0.025, [0.25, 0.5, 1.0], spending)
        assert sum(alphas) == pytest.approx(0.025) and all(a > 0 for a in alphas)
        assert spent(0.025, 1.0, spending) == 0.025
    assert look_alphas(0.025, [0.25, 0.5, 1.0], "obrien-fleming")[0] < 1e-4  # O'Brien-Fleming: almost nothing early


def _sequential_pass_rate(n, delta, flips, margin, looks, spending, trials, seed):
    """Share of simulated candidates a sequential gate passes, and the mean share of items it evaluates (every trial
    at once: the counts at each look are prefix sums of one seeded stream of outcomes)."""
    rng = np.random.default_rng(seed)
    alphas = look_alphas(0.025, looks, spending)
    lose = flips / 2 - delta / 2
    outcomes = rng.choice(3, size=(trials, n), p=[flips - lose, lose, 1 - flips])  # 0 gained, 1 lost, 2 same
    gained, lost = np.cumsum(outcomes == 0, axis=1), np.cumsum(outcomes == 1, axis=1)
    open_ = np.ones(trials, dtype=bool)
    passed, used = np.zeros(trials, dtype=bool), np.ones(trials)
    for k, (t, alpha) in enumerate(zip(looks, alphas)):
        m = math.ceil(t * n)
        _, low, high = tango_interval(gained[:, m - 1], lost[:, m - 1], np.full(trials, m), z_of(alpha))
        decided = open_ & ((100 * low > -margin) | (100 * high < -margin) | (k == len(looks) - 1))
        passed |= decided & (100 * low > -margin)
        used[decided] = m / n
        open_ &= ~decided
    return float(passed.mean()), float(used.mean())


def test_sequential_looks_keep_the_type_one_error_and_most_of_the_power():
    """Seeded simulation. A candidate exactly the margin worse must pass at most alpha (one-sided 2.5 %) of the
    time, up to three simulation SDs; one as good as the baseline keeps the fixed design's power and, with few
    flips on 2,000 items (FP8-like), is decided on well under the items the fixed design evaluates."""
    trials = 4000
    slack = 3 * math.sqrt(0.025 * 0.975 / trials)
    for spending in ("obrien-fleming", "pocock"):
        for n in (500, 2000):
            false_pass, _ = _sequential_pass_rate(n, -0.04, 0.14, 4, [0.25, 0.5, 1.0], spending, trials, seed=n)
            assert false_pass <= 0.025 + slack, (spending, n, false_pass)
        power, used = _sequential_pass_rate(2000, 0.0, 0.02, 4, [0.25, 0.5, 1.0], spending, 1000, seed=3)
        fixed, _ = _sequential_pass_rate(2000, 0.0, 0.02, 4, [1.0], spending, 1000, seed=3)
        assert power >= fixed - 0.01 and used < 0.5, (spending, power, fixed, used)




def test_a_sequential_gate_decides_at_the_first_look_that_can(tmp_path):
    rng = random.Random(4)
    population = 2000
    base = [int(rng.random() < 0.6) for _ in range(population)]
    (tmp_path / "suite.yaml").write_text("sequential: {looks: [0.25, 0.5, 1.0]}\ntasks:\n  arc_easy: {margin: 4}\n")
    a = write_seeded(tmp_path / "a", "arc_easy", base, population)
    same = [v if rng.random() > 0.01 else 1 - v for v in base]  # 1 % flips: within noise of a 4-point margin
    first = gate(a, write_seeded(tmp_path / "b", "arc_easy", same, population, 0.25), suite=tmp_path / "suite.yaml")
    second = gate(a, write_seeded(tmp_path / "c", "arc_easy", same, population, 0.5), suite=tmp_path / "suite.yaml")
    assert first.decision in ("pass", "continue") and second.decision == "pass"
    assert second.sequential.look == 2 and second.sequential.items == 1000
    broken = [0] * population  # everything lost: refuted at the first look, no need to look further
    early = gate(a, write_seeded(tmp_path / "d", "arc_easy", broken, population, 0.25), suite=tmp_path / "suite.yaml")
    assert early.decision == "fail" and early.sequential.look == 1 and not early.passed
    with pytest.raises(Exception, match="none of the looks"):
        gate(a, write_seeded(tmp_path / "e", "arc_easy", same, population, 0.3), suite=tmp_path / "suite.yaml")


def test_verdict_json_is_strict_json(tmp_path):
    (tmp_path / "suite.yaml").write_text("tasks:\n  arc_easy: {margin: 4}\n")
    a = write_seeded(tmp_path / "a", "arc_easy", [1] * 16, 16)
    b = write_seeded(tmp_path / "b", "arc_easy", [1] * 16, 16, model="n")
    report = gate(a, b, suite=tmp_path / "suite.yaml", report_dir=tmp_path / "r")
    assert not report.passed and "cannot certify a 4-point margin with 16 items" in report.tasks[0].note

    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    json.loads((tmp_path / "r" / "verdict.json").read_text(), parse_constant=refuse)
    page = (tmp_path / "r" / "report.html").read_text()
    assert "<table>" in page and "<pre>" not in page and page.count("data:image/png;base64,") == 1


@pytest.mark.parametrize("looks", ["[0.9999, 1.0]", "[0.5, 1.0]"])
def test_a_run_of_every_item_is_the_last_look_and_decides(tmp_path, looks):
    """Looks that round to one item count are one look: [0.9999, 1.0] on 500 items said UNDECIDED (exit 3) with
    every item evaluated, where [0.5, 1.0] said FAIL on the same data."""
    import random


    from quantkit.release.gate import gate

    rng = random.Random(7)
    population = 500
    base = [int(rng.random() < 0.6) for _ in range(population)]
    worse = [v if rng.random() > 0.15 else 0 for v in base]
    (tmp_path / "suite.yaml").write_text(f"sequential: {{looks: {looks}}}\ntasks:\n  arc_easy: {{margin: 2}}\n")
    a = write_seeded(tmp_path / "a", "arc_easy", base, population)
    report = gate(a, write_seeded(tmp_path / "b", "arc_easy", worse, population, 1.0), suite=tmp_path / "suite.yaml")
    assert report.decision == "fail" and report.sequential.look == report.sequential.looks == 2
    if looks == "[0.9999, 1.0]":  # both looks are 500 items: one test, spending what both spend
        assert report.sequential.alpha == pytest.approx(0.025, rel=1e-6)


def test_differences_that_cancel_in_every_cluster_leave_the_interval_as_it_is():
    """A design effect of 0 raised ZeroDivisionError in the gate (exit 1, the code for "a task fails")."""
    from quantkit.evaluation.run_dir import SampleRecord
    from quantkit.release.gate import _task_verdict
    from quantkit.release.suite import Suite, TaskSpec
    from quantkit.release.stats import design_effect, z_of

    clusters = [str(i // 2) for i in range(400)]
    differences = [1, -1] * 200  # a gain and a loss in every cluster
    assert design_effect(differences, clusters) == 1.0
    ids = [str(i) for i in range(400)]
    b = {i: SampleRecord(item_id=i, prompt_hash=i, correct=int(int(i) % 2 == 1)) for i in ids}
    c = {i: SampleRecord(item_id=i, prompt_hash=i, correct=int(int(i) % 2 == 0)) for i in ids}
    verdict = _task_verdict("mmlu", ids, b, c, 2.0, z_of(0.025), Suite(tasks={"mmlu": TaskSpec(margin=2.0)}), clusters)
    assert verdict.design_effect == 1.0 and verdict.delta == 0
