"""
Paired statistics for evaluations of the same items (tools/compare.py and study/ use them), paired statistics with
seeds as the unit (the 500-step experiment's contrasts: a t-interval, a two-level bootstrap over seeds and held-out
windows, Holm's adjustment), and the growth over depth of a per-layer series (analyze_layers.py and study/).

Both evaluations scored the same passages and questions, so their differences are paired: resampling items (not
the two evaluations separately) removes the item-to-item variation both share, and for accuracies only the items
on which the two disagree carry information (McNemar's test).
"""

import math
from typing import Callable, Sequence

import numpy as np

from lab.evaluation import metric_value, task_metrics

RESAMPLES = 10_000
SEED = 1234
LEVEL = 0.95
ROUNDING = 1e-12  # differences smaller than this are float rounding (every quantity here is far larger)


def resampled_sums(columns: np.ndarray, resamples: int = RESAMPLES, seed: int = SEED) -> np.ndarray:
    """[resamples, k]: for each of `resamples` draws of the n items (the rows of columns [n, k]) with replacement,
    each column's sum over the drawn items. Every column sees the same draws: that is what pairs a comparison."""
    columns = np.asarray(columns, dtype=np.float64)
    n = len(columns)
    rng = np.random.default_rng(seed)
    rows = max(1, 2 ** 22 // n)  # draws per chunk, so that the index matrix stays near 32 MB
    sums = []
    for start in range(0, resamples, rows):
        m = min(rows, resamples - start)
        idx = rng.integers(0, n, size=(m, n))
        counts = np.bincount((idx + n * np.arange(m)[:, None]).ravel(), minlength=m * n).reshape(m, n)
        sums.append(counts @ columns)  # how often each item was drawn, times its value: one product for all columns
    return np.concatenate(sums)


def paired_intervals(sides: dict[str, tuple[Sequence[float], Sequence[float]]], pairs: list[tuple[str, str]],
                     transform: Callable = lambda x: x, resamples: int = RESAMPLES, seed: int = SEED,
                     level: float = LEVEL) -> dict[tuple[str, str], tuple[float, float]]:
    """For each pair (A, B) of named sides (num, den) over the same n items: the percentile interval of
    metric(B) - metric(A), metric = transform(sum(num) / sum(den)), over `resamples` draws of the items with
    replacement. All pairs share the draws, so a table of comparisons is one bootstrap, not many."""
    names = list(sides)
    arrays = [np.asarray(x, dtype=np.float64) for name in names for x in sides[name]]
    n = len(arrays[0])
    if n == 0 or any(len(a) != n for a in arrays):
        raise ValueError(f"paired bootstrap needs equally many items on both sides, got {[len(a) for a in arrays]}")
    sums = resampled_sums(np.stack(arrays, axis=1), resamples, seed)
    metric = {name: transform(sums[:, 2 * i] / sums[:, 2 * i + 1]) for i, name in enumerate(names)}
    tail = (1 - level) / 2 * 100
    intervals = {}
    for a, b in pairs:
        low, high = np.percentile(metric[b] - metric[a], [tail, 100 - tail])
        intervals[(a, b)] = (float(low), float(high))
    return intervals


def paired_bootstrap(num_a: Sequence[float], den_a: Sequence[float], num_b: Sequence[float],
                     den_b: Sequence[float], transform: Callable = lambda x: x, resamples: int = RESAMPLES,
                     seed: int = SEED, level: float = LEVEL) -> tuple[float, float]:
    """Percentile interval of metric(B) - metric(A), metric = transform(sum(num) / sum(den)), over `resamples`
    draws of n items with replacement; each draw picks the same items for A and B."""
    sides = {"a": (num_a, den_a), "b": (num_b, den_b)}
    return paired_intervals(sides, [("a", "b")], transform, resamples, seed, level)[("a", "b")]


def mcnemar_exact(correct_a: Sequence[bool], correct_b: Sequence[bool]) -> float:
    """Two-sided exact McNemar p-value: of the n items where exactly one side is right, the chance under a fair
    coin of a split at least as uneven as the one seen, 2 * P(Binomial(n, 1/2) <= min(a_only, b_only)), at most 1."""
    a_only = sum(1 for a, b in zip(correct_a, correct_b) if a and not b)
    b_only = sum(1 for a, b in zip(correct_a, correct_b) if b and not a)
    n = a_only + b_only
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(a_only, b_only) + 1))
    return min(1.0, 2 * tail / 2 ** n)


