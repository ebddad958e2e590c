"""
The 500-step experiment's part of RESULTS.md (docs/experiment.md): its tables and figures, computed from the run
records alone (no checkpoints), so that `python -m study.report` rebuilds it from study/experiment-500.tar.gz.

Everything here follows the pre-registration: the four contrasts per base with Holm over all of them
(study/contrasts.py) carry the claims; every other comparison is secondary, a t-interval over seeds (the seed is the
unit), unadjusted and labelled so. A benchmark at its floor (every run scoring 0) is reported as such.
"""

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from data.sources import write_atomic
from lab.cli import format_table
from lab.stats import RESAMPLES, paired_t
from study import contrasts, layers
from study.design import (
    CONTRASTS,
    EXPERIMENT_METHODS,
    METHODS,
    TEST_SPLITS,
    baseline_folder,
    chosen_lr,
    method_folder,
    read_json,
    run_folders,
)

SETTING = "ood"
BENCH = {"lambada/acc": "LAMBADA acc", "lambada/ppl": "LAMBADA ppl", "wikitext/bits_per_byte": "WikiText bpb"}
CURVE = "sotu_search_loss"  # the learning curves: the search split's loss every CURVE_INTERVAL steps
OUTPUT_MATRIX = {"skip": "w_skip", "preproj": "w_down", "side_mlp": "w_a_down", "lora": "proj"}  # a term's growth


@dataclass
class Run:
    """One finished run's numbers (the baseline: the base itself)."""
    seed: int | None
    values: dict[str, float]  # held-out losses (TEST_SPLITS) and benchmark metrics (BENCH)
    curve: dict[int, float] = field(default_factory=dict)  # step -> search-split loss
    moved: dict[str, float] = field(default_factory=dict)
    layers: dict = field(default_factory=dict)  # layers.json


def read_run(folder: Path, seed: int | None) -> Run | None:
    """A run with its held-out losses; None before they are measured."""
    measures = read_json(folder / "measures.json")
    if any(s not in measures for s in TEST_SPLITS):
        return None
    values = {s: measures[s] for s in TEST_SPLITS}
    for summary in sorted(folder.glob("eval-*.json")):
        for task, r in read_json(summary)["results"].items():
            values.update({f"{task}/{k}": m["value"] for k, m in r["metrics"].items() if f"{task}/{k}" in BENCH})
    lines = (folder / "metrics.jsonl").read_text().splitlines() if (folder / "metrics.jsonl").is_file() else []
    rows = [json.loads(line) for line in lines if line.endswith("}")]
    return Run(seed, values, {r["step"]: r[CURVE] for r in rows if CURVE in r}, measures.get("moved", {}),
               read_json(folder / layers.RECORD))


def method_runs(out: Path, base: str, method: str) -> list[Run]:
    """A method's finished seeds at its chosen (or fixed) learning rate, by seed."""
    if method == "baseline":
        run = read_run(baseline_folder(out, base), None)
        return [run] if run else []
    lr = chosen_lr(out, base, SETTING, method)
    return [r for lr_text, seed, f in run_folders(method_folder(out, base, SETTING, method))
            if lr is not None and float(lr_text) == lr and (r := read_run(f, seed))]


def collect(out: Path, bases: list[str]) -> dict[str, dict[str, list[Run]]]:
    """{base: {method: runs}} of everything finished, in EXPERIMENT_METHODS order."""
    found = {b: {m: runs for m in EXPERIMENT_METHODS if (runs := method_runs(out, b, m))} for b in bases}
    return {b: methods for b, methods in found.items() if methods}


def interval_text(t: dict, digits: int = 4) -> str:
    """mean [low, high]; large values (perplexities) in 3 significant digits."""
    form = "+.3g" if abs(t["mean"]) >= 1e4 else f"+.{digits}f"
    return f"{t['mean']:{form}} [{t['low']:{form}}, {t['high']:{form}}]"


def at_floor(records: list[dict[str, float]], keys) -> list[str]:
    """The keys on which every record that has them scores exactly 0 (LAMBADA accuracy at this scale): nothing to
    compare there, and no claim."""
    values = {k: [r[k] for r in records if k in r] for k in keys}
    return [k for k, vs in values.items() if vs and all(v == 0 for v in vs)]


