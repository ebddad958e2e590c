"""
The study's design and layout, shared by the grid (study/grid.py, which runs it) and the report (study/report.py,
which turns its run folders into RESULTS.md): the bases, settings and methods, the size rules that scale the paper's
choices to a base's width, where each run's files live, and how both call the project's scripts.

    OUT/<base>/baseline/                                  the base itself (baseline_folder)
    OUT/<base>/<setting>/<method>/lr_search.json          the learning-rate search (method_folder)
    OUT/<base>/<setting>/<method>/lr<lr>-s<seed>/         one training run (Job.folder)

docs/screen.md describes each file of a run folder; docs/experiment.md, the 500-step experiment, adds windows.json.
"""

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from lab.checkpoint import ROOT, load_model
from model import GPT, SWITCHES, GPTConfig

OUT = ROOT / "out" / "experiment-500"  # the 500-step experiment; the 30-step screen's records are study/runs.tar.gz
STUDY_DIR = ROOT / "out" / "study-base"  # pre-trained by lab.recipes.STUDY_BASE
BASES = {"study": str(STUDY_DIR), "nano": "nano"}  # the primary analysis first, then its replication


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
FIRST_SEED = 42  # seeds 42, 43, ...: the paper's seed first, which is also the one the embedded base is built with
PAPER_LR = 1e-5

# The 500-step experiment as pre-registered in docs/experiment.md: the grid's defaults.
STEPS = 500
SEEDS = 5
EXPERIMENT_SETTINGS = ("ood",)
PROBE_LRS = (5e-4, 1e-3, 2e-3, 4e-3)  # factor 2; a choice on an edge adds the next point beyond it
FULL_LRS = (3e-5, 1e-4, 3e-4)
MAX_EXTEND = 3  # points a search may add beyond its grid's edges
CURVE_INTERVAL = 50  # steps between the search split's losses during training (the learning curves)
EXPERIMENT_METHODS = ("baseline", "preproj_skip", "skip", "skip_sidemlp", "linear_preproj_skip", "lora_matched",
                      "capacity", "preproj_skip_lr1e-5", "preproj_skip_bf16_lr1e-5")
PRIMARY_ONLY = ("capacity", "preproj_skip_lr1e-5", "preproj_skip_bf16_lr1e-5")  # not run on the replication base
# The pre-registered contrasts, each "pre-proj + skip minus" a control, on sotu_test's held-out loss.
CONTRASTS = {"skip_sidemlp": "mechanism: the MLP's output enters Q/K/V",
             "linear_preproj_skip": "nonlinearity: the SiLU",
             "lora_matched": "the paper's Table 2 claim: against LoRA of the same size",
             "skip": "what the pre-projection adds to the skip"}
LIMITS = {"lambada": 0, "wikitext": 0, "hellaswag": 2000, "arc_easy": 0}  # items per task; 0 = the full set
EXPERIMENT_TASKS = ("lambada", "wikitext")  # HellaSwag and ARC-Easy sat at chance in every run of the screen


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


def side_mlp_dim(d: int) -> int:
    """The side-MLP's inner size: the pre-projection's, int(1.25 d), so that skip + side-MLP has pre-projection +
    skip's parameters exactly and differs only in where the MLP's output goes (the residual, not Q/K/V)."""
    return int(d * GPTConfig.preproj_expansion)


