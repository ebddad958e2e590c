"""
The layer analysis of the 500-step experiment (docs/experiment.md, "Layer analysis, a fair test of the paper's
Figure 2"), measured from each run's checkpoint on held-out text and kept in the run folder as layers.json, so that
the report rebuilds without checkpoints.

    python -m study.layers                      # every finished run of out/experiment-500 that has no layers.json
    python -m study.layers --runs R1 R2         # these run folders (measured again if they have one)

A term is an additive per-layer output that a method trains:
    skip      W_skip x̃ (x̂ without pre-projection), added to the residual stream beside attention
    preproj   W_down σ(W_up x̂), the pre-projection's change to attention's input (σ = SiLU, or none when linear)
    side_mlp  W_a_down SiLU(W_a_up x̂), added to the residual stream beside attention
    lora      LoRA's update of the QKV and attention-output projections, (α / r) B A x, the two together
For each term and layer:
    norm, growth   ‖W‖_F and ‖W - W_0‖_F of each of its matrices (W_0: the initial values, drawn again from the
                   run's seed as train.py drew them; for LoRA the update ΔW = (α / r) B A, whose W_0 is 0)
    zero, mean     the held-out loss increase when that layer's term alone is replaced by zeros (zero-ablation) or
                   by its mean over the held-out positions (mean-ablation): a term that keeps most of its effect
                   under mean-ablation acts as an offset, not as a path for content
The statistics over seeds (summary) take the seed as the unit: per layer a t-interval, and over depth a slope and
the paper's last-over-first ratio, each per seed and then a t-interval, with and without layer 0 (which reads the
raw embedding).
"""

import argparse
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from data.prepare import split_tokens
from data.sources import DataError, write_atomic
from lab.checkpoint import CheckpointError, load_model, read_checkpoint
from lab.cli import ArgumentParser, positive_int
from lab.evaluation import val_loss
from lab.precision import for_inference, resolve_dtype
from lab.stats import paired_t
from model import GPT, LoRALinear
from study.design import (
    EXPERIMENT_METHODS,
    OUT,
    chosen_lr,
    code_version,
    initial_model,
    method_folder,
    run_folders,
)

HELDOUT = "sotu_test"  # the experiment's primary held-out text
TOKENS = 16_384  # its first 64 windows of 256: the ablations are paired on the same tokens, the seeds are the unit
RECORD = "layers.json"

# term -> (the modules whose output it is, or to which it is added, in a block; its matrices by name)
TERMS = {
    "skip": (lambda b: [b.w_skip], lambda b: {"w_skip": b.w_skip.weight}),
    "preproj": (lambda b: [b.w_down], lambda b: {"w_up": b.w_up.weight, "w_down": b.w_down.weight}),
    "side_mlp": (lambda b: [b.w_a_down], lambda b: {"w_a_up": b.w_a_up.weight, "w_a_down": b.w_a_down.weight}),
    "lora": (lambda b: [b.attn.qkv, b.attn.proj],
             lambda b: {"qkv": lora_update(b.attn.qkv), "proj": lora_update(b.attn.proj)}),
}


def terms_of(model: GPT) -> list[str]:
    """The terms a model trains, in TERMS order."""
    b = model.blocks[0]
    has = {"skip": b.w_skip is not None, "preproj": b.w_up is not None, "side_mlp": b.w_a_up is not None,
           "lora": isinstance(b.attn.qkv, LoRALinear)}
    return [t for t in TERMS if has[t]]


def lora_update(layer: LoRALinear) -> torch.Tensor:
    return layer.scaling * (layer.lora_b.detach().float() @ layer.lora_a.detach().float())


# --- weights ---

