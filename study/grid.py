"""
The experiment: the paper's Table 2 and Figure 2 re-measured on our own bases, with the controls the paper lacks
(docs/experiment.md gives the design, the commands and the budget).

    python experiments.py --dry_run              # every command of the grid, nothing run
    python experiments.py                        # the grid; resumable: what is finished is skipped
    python experiments.py --only nano,ood,preproj_skip --seeds 1 --steps 30    # a subset, shrunk
    python experiments.py --table                # RESULTS.md and its figures, from the finished runs

The grid: bases (BASES: the embedded `nano`, 6 layers, and the 12-layer `study` base, pre-trained here once by
STUDY_RECIPE) x settings (SETTINGS: `ood`, State of the Union speeches, a domain the bases never saw; `indist`, the
first chapters of the book held out of their pre-training) x methods (METHODS) x seeds. Each trained run is
train.py into its own folder, then in-process its held-out losses (and, for the probes, the share of new weights
that moved at all), then eval_lambada.py for the benchmarks (eval-<tasks>.json + .items.jsonl). Every stage is
skipped when its file exists, and an interrupted training resumes from its checkpoint.

Learning rates: each method's own grid (PROBE_LRS, FULL_LRS) trained at the first seed and scored on the setting's
search split (sotu_search or books_search), which no reported number uses; the other seeds train at the lr with
the lowest search loss. Reported held-out losses are on sotu_test and books_test, never trained on or searched on.
"""

import argparse
import csv
import json
import math
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from data.prepare import split_tokens
from data.sources import DataError, write_atomic
from lab.checkpoint import NANO_DIR, ROOT, CheckpointError, load_model, portable_name, read_checkpoint, save_run_file
from lab.cli import format_table
from lab.evaluation import TASKS, read_items, task_metrics, val_loss
from lab.precision import DTYPES, for_inference, resolve_dtype
from lab.stats import RESAMPLES, by_task, check_same_items, last_over_first, paired_intervals, seed_mean, trend
from model import SWITCHES, GPTConfig

OUT = ROOT / "out" / "experiment"
STUDY_DIR = ROOT / "out" / "study-base"
# The 12-layer study base (pythia-160m's depth; head size 64, as Pythia's) on the same pre-training split and recipe as
# the embedded base, with as many steps (600 of 16 x 256 tokens): twice the depth at two thirds of the width, so
# that a step costs no more than the embedded base's and the grid fits the CPU budget (docs/experiment.md).
STUDY_RECIPE = ("--init_from scratch --n_layer 12 --n_head 2 --n_embd 128 --block_size 256 --max_iters 600 "
                "--batch_size 16 --lr 2e-3 --min_lr 2e-4 --warmup_iters 30 --weight_decay 0.1 --beta2 0.95 "
                "--eval_tasks none --seed 42")
BASES = {"nano": "nano", "study": str(STUDY_DIR)}


@dataclass(frozen=True)
class Setting:
    data: str  # train.py --data
    search: str  # the split that chooses the learning rate
    label: str


SETTINGS = {
    "ood": Setting("corpus", "sotu_search", "out of domain: State of the Union addresses 1945-1992"),
    "indist": Setting("books", "books_search", "in distribution: the held-out book, chapters I-IX"),
}
TEST_SPLITS = {"sotu_test": "State of the Union 1997-2006", "books_test": "held-out book, chapters XII-XV"}
FIRST_SEED = 42  # seeds 42, 43, 44: the paper's seed first, which is also the one the embedded base is built with
PROBE_LRS = (3e-4, 1e-3, 3e-3)
FULL_LRS = (3e-5, 1e-4, 3e-4)
PAPER_LR = 1e-5
LIMITS = {"lambada": 0, "wikitext": 0, "hellaswag": 2000, "arc_easy": 0}  # items per task; 0 = the full set


# --- the methods, and the size rules that scale the paper's choices to a base of width d ---

def preproj_skip_params(d: int) -> int:
    """New parameters per layer of pre-projection + skip: 2 d int(1.25 d) + d^2."""
    return 2 * d * int(d * GPTConfig.preproj_expansion) + d * d