@dataclass(frozen=True)
class Method:
    label: str
    flags: Callable[[int], list[str]]  # train.py flags for a base of width d
    grid: str = "probe"  # the learning-rate grid it is searched over: "probe" (--lrs) or "full" (--full_lrs)
    lr: float | None = None  # a fixed learning rate instead of a search
    lr_from: str = ""  # or the learning rate chosen for that method
    seeds: int = 0  # seeds it runs, when fewer than the grid's


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
    # the controls of the 500-step experiment: pre-proj + skip's parameters, differing in one thing each
    "skip_sidemlp": Method("skip + side-MLP", lambda d: ["--skip", "--adapter_dim", str(side_mlp_dim(d))]),
    "linear_preproj_skip": Method("linear pre-proj + skip", lambda d: PP_SKIP + ["--preproj_linear"]),
    "full_ft": Method("full fine-tune", lambda d: ["--full_finetune"], grid="full"),
    # the extra rows: the paper's learning rate, and its precision (bf16 weights and AdamW state, no fp32 master)
    "preproj_skip_lr1e-5": Method("pre-proj + skip, the paper's lr", lambda d: PP_SKIP, lr=PAPER_LR, seeds=3),
    "preproj_skip_bf16": Method("pre-proj + skip, the paper's precision", lambda d: PP_SKIP + ["--pure_bf16"],
                                lr_from="preproj_skip"),
    "preproj_skip_bf16_lr1e-5": Method("pre-proj + skip, the paper's precision and lr",
                                       lambda d: PP_SKIP + ["--pure_bf16"], lr=PAPER_LR, seeds=3),
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
        return method_folder(out, self.base, self.setting, self.method) / f"lr{self.lr_text()}-s{self.seed}"

    def name(self) -> str:
        return f"{self.base}/{self.setting}/{self.method} lr {self.lr_text()} seed {self.seed}"

    def lr_text(self) -> str:
        return "LR" if self.lr is None else f"{self.lr:g}"


def run_folders(folder: Path) -> list[tuple[str, int, Path]]:
    """(lr as Job.lr_text writes it, seed, folder) of each run folder in a method's folder, by seed."""
    found = [(*f.name[len("lr"):].rsplit("-s", 1), f) for f in folder.glob("lr*-s*") if f.is_dir()]
    return sorted(((lr, int(seed), f) for lr, seed, f in found), key=lambda t: t[1])


def method_folder(out: Path, base: str, setting: str, method: str) -> Path:
    """A method's runs in one base and setting, and its lr_search.json."""
    return out / base / setting / method


def chosen_lr(out: Path, base: str, setting: str, method: str) -> float | None:
    """A method's fixed rate, its search's choice, or the grid's one rate (a grid of one searches nothing); None
    while its search runs."""
    grid_lrs = read_json(out / "grid.json").get("lrs", [])
    search = read_json(method_folder(out, base, setting, method) / "lr_search.json")
    return METHODS[method].lr or search.get("chosen") or (grid_lrs[0] if len(grid_lrs) == 1 else None)


def baseline_folder(out: Path, base: str) -> Path:
    return out / base / "baseline"


def eval_files(folder: Path, limits: dict[str, int], tasks: list[str]) -> list[tuple[list[str], int, Path]]:
    """(tasks, limit, summary file) of each eval_lambada.py call: tasks with the same item limit share one."""
    groups: dict[int, list[str]] = {}
    for t in tasks:
        groups.setdefault(limits[t], []).append(t)
    return [(ts, limit, folder / f"eval-{'-'.join(ts)}.json") for limit, ts in groups.items()]


def code_version() -> dict:
    """{"commit": the checkout's commit, "dirty": whether tracked files differ from it}; None for both outside a
    git checkout."""
    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}


def initial_model(ckpt: dict, mirror: str | None = None) -> GPT:
    """A probe run's model at step 0: its new parameters drawn again exactly as train.py drew them (its seed, then
    the same model construction)."""
    train_args = ckpt["train_args"]
    torch.manual_seed(train_args["seed"])
    switches = {k: train_args.get(k, getattr(GPTConfig, k)) for k in SWITCHES}  # older runs lack newer switches
    init, _, _ = load_model(train_args["init_from"], **switches, mirror=mirror)
    return init


def read_json(path: Path) -> dict:
    """A run record (job.json, measures.json, lr_search.json, ...); {} when it is not written yet."""
    return json.loads(path.read_text()) if path.is_file() else {}


# --- the project's scripts, as the grid and the report call them ---

def command(script: str, *argv) -> list[str]:
    return [sys.executable, script, *map(str, argv)]


def shared_flags(args, keys: tuple[str, ...] = ("device", "dtype", "mirror")) -> list[str]:
    """Where and how every subprocess computes, when given. A resumed training takes only where (its dtype is
    saved with it)."""
    return [f for k in keys if getattr(args, k) for f in (f"--{k}", getattr(args, k))]
