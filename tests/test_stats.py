"""The pre-registered statistics of the 500-step experiment (lab/stats.py): Student's t against published table
values, the paired t-interval with seeds as the unit, the two-level bootstrap over seeds and windows, Holm."""

import numpy as np
import pytest

from lab.stats import holm, paired_t, t_quantile, t_sf_two_sided, two_level_bootstrap


@pytest.mark.parametrize("df, q975", [(1, 12.7062), (2, 4.3027), (4, 2.7764), (10, 2.2281), (30, 2.0423)])
def test_t_quantiles_match_the_tables(df, q975):
    assert t_quantile(0.975, df) == pytest.approx(q975, abs=1e-4)
    assert t_sf_two_sided(q975, df) == pytest.approx(0.05, abs=1e-4)


def test_t_tails_match_closed_forms():
    assert t_sf_two_sided(1.0, 1) == pytest.approx(0.5)  # Cauchy: P(|T| > 1) = 1/2
    assert t_sf_two_sided(0.0, 4) == pytest.approx(1.0)
    # df = 2 has P(|T| > t) = 1 - t / sqrt(t^2 + 2)
    assert t_sf_two_sided(1.5, 2) == pytest.approx(1 - 1.5 / np.sqrt(1.5 ** 2 + 2), abs=1e-12)


def test_paired_t_with_seeds_as_the_unit():
    diffs = [-0.010, -0.020, -0.015, -0.012, -0.018]  # five seeds, pre-proj + skip minus a control
    r = paired_t(diffs)
    sd = np.std(diffs, ddof=1)
    assert r["n"] == 5 and r["mean"] == pytest.approx(-0.015)
    assert r["high"] - r["mean"] == pytest.approx(2.776445 * sd / np.sqrt(5), rel=1e-6)
    assert r["p"] == pytest.approx(t_sf_two_sided(-0.015 / (sd / np.sqrt(5)), 4)) and r["p"] < 0.01
    assert paired_t([0.01, -0.01, 0.02, -0.02, 0.0])["p"] == pytest.approx(1.0)
    # equal scores whose float sums differ in the last bit are no difference (no false star from a float zero)
    zero = paired_t([0.1 + 0.2 - 0.3, 0.1 + 0.2 - 0.3, 2.7755575615628914e-17])
    assert zero["mean"] == 0.0 and zero["p"] == 1.0 and zero["low"] == zero["high"] == 0.0
    # benchmark scores of 300 items: the same 7-item gain on every seed, from different float paths
    gains = [77 / 300 - 70 / 300, 78 / 300 - 71 / 300, 79 / 300 - 72 / 300]
    assert np.ptp(gains) > 0  # the float noise this is about
    same = paired_t(gains)
    assert same["low"] == same["high"] == same["mean"] and same["p"] == 0.0
    cancel = paired_t([71 / 300 - 70 / 300, 72 / 300 - 73 / 300, 0.0])  # one item gained, one lost
    assert cancel["mean"] == 0.0 and cancel["low"] < 0.0 < cancel["high"]


def test_two_level_bootstrap_counts_seed_and_window_noise():
    rng = np.random.default_rng(0)
    seeds, windows = 5, 382
    shift = np.array([-0.02, 0.01, -0.03, 0.0, -0.01])[:, None]  # seed-to-seed spread of the difference
    b = rng.normal(5.0, 0.3, (seeds, windows))
    a = b + shift + rng.normal(0.0, 0.001, (seeds, windows))
    low, high = two_level_bootstrap(a, b, resamples=4000)
    assert low < (a - b).mean() < high
    assert high - low > 0.02  # the seeds' spread, not the tiny window noise, sets the width
    const_low, const_high = two_level_bootstrap(b - 0.01, b, resamples=500)
    assert const_low == pytest.approx(-0.01) and const_high == pytest.approx(-0.01)
    with pytest.raises(ValueError, match="different seeds or windows"):
        two_level_bootstrap(a[:4], b)


def test_holm_by_hand():
    # sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1 = 0.02, 0.03, 0.06, 0.04, then made monotone: 0.06 for the last
    assert holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": 0.005}) == pytest.approx(
        {"a": 0.03, "b": 0.06, "c": 0.06, "d": 0.02})
    assert holm({"x": 0.6, "y": 0.7}) == {"x": 1.0, "y": 1.0}