def paper_rank(d: int) -> int:
    """The paper's LoRA rank scaled by width: r = 480 at d = 768."""
    return round(d * 480 / 768)


def matched_rank(d: int) -> int:
    """The LoRA rank with pre-projection + skip's parameter count: LoRA on QKV (d -> 3d) and the attention output
    (d -> d) adds r (d + 3d) + r (d + d) = 6 d r per layer."""
    return round(preproj_skip_params(d) / (6 * d))


def capacity_dim(d: int) -> int:
    """The capacity adapter's inner size with pre-projection + skip's parameter count: 2 d a per layer."""
    return round(preproj_skip_params(d) / (2 * d))


@dataclass(frozen=True)
class Method:
    label: str
    flags: Callable[[int], list[str]]  # train.py flags for a base of width d
    grid: str = "probe"  # the learning-rate grid it is searched over: "probe" (--lrs) or "full" (--full_lrs)
    lr: float | None = None  # a fixed learning rate instead of a search
    lr_from: str = ""  # or the learning rate chosen for that method


PP_SKIP = ["--preproj", "--skip"]
METHODS = {
    "baseline": Method("baseline (the frozen base)", lambda d: [], grid=""),
    "preproj": Method("pre-proj", lambda d: ["--preproj"]),
    "skip": Method("skip only", lambda d: ["--skip"]),
    "preproj_skip": Method("pre-proj + skip", lambda d: PP_SKIP),
    "lora_paper": Method("LoRA, the paper's rank", lambda d: ["--lora_rank", str(paper_rank(d))]),
    "lora_matched": Method("LoRA, matched to pre-proj + skip", lambda d: ["--lora_rank", str(matched_rank(d))]),
    "preproj_lora": Method("pre-proj + LoRA", lambda d: ["--preproj", "--lora_rank", str(round(d * 64 / 768))]),
    "capacity": Method("capacity control", lambda d: ["--adapter_dim", str(capacity_dim(d))]),
    "full_ft": Method("full fine-tune", lambda d: ["--full_finetune"], grid="full"),
    # the extra rows: the paper's learning rate, and its precision (bf16 weights and AdamW state, no fp32 master)
    "preproj_skip_lr1e-5": Method("pre-proj + skip, the paper's lr", lambda d: PP_SKIP, lr=PAPER_LR),
    "preproj_skip_bf16": Method("pre-proj + skip, the paper's precision", lambda d: PP_SKIP + ["--pure_bf16"],
                                lr_from="preproj_skip"),
    "preproj_skip_bf16_lr1e-5": Method("pre-proj + skip, the paper's precision and lr",
                                       lambda d: PP_SKIP + ["--pure_bf16"], lr=PAPER_LR),
}


# --- where everything lives ---

@dataclass(frozen=True)
class Job:
    """One training run of the grid."""
    base: str
    setting: str
    method: str
    lr: float | None  # None: not chosen yet (a dry run before the search)
    seed: int

    def folder(self, out: Path) -> Path:
        return out / self.base / self.setting / self.method / f"lr{self.lr_text()}-s{self.seed}"

    def name(self) -> str:
        return f"{self.base}/{self.setting}/{self.method} lr {self.lr_text()} seed {self.seed}"

    def lr_text(self) -> str:
        return "LR" if self.lr is None else f"{self.lr:g}"


def baseline_folder(out: Path, base: str) -> Path:
    return out / base / "baseline"


def eval_files(folder: Path, limits: dict[str, int], tasks: list[str]) -> list[tuple[list[str], int, Path]]:
    """(tasks, limit, summary file) of each eval_lambada.py call: tasks with the same item limit share one."""
    groups: dict[int, list[str]] = {}
    for t in tasks:
        groups.setdefault(limits[t], []).append(t)
    return [(ts, limit, folder / f"eval-{'-'.join(ts)}.json") for limit, ts in groups.items()]


def read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


# --- running: subprocesses, each logged into its run folder ---

def command(script: str, *argv) -> list[str]:
    return [sys.executable, script, *map(str, argv)]


def shared_flags(args, keys: tuple[str, ...] = ("device", "dtype", "mirror")) -> list[str]:
    """Where and how every subprocess computes, when given. A resumed training takes only where (its dtype is
    saved with it)."""
    return [f for k in keys if getattr(args, k) for f in (f"--{k}", getattr(args, k))]