def matrix_growth(model: GPT, init: GPT, term: str) -> dict[str, dict[str, list[float]]]:
    """{matrix: {"norm": ‖W‖_F per layer, "growth": ‖W - W_0‖_F per layer}} of a term."""
    matrices = TERMS[term][1]
    out: dict[str, dict[str, list[float]]] = {}
    for block, start in zip(model.blocks, init.blocks):
        for name, w in matrices(block).items():
            w, w0 = w.detach().float(), matrices(start)[name].detach().float()
            m = out.setdefault(name, {"norm": [], "growth": []})
            m["norm"].append(w.norm().item())
            m["growth"].append((w - w0).norm().item())
    return out


# --- ablations ---

def untouched(module: nn.Module, x: torch.Tensor):
    """What a term's module computes without the term: LoRA's base projection; 0 where the output is the term."""
    return F.linear(x, module.weight, module.bias) if isinstance(module, LoRALinear) else 0


def replace_term(stand_in):
    """A forward hook that puts stand_in(term) in place of the module's term."""
    def hook(module, args, out):
        rest = untouched(module, args[0])
        return rest + stand_in(out - rest)
    return hook


@torch.no_grad()
def term_means(model: GPT, terms: list[str], stream: np.ndarray, seq_len: int, tokens: int,
               ctx) -> tuple[float, dict]:
    """(the intact held-out loss, {module: its term's mean over every held-out position, fp32}), for every term in
    one pass."""
    sums: dict[nn.Module, list] = {}

    def keep(module, args, out):
        value = (out - untouched(module, args[0])).float().flatten(0, -2)
        total = sums.setdefault(module, [0.0, 0])
        total[0], total[1] = total[0] + value.sum(0), total[1] + len(value)
    modules = [m for term in terms for b in model.blocks for m in TERMS[term][0](b)]
    handles = [m.register_forward_hook(keep) for m in modules]
    try:
        loss = val_loss(model, stream, seq_len, tokens, ctx)
    finally:
        for h in handles:
            h.remove()
    return loss, {m: s / n for m, (s, n) in sums.items()}


@torch.no_grad()
def ablations(model: GPT, term: str, stream: np.ndarray, seq_len: int, tokens: int, ctx, loss: float,
              means: dict) -> dict[str, list[float]]:
    """{"zero": per layer the held-out loss increase over the intact `loss` with that layer's term replaced by
    zeros, "mean": ... by its mean over the held-out positions (`means`, term_means)}. Each layer is ablated alone,
    on the same tokens."""
    out = {"zero": [], "mean": []}
    for block in model.blocks:
        for kind in ("zero", "mean"):
            handles = [m.register_forward_hook(replace_term(
                torch.zeros_like if kind == "zero" else lambda t, mean=means[m]: mean.to(t.dtype).expand_as(t)))
                for m in TERMS[term][0](block)]
            try:
                out[kind].append(val_loss(model, stream, seq_len, tokens, ctx) - loss)
            finally:
                for h in handles:
                    h.remove()
    return out


# --- one run folder ---

def measure_run(folder: Path, tokens: int = TOKENS, seq_len: int = 256, device: str = "cpu", dtype: str = "auto",
                mirror: str | None = None, cache: dict | None = None) -> dict:
    """layers.json's record of one run folder (not written)."""
    ckpt = read_checkpoint(folder)
    model, tokenizer, _ = load_model(str(folder), mirror=mirror)
    terms = terms_of(model)
    init = initial_model(ckpt, mirror)
    cache = {} if cache is None else cache
    key = (tokenizer.to_str(), HELDOUT)
    if key not in cache:
        cache[key] = split_tokens(HELDOUT, tokenizer, mirror)
    growth = {term: matrix_growth(model, init, term) for term in terms}  # from the saved weights, before any cast
    seq_len = min(seq_len, model.config.block_size)
    ctx = for_inference(model, device, resolve_dtype(dtype, device))  # may hold the weights in bf16
    record = {"heldout": HELDOUT, "tokens": min(tokens, len(cache[key]) - 1) // seq_len * seq_len, "seq_len": seq_len,
              "dtype": str(resolve_dtype(dtype, device)).removeprefix("torch."), "step": ckpt.get("step"),
              **code_version(), "terms": {}}
    record["loss"], means = term_means(model, terms, cache[key], seq_len, tokens, ctx)
    for term in terms:
        cut = ablations(model, term, cache[key], seq_len, tokens, ctx, record["loss"], means)
        record["terms"][term] = {**cut, "matrices": growth[term]}
    return record


