"""Paired comparisons: McNemar's exact test and the paired bootstrap on cases with known answers, tools/compare.py
end to end on hand-written item files, and evaluations of different items."""

import json
import math

import numpy as np
import pytest

from lab import stats
from lab.evaluation import item_record, items_jsonl
from tools import compare


@pytest.mark.parametrize("a_only,b_only,expected", [
    (1, 9, 2 * (1 + 10) / 2 ** 10),  # 2 P(X <= 1), X ~ Binomial(10, 1/2) = 22/1024
    (9, 1, 22 / 1024),  # symmetric
    (0, 6, 2 / 2 ** 6),
    (5, 5, 1.0),  # an even split: capped at 1
    (0, 0, 1.0),  # no discordant pair: no evidence either way
    (3, 17, 2 * sum(math.comb(20, k) for k in range(4)) / 2 ** 20),
])
def test_mcnemar_exact(a_only, b_only, expected):
    both, neither = 7, 4  # concordant pairs carry no information: they must not change the p-value
    a = [True] * a_only + [False] * b_only + [True] * both + [False] * neither
    b = [False] * a_only + [True] * b_only + [True] * both + [False] * neither
    assert stats.mcnemar_exact(a, b) == pytest.approx(expected, rel=1e-12)


def test_bootstrap_of_a_constant_shift_is_that_shift():
    a = np.random.default_rng(0).normal(size=50)
    ones = np.ones(50)
    assert stats.paired_bootstrap(a, ones, a, ones) == (0.0, 0.0)
    low, high = stats.paired_bootstrap(a, ones, a + 0.25, ones, resamples=500)
    assert low == pytest.approx(0.25, abs=1e-12) and high == pytest.approx(0.25, abs=1e-12)
    # a ratio of sums: B's numerator is A's plus 0.5 of each item's denominator, so B - A = 0.5 on every draw
    den = np.random.default_rng(1).integers(1, 9, size=50)
    low, high = stats.paired_bootstrap(a, den, a + 0.5 * den, den, resamples=500)
    assert low == pytest.approx(0.5, abs=1e-12) and high == pytest.approx(0.5, abs=1e-12)


def test_bootstrap_interval_matches_the_exact_distribution():
    """Accuracy differences on 20 items: 6 only B got right, 2 only A, 12 both or neither. A bootstrap draw's
    difference is (N+ - N-) / 20 with (N+, N-, N0) ~ Multinomial(20; 0.3, 0.1, 0.6), whose quantiles are exact."""
    n = 20
    right_a = np.array([0] * 6 + [1] * 2 + [1] * 5 + [0] * 7, dtype=float)
    right_b = np.array([1] * 6 + [0] * 2 + [1] * 5 + [0] * 7, dtype=float)
    pmf: dict[float, float] = {}
    for up in range(n + 1):
        for down in range(n + 1 - up):
            p = (math.factorial(n) / (math.factorial(up) * math.factorial(down) * math.factorial(n - up - down))
                 * 0.3 ** up * 0.1 ** down * 0.6 ** (n - up - down))
            pmf[(up - down) / n] = pmf.get((up - down) / n, 0.0) + p
    values = sorted(pmf)
    cdf = np.cumsum([pmf[v] for v in values])
    exact_low = values[int(np.searchsorted(cdf, 0.025))]
    exact_high = values[int(np.searchsorted(cdf, 0.975))]
    low, high = stats.paired_bootstrap(right_a, np.ones(n), right_b, np.ones(n))
    assert abs(low - exact_low) <= 1 / n + 1e-12 and abs(high - exact_high) <= 1 / n + 1e-12
    assert low < 0.2 < high  # the observed difference, 0.2, lies inside
    assert stats.paired_bootstrap(right_a, np.ones(n), right_b, np.ones(n)) == (low, high)  # fixed seed


def lambada_items(correct: list[bool], logprob: float) -> list[dict]:
    return [item_record("lambada", "lm-eval", i, logprob, 2, False, c) for i, c in enumerate(correct)]


def write(path, records) -> str:
    path.write_text(items_jsonl(records))
    return str(path)


def test_compare_end_to_end(tmp_path, capsys):
    """A right on items 0-4, B on 0-2 and 5-9: A only on 2, B only on 5. Losses 1 and 2 nats on every item."""
    a = write(tmp_path / "a.items.jsonl", lambada_items([True] * 5 + [False] * 5, -1.0))
    (tmp_path / "b.json").write_text("{}")  # a summary: its items are found beside it
    write(tmp_path / "b.items.jsonl", lambada_items([True] * 3 + [False] * 2 + [True] * 5, -2.0))
    report = compare.main([a, str(tmp_path / "b.json"), "--resamples", "2000", "--out", str(tmp_path / "c.json")])
    acc, ppl = report["rows"]
    assert (acc["metric"], acc["a"], acc["b"]) == ("acc", 0.5, 0.8) and acc["diff"] == pytest.approx(0.3)
    assert (acc["a_only"], acc["b_only"]) == (2, 5)
    assert acc["p_mcnemar"] == pytest.approx(2 * (1 + 7 + 21) / 2 ** 7)
    assert acc["low"] < 0.3 < acc["high"]
    assert ppl["diff"] == pytest.approx(math.e ** 2 - math.e) and ppl["p_mcnemar"] is None
    assert ppl["low"] == pytest.approx(ppl["diff"]) and ppl["high"] == pytest.approx(ppl["diff"])  # no spread
    assert json.loads((tmp_path / "c.json").read_text()) == json.loads(json.dumps(report))
    out = capsys.readouterr().out
    assert "McNemar p" in out and "2,000 draws, seed 1234" in out


@pytest.mark.parametrize("b_records,message", [
    (lambada_items([True] * 9, -1.0), r"lambada: the evaluations scored different items \(10 vs 9 items, first "
                                      r"difference at position 9\)"),
    ([dict(r, protocol="paper") for r in lambada_items([True] * 10, -1.0)],
     "lambada: the evaluations used different protocols"),
    ([dict(r, task="wikitext") for r in lambada_items([True] * 10, -1.0)],
     r"the evaluations hold different tasks \(lambada vs wikitext\)"),
])
def test_compare_refuses_different_items(tmp_path, b_records, message):
    a = write(tmp_path / "a.items.jsonl", lambada_items([True] * 10, -1.0))
    b = write(tmp_path / "b.items.jsonl", b_records)
    with pytest.raises(SystemExit, match=f"^error: {message}"):
        compare.main([a, b, "--out", str(tmp_path / "c.json")])
    assert not (tmp_path / "c.json").exists()


def test_compare_bad_files(tmp_path):
    a = write(tmp_path / "a.items.jsonl", lambada_items([True] * 3, -1.0))
    with pytest.raises(SystemExit, match=r"^error: .*missing.items.jsonl does not exist; eval_lambada.py writes it"):
        compare.main([a, str(tmp_path / "missing.json"), "--out", str(tmp_path / "c.json")])
    (tmp_path / "bad.items.jsonl").write_text('{"task": "lambada"}\n')
    with pytest.raises(SystemExit, match=r"^error: .*bad.items.jsonl:1: not an item record"):
        compare.main([a, str(tmp_path / "bad.items.jsonl"), "--out", str(tmp_path / "c.json")])
    assert not (tmp_path / "c.json").exists()
