"""
How much each layer uses the content skip, measured three ways (the paper's Figure 2 measures only the first).

    python analyze_layers.py                                   # the default probe, out/nano-preproj-skip
    python analyze_layers.py --paper                           # ... with the paper's Figure 2 numbers overlaid
    python analyze_layers.py --ckpt out/s1 out/s2 out/s3 --out out/seeds    # several seeds: mean and spread
    python analyze_layers.py --ckpt out/small out/deep         # different depths: x becomes depth fraction

Per layer of each checkpoint:
  weight norms  ‖W_skip‖_F, ‖W_up‖_F, ‖W_down‖_F, against their expected value at initialisation
  share         on held-out text, the mean over tokens of ‖W_skip·x̃‖ / ‖attn_out‖ and of ‖W_skip·x̃‖ / ‖x‖
  causal weight the increase in held-out loss when that layer's skip alone is zeroed
Held-out text is the run's own training domain, through the model's own tokenizer: WikiText-103 validation for a
probe trained on WikiText (the paper's), the State of the Union speeches from 1993 on (the `val` split) for the
embedded probe, the held-out book's last chapters for a probe on its first (`--data books`), a held-out book for a
model pre-trained here; the output names it. Checkpoints that differ only in their seed are drawn as one line (mean)
with a band (min-max). Writes layers.png (every measure),
layers_<measure>.png (one each) and layers.csv to --out. Two growth statistics are printed, each labelled: ours (the
last quarter of layers over the first three quarters) and the paper's (the last layer over the first).
"""

import argparse
import csv
import io
import math
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: works on machines without a display
import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.ticker import MaxNLocator

from data import text
from data.prepare import HELDOUT_TEXT, heldout_stream, probe_data
from data.sources import DataError, write_atomic, write_error
from lab.checkpoint import ROOT, RUN_SETTINGS, CheckpointError, is_run_folder, load_model, read_checkpoint, run_name
from lab.cli import ArgumentParser, device, format_table, out_folder, positive_int
from lab.evaluation import val_loss
from lab.precision import DTYPES, for_inference, prefer_flash_attention, resolve_dtype
from lab.stats import last_over_first, trend
from model import GPT

DEFAULT_RUN = ROOT / "out" / "nano-preproj-skip"

# measure -> (column header, panel title, y-axis label)
MEASURES = {
    "norm_skip": ("|W_skip|", "‖W_skip‖_F (the paper's measure)", "Frobenius norm"),
    "norm_up": ("|W_up|", "‖W_up‖_F (pre-projection, in)", "Frobenius norm"),
    "norm_down": ("|W_down|", "‖W_down‖_F (pre-projection, out)", "Frobenius norm"),
    "share_attn": ("skip/attn", "skip vs attention: mean ‖W_skip·x̃‖ / ‖attn_out‖", "ratio of norms"),
    "share_x": ("skip/x", "skip vs residual stream: mean ‖W_skip·x̃‖ / ‖x‖", "ratio of norms"),
    "causal": ("dloss", "causal weight: held-out loss increase, this skip zeroed", "Δ loss (nats / token)"),
}

# The paper's Figure 2: ‖W_skip‖_F per layer after its probe (d = n_embd, W_skip initialised N(0, 1e-4)).
PAPER_SKIP_NORMS = {
    "paper, Pythia-160M": (768, [0.1295, 0.1301, 0.1283, 0.1274, 0.1273, 0.1279, 0.1315, 0.1358, 0.1507, 0.1905,
                                 0.2575, 0.2959]),
    "paper, Pythia-410M": (1024, [0.2017, 0.1982, 0.1973, 0.1958, 0.1945, 0.1927, 0.1887, 0.1883, 0.1893, 0.1888,
                                  0.1887, 0.1911, 0.1928, 0.1949, 0.1948, 0.1983, 0.2048, 0.2070, 0.2117, 0.2153,
                                  0.2399, 0.2573, 0.2785, 0.2825]),
}
PAPER_SKIP_INIT_STD = 1e-4


