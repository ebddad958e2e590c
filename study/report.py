"""
The report: study/RESULTS.md and its figures (study/figures/), rebuilt from run records alone, no checkpoints and no
training: first the 500-step experiment (study/results.py, from study/experiment-500.tar.gz, which
`python -m study.records` packs), then the 30-step screen before it (from study/runs.tar.gz), labelled as the short
horizon it is. Tables and figures are replaced; the hand-written reading between the markers of READING is kept.

    python -m study.report                              # from the committed records into study/RESULTS.md
    python -m study.report --out out/experiment-500     # the experiment from its run folders (while it runs)
    python -m study.report --results R.md               # another file, figures/ beside it

The screen's statistics take the seed as the unit: each comparison is a 95% t-interval over seeds (paired by seed
against another method; against the frozen base, one model, the seeds' differences from it), and a star marks only
what survives Holm's adjustment over every comparison of the screen. docs/screen.md describes its tables.
"""

import argparse
import math
import re
import shlex
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from data.sources import DataError, write_atomic
from lab.checkpoint import ROOT, CheckpointError
from lab.cli import ArgumentParser, format_table, out_file, positive_int
from lab.recipes import STUDY_BASE, flags
from lab.stats import RESAMPLES, holm, paired_t
from study import records, results
from study.design import (
    BASES,
    METHODS,
    SETTINGS,
    STUDY_DIR,
    TEST_SPLITS,
    baseline_folder,
    method_folder,
    read_json,
    run_folders,
)

COLUMNS = {  # a held-out split, or task/metric of a benchmark
    "sotu_test": "loss SOTU", "books_test": "loss book", "lambada/acc": "LAMBADA acc", "lambada/ppl": "LAMBADA ppl",
    "wikitext/bits_per_byte": "WikiText bpb", "hellaswag/acc_norm": "HellaSwag acc_norm",
    "arc_easy/acc_norm": "ARC-E acc_norm",
}
BENCH = [k for k in COLUMNS if "/" in k]
REFERENCES = ("baseline", "lora_matched")
ALPHA = 0.05
EXPERIMENT_RECORDS, SCREEN_RECORDS = records.TARBALL, ROOT / "study" / "runs.tar.gz"
READING = ("<!-- reading: kept when the tables are rebuilt -->", "<!-- /reading -->")
# Where the reading turns from the experiment to the screen, and the heading of the screen's generated sections.
SCREEN_READING = "<!-- the screen's reading -->"
SCREEN_HEADING = "# The 30-step screen"


@dataclass
class RunRecord:
    """A finished run of the screen (or, for the baseline, the base itself): its numbers."""
    folder: Path
    seed: int | None  # None for the baseline
    values: dict[str, float]
    measures: dict
    seconds: float | None  # training time; None when unknown (a training finished after its timer was killed)


def load_run_record(folder: Path, seed: int | None = None) -> RunRecord | None:
    """A run with its held-out losses and at least one evaluation; None for anything less."""
    measures = read_json(folder / "measures.json")
    summaries = sorted(folder.glob("eval-*.json"))
    if not summaries or any(s not in measures for s in TEST_SPLITS):
        return None
    values = {s: measures[s] for s in TEST_SPLITS}
    for summary in summaries:
        for task, r in read_json(summary)["results"].items():
            values.update({f"{task}/{name}": m["value"] for name, m in r["metrics"].items()})
    return RunRecord(folder, seed, values, measures, read_json(folder / "timing.json").get("train_seconds"))


def method_runs(folder: Path) -> tuple[float | None, list[RunRecord]]:
    """(lr, finished runs, one per seed) of a method in one base and setting: the runs at the lr its search chose,
    or, without a search record, at the lr with the most finished seeds."""
    by_lr: dict[str, list[RunRecord]] = {}
    for lr, seed, f in run_folders(folder):
        record = load_run_record(f, seed)
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