def against_baseline(methods: dict[str, list[Run]]) -> str:
    """Each method minus the frozen base, per held-out split and benchmark: mean over seeds and the 95% t-interval
    (seeds as the unit; the baseline is one deterministic model). Secondary: unadjusted, no claims."""
    if "baseline" not in methods:
        return "(the baseline has not been measured yet)"
    base = methods["baseline"][0].values
    floor = at_floor([r.values for runs in methods.values() for r in runs], BENCH)
    keys = [k for k in (*TEST_SPLITS, *BENCH) if k in base and k not in floor]
    rows = []
    for m, runs in methods.items():
        if m == "baseline" or len(runs) < 2:
            continue
        cells = [interval_text(paired_t([r.values[k] - base[k] for r in runs]))
                 if all(k in r.values for r in runs) else None for k in keys]
        rows.append([METHODS[m].label, len(runs), *cells])
    header = ["method", "seeds", *(f"Δ {TEST_SPLITS.get(k, BENCH.get(k))}" for k in keys)]
    note = f" {', '.join(BENCH[k] for k in floor)}: 0 for every run, at the floor, no claim." if floor else ""
    baseline = ", ".join(f"{TEST_SPLITS.get(k, BENCH.get(k))} {base[k]:.4g}" for k in keys)
    return (f"The frozen base: {baseline}.{note}\n\n" + format_table(header, rows, markdown=True)
            if rows else "(no method has two seeds yet)")


def search_table(out: Path, base: str) -> str:
    rows = []
    for m in EXPERIMENT_METHODS:
        record = read_json(method_folder(out, base, SETTING, m) / "lr_search.json")
        if record:
            losses = ", ".join(f"{float(lr):g}: {loss:.4f}" for lr, loss in record["losses"].items())
            rows.append([METHODS[m].label, losses, f"{record['chosen']:g}", "yes" if record["at_edge"] else "no"])
    return format_table(["method", "sotu_search loss at step 500, per lr (seed 42)", "chosen",
                         "still on an edge"], rows, markdown=True) if rows else ""


def paper_rows(methods: dict[str, list[Run]]) -> str:
    """The paper's recipe rows: does lr 1e-5 learn in 500 steps, and how many entries never move."""
    if "baseline" not in methods:
        return ""
    base = methods["baseline"][0].values["sotu_test"]
    rows = []
    for m in ("preproj_skip", "preproj_skip_lr1e-5", "preproj_skip_bf16_lr1e-5"):
        runs = methods.get(m, [])
        if len(runs) >= 2:
            moved = {k: np.mean([r.moved[k] for r in runs]) for k in ("w_up", "w_down", "w_skip")}
            rows.append([METHODS[m].label, len(runs), interval_text(paired_t([r.values["sotu_test"] - base
                                                                               for r in runs])),
                         *(f"{100 * v:.1f} %" for v in moved.values())])
    return format_table(["method", "seeds", "Δ held-out loss, State of the Union (95% t)", "W_up moved",
                         "W_down moved", "W_skip moved"], rows, markdown=True) if rows else ""


def curve_by_step(runs: list[Run]) -> dict[int, list[float]]:
    """A method's learning curve: the search split's loss of each seed at every step all its seeds logged."""
    steps = set.intersection(*(set(r.curve) for r in runs)) if runs else set()
    return {s: [r.curve[s] for r in runs] for s in sorted(steps)}


def curve_table(methods: dict[str, list[Run]]) -> str:
    """The learning curves in numbers: the search split's loss at every logged step, mean and sample standard
    deviation over the seeds at each method's chosen rate (the figure's points), so the early ranking can be read
    and quoted."""
    def cell(values: list[float] | None) -> str:
        if values is None:
            return "-"
        return f"{np.mean(values):.4f} ± {np.std(values, ddof=1):.4f}" if len(values) > 1 else f"{values[0]:.4f}"

    curves = {m: c for m, runs in methods.items() if (c := curve_by_step(runs))}
    steps = sorted(set().union(*curves.values()))
    rows = [[METHODS[m].label, len(methods[m]), *(cell(c.get(s)) for s in steps)] for m, c in curves.items()]
    return format_table(["method", "seeds", *(f"step {s}" for s in steps)], rows, markdown=True) if rows else ""


