"""
The report: study/RESULTS.md, its bar charts and its layer figure (study/figures/), rebuilt from the finished run
folders of the grid (study/grid.py). Tables and figures are replaced; the hand-written reading between the
markers of READING is kept.

    python -m study.report                                   # from out/experiment into study/RESULTS.md
    python -m study.report --out OUT --results RESULTS.md    # other run folders; figures/ beside the results

A run counts once it has its held-out losses and at least one evaluation. The numbers of the tables come from the
run records alone (study/runs.tar.gz holds those of the grid behind RESULTS.md); the layer analysis runs
analyze_layers.py, which needs the runs' checkpoints. docs/screen.md describes every table.
"""

import argparse
import csv
import math
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

from data.sources import DataError, write_atomic
from lab.checkpoint import ROOT, CheckpointError, portable_name
from lab.cli import ArgumentParser, format_table, out_file, positive_int
from lab.evaluation import read_items, task_metrics
from lab.recipes import STUDY_BASE, flags
from lab.stats import RESAMPLES, by_task, check_same_items, last_over_first, paired_intervals, seed_mean, trend
from study.design import (
    BASES,
    METHODS,
    SETTINGS,
    STUDY_DIR,
    TEST_SPLITS,
    add_shared_args,
    baseline_folder,
    command,
    method_folder,
    read_json,
    run_folders,
    shared_flags,
)

COLUMNS = {  # a held-out split, or task/metric of a benchmark
    "sotu_test": "loss SOTU", "books_test": "loss book", "lambada/acc": "LAMBADA acc", "lambada/ppl": "LAMBADA ppl",
    "wikitext/bits_per_byte": "WikiText bpb", "hellaswag/acc_norm": "HellaSwag acc_norm",
    "arc_easy/acc_norm": "ARC-E acc_norm",
}
BENCH = [k for k in COLUMNS if "/" in k]
REFERENCES = ("baseline", "lora_matched")
LAYER_MEASURES = {"norm_skip": "‖W_skip‖_F", "share_attn": "‖W_skip·x̃‖ / ‖attn_out‖", "causal": "causal weight"}
READING = ("<!-- reading: kept when the tables are rebuilt -->", "<!-- /reading -->")


@dataclass
class RunRecord:
    """A finished run (or, for the baseline, the base itself): its numbers and its per-item records."""
    folder: Path
    values: dict[str, float]
    records: list[dict]
    measures: dict
    seconds: float | None  # training time; None when unknown (a training finished after its timer was killed)


def load_run_record(folder: Path) -> RunRecord | None:
    """A run with its held-out losses and at least one evaluation; None for anything less."""
    measures = read_json(folder / "measures.json")
    summaries = sorted(folder.glob("eval-*.json"))
    if not summaries or any(s not in measures for s in TEST_SPLITS):
        return None
    values = {s: measures[s] for s in TEST_SPLITS}
    records = []
    for summary in summaries:
        for task, r in read_json(summary)["results"].items():
            values.update({f"{task}/{name}": m["value"] for name, m in r["metrics"].items()})
        records += read_items(summary)
    return RunRecord(folder, values, records, measures, read_json(folder / "timing.json").get("train_seconds"))


def method_runs(folder: Path) -> tuple[float | None, list[RunRecord]]:
    """(lr, finished runs, one per seed) of a method in one base and setting: the runs at the lr its search chose,
    or, without a search record, at the lr with the most finished seeds."""
    by_lr: dict[str, list[RunRecord]] = {}
    for lr, _, f in run_folders(folder):
        record = load_run_record(f)
        if record:
            by_lr.setdefault(lr, []).append(record)
    if not by_lr:
        return None, []
    chosen = read_json(folder / "lr_search.json").get("chosen")
    key = f"{chosen:g}" if chosen is not None and f"{chosen:g}" in by_lr else max(by_lr, key=lambda k: len(by_lr[k]))
    return float(key), by_lr[key]


