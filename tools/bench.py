"""
Speed and memory, measured side by side in one run, printed as a markdown table of ratios with the raw figures.

    python -m tools.bench              # pythia-70m and pythia-160m shapes, fp32 and bf16, every section
    python -m tools.bench --smoke      # tiny shapes and counts: checks that every section runs
    python -m tools.bench --shapes pythia-160m --sections 1,6    # the bf16 measures only (sections 1, 3 and 6)

docs/performance.md holds the measured tables and how long a full run takes.

Sections (the targets are checked in the same run, never by timed unit tests):
  1. training step tokens/s, ours vs transformers.GPTNeoXForCausalLM with the same weights, full fine-tune and
     frozen probe (for transformers the probe is added by patching its modules at run time, as the paper's code does)
  2. frozen probe vs full fine-tune of the same model (and of the plain base): step time and peak memory
  3. pre-proj + skip overhead on a training step, next to the theoretical FLOP ratio
  4. LAMBADA documents/s: our batched scorer vs one example at a time vs the paper's per-target-token loop
  5. generation tokens/s with and without the K/V cache (first shape, random weights); K/V cache bytes with and
     without pre-proj + skip
  6. bf16 against fp32 (lab/precision.py): the peak matrix-product rates (their ratio is the ceiling of every bf16 /
     fp32 ratio), our training step (embedded base pre-training and probe, pythia-160m probe), what holding a
     frozen base in bf16 buys over autocast's casts, the achieved FLOP rate (the step's products as it runs them,
     step_flops) against the peak bf16 matrix-product rate and the same rate if only the step's matrix products
     ran (on contiguous operands: the ceiling at its shapes; on the layouts the step gives them: what its products
     cost as it runs them), causal attention (the fused kernel in bf16 vs fp32, and model.attention vs the fused
     kernel), and full LAMBADA scoring, with what bf16 changes in its per-passage log-probabilities

Where the two sides do different work (sections 3 and 4) the table also shows the FLOP ratio: on a compute-bound
device such as a CPU, a measured speed-up cannot go much beyond it. Both sides run in one process with the same
allocator setting (cli.keep_freed_memory, unless --system_malloc), or the tcmalloc or jemalloc preloaded in glibc's
place, which the first line names.
"""

import argparse
import copy
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils import flop_counter

from data.prepare import VOCAB_SIZE
from data.sources import DataError
from lab.checkpoint import ROOT, CheckpointError
from lab.cli import (
    ArgumentParser,
    device,
    explicit_flags,
    format_table,
    keep_freed_memory,
    positive_int,
    preloaded_malloc,
)
from lab.evaluation import encode_pair, score_pairs
from lab.loss import training_loss
from lab.ops import OpRecorder
from lab.precision import DTYPES, autocast, dtype_name, for_inference, hold_matrices_in, prefer_flash_attention
from lab.recipes import NANO_SHAPE
from load_pythia import load_pythia
from model import GPT, GPTConfig, KVCache, attention

PROMPT_TOKENS = 16  # section 5's prompt
WINDOW = GPTConfig().block_size  # every shape's (GPTConfig's default, Pythia's 2048)
SHAPES = {  # name: GPTConfig's shape settings
    "nano": dict(vocab_size=VOCAB_SIZE, **{k: NANO_SHAPE[k] for k in ("n_layer", "n_head", "n_embd")}),  # embedded
    "pythia-70m": dict(vocab_size=50304, n_layer=6, n_head=8, n_embd=512),
    "pythia-160m": dict(vocab_size=50304, n_layer=12, n_head=12, n_embd=768),
    "tiny": dict(vocab_size=512, n_layer=2, n_head=4, n_embd=64),
}


def hf_model(shape: str, device: str):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    c = shape_config(shape)
    cfg = GPTNeoXConfig(vocab_size=c.vocab_size, hidden_size=c.n_embd, num_hidden_layers=c.n_layer,
                        num_attention_heads=c.n_head, intermediate_size=c.intermediate_size, rotary_pct=c.rotary_pct,
                        max_position_embeddings=c.block_size, attn_implementation="sdpa")
    torch.manual_seed(0)
    return GPTNeoXForCausalLM(cfg).to(device)


def ours_from_hf(hf, device: str, **switches) -> GPT:
    """Our model with exactly the transformers model's weights (through the loader, as users get them)."""
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        return load_pythia(tmp, **switches).to(device)