@dataclass
class Analysis:
    """The per-layer measures of one checkpoint; `values` holds only the measures that apply to it."""
    label: str
    group: str  # checkpoints that differ only in their seed share a group
    group_name: str
    n_layer: int
    values: dict[str, list[float]]
    init: dict[str, float]  # measure -> expected value at initialisation (the weight norms)
    path: str = ""
    heldout: str = ""  # the held-out text of the share and causal measures (a data.prepare.HELDOUT_TEXT key)
    heldout_loss: float = math.nan
    tokens: int = 0
    members: list["Analysis"] = field(default_factory=list)  # a group's checkpoints (empty for one checkpoint)
    quoted: bool = False  # numbers quoted from the paper, not measured here


# --- the measures ---

def weight_norms(model: GPT) -> dict[str, list[float]]:
    """Frobenius norm of each layer's W_skip, W_up and W_down (those the model has)."""
    out = {}
    for key, attr in (("norm_skip", "w_skip"), ("norm_up", "w_up"), ("norm_down", "w_down")):
        if getattr(model.blocks[0], attr) is not None:
            out[key] = [getattr(b, attr).weight.detach().float().norm().item() for b in model.blocks]
    return out


def expected_init_norms(model: GPT) -> dict[str, float]:
    """E‖W‖_F ≈ std · sqrt(rows · cols) for a matrix drawn N(0, std), as init_new_params draws them."""
    c = model.config
    out = {}
    if c.skip:
        out["norm_skip"] = c.skip_init_std * c.n_embd
    if c.preproj:
        out["norm_up"] = out["norm_down"] = c.preproj_init_std * math.sqrt(c.n_embd * c.preproj_dim)
    return out


@torch.no_grad()
def skip_shares(model: GPT, stream: np.ndarray, seq_len: int, max_tokens: int,
                ctx=None) -> tuple[dict[str, list[float]], float]:
    """Per layer, the mean over held-out tokens of ‖W_skip·x̃‖/‖attn_out‖ and ‖W_skip·x̃‖/‖x‖; and the loss.

    Hooks read the tensors the block's own forward computes (x as it enters the block, attn_out, W_skip·x̃), so
    this measures the model as it runs rather than a re-implementation of it."""
    n = model.config.n_layer
    sums = {"share_attn": torch.zeros(n, dtype=torch.float64), "share_x": torch.zeros(n, dtype=torch.float64)}
    counts = torch.zeros(n, dtype=torch.float64)
    seen = {}

    def keep_x(i):
        return lambda module, args: seen.__setitem__(("x", i), args[0])

    def keep_attn(i):
        return lambda module, args, out: seen.__setitem__(("attn", i), out)

    def accumulate(i):  # W_skip runs after attention in Block.forward, so x and attn_out are already seen
        def hook(module, args, out):
            skip = out.float().norm(dim=-1)
            sums["share_attn"][i] += (skip / seen["attn", i].float().norm(dim=-1)).sum().item()
            sums["share_x"][i] += (skip / seen["x", i].float().norm(dim=-1)).sum().item()
            counts[i] += skip.numel()
        return hook

    handles = []
    for i, block in enumerate(model.blocks):
        handles += [block.register_forward_pre_hook(keep_x(i)), block.attn.register_forward_hook(keep_attn(i)),
                    block.w_skip.register_forward_hook(accumulate(i))]
    try:
        loss = val_loss(model, stream, seq_len, max_tokens, ctx)
    finally:
        for h in handles:
            h.remove()
    return {k: (v / counts).tolist() for k, v in sums.items()}, loss


def causal_weights(model: GPT, stream: np.ndarray, seq_len: int, max_tokens: int, base_loss: float,
                   ctx=None) -> list[float]:
    """Per layer, held-out loss with that layer's skip output replaced by zeros, minus the intact loss.
    The same tokens are scored each time, so the differences are paired and not swamped by text noise."""
    out = []
    for block in model.blocks:
        handle = block.w_skip.register_forward_hook(lambda module, args, y: torch.zeros_like(y))
        try:
            out.append(val_loss(model, stream, seq_len, max_tokens, ctx) - base_loss)
        finally:
            handle.remove()
    return out


# --- one checkpoint ---