def resume_argv(folder: Path, args) -> list[str]:
    return command("train.py", "--out_dir", folder, "--resume", *shared_flags(args, ("device", "mirror")))


def execute(argv: list[str], log: Path, args) -> int:
    """Run a command from the project root, its output appended to log; its exit status. A dry run only prints it."""
    print("  $ python " + shlex.join(argv[1:]), flush=True)
    if args.dry_run:
        return 0
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        f.write(f"\n$ {shlex.join(argv)}\n")
        f.flush()
        return subprocess.run(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode


def last_error(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("error: ")]
    return lines[-1] if lines else f"failed; see {log}"


def ensure_base(name: str, init_from: str, args) -> bool:
    """Build a base that train.py makes (the embedded one, the study base) unless it is finished (its eval.json);
    resume it from its checkpoint when it was interrupted. False in a dry run when the base does not exist yet
    (its width, which sizes the methods, is unknown until it does)."""
    folder = NANO_DIR if init_from == "nano" else Path(init_from).resolve()
    if folder not in (NANO_DIR, STUDY_DIR) or (folder / "eval.json").is_file():
        return True
    resume = (folder / "ckpt.pt").is_file()
    if resume:
        argv = resume_argv(folder, args)
    elif folder == STUDY_DIR:
        argv = command("train.py", *STUDY_RECIPE.split(), "--out_dir", folder, *shared_flags(args))
    else:  # train.py pre-trains the embedded base on first use; a one-step probe makes it do just that
        argv = command("train.py", "--init_from", "nano", "--skip", "--max_iters", 1, "--eval_tasks", "none",
                       "--eval_tokens", 256, "--out_dir", args.out / name / "build", *shared_flags(args))
    print(f"[base] {name}: {'resuming its pre-training' if resume else 'pre-training it first'}", flush=True)
    rc = execute(argv, args.out / name / "base.log", args)
    if rc:
        raise SystemExit(f"error: building the {name} base failed: {last_error(args.out / name / 'base.log')}")
    return not args.dry_run


def base_width(init_from: str, args) -> int:
    try:
        model, _, _ = load_model(init_from, mirror=args.mirror)
    except CheckpointError as e:
        raise SystemExit(f"error: base {init_from}: {e}")
    return model.config.n_embd


def train_argv(job: Job, init_from: str, d: int, args) -> list[str]:
    m, s = METHODS[job.method], SETTINGS[job.setting]
    lr, min_lr = job.lr_text(), ("LR/10" if job.lr is None else f"{job.lr / 10:g}")  # to a tenth, as train.py
    return command("train.py", "--init_from", init_from, *m.flags(d), "--data", s.data, "--max_iters", args.steps,
                   "--batch_size", args.batch_size, "--seq_len", args.seq_len, "--lr", lr, "--min_lr", min_lr,
                   "--warmup_iters", max(1, args.steps // 10), "--seed", job.seed, "--eval_tasks", "none",
                   "--eval_interval", args.steps, "--eval_tokens", args.heldout_tokens or 16384,
                   "--out_dir", job.folder(args.out),
                   *shared_flags(args))


def train(job: Job, init_from: str, d: int, args) -> bool:
    """Train one run unless it is finished (train.py's eval.json) or diverged; resume it when it has a
    checkpoint. False when it diverged (its loss went non-finite: a learning rate too high)."""
    folder = job.folder(args.out)
    if (folder / "diverged.json").is_file():
        return False
    if (folder / "eval.json").is_file():
        return True
    argv = train_argv(job, init_from, d, args)
    recorded = read_json(folder / "job.json").get("train")
    if recorded and recorded[2:] != argv[2:] and not args.dry_run:
        raise SystemExit(f"error: {folder} was started with other settings ({shlex.join(recorded[2:])}); "
                         f"pass another --out or delete that folder")
    print(f"[train] {job.name()}", flush=True)
    if not args.dry_run:
        save_run_file(folder, "job.json", {"train": argv})
    if (folder / "ckpt.pt").is_file():
        argv = resume_argv(folder, args)
    t0 = time.time()
    try:
        rc = execute(argv, folder / "log.txt", args)
    finally:  # every invocation's time counts, one stopped by Ctrl-C or SIGTERM too
        if not args.dry_run:
            timing = read_json(folder / "timing.json")
            save_run_file(folder, "timing.json", {"train_seconds": timing.get("train_seconds", 0) + time.time() - t0,
                                                  "invocations": timing.get("invocations", 0) + 1})
    if rc and "the loss became" in last_error(folder / "log.txt"):
        save_run_file(folder, "diverged.json", {"error": last_error(folder / "log.txt")})
        print(f"  diverged: {last_error(folder / 'log.txt')}")
        return False
    if rc:
        raise SystemExit(f"error: training {job.name()} failed: {last_error(folder / 'log.txt')}")
    return True


# --- measured in-process: held-out losses, trainable parameters, weights that moved ---

def heldout_losses(model, tokenizer, splits: list[str], args, cache: dict) -> dict[str, float]:
    """Mean next-token loss over every whole window of each split (of its first --heldout_tokens; 0 = all)."""
    seq_len = min(args.seq_len, model.config.block_size)
    ctx = for_inference(model, args.device or "cpu", resolve_dtype(args.dtype or "auto", args.device or "cpu"))
    losses = {}
    for name in splits:
        key = ("tokens", tokenizer.to_str(), name)
        if key not in cache:
            cache[key] = split_tokens(name, tokenizer, args.mirror)
        losses[name] = val_loss(model, cache[key], seq_len, args.heldout_tokens or len(cache[key]), ctx)
    return losses


@torch.no_grad()
def moved_shares(folder: Path, args) -> dict[str, float]:
    """For a probe: per kind of new matrix (w_up, w_down, w_skip, ...), the share of its entries that differ from
    their initial value at all. The initial values are drawn again exactly as train.py drew them (its seed, then
    the same model construction), and compared in the dtype the run held them in."""
    ckpt = read_checkpoint(folder)
    train_args = ckpt["train_args"]
    torch.manual_seed(train_args["seed"])
    init, _, _ = load_model(train_args["init_from"], **{k: train_args[k] for k in SWITCHES},
                            mirror=args.mirror)
    moved: dict[str, list[int]] = {}
    for name, start in init.new_state_dict().items():
        now = ckpt["model"][name]
        counts = moved.setdefault(name.split(".")[-2], [0, 0])
        counts[0] += int((now != start.to(now.dtype)).sum())
        counts[1] += now.numel()
    return {kind: m / n for kind, (m, n) in moved.items()}


def measure(folder: Path, init_from: str, splits: list[str], args, cache: dict) -> dict:
    """measures.json of a run folder (or of a base, for the baseline), completed with what is missing: held-out
    losses on `splits`, trainable parameters, and for a probe the share of new weights that moved."""
    path = folder / "measures.json"
    saved = read_json(path)
    missing = [s for s in splits if s not in saved]
    if not missing:
        return saved
    print(f"[measure] {folder.relative_to(args.out)}: held-out loss on {', '.join(missing)}", flush=True)
    if args.dry_run:
        return saved
    model, tokenizer, _ = load_model(init_from, mirror=args.mirror)
    if "trainable" not in saved:  # a base folder (the baseline) has no config.json: nothing trains
        kind = read_json(folder / "config.json").get("kind")
        saved["trainable"] = {"probe": model.num_params("new"), "full": model.num_params("all")}.get(kind, 0)
        saved["shape"] = {"n_layer": model.config.n_layer, "n_embd": model.config.n_embd,
                          "base_params": model.num_params("base")}
        if kind == "probe":
            saved["moved"] = moved_shares(folder, args)
    saved.update(heldout_losses(model, tokenizer, missing, args, cache))
    save_run_file(folder, "measures.json", saved)
    return saved


def benchmarks(folder: Path, init_from: str, args) -> None:
    """eval_lambada.py on the model, one call per item limit, each skipped when its summary exists."""
    for tasks, limit, summary in eval_files(folder, args.limits, args.tasks):
        if summary.is_file():
            continue
        print(f"[eval] {folder.relative_to(args.out)}: {', '.join(tasks)}" + (f" (first {limit})" if limit else ""),
              flush=True)
        argv = command("eval_lambada.py", "--init_from", init_from, "--tasks", ",".join(tasks), "--out", summary,
                       *(["--limit", limit] if limit else []), *shared_flags(args))
        if execute(argv, folder / "log.txt", args):
            raise SystemExit(f"error: evaluating {folder} failed: {last_error(folder / 'log.txt')}")


# --- the grid ---

def search(base: str, init_from: str, d: int, setting: str, method: str, args, cache: dict) -> float | None:
    """The learning rate of a method in a setting: its fixed one, the one chosen for another method, or the
    search over its grid at the first seed (lr_search.json). None in a dry run, before the search has run."""
    key = ("lr", base, setting, method)
    if key not in cache:
        cache[key] = choose_lr(base, init_from, d, setting, method, args, cache)
    return cache[key]


def choose_lr(base: str, init_from: str, d: int, setting: str, method: str, args, cache: dict) -> float | None:
    m = METHODS[method]
    if m.lr_from:  # searched first when it has not been
        return search(base, init_from, d, setting, m.lr_from, args, cache)
    if m.lr is not None:
        return m.lr
    grid = args.full_lrs if m.grid == "full" else args.lrs
    if len(grid) == 1:
        return grid[0]
    path = args.out / base / setting / method / "lr_search.json"
    if path.is_file():
        return read_json(path)["chosen"]
    split = SETTINGS[setting].search
    losses = {}
    for lr in grid:
        job = Job(base, setting, method, lr, args.seeds[0])
        ok = train(job, init_from, d, args)
        losses[lr] = measure(job.folder(args.out), str(job.folder(args.out)), [split], args, cache).get(
            split, math.inf) if ok else math.inf
    if args.dry_run:
        return None
    chosen = min(losses, key=losses.get)
    save_run_file(path.parent, path.name, {"split": split, "seed": args.seeds[0], "steps": args.steps,
                                           "losses": {f"{lr:g}": v for lr, v in losses.items()}, "chosen": chosen})
    print(f"[search] {base}/{setting}/{method}: lr {chosen:g} (search loss {losses[chosen]:.4f})", flush=True)
    return chosen


def run_method(base: str, init_from: str, d: int, setting: str, method: str, args, cache: dict) -> None:
    lr = search(base, init_from, d, setting, method, args, cache)
    for seed in args.seeds:
        job = Job(base, setting, method, lr, seed)
        if lr is None and seed == args.seeds[0] and not METHODS[method].lr_from:  # a dry run before the search
            print(f"[train] {job.name()}: the search's run at the chosen lr")
            continue
        if not train(job, init_from, d, args):
            continue  # diverged: the table counts its seeds
        folder = job.folder(args.out)
        measure(folder, str(folder), list(TEST_SPLITS), args, cache)
        benchmarks(folder, str(folder), args)


def run_grid(args) -> None:
    cache: dict = {}  # held-out token streams (per tokenizer and split) and learning rates (per method)
    if not args.dry_run:
        save_run_file(args.out, "grid.json", grid_record(args))
    for base, init_from in args.bases.items():
        if not ensure_base(base, init_from, args):
            print(f"note: {base} is not built yet; its runs are listed once it is (run without --dry_run)")
            continue
        d = base_width(init_from, args)
        if "baseline" in args.methods:
            measure(baseline_folder(args.out, base), init_from, list(TEST_SPLITS), args, cache)
            benchmarks(baseline_folder(args.out, base), init_from, args)
        for setting in args.settings:
            for method in args.methods:
                if method != "baseline":
                    run_method(base, init_from, d, setting, method, args, cache)


def grid_record(args) -> dict:
    """What the table's setup section states: the budget and the search as run."""
    return {"bases": args.bases, "steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
            "seeds": args.seeds, "lrs": args.lrs, "full_lrs": args.full_lrs, "paper_lr": PAPER_LR,
            "limits": {t: args.limits[t] for t in args.tasks}, "dtype": args.dtype or "auto",
            "heldout_tokens": args.heldout_tokens}


# --- the tables: RESULTS.md and its figures, rebuilt from the run folders ---

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
class Run:
    """A finished run (or, for the baseline, the base itself): its numbers and its per-item records."""
    folder: Path
    values: dict[str, float]
    records: list[dict]
    measures: dict
    seconds: float | None  # training time; None when unknown (a training finished after its timer was killed)


def load_run(folder: Path) -> Run | None:
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
    return Run(folder, values, records, measures, read_json(folder / "timing.json").get("train_seconds"))


def method_runs(folder: Path) -> tuple[float | None, list[Run]]:
    """(lr, finished runs, one per seed) of a method in one base and setting: the runs at the lr its search chose,
    or, without a search record, at the lr with the most finished seeds."""
    by_lr: dict[str, list[Run]] = {}
    for f in sorted(folder.glob("lr*-s*"), key=lambda f: int(f.name.rsplit("-s", 1)[1])):
        run = load_run(f)
        if run:
            by_lr.setdefault(f.name.rsplit("-s", 1)[0][2:], []).append(run)
    if not by_lr:
        return None, []
    chosen = read_json(folder / "lr_search.json").get("chosen")
    key = f"{chosen:g}" if chosen is not None and f"{chosen:g}" in by_lr else max(by_lr, key=lambda k: len(by_lr[k]))
    return float(key), by_lr[key]


def collect(out: Path) -> dict[str, dict[str, dict[str, tuple[float | None, list[Run]]]]]:
    """{base: {setting: {method: (lr, runs)}}} of everything finished; the baseline heads every setting."""
    order = list(BASES)
    folders = sorted((p for p in out.iterdir() if p.is_dir()), key=lambda p: (order.index(p.name)
                                                                            if p.name in order else len(order), p.name))
    results = {}
    for base_dir in folders:
        baseline = load_run(baseline_folder(out, base_dir.name))
        settings = {}
        for setting in SETTINGS:
            methods = {"baseline": (None, [baseline] if baseline else [])}
            methods.update({m: method_runs(base_dir / setting / m) for m in METHODS if m != "baseline"})
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
        record = read_json(out / base / setting / m / "lr_search.json")
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
        fig.savefig(paths[-1], dpi=100)
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


def setup_section(out: Path) -> str:
    g = read_json(out / "grid.json")
    if not g:
        return "(no grid.json: the settings of the runs are not recorded)"
    limits = ", ".join(f"{t} {'all' if n == 0 else f'first {n}'}" for t, n in g["limits"].items())
    settings = "; ".join(f"`{name}`, {s.label} (lr search on `{s.search}`)" for name, s in SETTINGS.items())
    heldout = f"the first {g['heldout_tokens']:,} tokens" if g.get("heldout_tokens") else "all their tokens"
    study = (f" The study base is pre-trained once by `python train.py {STUDY_RECIPE} --out_dir out/study-base`."
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
        raise SystemExit(f"error: no finished run under {args.out}; run `python experiments.py` first")
    fig_dir = args.results.parent / "figures"
    fig_dir.mkdir(parents=True, exist_ok=True)
    try:
        found = {(b, s): comparisons(methods, args.resamples)
                 for b, settings in results.items() for s, methods in settings.items()}
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    parts = ["# Results: the paper's Table 2 and Figure 2 re-measured, with controls",
             "Generated by `python experiments.py --table` from the run folders of `python experiments.py` "
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


# --- the command line ---

def parse_list(text: str, kind=float) -> tuple:
    return tuple(kind(x) for x in text.split(",") if x.strip())


def parse_limits(text: str, tasks: list[str]) -> dict[str, int]:
    """TASK=N,... (a bare N: every task) over LIMITS."""
    limits = dict(LIMITS)
    for part in filter(None, (p.strip() for p in text.split(","))):
        task, _, n = part.rpartition("=")
        if (task and task not in TASKS) or not n.isdigit():
            raise SystemExit(f"error: --limit {part!r}: expected TASK=N or N, with TASK in {', '.join(TASKS)}")
        limits.update({t: int(n) for t in ([task] if task else tasks)})
    return limits


def select(only: str, bases: dict) -> tuple[dict, list[str], list[str]]:
    """(bases, settings, methods) that --only names; a kind it names none of is taken whole."""
    names = [n for n in only.split(",") if n]
    unknown = [n for n in names if n not in bases and n not in SETTINGS and n not in METHODS]
    if unknown:
        raise SystemExit(f"error: --only {unknown[0]!r} is no base, setting or method; choose from "
                         f"{', '.join([*bases, *SETTINGS, *METHODS])}")
    pick = lambda pool: [n for n in pool if n in names] or list(pool)  # noqa: E731
    return {b: bases[b] for b in pick(bases)}, pick(SETTINGS), pick(METHODS)


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--table", action="store_true", help="rebuild RESULTS.md and its figures from finished runs")
    p.add_argument("--dry_run", action="store_true", help="print the commands of the grid; run nothing")
    p.add_argument("--only", default="", help="comma-separated bases, settings and methods (a kind not named: all)")
    p.add_argument("--bases", default="", help="NAME=MODEL,... instead of nano=nano,study=out/study-base")
    p.add_argument("--steps", type=int, default=150, help="training steps of every run")
    p.add_argument("--seeds", type=int, default=3, help=f"seeds per method: {FIRST_SEED}, {FIRST_SEED + 1}, ...")
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--seq_len", type=int, default=256, help="training and held-out window length")
    p.add_argument("--lrs", default=",".join(f"{x:g}" for x in PROBE_LRS), help="the probes' lr grid")
    p.add_argument("--full_lrs", default=",".join(f"{x:g}" for x in FULL_LRS), help="full fine-tuning's lr grid")
    p.add_argument("--tasks", default=",".join(TASKS), help="benchmarks of every run")
    p.add_argument("--limit", default="", help=f"items per task, TASK=N,... or N for all (0 = full set); "
                                               f"default {','.join(f'{t}={n}' for t, n in LIMITS.items())}")
    p.add_argument("--out", default=str(OUT), help="folder of the run folders")
    p.add_argument("--results", default=str(ROOT / "study" / "RESULTS.md"),
                   help="--table writes this (figures beside it)")
    p.add_argument("--resamples", type=int, default=RESAMPLES, help="bootstrap draws of the table")
    p.add_argument("--heldout_tokens", type=int, default=0, help="held-out tokens per loss (0 = the whole split)")
    p.add_argument("--layer_tokens", type=int, default=16384, help="held-out tokens of the layer analysis")
    p.add_argument("--device", default=None, help="passed to every script (default: theirs)")
    p.add_argument("--dtype", default=None, choices=["auto", *DTYPES], help="passed to every script (default: auto)")
    p.add_argument("--mirror", default=None, help="offline data mirror folder (default: $PREPROJ_MIRROR)")
    args = p.parse_args(argv)
    pairs = [b.split("=", 1) for b in args.bases.split(",") if b]
    if any(len(pair) != 2 or not all(pair) for pair in pairs):
        raise SystemExit(f"error: --bases {args.bases!r}: expected NAME=MODEL,... (e.g. nano=nano,p160=pythia-160m)")
    bases = dict(pairs) or BASES
    args.bases, args.settings, args.methods = select(args.only, bases)
    args.tasks = [t for t in args.tasks.split(",") if t]
    if any(t not in TASKS for t in args.tasks) or args.steps < 1 or args.seeds < 1:
        raise SystemExit(f"error: --tasks takes {', '.join(TASKS)}; --steps and --seeds must be positive")
    args.limits = parse_limits(args.limit, args.tasks)
    args.seeds = [FIRST_SEED + i for i in range(args.seeds)]
    args.lrs, args.full_lrs = parse_list(args.lrs), parse_list(args.full_lrs)
    args.out, args.results = Path(args.out).resolve(), Path(args.results).resolve()
    return args


def main(argv: list[str] | None = None) -> None:
    args = get_args(argv)
    try:
        write_results(args) if args.table else run_grid(args)
    except (CheckpointError, DataError) as e:
        raise SystemExit(f"error: {e}")


if __name__ == "__main__":
    # a SIGTERM stops the running subprocess too (subprocess.run kills it on the way out), not only this script
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit("error: stopped by SIGTERM; run the same command "
                                                                 "again to resume"))
    main()