def patch_hf_probe(hf) -> list[nn.Parameter]:
    """Pre-projection + skip added to transformers' GPT-NeoX at run time with hooks (the paper's approach)."""
    d = hf.config.hidden_size
    new = []
    for layer in hf.gpt_neox.layers:
        attn = layer.attention
        attn.w_up = nn.Linear(d, int(1.25 * d), bias=False, device=hf.device)
        attn.w_down = nn.Linear(int(1.25 * d), d, bias=False, device=hf.device)
        attn.w_skip = nn.Linear(d, d, bias=False, device=hf.device)

        def pre(module, args, kwargs):
            x_hat = kwargs.get("hidden_states", args[0] if args else None)
            module._x_tilde = x_hat + module.w_down(F.silu(module.w_up(x_hat)))
            if "hidden_states" in kwargs:
                kwargs["hidden_states"] = module._x_tilde
                return args, kwargs
            return (module._x_tilde, *args[1:]), kwargs

        def post(module, args, kwargs, output):
            return (output[0] + module.w_skip(module._x_tilde), *output[1:])

        attn.register_forward_pre_hook(pre, with_kwargs=True)
        attn.register_forward_hook(post, with_kwargs=True)
        new += [attn.w_up.weight, attn.w_down.weight, attn.w_skip.weight]
    for p in hf.parameters():
        p.requires_grad_(False)
    for p in new:
        p.requires_grad_(True)
    return new


def step_fn(model, hf: bool, x: torch.Tensor, dtype: torch.dtype = torch.float32):
    """One training step (forward, backward, AdamW) over the trainable parameters in the compute dtype (autocast
    for bf16, as train.py); returns a callable."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, fused=True)  # the fused kernel, as train.py uses
    ctx = autocast(x.device.type, dtype)

    def step():
        with ctx:
            loss = model(input_ids=x, labels=x).loss if hf else training_loss(model, x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_interleaved(fns: dict, reps: int, device: str) -> dict[str, float]:
    """Median seconds per call of each function, calls interleaved so drift hits all alike; one warm-up each."""
    times = {k: [] for k in fns}
    for r in range(reps + 1):
        for k, fn in fns.items():
            sync(device)
            t = time.perf_counter()
            fn()
            sync(device)
            if r:
                times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def bench_training(shape: str, batch: int, seq: int, reps: int, device: str,
                   dtypes: list[torch.dtype]) -> list[dict]:
    """Sections 1 and 3: ours vs transformers (full and probe) in each precision, and ours with vs without
    pre-proj + skip. Each comparison holds only its own two models, timed interleaved, so that neither runs on a
    busier machine. In bf16 ours holds its frozen matrices in bf16 (as train.py); transformers runs under autocast."""
    hf_full = hf_model(shape, device)
    x = torch.randint(0, SHAPES[shape]["vocab_size"], (batch, seq + 1), device=device)
    tokens, rows = batch * seq, []
    for dtype, mode in [(dtype, mode) for dtype in dtypes for mode in ("full", "probe")]:
        ours = ours_from_hf(hf_full, device, preproj=mode == "probe", skip=mode == "probe")
        hf = hf_full
        if mode == "probe":
            ours.freeze_base()
            hold_matrices_in(ours, dtype)
            hf = hf_model(shape, device)
            hf.load_state_dict(hf_full.state_dict())
            patch_hf_probe(hf)
        t = time_interleaved({"ours": step_fn(ours, False, x, dtype), "hf": step_fn(hf, True, x[:, :-1], dtype)},
                             reps, device)
        rows.append({"section": 1, "what": f"{shape} {mode} train step, {dtype_name(dtype)}, ours vs transformers",
                     "ours": tokens / t["ours"], "reference": tokens / t["hf"], "unit": "tok/s",
                     "ratio": t["hf"] / t["ours"], "target": ">= 1.0"})
        del ours, hf
    del hf_full
    torch.manual_seed(0)
    configs = {k: shape_config(shape, switches=k) for k in (False, True)}
    models = {k: GPT(c).to(device) for k, c in configs.items()}
    t = time_interleaved({k: step_fn(m, False, x) for k, m in models.items()}, reps, device)
    flop = train_flops(configs[True], seq, frozen_base=False) / train_flops(configs[False], seq, frozen_base=False)
    rows.append({"section": 3, "what": f"{shape} pre-proj + skip step time / baseline (full fine-tune)",
                 "ours": t[True], "reference": t[False], "unit": "s/step", "ratio": t[True] / t[False],
                 "flop": flop, "target": f"<= {flop + 0.05:.3f}"})
    return rows


def forward_flops(c: GPTConfig, seq: int, logit_rows: int | None = None) -> float:
    """FLOPs of one forward pass over seq tokens, with the output layer applied to logit_rows of them (all by
    default): 2 per weight per token, plus attention scores and values in full (the nanoGPT / PaLM estimate)."""
    with torch.device("meta"):
        m = GPT(c)
    head = m.lm_head.weight.numel()
    blocks = m.num_params() - m.wte.weight.numel() - head  # the embedding is a lookup, not a matmul
    rows = seq if logit_rows is None else logit_rows
    return 2 * seq * blocks + attention_flops(c, seq) + 2 * rows * head


def attention_flops(c: GPTConfig, seq: int) -> float:
    """FLOPs of attention's two products in one forward pass over seq tokens (scores, then values), in full: the
    causal mask's upper half is computed and discarded."""
    return 4 * c.n_layer * c.n_embd * seq * seq


