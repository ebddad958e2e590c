"""
What every command-line script shares: the flags that name a model, the table printer and process set-up.
Library code never imports argparse; scripts turn their flags into plain arguments here.
"""

import argparse
import ctypes
import math
import os
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, NoReturn

import torch
import torch.distributed as dist

from lab.precision import DTYPES
from model import SWITCHES


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The flags every script shares to name a model and where it runs."""
    p.add_argument("--init_from", default="nano",
                   help="nano (default, the embedded base), scratch, pythia-160m (or any Pythia / HF id), "
                        "a Hugging Face folder, or one of our run folders")
    p.add_argument("--preproj", action="store_true", help="add the pre-projection MLP before Q/K/V")
    p.add_argument("--preproj_linear", action="store_true",
                   help="with --preproj: drop its SiLU (x_hat + W_down W_up x_hat), the control for its nonlinearity")
    p.add_argument("--skip", action="store_true", help="add the content skip W_skip around attention")
    p.add_argument("--lora_rank", type=nonneg_int, default=0, help="LoRA rank on query_key_value and dense (0 = off)")
    p.add_argument("--lora_alpha", type=nonneg_float, default=0.0, help="LoRA alpha (0 = 2 * rank, as the paper)")
    p.add_argument("--adapter_dim", type=nonneg_int, default=0,
                   help="capacity control: a parallel MLP adapter of this inner size beside attention (0 = off)")
    p.add_argument("--device", type=device, default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="compute precision: auto = bf16 where the device has native bf16 matrix units, else fp32 "
                        "(see lab/precision.py)")
    p.add_argument("--seed", type=nonneg_int, default=42)
    p.add_argument("--mirror", default=None, help="offline data mirror folder (default: $PREPROJ_MIRROR)")


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr, `error: ...`, like every other error of the scripts."""

    def error(self, message: str):
        self.exit(2, f"error: {message}\n")


# --- flag types: a bad value stops at parse time with one line naming the flag and the allowed range ---

def _number(text: str, kind: type, ok: Callable[[float], bool], allowed: str):
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or not ok(value):
        raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _number(text, int, lambda v: v > 0, "an integer >= 1")


def nonneg_int(text: str) -> int:
    return _number(text, int, lambda v: v >= 0, "an integer >= 0")


def positive_float(text: str) -> float:
    return _number(text, float, lambda v: v > 0, "a finite number > 0")


def positive_float_list(text: str) -> tuple[float, ...]:
    """One or more comma-separated finite numbers > 0 (a learning-rate grid)."""
    parts = [t.strip() for t in text.split(",") if t.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers > 0, got {text!r}")
    return tuple(positive_float(t) for t in parts)


def nonneg_float(text: str) -> float:
    return _number(text, float, lambda v: v >= 0, "a finite number >= 0")


def fraction(text: str) -> float:
    return _number(text, float, lambda v: 0 <= v < 1, "a number in [0, 1)")


def name_list(text: str) -> str:
    """A comma-separated list with at least one name (kept as the text)."""
    if not [t for t in text.split(",") if t.strip()]:
        raise argparse.ArgumentTypeError("expected at least one name, got an empty list")
    return text


def utf8(text: str) -> str:
    """Text given on the command line, which must be valid UTF-8 (the shell passes bytes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise argparse.ArgumentTypeError(f"not valid UTF-8 (byte {e.start}); pass the text in UTF-8")
    return text


def device(text: str) -> str:
    """A device this machine has: cpu, cuda, cuda:N (N below the GPU count) or mps."""
    try:
        dev = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"unknown device {text!r}; use cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text}: this machine has no usable CUDA GPU; use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise argparse.ArgumentTypeError(f"{text}: MPS is not available here; use --device cpu")
    if dev.type not in ("cpu", "cuda", "mps"):
        raise argparse.ArgumentTypeError(f"unsupported device {text!r}; use cpu, cuda or cuda:N")
    return text


def _writable_below(path: Path) -> None:
    """Refuse a path under an existing file (nothing could be created there)."""
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise argparse.ArgumentTypeError(f"{path}: {parent} is a file, not a folder")
            return


def out_folder(text: str) -> str:
    """A folder to write into: it may not exist yet, but it must not be a file."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file; pass a folder")
    _writable_below(path)
    return text


def out_file(text: str) -> str:
    """A file to write: it may not exist yet, but it must not be a folder."""
    path = Path(text)
    if path.is_dir() or text.endswith("/"):
        raise argparse.ArgumentTypeError(f"{text} is a folder; pass a file name")
    _writable_below(path)
    return text


def is_hub_name(init_from: str) -> bool:
    """A model that --init_from fetches from the Hugging Face Hub: a Pythia name or id that is no local folder (as
    lab.checkpoint.load_model tells them apart)."""
    return init_from.startswith(("pythia-", "EleutherAI/")) and not Path(init_from).exists()


