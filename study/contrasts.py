"""
The pre-registered contrasts of the 500-step experiment (docs/experiment.md), from its run folders: per base, each
CONTRASTS control against pre-proj + skip on sotu_test's held-out loss, paired by seed, with the t-interval over
seeds, the two-level bootstrap over seeds and windows, and Holm's adjustment over every test of every base (one not
run yet counting as p = 1).

    python -m study.contrasts                        # the table, from out/experiment-500
    python -m study.contrasts --out OUT --json C.json

A contrast is decided when its Holm-adjusted p is below ALPHA (the same rule for every contrast), in the direction
of its sign: "supported" when pre-proj + skip has the lower loss, "reversed" when the control has; otherwise it is
"not shown" at this scale. Each method's runs are its seeds at its chosen rate; a contrast uses the seeds both
arms have, and a diverged seed counts as missing.
"""

import argparse
import json
from pathlib import Path

import numpy as np

from data.sources import DataError, write_atomic
from lab.cli import ArgumentParser, format_table, out_file, positive_int
from lab.stats import RESAMPLES, SEED, holm, paired_t, two_level_bootstrap
from study.design import CONTRASTS, METHODS, OUT, chosen_lr, method_folder, read_json, run_folders

PRIMARY = "sotu_test"  # the pre-registered outcome: own-domain held-out loss
ARM = "preproj_skip"
ALPHA = 0.05
SETTING = "ood"


def seed_windows(out: Path, base: str, method: str) -> dict[int, np.ndarray]:
    """{seed: the primary split's per-window losses} of a method's finished runs at its chosen learning rate."""
    chosen = chosen_lr(out, base, SETTING, method)
    runs = {}
    for lr, seed, run in run_folders(method_folder(out, base, SETTING, method)):
        windows = read_json(run / "windows.json").get(PRIMARY)
        if windows is not None and chosen is not None and float(lr) == chosen:
            runs[seed] = np.asarray(windows, dtype=float)
    return runs


def contrast(out: Path, base: str, control: str, resamples: int) -> dict | None:
    """pre-proj + skip minus the control over their common seeds; None when fewer than two seeds are common."""
    arm, ref = seed_windows(out, base, ARM), seed_windows(out, base, control)
    seeds = sorted(set(arm) & set(ref))
    if len(seeds) < 2:
        return None
    a, b = np.stack([arm[s] for s in seeds]), np.stack([ref[s] for s in seeds])
    t = paired_t(a.mean(axis=1) - b.mean(axis=1))
    low, high = two_level_bootstrap(a, b, resamples, SEED)
    return {"base": base, "control": control, "question": CONTRASTS[control], "seeds": seeds, **t,
            "boot_low": low, "boot_high": high}


def contrasts(out: Path, bases: list[str], resamples: int = RESAMPLES) -> list[dict]:
    """Every pre-registered contrast that has runs, Holm-adjusted over the whole pre-registered family (every
    control on every base): a test whose arms have not run yet counts as p = 1, so that a grid still running never
    shows a milder adjustment than the family it was registered with."""
    rows = [r for base in bases for control in CONTRASTS if (r := contrast(out, base, control, resamples))]
    family = {f"{base}/{control}": 1.0 for base in bases for control in CONTRASTS}
    adjusted = holm(family | {f"{r['base']}/{r['control']}": r["p"] for r in rows})
    for r in rows:
        r["p_holm"] = adjusted[f"{r['base']}/{r['control']}"]
        r["verdict"] = verdict(r["mean"], r["p_holm"])
    return rows


def verdict(difference: float, p_holm: float) -> str:
    """The decision rule: decided below ALPHA, in the direction of pre-proj + skip minus the control."""
    if p_holm >= ALPHA:
        return "not shown"
    return "supported" if difference < 0 else "reversed"


def table(rows: list[dict]) -> str:
    header = ["base", "pre-proj + skip minus", "seeds", "difference", "95% t-interval", "95% two-level bootstrap",
              "p", "p (Holm)", "verdict"]
    cells = [[r["base"], METHODS[r["control"]].label, len(r["seeds"]), r["mean"], f"[{r['low']:.4f}, {r['high']:.4f}]",
              f"[{r['boot_low']:.4f}, {r['boot_high']:.4f}]", r["p"], r["p_holm"], r["verdict"]] for r in rows]
    return format_table(header, cells, markdown=True)


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(prog="python -m study.contrasts", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(OUT), help="the experiment's run folders")
    p.add_argument("--bases", default="study,nano", help="comma-separated bases, the primary first")
    p.add_argument("--resamples", type=positive_int, default=RESAMPLES, help="draws of the two-level bootstrap")
    p.add_argument("--json", type=out_file, default=None, help="also write the rows to this JSON file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = get_args(argv)
    rows = contrasts(Path(args.out), [b for b in args.bases.split(",") if b], args.resamples)
    print(table(rows) if rows else "no contrast has two seeds in both arms yet")
    if args.json:
        try:
            write_atomic(Path(args.json), json.dumps(rows, indent=2))
        except DataError as e:
            raise SystemExit(f"error: {e}")
    return rows


if __name__ == "__main__":
    main()