def lambada_flops(c: GPTConfig, pairs: list, batch_size: int) -> tuple[float, float]:
    """FLOPs of our batched scorer (longest first, each batch padded to its longest, logits only where a target
    is scored) and of the per-target-token loop (a whole forward pass, all logits, for every target token)."""
    lengths = sorted((len(ctx) + len(cont) - 1 for ctx, cont in pairs), reverse=True)
    batched = sum(len(lengths[i:i + batch_size]) * forward_flops(c, lengths[i], 0)
                  for i in range(0, len(lengths), batch_size))
    batched += sum(len(cont) for _, cont in pairs) * forward_flops(c, 0, 1)
    loop = sum(forward_flops(c, len(ctx) + i) for ctx, cont in pairs for i in range(len(cont)))
    return batched, loop


# Section 2's ways of training: (pre-proj + skip, frozen base)
MODES = {"probe": (True, True), "full": (True, False), "base full": (False, False)}


def shape_config(shape: str, switches: bool = False) -> GPTConfig:
    """A SHAPES entry as a config, with pre-proj + skip on or off."""
    return GPTConfig(**SHAPES[shape], preproj=switches, skip=switches)


def measure_mode(shape: str, mode: str, batch: int, seq: int, reps: int, device: str) -> dict:
    """Step time and peak memory of one way of training (on CPU, run alone in a fresh process)."""
    torch.manual_seed(0)
    model = GPT(shape_config(shape, MODES[mode][0])).to(device)
    if MODES[mode][1]:
        model.freeze_base()
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    step = step_fn(model, False, torch.randint(0, model.config.vocab_size, (batch, seq + 1), device=device))
    seconds = time_interleaved({"s": step}, reps, device)["s"]
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda") else peak_rss_mb()
    return {"peak_mb": peak, "seconds": seconds}


def train_flops(c: GPTConfig, seq: int, frozen_base: bool) -> float:
    """An estimate of a training step's FLOPs: the forward; the backward to the activations, one forward's worth for
    the products with a weight and two for attention's, whose operands are both activations; the weight gradients
    of every parameter, or with a frozen base of the new parameters alone. With a frozen base it counts the first
    block's backward in full, of which a step skips what leads only to the frozen embedding (step_flops counts
    what a step runs)."""
    if not frozen_base:
        return 3 * forward_flops(c, seq)
    with torch.device("meta"):
        new = GPT(c).num_params("new")
    return 2 * forward_flops(c, seq) + attention_flops(c, seq) + 2 * seq * new


# Products a step runs on a CPU that PyTorch's FLOP counter has no formula for: the fp32 loss's weight gradient,
# accumulated in place (lab/loss.py), and the CPU's fused attention kernel, forward and backward.
# The formulas are PyTorch's own for addmm and attention, unwrapped (the counter wraps what it is given).
CPU_FLOP_FORMULAS = {
    torch.ops.aten.addmm_: flop_counter.addmm_flop.__wrapped__,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: flop_counter.sdpa_flop.__wrapped__,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: flop_counter.sdpa_backward_flop.__wrapped__,
}


def step_flops(step) -> float:
    """The FLOPs of the matrix products one call of step runs, forward and backward, as PyTorch's FLOP counter
    counts them: the work the step does, whatever is frozen. A fused attention kernel (fp32 on a CPU, any precision
    on a GPU) is counted with the scores its backward computes again."""
    with flop_counter.FlopCounterMode(display=False, custom_mapping=CPU_FLOP_FORMULAS) as counter:
        step()
    return counter.get_total_flops()