def collect(out: Path) -> dict[str, dict[str, dict[str, tuple[float | None, list[RunRecord]]]]]:
    """{base: {setting: {method: (lr, runs)}}} of everything finished; the baseline heads every setting."""
    order = list(BASES)
    folders = sorted((p for p in out.iterdir() if p.is_dir()), key=lambda p: (order.index(p.name)
                                                                            if p.name in order else len(order), p.name))
    results = {}
    for base_dir in folders:
        baseline = load_run_record(baseline_folder(out, base_dir.name))
        settings = {}
        for setting in SETTINGS:
            methods = {"baseline": (None, [baseline] if baseline else [])}
            methods.update({m: method_runs(method_folder(out, base_dir.name, setting, m))
                            for m in METHODS if m != "baseline"})
            methods = {m: v for m, v in methods.items() if v[1]}
            if set(methods) - {"baseline"}:
                settings[setting] = methods
        if settings:
            results[base_dir.name] = settings
    return results


def mean_sd(xs: list[float], digits: int = 4) -> str:
    """mean ± sample standard deviation over seeds (the mean alone for one)."""
    if not xs:
        return "-"
    mean = sum(xs) / len(xs)
    if len(xs) == 1:
        return f"{mean:.{digits}g}"
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
    return f"{mean:.{digits}g} ± {sd:.2g}"


def method_table(methods: dict) -> str:
    header = ["method", "lr", "trainable", "train s", *COLUMNS.values(), "seeds"]
    rows = []
    for m, (lr, runs) in methods.items():
        rows.append([METHODS[m].label, "-" if lr is None else f"{lr:g}", f"{runs[0].measures['trainable']:,}",
                     mean_sd([r.seconds for r in runs if r.seconds is not None], 3),
                     *(mean_sd([r.values[k] for r in runs if k in r.values]) for k in COLUMNS), len(runs)])
    return format_table(header, rows, markdown=True)


def comparisons(methods: dict, resamples: int) -> dict[tuple[str, str, str], tuple[float, float, float]]:
    """(reference, method, benchmark metric) -> (method - reference, 95% low, 95% high). Seeds are pooled: per
    item, each method's score is averaged over its seeds, and the paired bootstrap resamples items (one set of
    draws per metric, shared by every pair)."""
    found = {}
    for key in BENCH:
        task, name = key.split("/")
        runs = {m: [by_task(r.records).get(task) for r in rs] for m, (_, rs) in methods.items()}
        runs = {m: rs for m, rs in runs.items() if all(rs)}
        refs = [r for r in REFERENCES if r in runs]
        if not refs:
            continue
        for rs in runs.values():  # every method scored the same items as the first reference
            check_same_items({task: runs[refs[0]][0]}, {task: rs[0]})
        metric = task_metrics(task, runs[refs[0]][0][0]["protocol"])[name]
        sides = {m: seed_mean(rs, metric) for m, rs in runs.items()}
        pairs = [(ref, m) for ref in refs for m in sides if m != ref]
        for (a, b), (low, high) in paired_intervals(sides, pairs, metric.transform, resamples).items():
            value = {m: float(metric.transform(sides[m][0].sum() / sides[m][1].sum())) for m in (a, b)}
            found[(a, b, key)] = (value[b] - value[a], low, high)
    return found


def beyond_noise(low: float, high: float) -> bool:
    return low > 0 or high < 0


def comparison_section(methods: dict, found: dict, ref: str) -> str:
    """A table of each method against one reference, and a plain statement of which differences are noise."""
    keys = [k for k in BENCH if any((ref, m, k) in found for m in methods)]
    rows, beyond = [], []
    for m in methods:
        cells = []
        for k in keys:
            if (ref, m, k) not in found:
                cells.append("-")
                continue
            diff, low, high = found[(ref, m, k)]
            cells.append(f"{diff:+.3g} [{low:+.3g}, {high:+.3g}]" + (" *" if beyond_noise(low, high) else ""))
            if beyond_noise(low, high):
                beyond.append(f"{METHODS[m].label}, {COLUMNS[k]} {diff:+.3g}")
        if any(c != "-" for c in cells):
            rows.append([METHODS[m].label, *cells])
    if not rows:
        return ""
    table = format_table(["method", *(f"Δ {COLUMNS[k]}" for k in keys)], rows, markdown=True)
    verdict = ("Beyond the noise of the items (the 95% interval excludes 0, marked *): " + "; ".join(beyond) +
               ". Every other difference is within noise." if beyond else "Every difference is within noise.")
    return f"Against {METHODS[ref].label}:\n\n{table}\n\n{verdict}"


