"""
The study's grid: by default the pre-registered 500-step experiment (docs/experiment.md: design, contrasts,
budget); study/report.py turns the finished runs into study/RESULTS.md.

    python -m study.grid --dry_run              # every command of the grid, nothing run
    python -m study.grid                        # the experiment; resumable: what is finished is skipped
    python -m study.grid --only nano,preproj_skip --seeds 1 --steps 30    # a subset, shrunk

The grid (study/design.py): bases (BASES: the 12-layer `study` base, pre-trained here once by lab.recipes.STUDY_BASE,
then the embedded `nano`) x settings (EXPERIMENT_SETTINGS: `ood`, State of the Union speeches, a domain the bases
never saw) x methods (EXPERIMENT_METHODS; any other of SETTINGS and METHODS runs when --only names it) x seeds. Each
trained run is train.py into its own folder, validating on the search split every CURVE_INTERVAL steps, then
in-process its held-out losses (each window's, and for the probes the share of new weights that moved at all),
then eval_lambada.py for the benchmarks (eval-<tasks>.json + .items.jsonl). Every stage is skipped when its file
exists, and an interrupted training resumes from its checkpoint. A training that diverges (train.py's exit status
lab.run_folder.EXIT_DIVERGED) is recorded in diverged.json and counts as an infinite loss. The grid's folder records
the commit it runs at and refuses to continue from another.

Learning rates: each method's own grid (PROBE_LRS, FULL_LRS) trained at the first seed and scored on the setting's
search split (sotu_search), which no reported number uses, with points added beyond an edge that the search chose
(MAX_EXTEND); the other seeds train at the lr with the lowest search loss. Reported held-out losses are on sotu_test
and books_test, never trained on or searched on.
"""

import argparse
import math
import platform
import resource
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from data.prepare import split_tokens
from data.sources import DataError
from lab.checkpoint import NANO_DIR, ROOT, CheckpointError, load_model, read_checkpoint, save_run_file
from lab.cli import ArgumentParser, nonneg_int, out_folder, positive_float_list, positive_int
from lab.evaluation import TASKS, window_losses
from lab.precision import DTYPES, for_inference, resolve_dtype
from lab.recipes import STUDY_BASE, flags
from lab.run_folder import EXIT_DIVERGED
from study.design import (
    BASES,
    CURVE_INTERVAL,
    EXPERIMENT_METHODS,
    EXPERIMENT_SETTINGS,
    EXPERIMENT_TASKS,
    FIRST_SEED,
    FULL_LRS,
    LIMITS,
    MAX_EXTEND,
    METHODS,
    OUT,
    PAPER_LR,
    PRIMARY_ONLY,
    PROBE_LRS,
    SEEDS,
    SETTINGS,
    STEPS,
    STUDY_DIR,
    TEST_SPLITS,
    Job,
    baseline_folder,
    code_version,
    command,
    eval_files,
    initial_model,
    method_folder,
    read_json,
    shared_flags,
)

# --- running: subprocesses, each logged into its run folder ---

def add_shared_args(p: argparse.ArgumentParser) -> None:
    """The grid's options that every subprocess shares: the run folders, the window, where to compute."""
    p.add_argument("--out", type=out_folder, default=str(OUT), help="folder of the run folders")
    p.add_argument("--seq_len", type=positive_int, default=256,
                   help="window length of training and of held-out losses")
    p.add_argument("--device", default=None, help="passed to every script (default: theirs)")
    p.add_argument("--dtype", default=None, choices=["auto", *DTYPES], help="passed to every script (default: auto)")
    p.add_argument("--mirror", default=None, help="offline data mirror folder (default: $PREPROJ_MIRROR)")


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
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
        try:
            return proc.wait()
        except BaseException:  # Ctrl-C, or SIGTERM (the handler's SystemExit): the child saves and stops first
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # train.py finishes its step, checkpoints and exits
            proc.wait()
            raise


