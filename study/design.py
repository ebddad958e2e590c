"""
The study's design and layout, shared by the grid (study/grid.py, which runs it) and the report (study/report.py,
which turns its run folders into RESULTS.md): the bases, settings and methods, the size rules that scale the paper's
choices to a base's width, where each run's files live, and how both call the project's scripts.

    OUT/<base>/baseline/                                  the base itself (baseline_folder)
    OUT/<base>/<setting>/<method>/lr_search.json          the learning-rate search (method_folder)
    OUT/<base>/<setting>/<method>/lr<lr>-s<seed>/         one training run (Job.folder)

docs/experiment.md describes each file of a run folder.
"""

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from lab.checkpoint import ROOT
from lab.precision import DTYPES
from model import GPTConfig

OUT = ROOT / "out" / "experiment"
STUDY_DIR = ROOT / "out" / "study-base"  # pre-trained by lab.recipes.STUDY_BASE
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


def baseline_folder(out: Path, base: str) -> Path:
    return out / base / "baseline"


def eval_files(folder: Path, limits: dict[str, int], tasks: list[str]) -> list[tuple[list[str], int, Path]]:
    """(tasks, limit, summary file) of each eval_lambada.py call: tasks with the same item limit share one."""
    groups: dict[int, list[str]] = {}
    for t in tasks:
        groups.setdefault(limits[t], []).append(t)
    return [(ts, limit, folder / f"eval-{'-'.join(ts)}.json") for limit, ts in groups.items()]


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


def add_shared_args(p: argparse.ArgumentParser) -> None:
    """The options of both study/grid.py and study/report.py: the run folders, the window, where to compute."""
    p.add_argument("--out", default=str(OUT), help="folder of the run folders")
    p.add_argument("--seq_len", type=int, default=256,
                   help="window length: of training and held-out losses (grid), of the layer analysis (report)")
    p.add_argument("--device", default=None, help="passed to every script (default: theirs)")
    p.add_argument("--dtype", default=None, choices=["auto", *DTYPES], help="passed to every script (default: auto)")
    p.add_argument("--mirror", default=None, help="offline data mirror folder (default: $PREPROJ_MIRROR)")