def checkpoint_arg(arg: str) -> str:
    """A run folder, its ckpt.pt, or a model name, as load_model takes it; a missing path is an error."""
    path = Path(arg)
    if path.suffix == ".pt":
        if not path.is_file():
            raise SystemExit(f"error: {arg} does not exist")
        return str(path.parent)
    if not path.exists() and arg != "nano" and not arg.startswith(("pythia-", "EleutherAI/")):
        raise SystemExit(f"error: {arg} does not exist; pass a run folder (or its ckpt.pt) or a Pythia name "
                         f"(the default run is made by `python train.py --preproj --skip`)")
    return arg


def train_args_of(arg: str) -> dict | None:
    """The training settings saved in one of our run folders; None for a model name or another folder."""
    return read_checkpoint(Path(arg)).get("train_args") if is_run_folder(Path(arg)) else None


def identity(arg: str, model: GPT, train_args: dict | None) -> tuple[str, str, str]:
    """(label, group key, group name). Runs that share every setting defining them (checkpoint.RUN_SETTINGS) but the
    seed form a group, named like train.py names its run folders."""
    label = Path(arg.rstrip("/")).name or arg
    shape = f"{model.config.n_layer}x{model.config.n_embd}"
    if not train_args:  # a model name or a checkpoint from elsewhere: a group of its own
        return label, f"{arg} {shape}", label
    key = repr(sorted((k, train_args.get(k)) for k in RUN_SETTINGS if k != "seed")) + shape
    return label, key, run_name(train_args)


def heldout_of(train_args: dict | None, tokenizer) -> str:
    """The held-out text in the domain the run trained on (a HELDOUT_TEXT key, or the run's own --data path, whose
    held-out part it is): WikiText validation for a WikiText
    probe, the `val` split for a probe on the embedded corpus (and for checkpoints whose training is unknown), the
    book's last chapters for a probe on its first, the held-out book for a model pre-trained from scratch on the
    books."""
    if not train_args:
        return "val"
    if text.is_path(train_args.get("data", "auto")):  # your own text: its held-out part (data/text.py)
        return train_args["data"]
    if train_args["init_from"] == "scratch":
        return "val_books"
    data = probe_data(train_args.get("data", "auto"), train_args["init_from"], tokenizer)
    return {"wikitext103": "wikitext", "books": "books_test"}.get(data, "val")


def heldout_tokens(name: str, tokenizer, mirror: str | None) -> np.ndarray:
    """A held-out text (heldout_of) as one token stream."""
    if name in HELDOUT_TEXT:
        return heldout_stream(name, tokenizer, mirror)
    return text.load_parts(text.read_source(name), tokenizer)[0]["test"]


def heldout_label(name: str) -> str:
    return HELDOUT_TEXT.get(name, f"the held-out end of {name} (its `test` part)")


def analyse(arg: str, args: argparse.Namespace, streams: dict) -> Analysis | None:
    """Every measure that applies to one checkpoint; None (with a note) when none does."""
    model, tokenizer, _ = load_model(arg, mirror=args.mirror)
    train_args = train_args_of(arg)
    label, group, group_name = identity(arg, model, train_args)
    values = weight_norms(model)  # of the weights as trained, before they are cast for computing
    ctx = for_inference(model, args.device, resolve_dtype(args.dtype, args.device))
    if not values:
        print(f"note: {label} has neither pre-projection nor content skip; nothing to measure, left out")
        return None
    a = Analysis(label=label, group=group, group_name=group_name, n_layer=model.config.n_layer, values=values,
                 init=expected_init_norms(model), path=arg)
    if not model.config.skip:
        print(f"note: {label} has no content skip; only the pre-projection's weight norms apply to it")
        return a
    a.heldout = heldout_of(train_args, tokenizer)
    key = (tokenizer.to_str(), a.heldout)
    if key not in streams:
        streams[key] = heldout_tokens(a.heldout, tokenizer, args.mirror)
    seq_len = min(args.seq_len, model.config.block_size)
    a.tokens = min(args.tokens, len(streams[key]) - 1) // seq_len * seq_len
    shares, a.heldout_loss = skip_shares(model, streams[key], seq_len, args.tokens, ctx)
    a.values.update(shares)
    a.values["causal"] = causal_weights(model, streams[key], seq_len, args.tokens, a.heldout_loss, ctx)
    return a


# --- several checkpoints: groups, the trend, table, CSV, figures ---

