"""
What every command-line script shares: the flags that name a model, the table printer and process set-up.
Library code never imports argparse; scripts turn their flags into plain arguments here.
"""

import argparse
import ctypes
import sys

import torch

from model import SWITCHES
from precision import DTYPES


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The flags every script shares to name a model and where it runs."""
    p.add_argument("--init_from", default="nano",
                   help="nano (default, the embedded base), scratch, pythia-160m (or any Pythia / HF id), "
                        "a Hugging Face folder, or one of our run folders")
    p.add_argument("--preproj", action="store_true", help="add the pre-projection MLP before Q/K/V")
    p.add_argument("--skip", action="store_true", help="add the content skip W_skip around attention")
    p.add_argument("--lora_rank", type=int, default=0, help="LoRA rank on query_key_value and dense (0 = off)")
    p.add_argument("--lora_alpha", type=float, default=0.0, help="LoRA alpha (0 = 2 * rank, as the paper)")
    p.add_argument("--adapter_dim", type=int, default=0,
                   help="capacity control: a parallel MLP adapter of this inner size beside attention (0 = off)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="compute precision: auto = bf16 where the device has native bf16 matrix units, else fp32 "
                        "(see precision.py)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--mirror", default=None, help="offline data mirror folder (default: $PREPROJ_MIRROR)")


def switches_of(args: argparse.Namespace) -> dict:
    """The research switches of a parsed command line, as load_model and GPTConfig take them."""
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


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory for reuse instead of handing it back to the operating system.

    A training step frees and re-allocates the same activations every time. By default glibc returns blocks over
    32 MB, and a free heap top over 64 MB, to the OS, so the next step page-faults and zeroes them all over again
    (README, "Performance", measures the cost). PyTorch's caching allocator does this on CUDA; this is the CPU
    counterpart. Linux with glibc only; returns whether it took effect.
    """
    if sys.platform != "linux":
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
    return bool(mallopt) and mallopt(m_mmap_threshold, 2**30) == 1 and mallopt(m_trim_threshold, 2**30) == 1