def comparisons(methods: dict) -> dict[tuple[str, str, str], dict]:
    """(reference, method, column) -> paired_t of method minus reference with the seed as the unit: paired by seed
    against another method (the seeds both have), against the frozen base (one model) its seeds' differences."""
    found = {}
    floor = floor_columns(methods)
    for ref in (r for r in REFERENCES if r in methods):
        ref_runs = {r.seed: r for r in methods[ref][1]}
        for m, (_, runs) in methods.items():
            if m == ref:
                continue
            for key in (k for k in COLUMNS if k not in floor):
                pairs = [(r, ref_runs[None] if ref == "baseline" else ref_runs.get(r.seed)) for r in runs]
                diffs = [r.values[key] - b.values[key] for r, b in pairs if b and key in r.values and key in b.values]
                if len(diffs) >= 2:
                    found[(ref, m, key)] = paired_t(diffs)
    return found


def floor_columns(methods: dict) -> list[str]:
    """The columns at the floor in a cell (results.at_floor over every run of it)."""
    return results.at_floor([r.values for _, runs in methods.values() for r in runs], COLUMNS)


def spread(t: dict) -> bool:
    """Whether the seeds' differences vary at all: with none, a t-test has no p-value to give."""
    return t["low"] < t["high"]


def adjust(found: dict) -> int:
    """Holm over every comparison of the screen that has a p-value (all bases and settings): each gains "p_holm"
    (the others 1.0); returns the family's size."""
    family = {(cell, key): t["p"] for cell, comps in found.items() for key, t in comps.items() if spread(t)}
    adjusted = holm(family)
    for cell, comps in found.items():
        for key, t in comps.items():
            t["p_holm"] = adjusted.get((cell, key), 1.0)
    return len(family)


def comparison_section(methods: dict, found: dict, ref: str) -> str:
    """A table of each method against one reference: the difference over seeds, its 95% t-interval, and a star
    where Holm's adjustment over the whole screen keeps p below ALPHA."""
    keys = [k for k in COLUMNS if any((ref, m, k) in found for m in methods)]
    rows = []
    for m in methods:
        cells = []
        for k in keys:
            t = found.get((ref, m, k))
            if t is None:
                cells.append("-")
            elif not spread(t):
                cells.append(f"{t['mean']:+.3g} (every seed)")
            else:
                cells.append(f"{t['mean']:+.3g} [{t['low']:+.3g}, {t['high']:+.3g}]" + (" *" if t["p_holm"] < ALPHA
                                                                                            else ""))
        if any(c != "-" for c in cells):
            rows.append([METHODS[m].label, *cells])
    if not rows:
        return ""
    table = format_table(["method", *(f"Δ {COLUMNS[k]}" for k in keys)], rows, markdown=True)
    floor = ", ".join(COLUMNS[k] for k in floor_columns(methods))
    note = f"\n\n{floor}: 0 for every run, at the floor." if floor else ""
    return f"Against {METHODS[ref].label}:\n\n{table}{note}"


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


def bar_charts(screen: dict, found: dict, fig_dir: Path) -> list[Path]:
    """A PNG per column: each method minus the baseline, a panel per base and setting, the bars the mean over seeds,
    the intervals the 95% t-interval over seeds."""
    plt = results.pyplot()
    panels = [(b, s) for b in screen for s in screen[b] if "baseline" in screen[b][s]]
    paths = []
    for key, header in COLUMNS.items() if panels else ():
        if not any(("baseline", m, key) in found[cell] for cell in panels for m in screen[cell[0]][cell[1]]):
            continue  # a column at the floor everywhere: nothing to draw
        fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 5), squeeze=False)
        for ax, (base, setting) in zip(axes[0], panels):
            bars = [(METHODS[m].label, t["mean"], t["low"], t["high"]) for m in screen[base][setting]
                    if (t := found[(base, setting)].get(("baseline", m, key)))]
            x = range(len(bars))
            ax.bar(x, [b[1] for b in bars], yerr=[[b[1] - b[2] for b in bars], [b[3] - b[1] for b in bars]],
                   capsize=3, color="tab:blue")
            ax.axhline(0.0, color="black", lw=0.8)
            ax.set_xticks(list(x), [b[0] for b in bars], rotation=60, ha="right", fontsize=8)
            ax.set_title(f"{base}, {setting}", fontsize=10)
            ax.grid(axis="y", alpha=0.3)
        fig.suptitle(f"{header}: method - baseline, 30-step screen (mean and 95% t-interval over seeds)", fontsize=11)
        fig.tight_layout()
        paths.append(fig_dir / f"screen_delta_{key.replace('/', '_')}.png")
        results.save(fig, paths[-1])
    return paths


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
        "- Statistics: mean ± sample standard deviation over seeds in the tables of each setting; each comparison a "
        "95% t-interval over seeds (n - 1 degrees of freedom; paired by seed against another method, the seeds' "
        "differences against the frozen base); * where Holm's adjustment over every comparison of the screen keeps "
        f"p below {ALPHA}. The items are the same for every run, so a seed's benchmark score already holds the "
        "items' noise that two methods do not share."])