def moved_table(methods: dict) -> str:
    """The share of pre-projection and skip entries that moved at all, per precision and lr."""
    kinds = ("w_up", "w_down", "w_skip")
    rows = [[METHODS[m].label, f"{lr:g}", *(mean_sd([100 * r.measures["moved"][k] for r in runs], 3) + " %"
                                             for k in kinds)]
            for m, (lr, runs) in methods.items() if m.startswith("preproj_skip")]
    return format_table(["method", "lr", *(f"{k} moved" for k in kinds)], rows, markdown=True) if rows else ""


def search_table(out: Path, base: str, setting: str) -> str:
    rows = []
    for m in METHODS:
        record = read_json(method_folder(out, base, setting, m) / "lr_search.json")
        if record:
            losses = ", ".join(f"{lr}: {loss:.4f}" for lr, loss in record["losses"].items())
            rows.append([METHODS[m].label, record["split"], losses, f"{record['chosen']:g}"])
    return format_table(["method", "scored on", "loss per lr", "chosen"], rows, markdown=True) if rows else ""


def base_table(results: dict) -> str:
    rows = []
    for base, settings in results.items():
        methods = next(iter(settings.values()))
        if "baseline" not in methods:
            continue
        run = methods["baseline"][1][0]
        shape = run.measures["shape"]
        rows.append([base, shape["n_layer"], shape["n_embd"], f"{shape['base_params']:,}",
                     *(f"{run.values[k]:.4g}" if k in run.values else "-" for k in COLUMNS)])
    return format_table(["base", "layers", "d", "parameters", *COLUMNS.values()], rows, markdown=True)


def bar_charts(results: dict, found: dict, fig_dir: Path) -> list[Path]:
    """A PNG per metric: each method minus the baseline, a panel per base and setting. Intervals: the paired
    bootstrap's 95% over items for benchmarks, the min-max over seeds for held-out losses."""
    import matplotlib
    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    panels = [(b, s) for b in results for s in results[b] if "baseline" in results[b][s]]
    paths = []
    for key, header in COLUMNS.items() if panels else ():
        fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 5), squeeze=False)
        for ax, (base, setting) in zip(axes[0], panels):
            methods, bars = results[base][setting], []
            for m, (_, runs) in methods.items():
                if "/" in key and ("baseline", m, key) in found[(base, setting)]:
                    bars.append((METHODS[m].label, *found[(base, setting)][("baseline", m, key)]))
                elif "/" not in key and m != "baseline":
                    deltas = [r.values[key] - methods["baseline"][1][0].values[key] for r in runs]
                    bars.append((METHODS[m].label, sum(deltas) / len(deltas), min(deltas), max(deltas)))
            x = range(len(bars))
            ax.bar(x, [b[1] for b in bars], yerr=[[b[1] - b[2] for b in bars], [b[3] - b[1] for b in bars]],
                   capsize=3, color="tab:blue")
            ax.axhline(0.0, color="black", lw=0.8)
            ax.set_xticks(list(x), [b[0] for b in bars], rotation=60, ha="right", fontsize=8)
            ax.set_title(f"{base}, {setting}", fontsize=10)
            ax.grid(axis="y", alpha=0.3)
        spread = "95% paired bootstrap over items" if "/" in key else "min-max over seeds"
        fig.suptitle(f"{header}: method - baseline (bars: mean over seeds; intervals: {spread})", fontsize=11)
        fig.tight_layout()
        paths.append(fig_dir / f"delta_{key.replace('/', '_')}.png")
        # atomic, so that a full disk leaves the previous figure whole
        write_atomic(paths[-1], lambda tmp, fig=fig: fig.savefig(tmp, format="png", dpi=100))
        plt.close(fig)
    return paths