def peak_rss_mb() -> float:
    """This process's peak resident memory. VmHWM, not ru_maxrss: a child started from a large parent inherits
    the parent's ru_maxrss across fork + exec, which would hide the child's own peak."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # not Linux: the best available


def bench_probe_vs_full(shape: str, batch: int, seq: int, reps: int, device: str,
                        system_malloc: bool) -> list[dict]:
    """Section 2: the probe against full fine-tuning of the same model (the target), and of the plain base (for
    reference). On CPU each runs in its own process so that peak RSS is its own."""
    res = {}
    for mode in MODES:
        if device == "cpu":
            spec = json.dumps([shape, mode, batch, seq, reps])
            argv = [sys.executable, "-m", "tools.bench", "--memory_child", spec] + ["--system_malloc"] * system_malloc
            out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=True).stdout
            res[mode] = json.loads(out.strip().splitlines()[-1])
        else:
            res[mode] = measure_mode(shape, mode, batch, seq, reps, device)
    flops = {mode: train_flops(shape_config(shape, switches), seq, frozen)
             for mode, (switches, frozen) in MODES.items()}
    rows = []
    for ref, target in (("full", "<= 0.75"), ("base full", "-")):
        what = "full fine-tune" if ref == "full" else "full fine-tune of the base without pre-proj + skip"
        rows += [{"section": 2, "what": f"{shape} probe / {what}, step time", "ours": res["probe"]["seconds"],
                  "reference": res[ref]["seconds"], "unit": "s/step",
                  "ratio": res["probe"]["seconds"] / res[ref]["seconds"], "flop": flops["probe"] / flops[ref],
                  "target": target},
                 {"section": 2, "what": f"{shape} probe / {what}, peak memory", "ours": res["probe"]["peak_mb"],
                  "reference": res[ref]["peak_mb"], "unit": "MB",
                  "ratio": res["probe"]["peak_mb"] / res[ref]["peak_mb"], "target": "< 1.0" if ref == "full" else "-"}]
    return rows


@torch.inference_mode()
def paper_token_loop(model: GPT, pairs: list) -> list[bool]:
    """The paper's LAMBADA scoring: one forward pass per target token, checking each greedy prediction."""
    correct, device = [], model.wte.weight.device
    for ctx, cont in pairs:
        ok = True
        for i, tok in enumerate(cont):
            logits, _ = model(torch.tensor([ctx + cont[:i]], device=device))
            ok &= bool(logits[0, -1].argmax() == tok)
        correct.append(ok)
    return correct


def bench_eval(model: GPT, tokenizer, n_docs: int, mirror: str | None) -> list[dict]:
    """Section 4, on the first n_docs LAMBADA passages."""
    from data import benchmarks

    pairs = [encode_pair(tokenizer, c, t) for c, t in benchmarks.lambada(mirror)[:n_docs]]
    t0 = time.perf_counter()
    batched = score_pairs(model, pairs, batch_size=32)
    t1 = time.perf_counter()
    single = score_pairs(model, pairs, batch_size=1)
    t2 = time.perf_counter()
    loop = paper_token_loop(model, pairs)
    t3 = time.perf_counter()
    assert [s.greedy for s in batched] == [s.greedy for s in single] == loop, "the three scorers disagree"
    ours_flops, loop_flops = lambada_flops(model.config, pairs, 32)
    return [{"section": 4, "what": "LAMBADA batched vs one at a time", "ours": n_docs / (t1 - t0),
             "reference": n_docs / (t2 - t1), "unit": "docs/s", "ratio": (t2 - t1) / (t1 - t0),
             "flop": lambada_flops(model.config, pairs, 1)[0] / ours_flops, "target": "-"},
            {"section": 4, "what": "LAMBADA batched vs paper's per-token loop", "ours": n_docs / (t1 - t0),
             "reference": n_docs / (t3 - t2), "unit": "docs/s", "ratio": (t3 - t2) / (t1 - t0),
             "flop": loop_flops / ours_flops, "target": ">= 10"}]