def kept_reading(path: Path) -> str:
    """The hand-written reading of an earlier RESULTS.md, or a placeholder for it."""
    text = path.read_text() if path.is_file() else ""
    if READING[0] in text and READING[1] in text:
        return text[text.index(READING[0]):text.index(READING[1]) + len(READING[1])]
    return (f"{READING[0]}\n## Reading\n\n(To be written from the tables below: what replicates, what does not, what "
            f"the controls show, and what only a GPU run on Pythia can settle.)\n{READING[1]}")


NUMBER = re.compile(r"(?<![\w.])(?>(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:e[+-]?\d+)?)(?=x\b|[^\w.]|\.(?!\w)|$)")
NOT_FIGURES = re.compile(r"`[^`]*`|arXiv \d+\.\d+|et al\. \d{4}|(?:Table|Figure) \d+|[A-Za-z]\w*-\d+\w*")


def figures(text: str) -> set[str]:
    """The numbers of a text as written, without their signs: names, commands and citations left out."""
    return set(NUMBER.findall(NOT_FIGURES.sub(" ", text)))


def unquoted_numbers(results: str) -> list[str]:
    """The numbers of RESULTS.md's hand-written reading that its generated part (tables, setup, notes) does not
    show: a figure gone stale when the tables were rebuilt, or mistyped. Every number counts, as written (0.141
    and 0.1410 differ), except inside code, names such as pythia-160m, and citations; a small integer can still
    match by chance, so the check is sharpest on measured figures. A reading split by SCREEN_READING is checked
    part by part: what it says of the experiment against the experiment's tables, what follows against the
    screen's, so that a stale figure cannot pass by matching a cell of the other grid."""
    start, end = results.index(READING[0]), results.index(READING[1]) + len(READING[1])
    reading, generated = results[start:end], results[:start] + results[end:]
    parts = [(reading, generated)]
    if SCREEN_READING in reading and SCREEN_HEADING in generated:
        (r_exp, r_screen), (g_exp, g_screen) = reading.split(SCREEN_READING, 1), generated.split(SCREEN_HEADING, 1)
        parts = [(r_exp, g_exp), (r_screen, SCREEN_HEADING + g_screen)]
    return sorted(set().union(*(figures(r) - figures(g) for r, g in parts)))


def setting_sections(out: Path, base: str, setting: str, methods: dict, found: dict) -> list[str]:
    parts = [f"## {base}: {SETTINGS[setting].label}", method_table(methods)]
    parts += [sec for ref in REFERENCES if ref in methods and (sec := comparison_section(methods, found, ref))]
    if moved := moved_table(methods):
        parts += ["Share of pre-projection and skip entries that moved at all from their initial values "
                  "(bf16 weights without a master copy lose updates below half a bf16 step):", moved]
    if searched := search_table(out, base, setting):
        parts += ["Learning-rate search (first seed, loss on the search split):", searched]
    return parts