def layer_section(results: dict, args, fig_dir: Path) -> str:
    """analyze_layers.py over every finished pre-proj + skip run (depth fraction, the paper's curves overlaid),
    and the growth statistics per base and setting with their range over seeds."""
    # run folders named as checkpoints record their bases: relative to the project, so the csv holds no machine paths
    runs = {(b, s): [portable_name(str(r.folder)) for r in results[b][s]["preproj_skip"][1]]
            for b in results for s in results[b] if "preproj_skip" in results[b][s]}
    if not runs:
        return "No pre-proj + skip run has finished yet."
    out = fig_dir / "layers"
    argv = command("analyze_layers.py", "--ckpt", *(f for fs in runs.values() for f in fs), "--out", out, "--paper",
                   "--depth_fraction", "--tokens", args.layer_tokens, "--seq_len", args.seq_len, *shared_flags(args))
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"error: analyze_layers.py failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    per_run: dict[str, dict[str, list[float]]] = {}
    with open(out / "layers.csv") as f:
        for row in csv.DictReader(f):
            for k in LAYER_MEASURES:
                if row[k]:
                    per_run.setdefault(row["checkpoint"], {}).setdefault(k, []).append(float(row[k]))
    rows = []
    for (base, setting), folders in runs.items():
        for k, label in LAYER_MEASURES.items():
            series = [per_run[str(f)][k] for f in folders if k in per_run.get(str(f), {})]
            if series:
                rows.append([base, setting, label, value_range([trend(v) for v in series]),
                             value_range([last_over_first(v) for v in series]), len(series)])
    table = format_table(["base", "setting", "measure", "last quarter / first three quarters (ours)",
                          "last / first layer (the paper's)", "seeds"], rows, markdown=True)
    rel = out.relative_to(args.results.parent).as_posix()
    return (f"![layer analysis]({rel}/layers.png)\n\nThe three measures of `analyze_layers.py` per layer (x: depth "
            f"fraction; dotted: the paper's Figure 2; bands: min-max over seeds). Growth statistics, mean "
            f"[min, max] over seeds:\n\n{table}")


def value_range(xs: list[float]) -> str:
    return f"{sum(xs) / len(xs):.3g} [{min(xs):.3g}, {max(xs):.3g}]"


def shown(init_from: str) -> str:
    """A base as RESULTS.md names it: a path inside the project relative to it, any other path by its name."""
    path = Path(init_from)
    if not path.is_absolute():
        return init_from
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name


def study_base_command() -> str:
    """How the study base is pre-trained, as the grid runs it (without the flags of where it computes)."""
    return f"python train.py {shlex.join(flags(STUDY_BASE))} --out_dir {shown(str(STUDY_DIR))}"


def setup_section(out: Path) -> str:
    g = read_json(out / "grid.json")
    if not g:
        return "(no grid.json: the settings of the runs are not recorded)"
    limits = ", ".join(f"{t} {'all' if n == 0 else f'first {n}'}" for t, n in g["limits"].items())
    settings = "; ".join(f"`{name}`, {s.label} (lr search on `{s.search}`)" for name, s in SETTINGS.items())
    heldout = f"the first {g['heldout_tokens']:,} tokens" if g.get("heldout_tokens") else "all their tokens"
    study = (f" The study base is pre-trained once by `{study_base_command()}`."
             if "study" in g["bases"] else "")
    grids = [", ".join(f"{x:g}" for x in g[k]) + (" (fixed)" if len(g[k]) == 1 else "") for k in ("lrs", "full_lrs")]
    return "\n".join([
        "- Bases: " + ", ".join(f"`{b}` ({shown(i)})" for b, i in g["bases"].items()) + "." + study,
        f"- Settings: {settings}. Data splits: `python -m data.prepare` and its docstring.",
        "- Held-out losses on every run: " + "; ".join(f"`{k}` ({v})" for k, v in TEST_SPLITS.items()) +
        f", over {heldout} in windows of {g['seq_len']} tokens. Neither is trained on or used by the lr search.",
        f"- Training: {g['steps']} steps of {g['batch_size']} x {g['seq_len']} tokens, AdamW, 10% warm-up then "
        f"cosine to lr / 10, compute dtype {g['dtype']}, seeds {', '.join(map(str, g['seeds']))}.",
        f"- Learning rates: searched at seed {g['seeds'][0]} over {grids[0]} (probes) and {grids[1]} (full "
        f"fine-tune), the lowest loss on the setting's search split wins; the "
        f"paper's {g['paper_lr']:g} as extra rows; the paper's precision at pre-proj + skip's chosen lr and at "
        f"{g['paper_lr']:g}.",
        f"- Benchmarks (lm-eval protocol, eval_lambada.py): {limits}.",
        "- Statistics: mean ± sample standard deviation over seeds; paired bootstrap 95% intervals over the items "
        "(each method's per-item score averaged over its seeds, so the interval is the item noise of the seed "
        f"mean), {RESAMPLES:,} draws, seed 1234, one set of draws shared by every comparison of a metric."])