def group_runs(analyses: list[Analysis]) -> list[Analysis]:
    """One series per group: a lone checkpoint as it is, several seeds as their per-layer mean."""
    groups: dict[str, list[Analysis]] = {}
    for a in analyses:
        groups.setdefault(a.group, []).append(a)
    series = []
    for members in groups.values():
        if len(members) == 1:
            series.append(members[0])
            continue
        first = members[0]
        mean = {k: np.mean([m.values[k] for m in members], axis=0).tolist() for k in first.values}
        series.append(Analysis(label=f"{first.group_name}, mean of {len(members)} seeds", group=first.group,
                               group_name=first.group_name, n_layer=first.n_layer, values=mean, init=first.init,
                               members=members))
    return series


def paper_series() -> list[Analysis]:
    return [Analysis(label=name, group=name, group_name=name, n_layer=len(norms), values={"norm_skip": norms},
                     init={"norm_skip": PAPER_SKIP_INIT_STD * d}, quoted=True)
            for name, (d, norms) in PAPER_SKIP_NORMS.items()]


def trend_lines(a: Analysis) -> str:
    """Both statistics of a series, each labelled."""
    ours = ", ".join(f"{MEASURES[k][0]} {trend(v):.2f}x" for k, v in a.values.items())
    paper = ", ".join(f"{MEASURES[k][0]} {last_over_first(v):.2f}x" for k, v in a.values.items())
    return (f"trend {a.label}, last quarter / first three quarters of layers (ours): {ours}\n"
            f"trend {a.label}, last layer / first layer (the paper's statistic): {paper}")


def layer_table(a: Analysis) -> str:
    """One checkpoint's measures, a row per layer, then the expected values at initialisation."""
    keys = [k for k in MEASURES if k in a.values]
    head = f"{a.label}: {a.n_layer} layers"
    if a.tokens:
        head += f", held-out loss {a.heldout_loss:.4f} over {a.tokens:,} tokens of {heldout_label(a.heldout)}"
    rows = [[str(i)] + [a.values[k][i] for k in keys] for i in range(a.n_layer)]
    rows.append(["init"] + [a.init.get(k) for k in keys])
    return head + "\n" + format_table(["layer"] + [MEASURES[k][0] for k in keys], rows)


def depth_axis(n_layer: int, fraction: bool) -> np.ndarray:
    """Layer index, or depth fraction 0..1 so that models of different depth line up."""
    layers = np.arange(n_layer)
    return layers / max(1, n_layer - 1) if fraction else layers


def save_figure(fig, path: Path, dpi: int) -> None:
    """A PNG written atomically: a full disk leaves the previous figure whole, never a truncated one."""
    write_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=dpi))


def write_csv(path: Path, analyses: list[Analysis]) -> None:
    f = io.StringIO(newline="")
    w = csv.writer(f)
    w.writerow(["checkpoint", "n_layer", "layer", "depth_fraction", "heldout_text", "heldout_loss", *MEASURES])
    for a in analyses:
        for i, frac in enumerate(depth_axis(a.n_layer, True)):
            cells = [f"{a.values[k][i]:.6g}" if k in a.values else "" for k in MEASURES]
            w.writerow([a.path, a.n_layer, i, f"{frac:.4f}", a.heldout,
                        f"{a.heldout_loss:.6g}" if a.tokens else "", *cells])
    write_atomic(path, f.getvalue())  # a full disk leaves the previous file whole