def screen_sections(screen_out: Path, fig_dir: Path) -> list[str]:
    """The 30-step screen's sections, its statistics as the module docstring states them."""
    screen = collect(screen_out)
    found = {(b, st): comparisons(methods) for b, settings in screen.items() for st, methods in settings.items()}
    n = adjust(found)
    hits = sum(t["p"] < ALPHA and spread(t) for comps in found.values() for t in comps.values())
    kept = sum(t["p_holm"] < ALPHA for comps in found.values() for t in comps.values())
    parts = [f"{SCREEN_HEADING} (a short horizon: 30 steps of 8 x 256 tokens)",
             "The grid before the experiment, kept as the screen whose ranking the experiment tests at the paper's "
             "horizon (docs/screen.md). Its layer analysis needed checkpoints that were not kept and is not rebuilt; "
             "the experiment's replaces it.",
             f"Multiplicity: {n} comparisons with a p-value (every method against the frozen base and against matched "
             f"LoRA, every column off the floor, every base and setting; a difference the same for every seed has "
             f"none and is marked so); {hits} have p < {ALPHA} unadjusted, {kept} after Holm's adjustment (starred).",
             "## Setup", setup_section(screen_out), "## Bases", base_table(screen)]
    for base, settings in screen.items():
        for setting, methods in settings.items():
            parts += setting_sections(screen_out, base, setting, methods, found[(base, setting)])
    parts += ["## Each method against the baseline"]
    parts += [f"![{p.stem}]({p.relative_to(fig_dir.parent).as_posix()})" for p in bar_charts(screen, found, fig_dir)]
    return parts


def write_results(args) -> None:
    """RESULTS.md and its figures from the records: the experiment's, then the screen's."""
    fig_dir = args.results.parent / "figures"
    with tempfile.TemporaryDirectory() as tmp:
        experiment = args.out or (records.unpack(EXPERIMENT_RECORDS, Path(tmp) / "experiment")
                                  if EXPERIMENT_RECORDS.is_file() else None)
        screen = args.screen or records.unpack(SCREEN_RECORDS, Path(tmp) / "screen")
        for folder in (f for f in (experiment, screen) if f is not None):
            if not (folder / "grid.json").is_file():
                raise SystemExit(f"error: {folder} holds no grid (no grid.json)")
        parts = ["# Results: the paper's Table 2 and Figure 2 re-measured, with controls",
                 "Generated by `python -m study.report` from the committed run records (study/experiment-500.tar.gz, "
                 "study/runs.tar.gz); rebuilt tables replace these, the reading between the markers is kept.",
                 kept_reading(args.results)]
        if experiment is not None:
            parts += results.sections(experiment, args.bases, fig_dir, args.resamples)
        parts += screen_sections(screen, fig_dir)
    text = "\n\n".join(parts) + "\n"
    write_atomic(args.results, text)
    print(f"wrote {args.results} and its figures in {fig_dir}")
    if stale := unquoted_numbers(text):
        print(f"warning: the reading quotes numbers that no table shows (stale or mistyped): {', '.join(stale)}",
              file=sys.stderr)


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(prog="python -m study.report", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="the experiment's run folders (default: its committed records)")
    p.add_argument("--screen", default=None, help="the screen's run folders (default: its committed records)")
    p.add_argument("--bases", default=",".join(BASES), help="the experiment's bases, the primary first")
    p.add_argument("--results", type=out_file, default=str(ROOT / "study" / "RESULTS.md"),
                   help="the file written, figures/ beside it")
    p.add_argument("--resamples", type=positive_int, default=RESAMPLES, help="draws of the contrasts' bootstrap")
    args = p.parse_args(argv)
    args.out, args.screen = (Path(f).resolve() if f else None for f in (args.out, args.screen))
    args.results, args.bases = Path(args.results).resolve(), [b for b in args.bases.split(",") if b]
    return args


def main(argv: list[str] | None = None) -> None:
    try:
        write_results(get_args(argv))
    except (CheckpointError, DataError) as e:
        raise SystemExit(f"error: {e}")


if __name__ == "__main__":
    main()