def kept_reading(path: Path) -> str:
    """The hand-written reading of an earlier RESULTS.md, or a placeholder for it."""
    text = path.read_text() if path.is_file() else ""
    if READING[0] in text and READING[1] in text:
        return text[text.index(READING[0]):text.index(READING[1]) + len(READING[1])]
    return (f"{READING[0]}\n## Reading\n\n(To be written from the tables below: what replicates, what does not, what "
            f"the controls show, and what only a GPU run on Pythia can settle.)\n{READING[1]}")


def setting_sections(out: Path, base: str, setting: str, methods: dict, found: dict) -> list[str]:
    parts = [f"## {base}: {SETTINGS[setting].label}", method_table(methods)]
    parts += [sec for ref in REFERENCES if ref in methods and (sec := comparison_section(methods, found, ref))]
    if moved := moved_table(methods):
        parts += ["Share of pre-projection and skip entries that moved at all from their initial values "
                  "(bf16 weights without a master copy lose updates below half a bf16 step):", moved]
    if searched := search_table(out, base, setting):
        parts += ["Learning-rate search (first seed, loss on the search split):", searched]
    return parts


def write_results(args) -> None:
    """RESULTS.md and its figures from the finished runs under --out."""
    results = collect(args.out) if args.out.is_dir() else {}
    if not results:
        raise SystemExit(f"error: no finished run under {args.out}; run `python -m study.grid` first")
    fig_dir = args.results.parent / "figures"
    fig_dir.mkdir(parents=True, exist_ok=True)
    try:
        found = {(b, s): comparisons(methods, args.resamples)
                 for b, settings in results.items() for s, methods in settings.items()}
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    parts = ["# Results: the paper's Table 2 and Figure 2 re-measured, with controls",
             "Generated by `python -m study.report` from the run folders of `python -m study.grid` "
             "(docs/experiment.md); rebuilt tables replace these, the reading between the markers is kept.",
             kept_reading(args.results), "## Setup", setup_section(args.out), "## Bases", base_table(results)]
    for base, settings in results.items():
        for setting, methods in settings.items():
            parts += setting_sections(args.out, base, setting, methods, found[(base, setting)])
    charts = bar_charts(results, found, fig_dir)
    parts += ["## Each method against the baseline"]
    parts += [f"![{p.stem}]({p.relative_to(args.results.parent).as_posix()})" for p in charts]
    parts += ["## Layer analysis", layer_section(results, args, fig_dir)]
    write_atomic(args.results, "\n\n".join(parts) + "\n")
    print(f"wrote {args.results} and {len(charts)} charts in {fig_dir}")




def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(prog="python -m study.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shared_args(p)
    p.add_argument("--results", type=out_file, default=str(ROOT / "study" / "RESULTS.md"),
                   help="the file written, figures/ beside it")
    p.add_argument("--resamples", type=positive_int, default=RESAMPLES, help="bootstrap draws of the comparisons")
    p.add_argument("--layer_tokens", type=positive_int, default=16384, help="held-out tokens of the layer analysis")
    args = p.parse_args(argv)
    args.out, args.results = Path(args.out).resolve(), Path(args.results).resolve()
    return args


def main(argv: list[str] | None = None) -> None:
    try:
        write_results(get_args(argv))
    except (CheckpointError, DataError) as e:
        raise SystemExit(f"error: {e}")


if __name__ == "__main__":
    main()