def bench_generation(model: GPT, new_tokens: int, device: str) -> list[dict]:
    """Section 5: K/V-cached vs uncached generation; cache bytes with and without the switches."""
    prompt = torch.randint(0, model.config.vocab_size, (1, PROMPT_TOKENS), device=device)
    t = {}
    for use_cache in (True, False):
        sync(device)
        t0 = time.perf_counter()
        model.generate(prompt, new_tokens, temperature=0, use_cache=use_cache)
        sync(device)
        t[use_cache] = time.perf_counter() - t0
    c = model.config
    plain = GPTConfig(**{**c.to_dict(), "preproj": False, "skip": False})
    switched = GPTConfig(**{**c.to_dict(), "preproj": True, "skip": True})
    size = lambda cfg: KVCache(cfg, 1, 16 + new_tokens, "meta", torch.float32).nbytes()  # noqa: E731
    return [{"section": 5, "what": f"generation of {new_tokens} tokens, cache vs none", "ours": new_tokens / t[True],
             "reference": new_tokens / t[False], "unit": "tok/s", "ratio": t[False] / t[True], "target": ">= 5"},
            {"section": 5, "what": "K/V cache bytes, pre-proj + skip vs baseline", "ours": size(switched),
             "reference": size(plain), "unit": "bytes", "ratio": size(switched) / size(plain), "target": "== 1.0"}]


# Section 6's training steps: (shape, what trains, batch, target for bf16 / fp32)
# The share of the peak bf16 matrix-product rate that the embedded base's steps should reach (issue 24).
STEP_PEAK_TARGETS = {("nano", "pre-training"): ">= 0.65", ("nano", "probe"): ">= 0.60"}
PRECISION_STEPS = [("nano", "pre-training", 16, ">= 1.6"), ("nano", "probe", 16, "-"),
                   ("pythia-160m", "probe", 4, ">= 2.5")]