def by_task(records: list[dict]) -> dict[str, list[dict]]:
    tasks: dict[str, list[dict]] = {}
    for r in records:
        tasks.setdefault(r["task"], []).append(r)
    return tasks


def check_same_items(a: dict[str, list[dict]], b: dict[str, list[dict]]) -> None:
    """ValueError in one line unless A and B hold the same tasks, protocol and items (and, for multiple choice,
    the same gold answers)."""
    for side, tasks in (("A", a), ("B", b)):
        for task, records in tasks.items():
            seen = [r["item"] for r in records]
            if len(set(seen)) < len(seen):
                twice = next(i for k, i in enumerate(seen) if i in seen[:k])
                raise ValueError(f"evaluation {side} holds item {twice} of {task} more than once (a task evaluated "
                                 f"twice?); pairing would count it twice")
    if set(a) != set(b):
        raise ValueError(f"the evaluations hold different tasks ({', '.join(sorted(a))} vs {', '.join(sorted(b))})")
    for task in a:
        protocols = {r["protocol"] for r in a[task]} | {r["protocol"] for r in b[task]}
        if len(protocols) > 1:
            raise ValueError(f"{task}: the evaluations used different protocols ({' vs '.join(sorted(protocols))})")
        keys_a = [(r["item"], r.get("gold")) for r in a[task]]
        keys_b = [(r["item"], r.get("gold")) for r in b[task]]
        if keys_a != keys_b:
            first = next((i for i, (x, y) in enumerate(zip(keys_a, keys_b)) if x != y), min(len(keys_a), len(keys_b)))
            raise ValueError(f"{task}: the evaluations scored different items ({len(keys_a)} vs {len(keys_b)} items, "
                             f"first difference at position {first}); compare runs of the same data and --limit")


def compare_items(a_records: list[dict], b_records: list[dict], resamples: int = RESAMPLES,
                  seed: int = SEED) -> list[dict]:
    """Per task and metric: A, B, B - A with its paired bootstrap interval, and for accuracies McNemar's p-value
    and the counts of items only A or only B got right. ValueError when the items differ."""
    a, b = by_task(a_records), by_task(b_records)
    check_same_items(a, b)
    rows = []
    for task in a:
        for name, m in task_metrics(task, a[task][0]["protocol"]).items():
            sides = [([m.num(r) for r in recs], [m.den(r) for r in recs]) for recs in (a[task], b[task])]
            va, vb = metric_value(m, a[task])["value"], metric_value(m, b[task])["value"]
            low, high = paired_bootstrap(*sides[0], *sides[1], m.transform, resamples, seed)
            row = {"task": task, "metric": name, "n": len(a[task]), "a": va, "b": vb, "diff": vb - va,
                   "low": low, "high": high, "p_mcnemar": None}
            if m.accuracy:
                right_a, right_b = sides[0][0], sides[1][0]
                row["p_mcnemar"] = mcnemar_exact(right_a, right_b)
                row["a_only"] = sum(1 for x, y in zip(right_a, right_b) if x and not y)
                row["b_only"] = sum(1 for x, y in zip(right_a, right_b) if y and not x)
            rows.append(row)
    return rows


# --- seeds as the unit: the pre-registered contrasts of the 500-step experiment (docs/experiment.md) ---