def machine_time(out: Path) -> str:
    """Training time of every run of the grid, searches included (evaluations not counted): the totals, and the
    median training, which a busy or paused spell of the machine leaves alone."""
    timings = [read_json(f) for f in out.rglob("timing.json")]
    walls, cpus = ([t.get(k, 0.0) for t in timings] for k in ("train_seconds", "train_cpu_seconds"))
    grid = read_json(out / "grid.json")
    cpu = grid.get("cpu", "CPU not recorded")
    return (f"runs trained {len(timings)}, {sum(cpus) / 3600:.1f} h of CPU time ({cpu}) "
            f"and {sum(walls) / 3600:.1f} h of wall time, which counts any pause of the grid or other work beside it; "
            f"the median training {statistics.median(walls):.0f} s of wall time and {statistics.median(cpus):.0f} s "
            f"of CPU time; at commit {str(grid.get('commit'))[:7]}.")


def setup(out: Path) -> str:
    """What was run, from grid.json: the design is docs/experiment.md's, this is the record of it."""
    g = read_json(out / "grid.json")
    if not g:
        return "(no grid.json: the settings of the runs are not recorded)"
    tasks = ", ".join(f"{t} {'in full' if n == 0 else f'first {n}'}" for t, n in g.get("limits", {}).items())
    return "\n".join([
        f"- Pre-registered in docs/experiment.md (commit ed53c0c); run by `{' '.join(g['command'])}` at commit "
        f"{g['commit'][:7]}{' (with uncommitted changes)' if g.get('dirty') else ''} on {g.get('cpu', '?')}.",
        f"- Bases: {', '.join(f'`{b}`' for b in g['bases'])} (the first is the primary analysis).",
        f"- Every run: {g['steps']} steps of {g['batch_size']} x {g['seq_len']} tokens of the State of the Union "
        f"addresses 1945-1992; learning rates searched at seed {g['seeds'][0]} over "
        f"{', '.join(f'{x:g}' for x in g['lrs'])} (up to {g['max_extend']} more points past an edge); seeds "
        f"{', '.join(map(str, g['seeds']))} at the chosen rate; the paper's lr {g['paper_lr']:g} as extra rows.",
        f"- Primary outcome: held-out loss on `sotu_test` (1997-2006); forgetting on `books_test`; benchmarks "
        f"(lm-eval protocol): {tasks}.",
        "- Contrasts: pre-proj + skip minus each control, paired by seed; 95% t-interval over seeds and p-value, "
        "the two-level bootstrap over seeds and held-out windows beside it, Holm over every contrast of every base; "
        f"supported when the adjusted p < {contrasts.ALPHA} and pre-proj + skip's loss is the lower, reversed when "
        f"the adjusted p < {contrasts.ALPHA} and the control's is."])


def layer_table(methods: dict[str, list[Run]]) -> str:
    """Per method and term: growth of the term's output matrix and the causal weights, over depth."""
    rows = []
    for m, runs in methods.items():
        records = [r.layers for r in runs if r.layers]
        if len(records) < 2:
            continue
        for term in records[0]["terms"]:
            growth = layers.summary(records, term, "growth", OUTPUT_MATRIX[term])
            zero = layers.summary(records, term, "zero")
            mean = layers.summary(records, term, "mean")
            share = paired_t([sum(r["terms"][term]["mean"]) / sum(r["terms"][term]["zero"]) for r in records
                              if sum(r["terms"][term]["zero"])])
            rows.append([METHODS[m].label, term, len(records),
                         interval_text(growth["slope, all layers"]), interval_text(growth["slope, without layer 0"]),
                         interval_text(growth["last / first, all layers"], 2),
                         interval_text(zero["slope, without layer 0"]),
                         *(f"{sum(r['mean'] for r in t['layers']):.4f}" for t in (zero, mean)),
                         interval_text(share, 2)])
    header = ["method", "term", "seeds", "‖W - W_0‖ slope per layer", "... without layer 0", "last / first",
              "zero-ablation slope, without layer 0", "Σ zero-ablation", "Σ mean-ablation", "mean / zero"]
    return format_table(header, rows, markdown=True) if rows else "(no layer analysis yet: `python -m study.layers`)"


def family_note(done: int, n_bases: int) -> str:
    """What Holm's adjustment of the contrasts table is over."""
    m = len(CONTRASTS) * n_bases
    pending = f"; the {m - done} not run yet count as p = 1 until they have run" if done < m else ""
    where = "on one base" if n_bases == 1 else f"on each of {n_bases} bases"
    return (f"p (Holm): adjusted over the {m} pre-registered tests ({len(CONTRASTS)} contrasts {where})"
            f"{pending}.")