def plot_measure(ax, key: str, series: list[Analysis], fraction: bool) -> None:
    """One panel: a line per series (a band over its seeds), dashed reference lines at the initial values."""
    title, ylabel = MEASURES[key][1:]
    inits, plotted = {}, []
    for a in series:
        if key not in a.values:
            continue
        x = depth_axis(a.n_layer, fraction)
        line, = ax.plot(x, a.values[key], marker="o", ms=4, lw=2, label=a.label, ls=":" if a.quoted else "-")
        plotted += a.values[key]
        if a.members:
            runs = np.array([m.values[key] for m in a.members])
            ax.fill_between(x, runs.min(axis=0), runs.max(axis=0), color=line.get_color(), alpha=0.2,
                            label="min-max over seeds")
        if key in a.init:
            inits.setdefault(round(a.init[key], 6), line.get_color())
    for value, color in inits.items():
        ax.axhline(value, color=color, ls="--", lw=1, alpha=0.7, label=f"expected at init ({value:.3g})")
    plotted += list(inits)
    if key == "causal":  # a loss difference: zero is the reference, and it may be negative
        ax.axhline(0.0, color="black", lw=0.8)
    elif min(plotted) > 0 and max(plotted) > 20 * min(plotted):  # spanning decades: log keeps each curve visible
        ax.set_yscale("log")
    ax.set_title(title, fontsize=11)
    ax.set_ylabel(ylabel)
    ax.set_xlabel("depth fraction (layer / (n_layer - 1))" if fraction else "layer")
    if not fraction:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def save_figures(out: Path, series: list[Analysis], fraction: bool) -> list[Path]:
    """layers.png with a panel per measure, and layers_<measure>.png for each measure alone."""
    keys = [k for k in MEASURES if any(k in a.values for a in series)]
    cols = min(3, len(keys))
    rows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.5 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        plot_measure(ax, key, series, fraction)
    for ax in axes.flat[len(keys):]:
        ax.set_visible(False)
    fig.suptitle("How much each layer uses the content skip", fontsize=14)
    fig.tight_layout()
    paths = [out / "layers.png"]
    save_figure(fig, paths[0], dpi=110)
    plt.close(fig)
    for key in keys:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        plot_measure(ax, key, series, fraction)
        fig.tight_layout()
        paths.append(out / f"layers_{key}.png")
        save_figure(fig, paths[-1], dpi=110)
        plt.close(fig)
    return paths


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", nargs="+", default=[str(DEFAULT_RUN)],
                   help="run folders (or their ckpt.pt) or model names; default: the default probe run")
    p.add_argument("--out", "--out_dir", dest="out", type=out_folder, default=str(ROOT / "out" / "layers"),
                   help="folder for the figures and the CSV")
    p.add_argument("--paper", action="store_true", help="overlay the paper's Figure 2 (‖W_skip‖_F per layer)")
    p.add_argument("--depth_fraction", action="store_true",
                   help="x = depth fraction even for models of equal depth (automatic when depths differ)")
    p.add_argument("--tokens", type=positive_int, default=16384,
                   help="held-out tokens per loss and share measurement")
    p.add_argument("--seq_len", type=positive_int, default=256, help="window length (at most the model's block_size)")
    p.add_argument("--device", type=device, default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="compute precision (auto: bf16 where the device has native bf16 matrix units)")
    p.add_argument("--mirror", default=None, help="offline data mirror folder (default: $PREPROJ_MIRROR)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[Analysis]:
    prefer_flash_attention()
    args = get_args(argv)
    if args.tokens < args.seq_len:
        raise SystemExit(f"error: --tokens {args.tokens} is less than one window of --seq_len {args.seq_len}")
    paths = [checkpoint_arg(c) for c in args.ckpt]
    streams: dict = {}  # held-out tokens, per tokenizer
    try:
        analyses = [a for a in (analyse(c, args, streams) for c in paths) if a is not None]
    except (CheckpointError, DataError) as e:
        raise SystemExit(f"error: {e}")
    if not analyses:
        raise SystemExit("error: no checkpoint has a pre-projection or content skip, so there is nothing to measure")
    series = group_runs(analyses) + (paper_series() if args.paper else [])
    depths = sorted({a.n_layer for a in series})
    fraction = args.depth_fraction or len(depths) > 1
    if fraction and not args.depth_fraction:
        print(f"note: the models have {', '.join(map(str, depths))} layers; x is depth fraction so that they line up")
    for a in analyses:
        print(layer_table(a) + "\n")
    for a in series:
        print(trend_lines(a))
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        write_csv(out / "layers.csv", analyses)
        figures = save_figures(out, series, fraction)
    except OSError as e:  # the folder cannot be made
        raise SystemExit(f"error: {write_error(out, e)}")
    except DataError as e:  # a file cannot be written (a full disk): the previous one is left whole
        raise SystemExit(f"error: {e}")
    print(f"wrote {out / 'layers.csv'} and {len(figures)} figures: {', '.join(p.name for p in figures)}")
    return analyses


if __name__ == "__main__":
    main()
