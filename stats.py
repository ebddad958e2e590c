"""
Paired statistics for two evaluations of the same items (compare.py and experiment scripts use them).

Both evaluations scored the same passages and questions, so their differences are paired: resampling items (not
the two evaluations separately) removes the item-to-item variation both share, and for accuracies only the items
on which the two disagree carry information (McNemar's test).
"""

import math
from typing import Callable, Sequence

import numpy as np

from evaluation import metric_value, task_metrics

RESAMPLES = 10_000
SEED = 1234
LEVEL = 0.95


def paired_bootstrap(num_a: Sequence[float], den_a: Sequence[float], num_b: Sequence[float],
                     den_b: Sequence[float], transform: Callable = lambda x: x, resamples: int = RESAMPLES,
                     seed: int = SEED, level: float = LEVEL) -> tuple[float, float]:
    """Percentile interval of metric(B) - metric(A), metric = transform(sum(num) / sum(den)), over `resamples`
    draws of n items with replacement; each draw picks the same items for A and B."""
    arrays = [np.asarray(x, dtype=np.float64) for x in (num_a, den_a, num_b, den_b)]
    n = len(arrays[0])
    if n == 0 or any(len(a) != n for a in arrays):
        raise ValueError(f"paired bootstrap needs equally many items on both sides, got {[len(a) for a in arrays]}")
    rng = np.random.default_rng(seed)
    rows = max(1, 2 ** 22 // n)  # draws per chunk, so that the index matrix stays near 32 MB
    diffs = []
    for start in range(0, resamples, rows):
        idx = rng.integers(0, n, size=(min(rows, resamples - start), n))
        na, da, nb, db = (a[idx].sum(axis=1) for a in arrays)
        diffs.append(transform(nb / db) - transform(na / da))
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(np.concatenate(diffs), [tail, 100 - tail])
    return float(low), float(high)


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