def _incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b), by its continued fraction (modified Lentz)."""
    if x <= 0.0 or x >= 1.0:
        return 0.0 if x <= 0.0 else 1.0
    if x > (a + 1) / (a + b + 2):  # the fraction converges fast below its mean: use the symmetry there
        return 1.0 - _incomplete_beta(b, a, 1.0 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log(1 - x)) / a
    tiny, c, d, f = 1e-300, 1.0, 0.0, 1.0
    for i in range(400):
        m = i // 2
        if i == 0:
            num = 1.0
        elif i % 2 == 0:
            num = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        else:
            num = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        d = 1.0 + num * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + num / c
        c = c if abs(c) > tiny else tiny
        f *= c * d
        if abs(1.0 - c * d) < 1e-15:
            break
    return front * (f - 1.0)


def t_sf_two_sided(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with df degrees of freedom."""
    return _incomplete_beta(df / 2, 0.5, df / (df + t * t))


def t_quantile(p: float, df: float) -> float:
    """The p-quantile (p > 0.5) of Student's t with df degrees of freedom, by bisection on the exact tail."""
    low, high = 0.0, 1e6
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if t_sf_two_sided(mid, df) / 2 > 1 - p else (low, mid)
    return (low + high) / 2


def paired_t(diffs: Sequence[float], level: float = LEVEL) -> dict[str, float]:
    """The paired-by-seed difference: its mean, the t-interval at `level` and the two-sided p-value, with the seeds
    as the unit of replication (n - 1 degrees of freedom)."""
    d = np.asarray(diffs, dtype=float)
    n, mean = len(d), float(d.mean())
    # Equal values reach us by different float paths: a mean within rounding of 0 is 0, and the same difference on
    # every seed has no spread, so no t-test to make.
    mean = 0.0 if abs(mean) < ROUNDING else mean
    se = 0.0 if np.ptp(d) < ROUNDING else float(d.std(ddof=1) / math.sqrt(n))
    if se == 0.0:
        return {"n": n, "mean": mean, "low": mean, "high": mean, "p": 0.0 if mean else 1.0}
    half = t_quantile(1 - (1 - level) / 2, n - 1) * se
    return {"n": n, "mean": mean, "low": mean - half, "high": mean + half, "p": t_sf_two_sided(mean / se, n - 1)}


def two_level_bootstrap(a: np.ndarray, b: np.ndarray, resamples: int = RESAMPLES, seed: int = SEED,
                        level: float = LEVEL) -> tuple[float, float]:
    """The interval of mean(a) - mean(b) for [seed, window] arrays of per-window losses, paired on both levels:
    each draw resamples the seeds with replacement, then the windows with replacement, the same indices for both
    arms. It counts seed and window noise together."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"the two arms hold different seeds or windows ({a.shape} vs {b.shape})")
    rng = np.random.default_rng(seed)
    seeds, windows = a.shape
    diff = a - b
    draws = np.empty(resamples)
    for i in range(resamples):
        rows = rng.integers(0, seeds, seeds)
        cols = rng.integers(0, windows, (seeds, windows))
        draws[i] = diff[rows[:, None], cols].mean()
    tail = (1 - level) / 2 * 100
    return float(np.percentile(draws, tail)), float(np.percentile(draws, 100 - tail))


def holm(pvalues: dict[str, float]) -> dict[str, float]:
    """Holm's step-down adjustment of a family of p-values (family-wise error at any level), each capped at 1."""
    order = sorted(pvalues, key=pvalues.get)
    adjusted, running = {}, 0.0
    for rank, name in enumerate(order):
        running = max(running, min(1.0, (len(order) - rank) * pvalues[name]))
        adjusted[name] = running
    return adjusted


# --- growth over depth of a per-layer series (analyze_layers.py, study/) ---

def trend(values: list[float]) -> float:
    """Ours: the mean of the last quarter of layers over the mean of the first three quarters (where the paper
    says the growth is)."""
    cut = len(values) - max(1, len(values) // 4)
    return float(np.mean(values[cut:]) / np.mean(values[:cut])) if cut else math.nan


def last_over_first(values: list[float]) -> float:
    """The paper's statistic: the last layer's value over the first layer's (its "2.3x" at 160M)."""
    return float(values[-1] / values[0]) if values[0] else math.nan