def experiment_runs(out: Path, bases: list[str]) -> list[Path]:
    """Every finished probe run of the experiment at its method's chosen (or fixed) learning rate, in order."""
    runs = []
    for base in bases:
        for method in EXPERIMENT_METHODS:
            folder = method_folder(out, base, "ood", method)
            chosen = chosen_lr(out, base, "ood", method)
            for lr, _, run in run_folders(folder):
                if float(lr) == chosen and (run / "ckpt.pt").is_file() and (run / "timing.json").is_file():
                    runs.append(run)
    return runs


# --- the statistics over seeds ---

def interval(values) -> dict[str, float]:
    """Mean and 95% t-interval over seeds ({"n", "mean", "low", "high", "p"}, lab.stats.paired_t)."""
    return paired_t(np.asarray(values, dtype=float))


def depth_statistics(per_seed: np.ndarray) -> dict[str, dict[str, float]]:
    """From a [seeds, layers] measure: the slope over depth (per layer index, least squares) and the paper's
    last-over-first ratio, each per seed then as a t-interval over seeds, with and without layer 0."""
    out = {}
    for label, first in (("all layers", 0), ("without layer 0", 1)):
        values = per_seed[:, first:]
        layers = np.arange(first, per_seed.shape[1])
        out[f"slope, {label}"] = interval([np.polyfit(layers, v, 1)[0] for v in values])
        out[f"last / first, {label}"] = interval(values[:, -1] / values[:, 0])
    return out


def summary(records: list[dict], term: str, measure: str, matrix: str | None = None) -> dict:
    """One measure of one term over a method's seeds: {"layers": per layer interval, **depth_statistics}. measure
    is "zero" or "mean", or "norm" or "growth" of `matrix`."""
    rows = [r["terms"][term]["matrices"][matrix][measure] if matrix else r["terms"][term][measure] for r in records]
    per_seed = np.asarray(rows, dtype=float)
    return {"layers": [interval(per_seed[:, i]) for i in range(per_seed.shape[1])], **depth_statistics(per_seed)}


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(prog="python -m study.layers", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(OUT), help="the experiment's run folders")
    p.add_argument("--bases", default="study,nano", help="comma-separated bases")
    p.add_argument("--runs", nargs="+", default=None, help="these run folders instead (measured again)")
    p.add_argument("--tokens", type=positive_int, default=TOKENS, help=f"held-out tokens of {HELDOUT} per pass")
    p.add_argument("--seq_len", type=positive_int, default=256)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--mirror", default=None, help="offline data mirror folder (default: $PREPROJ_MIRROR)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[Path]:
    args = get_args(argv)
    runs = ([Path(r) for r in args.runs] if args.runs else
            [r for r in experiment_runs(Path(args.out), [b for b in args.bases.split(",") if b])
             if not (r / RECORD).is_file()])
    missing = [r for r in runs if not (r / "ckpt.pt").is_file()]
    if missing:
        raise SystemExit(f"error: {missing[0]} has no ckpt.pt; pass run folders of the experiment's trainings")
    cache: dict = {}
    for run in runs:
        try:
            record = measure_run(run, args.tokens, args.seq_len, args.device, args.dtype, args.mirror, cache)
            write_atomic(run / RECORD, json.dumps(record, indent=1))
        except (CheckpointError, DataError) as e:
            raise SystemExit(f"error: {run}: {e}")
        print(f"{run}: {', '.join(record['terms'])} ({record['tokens']} tokens of {HELDOUT})", flush=True)
    return runs


if __name__ == "__main__":
    main()
