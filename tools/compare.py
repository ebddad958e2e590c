"""
Two evaluations of the same items, compared item by item: for each task and metric, the difference B - A with a
paired bootstrap 95% interval and, for accuracies, McNemar's exact two-sided p-value.

    python -m tools.compare out/base/eval.json out/probe/eval.json     # their .items.jsonl files, found beside them
    python -m tools.compare A.items.jsonl B.items.jsonl --resamples 10000 --seed 1234 --out compare.json

The interval is the 2.5th to 97.5th percentile of B - A over --resamples draws of the items with replacement,
the same items for A and B, from a generator seeded with --seed: rerunning gives the same interval. An interval
that holds 0, or a p-value above 0.05, says the difference is within what the choice of items can produce.
"""

import argparse
from pathlib import Path

from data.sources import DataError
from lab.checkpoint import save_run_file
from lab.cli import ArgumentParser, format_table, nonneg_int, out_file, positive_int
from lab.evaluation import read_items
from lab.stats import LEVEL, RESAMPLES, SEED, compare_items


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(prog="python -m tools.compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", help="evaluation A: eval_lambada.py's JSON summary or its .items.jsonl")
    p.add_argument("b", help="evaluation B, of the same items")
    p.add_argument("--resamples", type=positive_int, default=RESAMPLES, help="bootstrap draws")
    p.add_argument("--seed", type=nonneg_int, default=SEED, help="seed of the bootstrap's generator")
    p.add_argument("--out", type=out_file, default="compare.json", help="where to write the JSON results")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = get_args(argv)
    if args.resamples < 100:
        raise SystemExit("error: --resamples must be at least 100 for a 95% interval")
    try:
        rows = compare_items(read_items(args.a), read_items(args.b), args.resamples, args.seed)
    except (DataError, ValueError) as e:
        raise SystemExit(f"error: {e}")
    table = [[r["task"], r["metric"], r["n"], r["a"], r["b"], r["diff"], r["low"], r["high"], r["p_mcnemar"]]
             for r in rows]
    print(format_table(["task", "metric", "n", "A", "B", "B - A", "95% low", "95% high", "McNemar p"], table))
    print(f"A = {args.a}, B = {args.b}; paired bootstrap of the items, {args.resamples:,} draws, seed {args.seed}")
    report = {"a": args.a, "b": args.b, "resamples": args.resamples, "seed": args.seed, "level": LEVEL,
              "rows": rows}
    out = Path(args.out)
    try:
        save_run_file(out.parent, out.name, report)
    except DataError as e:  # a full disk, a read-only folder
        raise SystemExit(f"error: {e}")
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