def peak_matmul(n: int, dtype: torch.dtype, device: str):
    """An n x n matrix product in dtype (2 n^3 FLOPs): the physical limit a training step is measured against."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    return lambda: a @ b


def peak_matmul_rate(n: int, dtype: torch.dtype, device: str, reps: int) -> float:
    """FLOP/s of peak_matmul."""
    return 2 * n**3 / time_interleaved({"mm": peak_matmul(n, dtype, device)}, max(reps, 5), device)["mm"]


# The matrix products a step runs, as the dispatcher sees them: op -> the position of its first matrix operand
# (addmm's and baddbmm's first input is the term added to the product; model.attention's scores are a baddbmm)
MATMUL_OPS = {torch.ops.aten.mm: 0, torch.ops.aten.addmm: 1, torch.ops.aten.bmm: 0, torch.ops.aten.baddbmm: 1}


def recorded_products(step, device: str, keep_strides: bool = False) -> list[list[torch.Tensor]]:
    """The operands of the matrix products that one call of step runs, made anew with the same shapes and dtypes:
    contiguous, or with keep_strides laid out as the step laid them out (a transposed view stays transposed).
    Products inside a fused kernel (scaled_dot_product_attention) are not recorded."""
    with OpRecorder() as ops:
        step()
    return [[replay_operand(shape, stride if keep_strides else None, dtype, device)
             for shape, stride, dtype in tensors[MATMUL_OPS[op]:MATMUL_OPS[op] + 2]]
            for op, tensors in ops.calls if op in MATMUL_OPS]


def matmul_replay(step, device: str, keep_strides: bool = False):
    """step's matrix products (recorded_products) as a callable that runs them alone: what the step would cost if
    nothing but its products ran; on contiguous operands the most its shapes reach, on the step's own layouts
    what its products cost as it runs them."""
    operands = recorded_products(step, device, keep_strides)
    return lambda: [torch.matmul(a, b) for a, b in operands]


def replay_operand(shape: list[int], stride: list[int] | None, dtype: torch.dtype, device: str) -> torch.Tensor:
    """A random tensor of shape, contiguous or with the given strides."""
    if stride is None:
        return torch.randn(shape, device=device, dtype=dtype)
    return torch.empty_strided(shape, stride, device=device, dtype=dtype).normal_()


def bench_precision(steps: list, seq: int, reps: int, device: str) -> list[dict]:
    """Section 6: the peak matrix-product rate in bf16 against fp32; bf16 against fp32 for our training step; for
    a frozen base also bf16 with the base held in bf16 against plain autocast (what holding it buys); and the
    achieved FLOP rate (step_flops: what the step runs, not train_flops' estimate) against the peak
    matrix-product rate in bf16."""
    rows, bf16, n = [], torch.bfloat16, 2048 if device == "cpu" else 8192
    peak, peak_fp32 = peak_matmul_rate(n, bf16, device, reps), peak_matmul_rate(n, torch.float32, device, reps)
    # A step is at best as much faster in bf16 as the device's matrix products are: the ceiling of the ratios below.
    rows.append({"section": 6, "what": f"peak matrix-product rate ({n} x {n}), bf16 vs fp32: the ceiling",
                 "ours": peak / 1e9, "reference": peak_fp32 / 1e9, "unit": "GFLOP/s", "ratio": peak / peak_fp32,
                 "target": "-"})
    for shape, what, batch, target in steps:
        torch.manual_seed(0)
        probe = what == "probe"
        fp32 = GPT(shape_config(shape, switches=probe)).to(device)
        if probe:
            fp32.freeze_base()
        held = copy.deepcopy(fp32)
        hold_matrices_in(held, bf16)
        x = torch.randint(0, SHAPES[shape]["vocab_size"], (batch, seq + 1), device=device)
        # the peak product interleaved with the steps, so that the machine's drift moves both alike
        fns = {"fp32": step_fn(fp32, False, x), "bf16": step_fn(held, False, x, bf16),
               "peak": peak_matmul(n, bf16, device)}
        if probe:
            fns["autocast"] = step_fn(copy.deepcopy(fp32), False, x, bf16)
        fns["products"] = matmul_replay(fns["bf16"], device)
        fns["products as laid out"] = matmul_replay(fns["bf16"], device, keep_strides=True)
        t = time_interleaved(fns, reps, device)
        name = f"{shape} {what} step ({batch} x {seq})"
        rows.append({"section": 6, "what": f"{name}, bf16 vs fp32", "ours": batch * seq / t["bf16"],
                     "reference": batch * seq / t["fp32"], "unit": "tok/s", "ratio": t["fp32"] / t["bf16"],
                     "target": target})
        if probe:
            rows.append({"section": 6, "what": f"{name}, bf16: base held in bf16 vs cast by autocast",
                         "ours": batch * seq / t["bf16"], "reference": batch * seq / t["autocast"], "unit": "tok/s",
                         "ratio": t["autocast"] / t["bf16"], "target": "-"})
        flops = step_flops(fns["bf16"])
        step_peak = 2 * n**3 / t["peak"]
        rows.append({"section": 6, "what": f"{name}, bf16: achieved / peak matrix-product FLOP rate (interleaved)",
                     "ours": flops / t["bf16"] / 1e9, "reference": step_peak / 1e9, "unit": "GFLOP/s",
                     "ratio": flops / t["bf16"] / step_peak, "target": STEP_PEAK_TARGETS.get((shape, what), "-")})
        # The same statistic if the step ran nothing but its matrix products: on contiguous operands, the most its
        # shapes can reach here; with the step's own layouts, what its products cost as it runs them.
        for replay, what_ran in (("products", "(their ceiling)"), ("products as laid out", "on its operands' layouts")):
            rows.append({"section": 6, "what": f"{name}, bf16: achieved / peak if only its matrix products ran "
                         f"{what_ran}", "ours": flops / t[replay] / 1e9, "reference": step_peak / 1e9,
                         "unit": "GFLOP/s", "ratio": flops / t[replay] / step_peak, "target": "-"})
        del fp32, held, fns
    return rows


def bench_attention(batch: int, heads: int, seq: int, reps: int, device: str) -> list[dict]:
    """Section 6: causal attention forward and backward at the embedded base's shape: the fused kernel in bf16
    against fp32 (what bf16 buys it), and model.attention against the fused kernel, both in bf16 (what writing
    attention out buys on a CPU; elsewhere model.attention is the fused kernel)."""
    inputs = {dt: [torch.randn(batch, heads, seq, 64, device=device, dtype=dt, requires_grad=True) for _ in range(3)]
              for dt in (torch.float32, torch.bfloat16)}

    def fused(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def fwd_bwd(fn, dt):
        return lambda: fn(*inputs[dt]).sum().backward()
    t = time_interleaved({"fused fp32": fwd_bwd(fused, torch.float32), "fused": fwd_bwd(fused, torch.bfloat16),
                          "ours": fwd_bwd(attention, torch.bfloat16)},
                         max(reps, 5), device)
    what = f"causal attention forward + backward ({batch} x {heads} heads x {seq} x 64)"
    return [{"section": 6, "what": f"{what}, fused kernel, bf16 vs fp32", "ours": t["fused"] * 1e3,
             "reference": t["fused fp32"] * 1e3, "unit": "ms", "ratio": t["fused fp32"] / t["fused"], "target": "-"},
            {"section": 6, "what": f"{what}, bf16, model.attention vs fused kernel", "ours": t["ours"] * 1e3,
             "reference": t["fused"] * 1e3, "unit": "ms", "ratio": t["fused"] / t["ours"], "target": "-"}]


def bench_lambada_precision(model: GPT, tokenizer, n_docs: int | None, mirror: str | None,
                            device: str) -> tuple[list[dict], str]:
    """Section 6: LAMBADA scoring (the full set by default) in bf16 against fp32, and what bf16 changes: the
    largest and mean per-document difference of the target's log-probability, and accuracy decisions flipped."""
    from data import benchmarks

    pairs = [encode_pair(tokenizer, c, t) for c, t in benchmarks.lambada(mirror)[:n_docs]]
    fp32, held = model.to(device).eval(), copy.deepcopy(model)
    ctx = for_inference(held, device, torch.bfloat16)
    seconds, scores = {}, {}
    for name, m, c in (("fp32", fp32, autocast(device, torch.float32)), ("bf16", held, ctx)):
        sync(device)
        t0 = time.perf_counter()
        with c:
            scores[name] = score_pairs(m, pairs, batch_size=32)
        sync(device)
        seconds[name] = time.perf_counter() - t0
    diffs = [abs(a.logprob - b.logprob) for a, b in zip(scores["fp32"], scores["bf16"])]
    flips = sum(a.greedy != b.greedy for a, b in zip(scores["fp32"], scores["bf16"]))
    quality = (f"LAMBADA bf16 vs fp32 over {len(pairs)} passages: |d logprob| max {max(diffs):.4f}, mean "
               f"{sum(diffs) / len(diffs):.4f} nats; accuracy {sum(s.greedy for s in scores['fp32'])} -> "
               f"{sum(s.greedy for s in scores['bf16'])} correct, {flips} decisions flipped")
    row = {"section": 6, "what": f"LAMBADA scoring ({len(pairs)} passages), bf16 vs fp32",
           "ours": len(pairs) / seconds["bf16"], "reference": len(pairs) / seconds["fp32"], "unit": "docs/s",
           "ratio": seconds["fp32"] / seconds["bf16"], "target": ">= 2"}
    return [row], quality


def check(row: dict) -> str:
    t, r = row["target"], row["ratio"]
    if t == "-":
        return ""
    op, value = t.split()[0], float(t.split()[1])
    ok = {">=": r >= value, "<=": r <= value, "<": r < value, "==": abs(r - value) < 1e-12}[op]
    return "pass" if ok else "MISS"


def print_table(rows: list[dict]) -> None:
    print(format_table(["#", "measure", "ours", "reference", "unit", "ratio", "FLOP ratio", "target", ""],
                       [[r["section"], r["what"], f"{r['ours']:,.4g}", f"{r['reference']:,.4g}", r["unit"],
                         f"{r['ratio']:.3f}", f"{r['flop']:.3f}" if "flop" in r else "", r["target"], check(r)]
                        for r in rows], markdown=True))


# What --smoke sets, and --eval_from, which it does not use (a random tiny model stands in for it).
SMOKE = dict(shapes="tiny", batch=2, seq=32, reps=1, lambada_docs=8, new_tokens=32, eval_from=None)


def precision_list(text: str) -> list[torch.dtype]:
    """--precisions: names from precision.DTYPES, comma-separated."""
    unknown = [s for s in text.split(",") if s not in DTYPES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown precision {unknown[0]!r}; choose from {', '.join(DTYPES)}")
    return [DTYPES[s] for s in text.split(",")]


def section_list(text: str) -> set[int]:
    """--sections: a comma-separated subset of 1-6 (1 and 3 come from the same steps, so either runs both)."""
    try:
        sections = {int(x) for x in text.split(",") if x.strip()}
    except ValueError:
        sections = set()
    if not sections or not sections <= {1, 2, 3, 4, 5, 6}:
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of 1-6, got {text!r}")
    return sections


def shape_list(text: str) -> str:
    """--shapes: names from SHAPES, comma-separated."""
    unknown = [s for s in text.split(",") if s not in SHAPES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown shape {unknown[0]!r}; choose from {', '.join(SHAPES)}")
    return text


def eval_model(args) -> tuple[GPT, object]:
    """Sections 4 and 6's model and tokenizer: --eval_from, or under --smoke a random tiny model with the real
    Pythia tokenizer standing in for the embedded base."""
    if args.smoke:
        from data.sources import fetch
        from load_pythia import load_tokenizer
        tokenizer = load_tokenizer(str(fetch("tokenizers/20B_tokenizer.json", args.mirror)))
        return GPT(GPTConfig(vocab_size=50304, block_size=512, n_layer=2, n_head=2, n_embd=32)), tokenizer
    from lab.checkpoint import load_model
    model, tokenizer, _ = load_model(args.eval_from, mirror=args.mirror)
    return model, tokenizer


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(prog="python -m tools.bench", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", type=device, default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shapes", type=shape_list, default="pythia-70m,pythia-160m")
    p.add_argument("--batch", type=positive_int, default=4)
    p.add_argument("--seq", type=positive_int, default=256)
    p.add_argument("--reps", type=positive_int, default=3)
    p.add_argument("--eval_from", default="nano", help="model for section 4 (any --init_from)")
    p.add_argument("--lambada_docs", type=positive_int, default=200,
                   help="passages for section 4's slow per-token loop")
    p.add_argument("--precisions", type=precision_list, default="float32,bfloat16", help="section 1's precisions")
    p.add_argument("--new_tokens", type=positive_int, default=256)
    p.add_argument("--sections", type=section_list, default="1,2,3,4,5,6", help="which sections to run, e.g. 1,6")
    p.add_argument("--mirror", default=None)
    p.add_argument("--smoke", action="store_true", help="tiny shapes and counts, to check that it all runs")
    p.add_argument("--system_malloc", action="store_true",
                   help="leave glibc's default of returning freed memory to the OS (train.py keeps it)")
    p.add_argument("--memory_child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unused = sorted(explicit_flags(p, argv) & set(SMOKE)) if args.smoke else []
    if unused:
        p.error(f"--smoke sets its own {', '.join('--' + k for k in unused)}; drop them, or drop --smoke")
    if args.seq > WINDOW:
        p.error(f"--seq {args.seq} is longer than the models' window of {WINDOW} positions")
    if PROMPT_TOKENS + args.new_tokens > WINDOW:
        p.error(f"--new_tokens {args.new_tokens}: with section 5's {PROMPT_TOKENS}-token prompt it passes the "
                f"models' window of {WINDOW} positions; ask for at most {WINDOW - PROMPT_TOKENS}")
    return args


def run_sections(args: argparse.Namespace) -> tuple[list[dict], str]:
    """(the rows of every section asked for, section 6's LAMBADA quality line or "")."""
    steps = PRECISION_STEPS
    if args.smoke:
        vars(args).update(SMOKE)
        steps = [("tiny", what, 2, target) for _, what, _, target in PRECISION_STEPS[:2]]
    torch.manual_seed(0)
    rows, sections = [], args.sections
    for shape in args.shapes.split(","):
        if sections & {1, 3}:
            rows += bench_training(shape, args.batch, args.seq, args.reps, args.device, args.precisions)
        if 2 in sections:
            rows += bench_probe_vs_full(shape, args.batch, args.seq, args.reps, args.device, args.system_malloc)
    model, tokenizer = eval_model(args) if sections & {4, 6} else (None, None)
    if 4 in sections:
        rows += bench_eval(model.to(args.device).eval(), tokenizer, args.lambada_docs, args.mirror)
    if 5 in sections:
        gen_model = GPT(shape_config(args.shapes.split(",")[0])).to(args.device).eval()  # the first shape
        rows += bench_generation(gen_model, args.new_tokens, args.device)
    quality = ""
    if 6 in sections:
        rows += bench_precision(steps, 256 if not args.smoke else args.seq, args.reps, args.device)
        rows += bench_attention(*((16, 3, 256) if not args.smoke else (2, 2, args.seq)), args.reps, args.device)
        lambada_rows, quality = bench_lambada_precision(model, tokenizer, args.lambada_docs if args.smoke else None,
                                                        args.mirror, args.device)
        rows += lambada_rows
    return rows, quality


def main(argv: list[str] | None = None) -> None:
    prefer_flash_attention()  # the kernels train.py and the evaluations run
    args = get_args(argv)
    malloc = "glibc default" if args.system_malloc else "freed memory kept, as train.py" if keep_freed_memory() \
        else "system default"
    preloaded = preloaded_malloc()
    if preloaded:  # then glibc's malloc, and the setting above, go unused
        malloc = f"{preloaded} (preloaded)"
    if args.memory_child:
        print(json.dumps(measure_mode(*json.loads(args.memory_child), "cpu")))
        return
    rows, quality = run_sections(args)
    print(f"device: {args.device} ({torch.get_num_threads()} threads), torch {torch.__version__}, malloc: {malloc}; "
          f"train batch {args.batch} x {args.seq}, median of {args.reps} steps")
    print_table(rows)
    if quality:
        print(quality)


if __name__ == "__main__":
    try:
        main()
    except (CheckpointError, DataError) as e:
        raise SystemExit(f"error: {e}")