def children_cpu_seconds() -> float:
    """CPU seconds (user + system) of the finished subprocesses so far: the machine time a run took, whatever else
    shared the machine meanwhile."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


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
        argv = command("train.py", *flags(STUDY_BASE), "--out_dir", folder, *shared_flags(args))
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
                   "--val_splits", s.search, "--eval_interval", min(CURVE_INTERVAL, args.steps),
                   "--eval_tokens", args.heldout_tokens or 65536,
                   "--out_dir", job.folder(args.out),
                   *shared_flags(args))


def train_job(job: Job, init_from: str, d: int, args) -> bool:
    """Train one run unless it is finished (train.py's eval.json) or diverged; resume it when it has a
    checkpoint. False when it diverged: train.py exited with EXIT_DIVERGED (its loss, or its weights at a
    checkpoint, became non-finite: a learning rate too high), recorded in diverged.json with train.py's error."""
    folder = job.folder(args.out)
    if (folder / "diverged.json").is_file():
        return False
    if (folder / "eval.json").is_file():
        return True
    argv = train_argv(job, init_from, d, args)
    recorded = read_json(folder / "job.json").get("train")
    trained = (folder / "ckpt.pt").is_file()  # a command refused before its first step trained nothing: retry it
    if recorded and recorded[2:] != argv[2:] and trained and not args.dry_run:
        raise SystemExit(f"error: {folder} was started with other settings ({shlex.join(recorded[2:])}); "
                         f"pass another --out or delete that folder")
    print(f"[train] {job.name()}", flush=True)
    if not args.dry_run:
        save_run_file(folder, "job.json", {"train": argv, **args.version, "grid_command": args.command})
    if (folder / "ckpt.pt").is_file():
        argv = resume_argv(folder, args)
    t0, cpu0 = time.time(), children_cpu_seconds()
    try:
        rc = execute(argv, folder / "log.txt", args)
    finally:  # every invocation's time counts, one stopped by Ctrl-C or SIGTERM too
        if not args.dry_run:
            timing = read_json(folder / "timing.json")
            save_run_file(folder, "timing.json", {
                "train_seconds": timing.get("train_seconds", 0) + time.time() - t0,
                "train_cpu_seconds": timing.get("train_cpu_seconds", 0) + children_cpu_seconds() - cpu0,
                "invocations": timing.get("invocations", 0) + 1})
    if rc == EXIT_DIVERGED:
        error = last_error(folder / "log.txt")
        save_run_file(folder, "diverged.json", {"error": error})
        print(f"  diverged: {error}")
        return False
    if rc:
        raise SystemExit(f"error: training {job.name()} failed: {last_error(folder / 'log.txt')}")
    return True


# --- measured in-process: held-out losses, trainable parameters, weights that moved ---

def heldout_losses(model, tokenizer, splits: list[str], args, cache: dict) -> dict[str, list[float]]:
    """The next-token loss of every whole window of each split (of its first --heldout_tokens; 0 = all)."""
    seq_len = min(args.seq_len, model.config.block_size)
    ctx = for_inference(model, args.device or "cpu", resolve_dtype(args.dtype or "auto", args.device or "cpu"))
    losses = {}
    for name in splits:
        key = ("tokens", tokenizer.to_str(), name)
        if key not in cache:
            cache[key] = split_tokens(name, tokenizer, args.mirror)
        losses[name] = window_losses(model, cache[key], seq_len, args.heldout_tokens or len(cache[key]), ctx)
    return losses


@torch.no_grad()
def moved_shares(folder: Path, args) -> dict[str, float]:
    """For a probe: per kind of new matrix (w_up, w_down, w_skip, ...), the share of its entries that differ from
    their initial value at all. The initial values are drawn again exactly as train.py drew them (its seed, then
    the same model construction), and compared in the dtype the run held them in."""
    ckpt = read_checkpoint(folder)
    moved: dict[str, list[int]] = {}
    for name, start in initial_model(ckpt, args.mirror).new_state_dict().items():
        now = ckpt["model"][name]
        counts = moved.setdefault(name.split(".")[-2], [0, 0])
        counts[0] += int((now != start.to(now.dtype)).sum())
        counts[1] += now.numel()
    return {kind: m / n for kind, (m, n) in moved.items()}


def measure(folder: Path, init_from: str, splits: list[str], args, cache: dict) -> dict:
    """measures.json of a run folder (or of a base, for the baseline), completed with what is missing: held-out
    losses on `splits` (their means; each window's loss in windows.json), trainable parameters, and for a probe the
    share of new weights that moved."""
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
    windows = heldout_losses(model, tokenizer, missing, args, cache)
    save_run_file(folder, "windows.json", {**read_json(folder / "windows.json"), **windows})
    saved.update({name: float(np.mean(losses)) for name, losses in windows.items()})
    save_run_file(folder, "measures.json", saved)
    return saved


def score_benchmarks(folder: Path, init_from: str, args) -> None:
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
    grid = list(args.full_lrs if m.grid == "full" else args.lrs)
    if len(grid) == 1:
        return grid[0]
    path = method_folder(args.out, base, setting, method) / "lr_search.json"
    if path.is_file():
        return read_json(path)["chosen"]
    split = SETTINGS[setting].search
    losses: dict[float, float] = {}
    added = 0
    while True:
        for lr in grid:
            if lr not in losses:
                job = Job(base, setting, method, lr, args.seeds[0])
                ok = train_job(job, init_from, d, args)
                losses[lr] = measure(job.folder(args.out), str(job.folder(args.out)), [split], args, cache).get(
                    split, math.inf) if ok else math.inf
        if args.dry_run:
            return None
        chosen = min(losses, key=losses.get)
        beyond = beyond_edge(list(losses), chosen)
        if beyond is None or added == args.max_extend:
            break
        print(f"[search] {base}/{setting}/{method}: lr {chosen:g} is the grid's edge; adding {beyond:g}", flush=True)
        grid.append(beyond)
        added += 1
    save_run_file(path.parent, path.name, {"split": split, "seed": args.seeds[0], "steps": args.steps,
                                           "losses": {f"{lr:g}": v for lr, v in sorted(losses.items())},
                                           "chosen": chosen, "at_edge": beyond is not None})
    print(f"[search] {base}/{setting}/{method}: lr {chosen:g} (search loss {losses[chosen]:.4f})", flush=True)
    return chosen


def beyond_edge(lrs: list[float], chosen: float) -> float | None:
    """The next point past the edge of the searched rates that the search chose, one step of the grid's own factor
    further (rounded to 3 digits, as folder names print it); None when the choice lies inside."""
    lrs = sorted(lrs)
    if chosen == lrs[-1]:
        return float(f"{lrs[-1] * lrs[-1] / lrs[-2]:.3g}")
    if chosen == lrs[0]:
        return float(f"{lrs[0] * lrs[0] / lrs[1]:.3g}")
    return None


def run_method(base: str, init_from: str, d: int, setting: str, method: str, args, cache: dict) -> None:
    lr = search(base, init_from, d, setting, method, args, cache)
    for seed in args.seeds[:METHODS[method].seeds or None]:
        job = Job(base, setting, method, lr, seed)
        if lr is None and seed == args.seeds[0] and not METHODS[method].lr_from:  # a dry run before the search
            print(f"[train] {job.name()}: the search's run at the chosen lr")
            continue
        if not train_job(job, init_from, d, args):
            continue  # diverged: the report counts its seeds
        folder = job.folder(args.out)
        measure(folder, str(folder), list(TEST_SPLITS), args, cache)
        score_benchmarks(folder, str(folder), args)


def run_grid(args) -> None:
    cache: dict = {}  # held-out token streams (per tokenizer and split) and learning rates (per method)
    if not args.dry_run:
        check_version(args)
        save_run_file(args.out, "grid.json", grid_record(args))
    for base, init_from in args.bases.items():
        if not ensure_base(base, init_from, args):
            print(f"note: {base} is not built yet; its runs are listed once it is (run without --dry_run)")
            continue
        d = base_width(init_from, args)
        if "baseline" in args.methods:
            measure(baseline_folder(args.out, base), init_from, list(TEST_SPLITS), args, cache)
            score_benchmarks(baseline_folder(args.out, base), init_from, args)
        for setting in args.settings:
            for method in args.methods:
                if method != "baseline" and (base == args.primary or method not in PRIMARY_ONLY):
                    run_method(base, init_from, d, setting, method, args, cache)


def check_version(args) -> None:
    """One grid, one version of the code: a grid folder started at another commit is continued only from a
    checkout of that commit."""
    started = read_json(args.out / "grid.json").get("commit")
    if started and started != args.version["commit"]:
        raise SystemExit(f"error: {args.out} holds a grid run at commit {started[:12]}, this checkout is at "
                         f"{(args.version['commit'] or 'no commit')[:12]}; continue it from a checkout of that "
                         f"commit (git worktree add DIR {started[:12]}), or pass another --out")
    if args.version["dirty"]:
        print("note: tracked files differ from the commit; the run records name the commit all the same")


def cpu_name() -> str:
    """The processor's model name, as lscpu prints it."""
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
             if line.startswith("model name")] if cpuinfo.is_file() else []
    return names[0] if names else platform.processor()