def explicit_flags(p: argparse.ArgumentParser, argv: list[str] | None) -> set[str]:
    """The settings the command line gave explicitly (even at their default value), as argparse dest names."""
    unset = object()
    given = argparse.Namespace(**{k: unset for k in vars(p.parse_args(argv))})
    p.parse_args(argv, namespace=given)  # argparse fills in defaults only for names the namespace lacks
    return {k for k, v in vars(given).items() if v is not unset}


def switches_of(args: argparse.Namespace) -> dict:
    """The research switches of a parsed command line, as load_model and GPTConfig take them."""
    if args.preproj_linear and not args.preproj:
        raise SystemExit("error: --preproj_linear changes the pre-projection; add --preproj")
    return {k: getattr(args, k) for k in SWITCHES}


def format_table(header: list[str], rows: list[list], markdown: bool = False) -> str:
    """Rows under a header, columns aligned (text left, numbers right), or as a Markdown table.
    Floats print with 4 decimals, or 4 significant digits when very small or large; None prints as '-'."""
    def cell(v) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.4f}" if v == 0 or 1e-2 <= abs(v) < 1e4 else f"{v:.4g}"
        return str(v)

    cells = [[cell(v) for v in row] for row in rows]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in cells])
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
    numeric = [all(isinstance(row[i], (int, float)) or row[i] is None for row in rows) for i in range(len(header))]

    def line(values: list[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    return "\n".join([line([str(h) for h in header])] + [line(r) for r in cells])


def results_table(results: dict) -> str:
    """evaluation.evaluate's results (and the harness adapter's, in the same layout) as a table: one row per task and
    metric, then a line for each task's truncation count and note."""
    rows = [[task, name, m["value"], m["stderr"], r["n"]]
            for task, r in results.items() for name, m in r["metrics"].items()]
    lines = [format_table(["task", "metric", "value", "stderr", "n"], rows)]
    for task, r in results.items():
        if r["truncated"]:
            lines.append(f"{task}: {r['truncated']} of {r['n']} items cut to fit the model's window")
        if "note" in r:
            lines.append(f"{task}: {r['note']}")
    return "\n".join(lines)


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory for reuse instead of handing it back to the operating system.

    A training step frees and re-allocates the same activations every time. By default glibc returns blocks over
    32 MB, and a free heap top over 64 MB, to the OS, so the next step page-faults and zeroes them all over again
    (docs/performance.md measures the cost). PyTorch's caching allocator does this on CUDA; this is the CPU
    counterpart. Linux with glibc only; returns whether it took effect.
    """
    if sys.platform != "linux":
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
    return bool(mallopt) and mallopt(m_mmap_threshold, 2**30) == 1 and mallopt(m_trim_threshold, 2**30) == 1


# Allocators that take malloc's place when preloaded (LD_PRELOAD): faster again than glibc's with freed memory kept,
# for a CPU training step (docs/performance-log.md, "Allocators")
MALLOC_LIBRARIES = ("tcmalloc", "jemalloc")


def preloaded_malloc(maps: str | None = None) -> str | None:
    """The allocator preloaded in glibc's place (a name from MALLOC_LIBRARIES), read from the libraries this
    process has mapped (/proc/self/maps, or the text of such a file), or None."""
    if maps is None:
        path = Path("/proc/self/maps")
        maps = path.read_text() if path.exists() else ""
    return next((name for name in MALLOC_LIBRARIES if f"/lib{name}" in maps), None)


@contextmanager
def first_rank_first(rank: int, world: int) -> Iterator[None]:
    """Rank 0 runs the block first (downloads, the corpus's preparation, caches) while the other processes wait,
    then they run it and find everything in place. One process alone just runs it."""
    if world > 1 and rank > 0:
        dist.barrier()
    yield
    if world > 1 and rank == 0:
        dist.barrier()


def exit_without_interpreter_shutdown(main: Callable[[], None]) -> NoReturn:
    """Run a script's main() and end the process at once with its exit status, skipping the interpreter's shutdown,
    for the processes torchrun starts: DDP keeps gloo's process group and its worker threads alive past
    destroy_process_group(), and a worker that lets go of a collective's tensor while the interpreter shuts down
    aborts the process (docs/reliability.md, "Several processes"). What the shutdown would print, a SystemExit's
    message or an uncaught exception's traceback, is printed here; main() has closed every file it wrote."""
    try:
        main()
        status = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            status = e.code or 0
        else:  # a message, which the shutdown would print before exiting with 1
            print(e.code, file=sys.stderr)
            status = 1
    except BaseException:
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def setup_distributed(device: str) -> tuple[int, int, str]:
    """(rank, world size, device); torchrun sets RANK/WORLD_SIZE. gloo on CPU, nccl on CUDA."""
    if "RANK" not in os.environ:
        return 0, 1, device
    cuda = device.startswith("cuda")
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if cuda else "gloo")
    if cuda:
        device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device