def sections(out: Path, bases: list[str], fig_dir: Path | None = None, resamples: int = RESAMPLES) -> list[str]:
    """The experiment's Markdown sections, the contrasts first; figures into fig_dir, linked relative to its
    parent (the folder of RESULTS.md)."""
    collected = collect(out, bases)
    rows = contrasts.contrasts(out, bases, resamples)
    parts = ["## The 500-step experiment: pre-registered contrasts", setup(out),
             contrasts.table(rows) if rows else "(no contrast has two seeds in both arms yet)",
             family_note(len(rows), len(bases)),
             f"Machine time: {machine_time(out)}"]
    for name, draw in (("curves", curve_figure), ("layers", layer_figure)):
        if fig_dir is not None and (path := draw(collected, fig_dir / f"experiment_{name}.png")):
            parts.append(f"![{name}]({path.relative_to(fig_dir.parent).as_posix()})")
    for base, methods in collected.items():
        parts += [f"## {base}: each method against the frozen base (secondary, unadjusted)", against_baseline(methods)]
        if searched := search_table(out, base):
            parts += ["Learning-rate search:", searched]
        if curve := curve_table(methods):
            parts += [f"Learning curves ({CURVE.removesuffix('_loss')} loss at each method's chosen lr, mean ± sd "
                      "over seeds):", curve]
        if paper := paper_rows(methods):
            parts += ["The paper's recipe rows:", paper]
        parts += ["Layer analysis (`study/layers.py`; intervals: 95% t over seeds):", layer_table(methods)]
    return parts


# --- figures (linear axes: a log axis would hide the shape the paper reads) ---

def pyplot():
    """matplotlib's pyplot on the file-only backend (works without a display), imported when a figure is drawn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save(fig, path: Path) -> Path:
    """A figure written atomically, with no metadata that would change its bytes from one build to the next."""
    write_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100, metadata={"Software": None}))
    pyplot().close(fig)
    return path


def curve_figure(collected: dict, path: Path) -> Path | None:
    """The search split's loss every 50 steps, per base and method: mean over seeds at the chosen rate."""
    plt = pyplot()
    panels = [(b, m) for b, m in collected.items() if any(r.curve for runs in m.values() for r in runs)]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(max(9, 6 * len(panels)), 4.5), squeeze=False)
    for ax, (base, methods) in zip(axes[0], panels):
        for m, runs in methods.items():
            if curve := curve_by_step(runs):
                ax.plot(list(curve), [np.mean(v) for v in curve.values()], marker=".",
                        label=f"{METHODS[m].label} ({len(runs)} seed{'s' * (len(runs) != 1)})")
        ax.set(title=base, xlabel="step", ylabel="sotu_search loss (nats / token)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Learning curves: the search split's loss, mean over seeds at each method's chosen lr", fontsize=10)
    fig.tight_layout()
    return save(fig, path)


def layer_figure(collected: dict, path: Path) -> Path | None:
    """Per base, three panels over depth: the growth ‖W - W_0‖ of each term's output matrix, its zero-ablation
    and its mean-ablation; a line per method and term, bands the 95% t-interval over seeds."""
    from matplotlib.ticker import MaxNLocator
    plt = pyplot()
    series = {b: [(m, term, [r.layers for r in runs if r.layers]) for m, runs in methods.items()
                  for term in (next((r.layers for r in runs if r.layers), {}) or {}).get("terms", {})]
              for b, methods in collected.items()}
    series = {b: [s for s in rows if len(s[2]) >= 2] for b, rows in series.items()}
    series = {b: rows for b, rows in series.items() if rows}
    if not series:
        return None
    fig, axes = plt.subplots(len(series), 3, figsize=(16, 4.5 * len(series)), squeeze=False)
    for row, (base, rows) in zip(axes, series.items()):
        for ax, (measure, title) in zip(row, (("growth", "‖W - W_0‖_F of the term's output matrix"),
                                              ("zero", "Δ held-out loss, term zeroed"),
                                              ("mean", "Δ held-out loss, term set to its mean"))):
            for m, term, records in rows:
                stats = layers.summary(records, term, measure, OUTPUT_MATRIX[term] if measure == "growth" else None)
                depth = np.arange(len(stats["layers"]))
                mean = [t["mean"] for t in stats["layers"]]
                ax.plot(depth, mean, marker=".", label=f"{METHODS[m].label}: {term}")
                ax.fill_between(depth, [t["low"] for t in stats["layers"]], [t["high"] for t in stats["layers"]],
                                alpha=0.2)
            ax.set(title=f"{base}: {title}", xlabel="layer")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
        row[0].legend(fontsize=7)
    fig.tight_layout()
    return save(fig, path)