def grid_record(args) -> dict:
    """grid.json: what the report's setup section states, the budget and the search as run, and the code's
    commit and the command of the latest invocation."""
    return {**args.version, "command": args.command, "cpu": cpu_name(), "bases": args.bases, "primary": args.primary,
            "steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len, "seeds": args.seeds,
            "lrs": args.lrs, "full_lrs": args.full_lrs, "paper_lr": PAPER_LR,
            "limits": {t: args.limits[t] for t in args.tasks}, "dtype": args.dtype or "auto",
            "heldout_tokens": args.heldout_tokens, "max_extend": args.max_extend}


# --- the command line ---

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
    """(bases, settings, methods) that --only names; a kind it names none of is the experiment's: every base,
    EXPERIMENT_SETTINGS, EXPERIMENT_METHODS (any other setting or method runs when named)."""
    names = [n for n in only.split(",") if n]
    unknown = [n for n in names if n not in bases and n not in SETTINGS and n not in METHODS]
    if unknown:
        raise SystemExit(f"error: --only {unknown[0]!r} is no base, setting or method; choose from "
                         f"{', '.join([*bases, *SETTINGS, *METHODS])}")
    pick = lambda pool, default: [n for n in pool if n in names] or list(default)  # noqa: E731
    return ({b: bases[b] for b in pick(bases, bases)}, pick(SETTINGS, EXPERIMENT_SETTINGS),
            pick(METHODS, EXPERIMENT_METHODS))


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(prog="python -m study.grid", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry_run", action="store_true", help="print the commands of the grid; run nothing")
    p.add_argument("--only", default="", help="comma-separated bases, settings and methods (a kind not named: all)")
    p.add_argument("--bases", default="", help="NAME=MODEL,... instead of study=out/study-base,nano=nano (the "
                                               "first is the primary base, the only one that runs " +
                                               ", ".join(PRIMARY_ONLY) + ")")
    p.add_argument("--steps", type=positive_int, default=STEPS, help="training steps of every run")
    p.add_argument("--seeds", type=positive_int, default=SEEDS,
                   help=f"seeds per method: {FIRST_SEED}, {FIRST_SEED + 1}, ...")
    p.add_argument("--batch_size", type=positive_int, default=16)
    p.add_argument("--lrs", type=positive_float_list, default=PROBE_LRS, help="the probes' lr grid, comma-separated")
    p.add_argument("--full_lrs", type=positive_float_list, default=FULL_LRS, help="full fine-tuning's lr grid")
    p.add_argument("--tasks", default=",".join(EXPERIMENT_TASKS), help="benchmarks of every reported run")
    p.add_argument("--max_extend", type=nonneg_int, default=MAX_EXTEND,
                   help="points a learning-rate search may add beyond the edge of its grid")
    p.add_argument("--limit", default="", help=f"items per task, TASK=N,... or N for all (0 = full set); "
                                               f"default {','.join(f'{t}={n}' for t, n in LIMITS.items())}")
    p.add_argument("--heldout_tokens", type=nonneg_int, default=0,
                   help="held-out tokens per loss (0 = the whole split)")
    add_shared_args(p)
    args = p.parse_args(argv)
    pairs = [b.split("=", 1) for b in args.bases.split(",") if b]
    if any(len(pair) != 2 or not all(pair) for pair in pairs):
        raise SystemExit(f"error: --bases {args.bases!r}: expected NAME=MODEL,... (e.g. nano=nano,p160=pythia-160m)")
    bases = dict(pairs) or BASES
    args.primary = next(iter(bases))
    args.bases, args.settings, args.methods = select(args.only, bases)
    args.tasks = [t for t in args.tasks.split(",") if t]
    unknown = [t for t in args.tasks if t not in TASKS]
    if unknown:
        p.error(f"--tasks: unknown task {unknown[0]!r}; choose from {', '.join(TASKS)}")
    args.limits = parse_limits(args.limit, args.tasks)
    args.seeds = [FIRST_SEED + i for i in range(args.seeds)]
    args.out = Path(args.out).resolve()
    args.version, args.command = code_version(), ["python", "-m", "study.grid", *(sys.argv[1:] if argv is None
                                                                                  else argv)]
    return args


def main(argv: list[str] | None = None) -> None:
    args = get_args(argv)
    try:
        run_grid(args)
    except (CheckpointError, DataError) as e:
        raise SystemExit(f"error: {e}")
    except KeyboardInterrupt:  # the running training has saved its step (execute)
        raise SystemExit("error: interrupted; run the same command again to resume") from None


if __name__ == "__main__":
    # a SIGTERM stops the grid after the running subprocess has stopped in its own way (execute), so that a
    # training saves its last step
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit("error: stopped by SIGTERM; run the same command "
                                                                 "again to resume"))
    main()
