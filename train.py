"""
One training loop for the frozen probe (the paper's experiment), full fine-tuning and pre-training from scratch.

    python train.py --preproj --skip                              # frozen probe on the embedded base (CPU, offline)
    python train.py --init_from pythia-160m --preproj --skip --paper   # the paper's recipe on real Pythia (GPU)
    python train.py --init_from scratch --out_dir out/mine        # pre-train a small GPT-NeoX
    torchrun --nproc_per_node=2 train.py --preproj --skip         # the same result on several processes

Whenever the base is pre-trained (anything but scratch), only the new parameters train unless --full_finetune.
The embedded base (`--init_from nano`) does not ship as weights: the first run pre-trains it with this same loop
(NANO_RECIPE, a step of its own that main() prints) and caches it in out/nano-base.
"""

import argparse
import json
import math
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, TextIO

import numpy as np
import torch
import torch.distributed as dist
from tokenizers import Tokenizer
from tqdm import tqdm

from data.prepare import (
    NANO_DATA,
    PROBE_SPLITS,
    load_nano_split,
    prepare_nano,
    probe_data,
    split_tokens,
    wikitext103_probe_lines,
)
from data.sources import DataError
from lab.checkpoint import (
    NANO_DIR,
    ROOT,
    CheckpointError,
    append_metrics,
    check_base,
    clean_temporaries,
    load_model,
    lock_run_folder,
    model_card,
    nano_status,
    open_metrics,
    read_checkpoint,
    run_name,
    save_checkpoint,
    save_run_file,
)
from lab.cli import (
    ArgumentParser,
    add_model_args,
    explicit_flags,
    format_table,
    fraction,
    keep_freed_memory,
    name_list,
    nonneg_float,
    nonneg_int,
    out_folder,
    positive_float,
    positive_int,
    switches_of,
)
from lab.evaluation import TASKS, check_data, evaluate, val_loss
from lab.precision import autocast, dtype_name, hold_as_paper, hold_matrices_in, resolve_dtype
from lab.run_folder import EXIT_DIVERGED, Diverged
from load_pythia import read_tokenizer
from model import GPT, GPTConfig

# The embedded base, pre-trained from scratch on the public-domain corpus the first time it is needed.
NANO_RECIPE = ("--init_from scratch --n_layer 6 --n_head 3 --n_embd 192 --block_size 256 --max_iters 600 "
               "--batch_size 16 --lr 2e-3 --min_lr 2e-4 --warmup_iters 30 --weight_decay 0.1 --beta2 0.95")
# The paper's probe recipe (PAPER.md): lr 1e-5, 500 steps, effective batch 16, 512 tokens, 50 warm-up, seed 42.
PAPER_RECIPE = dict(lr=1e-5, min_lr=0.0, max_iters=500, batch_size=16, grad_accum=1, seq_len=512,
                    warmup_iters=50, seed=42, weight_decay=0.0, beta2=0.999, data="wikitext103", pure_bf16=True)
# The flags a resumed run takes from its command line; every other setting comes from its checkpoint, so that it
# continues exactly. A flag given with --resume that would change another setting is refused, never ignored.
HONOURED_ON_RESUME = ("out_dir", "resume", "stop_at", "device", "compile", "mirror")


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    g = p.add_argument_group("run")
    g.add_argument("--out_dir", type=out_folder, default=None, help="run folder (default: out/<init>-<switches>)")
    g.add_argument("--resume", action="store_true",
                   help="continue the run in --out_dir exactly where it stopped, with its saved settings; of the "
                        "other flags it takes only --stop_at, --device, --compile and --mirror")
    g.add_argument("--stop_at", type=nonneg_int, default=0, help="end this invocation after this step (resume later)")
    g.add_argument("--full_finetune", action="store_true", help="train every weight, not only the new ones")
    g.add_argument("--paper", action="store_true",
                   help="the paper's probe recipe (PAPER_RECIPE) as defaults; flags given explicitly still win")
    g.add_argument("--pure_bf16", action=argparse.BooleanOptionalAction, default=False,
                   help="the paper's precision: weights and AdamW state in bf16 with no fp32 master copy, LoRA "
                        "adapters in fp32 (on with --paper; --no-pure_bf16 keeps fp32 masters)")
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g.add_argument("--data", default="auto", choices=["auto", "corpus", "books", "wikitext103"],
                   help="probe text: the embedded corpus's State of the Union speeches (corpus), its held-out "
                        "book's first chapters (books, the base's own domain), or the paper's WikiText-103 lines "
                        "(needs network)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--max_iters", type=positive_int, default=150)
    g.add_argument("--batch_size", type=positive_int, default=16,
                   help="sequences per optimizer step, all processes together")
    g.add_argument("--grad_accum", type=positive_int, default=1, help="micro-batches per step (per process)")
    g.add_argument("--seq_len", type=nonneg_int, default=0, help="training sequence length (0 = block_size)")
    g.add_argument("--lr", type=positive_float, default=1e-3)
    g.add_argument("--min_lr", type=nonneg_float, default=1e-4)
    g.add_argument("--warmup_iters", type=nonneg_int, default=15)
    g.add_argument("--weight_decay", type=nonneg_float, default=0.0)
    g.add_argument("--beta2", type=fraction, default=0.99)
    g.add_argument("--grad_clip", type=nonneg_float, default=1.0, help="gradient norm limit (0 = none)")
    g.add_argument("--eval_interval", type=positive_int, default=50)
    g.add_argument("--eval_tokens", type=positive_int, default=65536, help="validation tokens per evaluation")
    g.add_argument("--ckpt_interval", type=positive_int, default=50)
    g.add_argument("--eval_tasks", type=name_list, default="lambada,wikitext,hellaswag",
                   help="benchmarks at the end for base and trained model ('none' to skip)")
    g.add_argument("--hellaswag_limit", type=nonneg_int, default=500, help="HellaSwag items at the end (0 = all)")
    g = p.add_argument_group("model shape (scratch only)")
    g.add_argument("--n_layer", type=positive_int, default=6)
    g.add_argument("--n_head", type=positive_int, default=3)
    g.add_argument("--n_embd", type=positive_int, default=192)
    g.add_argument("--block_size", type=positive_int, default=256)
    if p.parse_known_args(argv)[0].paper:  # the recipe becomes the defaults, so any form of a flag overrides it
        p.set_defaults(**PAPER_RECIPE)
    args = p.parse_args(argv)
    if args.n_embd % args.n_head:
        p.error(f"--n_embd {args.n_embd} is not divisible by --n_head {args.n_head}")
    if args.resume:
        take_back_settings(args, explicit_flags(p, argv))
    return args


def run_dir(args) -> Path:
    return Path(args.out_dir or ROOT / "out" / run_name(vars(args)))


def take_back_settings(args: argparse.Namespace, explicit: set[str]) -> None:
    """A resumed run takes back its saved settings; explicit flags that disagree with them stop it in one line."""
    out_dir = run_dir(args)
    if not (out_dir / "ckpt.pt").is_file():
        raise SystemExit(f"error: --resume: {out_dir} holds no checkpoint to continue; start the run without "
                         f"--resume (or name its folder with --out_dir)")
    try:
        saved = read_checkpoint(out_dir, mmap=True)["train_args"]  # mmap: the settings, not the weights
    except (CheckpointError, KeyError) as e:
        raise SystemExit(f"error: --resume: {out_dir} holds no checkpoint of train.py ({e})")
    ignored = sorted(k for k in explicit - set(HONOURED_ON_RESUME) if saved.get(k) != getattr(args, k))
    if ignored:
        given = ", ".join(f"--{k} {getattr(args, k)} (saved: {saved.get(k)})" for k in ignored)
        raise SystemExit(f"error: --resume continues {out_dir} with its saved settings and would ignore {given}; "
                         f"drop them, or start a new run in another --out_dir")
    for k, v in saved.items():
        if k not in HONOURED_ON_RESUME:
            setattr(args, k, v)


# --- data: every batch is a pure function of (seed, step), so runs resume and split across processes exactly ---

def global_batch(data, step: int, rows: int, seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's whole batch: random windows of a token stream, or padded documents (pad label -100)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    if isinstance(data, np.ndarray):  # a stream: windows of seq_len + 1 tokens
        starts = torch.randint(0, len(data) - seq_len - 1, (rows,), generator=g).tolist()
        chunk = torch.stack([torch.from_numpy(data[s:s + seq_len + 1].astype(np.int64)) for s in starts])
        return chunk[:, :-1], chunk[:, 1:]
    # documents, visited in a fresh random order each epoch (the paper's padded lines)
    order = []
    epoch = (step * rows) // len(data)
    while len(order) < (step * rows) % len(data) + rows:
        order += torch.randperm(len(data), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        epoch += 1
    first = (step * rows) % len(data)
    docs = [data[i] for i in order[first:first + rows]]
    x = torch.zeros(rows, seq_len, dtype=torch.long)
    y = torch.full((rows, seq_len), -100, dtype=torch.long)
    for r, d in enumerate(docs):
        d = torch.from_numpy(d[:seq_len + 1])
        x[r, :len(d) - 1], y[r, :len(d) - 1] = d[:-1], d[1:]
    return x, y


def load_data(args, tokenizer: Tokenizer) -> tuple[object, dict[str, np.ndarray]]:
    """(training data, {validation name: token stream}) for this run."""
    if args.init_from == "scratch":
        return load_nano_split("pretrain"), {"val_books": load_nano_split("val_books")}
    data = probe_data(args.data, args.init_from, tokenizer)
    train_split, heldout = PROBE_SPLITS.get(data, PROBE_SPLITS["corpus"])
    vals = {name: split_tokens(name, tokenizer, args.mirror) for name in heldout}
    if data == "wikitext103":
        return wikitext103_probe_lines(tokenizer, max_tokens=args.seq_len), vals
    return split_tokens(train_split, tokenizer, args.mirror), vals


def lr_at(step: int, args) -> float:
    """Linear warm-up, then cosine decay from lr to min_lr at max_iters."""
    if step < args.warmup_iters:
        return args.lr * (step + 1) / args.warmup_iters
    t = (step - args.warmup_iters) / max(1, args.max_iters - args.warmup_iters)
    return args.min_lr + 0.5 * (1 + math.cos(math.pi * min(t, 1.0))) * (args.lr - args.min_lr)


# --- set-up: everything the loop needs, in one place ---

@dataclass
class Run:
    """One training job, ready to step: the model, its optimizer and data, and where it writes."""
    args: argparse.Namespace
    out_dir: Path
    model: GPT
    step_model: torch.nn.Module  # the model as the loop calls it: compiled and/or wrapped for DDP
    tokenizer: Tokenizer
    optimizer: torch.optim.Optimizer
    train_data: object
    vals: dict[str, np.ndarray]
    base_ref: dict | None  # what a probe re-attaches to
    base_model: GPT | None  # the untouched base, for side-by-side numbers at the end
    probe: bool
    rank: int
    world: int
    device: str
    ctx: object  # autocast, or nothing
    step: int = 0
    saved_step: int | None = None  # the step of the checkpoint in out_dir, if there is one
    val_at: tuple[int, dict] | None = None  # (step, validation losses) of the latest evaluation, for reuse

    @property
    def master(self) -> bool:
        return self.rank == 0


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


def run_folder(args) -> Path:
    """The run folder; a new run refuses one that already holds a run."""
    out_dir = run_dir(args)
    if not args.resume and (out_dir / "ckpt.pt").exists():
        raise SystemExit(f"error: {out_dir} already holds a run; pass --resume to continue it or pick another "
                         f"--out_dir")
    return out_dir


def build_model(args) -> tuple[GPT, Tokenizer, dict | None, GPT | None]:
    """(the model with its switches, its tokenizer, the base reference, the untouched base for comparison)."""
    switches = switches_of(args)
    if args.init_from == "scratch":
        prepare_nano(args.mirror)
        tokenizer = read_tokenizer(str(NANO_DATA / "tokenizer.json"))
        model = GPT(GPTConfig(vocab_size=tokenizer.get_vocab_size(), block_size=args.block_size,
                              n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, **switches))
        return model, tokenizer, None, None
    if args.init_from == "nano":
        prepare_nano(args.mirror)
    model, tokenizer, base_ref = load_model(args.init_from, **switches, mirror=args.mirror)
    base_model, _, _ = load_model(args.init_from, mirror=args.mirror)
    return model, tokenizer, base_ref, base_model.requires_grad_(False)


def make_optimizer(model: GPT, args) -> torch.optim.AdamW:
    """AdamW over the trainable parameters only; no weight decay on biases and norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    # fused: one kernel over all tensors; on a CPU the optimizer is a large share of a step
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, args.beta2), fused=True)


def check_benchmarks(args) -> None:
    """The end-of-run benchmarks exist and their data files read well, checked before training rather than after."""
    tasks = bench_settings(args)["tasks"]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise SystemExit(f"error: unknown --eval_tasks entry {unknown[0]!r}; choose from {', '.join(TASKS)} or none")
    check_data(tasks, args.mirror)


def check_lengths(args, model: GPT, vals: dict[str, np.ndarray]) -> None:
    """--seq_len fits the model, and every validation stream holds a window of it within --eval_tokens."""
    if args.seq_len > model.config.block_size:
        raise SystemExit(f"error: --seq_len {args.seq_len} is beyond the model's {model.config.block_size} "
                         f"positions; use at most {model.config.block_size}")
    for name, stream in vals.items():
        if min(args.eval_tokens, len(stream) - 1) < args.seq_len:
            raise SystemExit(f"error: --eval_tokens {args.eval_tokens} holds no window of --seq_len {args.seq_len} "
                             f"tokens of the {name} split ({len(stream)} tokens); pass --eval_tokens {args.seq_len} "
                             f"or more")


def setup_run(args) -> Run:
    """Check the request, then build the model, optimizer and data; a resumed run restores its state.

    Bad input raises SystemExit with a one-line message before anything is written."""
    check_benchmarks(args)
    rank, world, device = setup_distributed(args.device)
    if args.batch_size % (world * args.grad_accum):
        raise SystemExit(f"error: --batch_size {args.batch_size} must divide into {world} processes x "
                         f"{args.grad_accum} micro-batches")
    out_dir = run_folder(args)
    torch.manual_seed(args.seed)
    model, tokenizer, base_ref, base_model = build_model(args)
    probe = args.init_from != "scratch" and not args.full_finetune
    if probe:
        if model.num_params("new") == 0:
            raise SystemExit("error: a frozen probe needs something to train: add --preproj, --skip or --lora_rank "
                             "(or pass --full_finetune)")
        model.freeze_base()
    args.seq_len = args.seq_len or model.config.block_size
    train_data, vals = load_data(args, tokenizer)
    check_lengths(args, model, vals)
    dtype = torch.bfloat16 if args.pure_bf16 else resolve_dtype(args.dtype, device)
    args.dtype = dtype_name(dtype)  # recorded as used, not as asked ('auto')
    model.to(device)
    if args.pure_bf16:
        hold_as_paper(model)
    for m in (model, base_model):  # frozen weights in the compute dtype once, not cast at every step
        if m is not None and dtype != torch.float32:
            hold_matrices_in(m, dtype)
    run = Run(args, out_dir, model, model, tokenizer, make_optimizer(model, args), train_data, vals, base_ref,
              base_model, probe, rank, world, device, autocast(device, dtype))
    if args.resume:
        restore(run)
    run.step_model = torch.compile(model) if args.compile else model
    if world > 1:
        run.step_model = torch.nn.parallel.DistributedDataParallel(run.step_model)
    return run


def restore(run: Run) -> None:
    """A resumed run's weights, optimizer state and step, from its checkpoint; a probe only onto the very base
    it was trained on."""
    saved = read_checkpoint(run.out_dir)
    if run.probe:
        check_base(saved["base"], run.base_ref["sha256"], run.out_dir)
    run.model.load_state_dict({k: v.to(run.device) for k, v in saved["model"].items()}, strict=not run.probe)
    run.optimizer.load_state_dict(saved["optimizer"])
    run.step = run.saved_step = saved["step"]
    if run.args.stop_at and run.args.stop_at <= run.step:
        raise SystemExit(f"error: --stop_at {run.args.stop_at} is not after the checkpoint's step {run.step}")


def claim_folder(run: Run) -> TextIO:
    """Holding the folder's lock: check again that a new run finds no run there, remove stale temporaries, write
    config.json anew from the checkpoint (a kill may have cut the first save short), and open metrics.jsonl cut
    back to this run's step."""
    run_folder(run.args)  # another run may have finished into the folder since setup_run looked
    clean_temporaries(run.out_dir)
    if run.args.resume:
        save_run_file(run.out_dir, "config.json", model_card(read_checkpoint(run.out_dir, mmap=True)))
    return open_metrics(run.out_dir, run.step)


# --- stopping cleanly: Ctrl-C, kill, NaN ---

@contextmanager
def deferred_signals() -> Iterator[list[int]]:
    """During the training loop SIGINT and SIGTERM (Ctrl-C, kill, a scheduler's pre-emption) only note themselves
    in the list this yields: the loop finishes its step, saves a checkpoint and stops (see stop_signal)."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield received
        return
    previous = {s: signal.signal(s, lambda signum, frame: received.append(signum))
                for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def stop_signal(run: Run, received: list[int]) -> int:
    """The signal that stops the run after this step (0 = none), the same in every process so that all stop and
    save at the same step."""
    signum = received[0] if received else 0
    if run.world > 1:
        t = torch.tensor([signum], device=run.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        signum = int(t.item())
    return signum


@torch.no_grad()
def next_batch_loss(run: Run) -> float:
    """The loss of the current weights on (one micro-batch of) the next step's batch."""
    rows = run.args.batch_size // run.world // run.args.grad_accum
    x, y = global_batch(run.train_data, run.step, rows, run.args.seq_len, run.args.seed)
    with run.ctx:
        return run.model(x.to(run.device), y.to(run.device))[1].item()


def diverged(run: Run, what: str) -> Diverged:
    kept = (f"the last good checkpoint, step {run.saved_step}, is kept in {run.out_dir}"
            if run.saved_step is not None else "there is no earlier checkpoint")
    return Diverged(f"{what}; stopped without saving it; {kept}. Lower --lr")


def save_checked(run: Run) -> None:
    """Save a checkpoint only of weights that are finite and give a finite loss on the next batch: the kept
    checkpoint is always one that training can continue from."""
    finite = all(torch.isfinite(p).all() for p in run.model.parameters() if p.requires_grad)
    if not finite or not math.isfinite(next_batch_loss(run)):
        problem = "hold non-finite values" if not finite else "give a non-finite loss"
        raise diverged(run, f"the weights after step {run.step} {problem}")
    save_checkpoint(run.out_dir, run.model, probe=run.probe, base_ref=run.base_ref, step=run.step,
                    optimizer_state=run.optimizer.state_dict(), extra={"train_args": vars(run.args)},
                    tokenizer=run.tokenizer)
    run.saved_step = run.step


def interrupted(run: Run, signum: int) -> SystemExit:
    """Exit after a signal (exit status 128 + its number, as a shell reports it), saying how to go on."""
    if run.master:
        print(f"error: stopped by {signal.Signals(signum).name} after step {run.step}; the checkpoint is saved in "
              f"{run.out_dir}. Continue with: python train.py --out_dir {run.out_dir} --resume", file=sys.stderr)
    return SystemExit(128 + signum)


# --- the loop ---

def accumulate_gradients(run: Run, x: torch.Tensor, y: torch.Tensor) -> float:
    """Forward and backward over this process's rows in --grad_accum micro-batches; returns the step's mean loss
    over every process. DDP averages the gradients once, on the last micro-batch."""
    accum = run.args.grad_accum
    micro = len(x) // accum
    loss_sum = torch.zeros((), device=x.device)
    for m in range(accum):
        sync = m == accum - 1 or run.world == 1
        with (nullcontext() if sync else run.step_model.no_sync()), run.ctx:
            _, loss = run.step_model(x[m * micro:(m + 1) * micro], y[m * micro:(m + 1) * micro])
            (loss / accum).backward()
        loss_sum += loss.detach() / accum
    if run.world > 1:
        dist.all_reduce(loss_sum)
        loss_sum /= run.world
    return loss_sum.item()


def val_losses(run: Run, model: GPT) -> dict[str, float]:
    """Held-out loss of a model on every validation stream of the run."""
    return {name: val_loss(model, stream, run.args.seq_len, run.args.eval_tokens, run.ctx)
            for name, stream in run.vals.items()}


def trained_val_losses(run: Run) -> dict[str, float]:
    """The trained model's validation losses at the current step: the loop's last evaluation when it was at this
    step (the last step always evaluates), else measured now."""
    if run.val_at is None or run.val_at[0] != run.step:
        run.val_at = (run.step, val_losses(run, run.model))
    return run.val_at[1]


def train(args) -> tuple[GPT, dict]:
    """Run one training job; returns the model and the final metrics (empty when it stops early)."""
    run = setup_run(args)
    with lock_run_folder(run.out_dir) if run.master else nullcontext():
        log = claim_folder(run) if run.master else None
        base_losses = {}
        if run.base_model is not None and run.master:
            base_losses = val_losses(run, run.base_model.to(run.device))
            run.base_model.cpu()
        if run.master:
            print(f"{args.dtype} compute{' (the paper precision)' if args.pure_bf16 else ''} on {run.device} "
                  f"x{run.world}: {'probe' if run.probe else 'training'} {run.model.num_params('trainable'):,} of "
                  f"{run.model.num_params():,} parameters; {args.batch_size} x {args.seq_len} tokens per step -> "
                  f"{run.out_dir}")
        try:
            train_loop(run, log)
        finally:
            if log:
                log.close()
        if not run.master or run.step < args.max_iters:
            return run.model, {}
        results = final_report(run, base_losses)
        save_run_file(run.out_dir, "eval.json", {**results, "step": run.step})
    return run.model, results


def train_loop(run: Run, log: TextIO | None) -> None:
    """Step until --max_iters, --stop_at or a signal; the master logs every step and saves every --ckpt_interval."""
    args, model, opt = run.args, run.model, run.optimizer
    rows = args.batch_size // run.world  # this process's share of every batch
    t0, tokens, signum = time.time(), 0, 0
    model.train()
    with deferred_signals() as received, tqdm(total=args.max_iters, initial=run.step, disable=not run.master,
                                              dynamic_ncols=True) as bar:
        while run.step < args.max_iters and not (args.stop_at and run.step >= args.stop_at):
            lr = lr_at(run.step, args)
            for group in opt.param_groups:
                group["lr"] = lr
            x, y = global_batch(run.train_data, run.step, args.batch_size, args.seq_len, args.seed)
            x, y = x[run.rank * rows:(run.rank + 1) * rows].to(run.device), y[run.rank * rows:(run.rank + 1) * rows]
            loss = accumulate_gradients(run, x, y.to(run.device))
            if not math.isfinite(loss):
                raise diverged(run, f"the loss became {loss} at step {run.step + 1}")
            if args.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], args.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            run.step += 1
            tokens += int((y != -100).sum()) * run.world
            signum = stop_signal(run, received)
            if run.master:
                save_and_log(run, log, bar, signum, loss=loss, lr=lr, tok_per_s=round(tokens / (time.time() - t0)))
            if signum:
                break
    if signum:
        if run.world > 1:
            dist.barrier()  # the others wait for the master's checkpoint
        raise interrupted(run, signum)


def save_and_log(run: Run, log: TextIO, bar: tqdm, signum: int, **record) -> None:
    """The master's work after a step: the checkpoint when one is due (first, so that whatever fails after it
    loses no training), the progress bar, and the step's record (validation losses every --eval_interval)."""
    args = run.args
    if run.step % args.ckpt_interval == 0 or run.step in (args.max_iters, args.stop_at) or signum:
        save_checked(run)
    bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tok_per_s']:,}")
    bar.update(1)
    if run.step % args.eval_interval == 0 or run.step == args.max_iters:
        record.update({f"{n}_loss": v for n, v in trained_val_losses(run).items()})
    append_metrics(log, {"step": run.step, **record})


# --- the report at the end: frozen base and trained model side by side ---

def final_report(run: Run, base_losses: dict) -> dict:
    """Validation losses and lm-eval benchmarks of the frozen base and the trained model, printed side by side."""
    final = trained_val_losses(run)
    print_side_by_side("validation loss", {n: (base_losses.get(n), v) for n, v in final.items()})
    settings = bench_settings(run.args)
    results = {"val_loss": {"base": base_losses, "trained": final}, "benchmarks": {"settings": settings}}
    if not settings["tasks"]:
        return results
    try:
        with run.ctx:
            results["benchmarks"]["trained"] = run_benchmarks(run.model, run.tokenizer, run.args)
            if run.base_model is not None:
                results["benchmarks"]["base"] = base_benchmarks(run.base_model.to(run.device), run.tokenizer, run.args)
                run.base_model.cpu()
        print_benchmarks(results["benchmarks"])
    except ValueError as e:  # e.g. a window too short for HellaSwag's endings; the checkpoint is saved
        results["benchmarks"]["error"] = str(e)
        print(f"benchmarks not run: {e} (choose others with --eval_tasks)")
    return results


def bench_settings(args) -> dict:
    tasks = [t for t in args.eval_tasks.split(",") if t and t != "none"]
    return {"tasks": tasks, "hellaswag_limit": args.hellaswag_limit, "protocol": "lm-eval", "dtype": args.dtype}


def run_benchmarks(model: GPT, tokenizer: Tokenizer, args) -> dict:
    """lm-eval's LAMBADA and WikiText in full; HellaSwag on its first --hellaswag_limit items (0 = all)."""
    tasks = bench_settings(args)["tasks"]
    full = [t for t in tasks if t != "hellaswag"]
    results = evaluate(model, tokenizer, full, mirror=args.mirror) if full else {}
    if "hellaswag" in tasks:
        results.update(evaluate(model, tokenizer, ["hellaswag"], limit=args.hellaswag_limit or None,
                                mirror=args.mirror))
    return results


def base_benchmarks(base_model: GPT, tokenizer: Tokenizer, args) -> dict:
    """The frozen base's benchmarks: reused from the base's own run folder when it measured the same ones."""
    saved = Path(args.init_from if args.init_from != "nano" else NANO_DIR) / "eval.json"
    if saved.is_file():
        bench = json.loads(saved.read_text()).get("benchmarks", {})
        if bench.get("settings") == bench_settings(args) and "trained" in bench:
            return bench["trained"]
    return run_benchmarks(base_model, tokenizer, args)


def print_side_by_side(title: str, rows: dict[str, tuple]) -> None:
    print(format_table([title, "frozen base", "trained"], [[name, base, trained]
                                                           for name, (base, trained) in rows.items()]))


def print_benchmarks(bench: dict) -> None:
    rows = {}
    for task, r in bench["trained"].items():
        for metric, m in r["metrics"].items():
            base = bench.get("base", {}).get(task, {}).get("metrics", {}).get(metric, {}).get("value")
            rows[f"{task} {metric} (n={r['n']})"] = (base, m["value"])
    print_side_by_side("benchmark (lm-eval)", rows)


def nano_base_args(args) -> argparse.Namespace | None:
    """The command that pre-trains the embedded base, or finishes a first pre-training that was stopped, when this
    run needs the base and it is not ready."""
    if args.init_from != "nano" or args.resume or nano_status() == "ready":
        return None
    argv = ["--out_dir", str(NANO_DIR), "--device", args.device] + (["--mirror", args.mirror] if args.mirror else [])
    if nano_status() == "not finished":
        return get_args(argv + ["--resume"])
    return get_args(NANO_RECIPE.split() + argv + ["--seed", str(args.seed)])


def main() -> None:
    args = get_args()
    keep_freed_memory()
    try:
        base_args = nano_base_args(args)
        if base_args is not None:  # step 1 of 2: the embedded base, once; later runs load it from out/nano-base
            print(f"finishing the embedded base's pre-training: python train.py --out_dir {NANO_DIR} --resume"
                  if base_args.resume else
                  f"pre-training the embedded base first (once): python train.py {NANO_RECIPE} --out_dir {NANO_DIR}")
            train(base_args)
        train(args)
    except (CheckpointError, DataError) as e:
        raise SystemExit(f"error: {e}")
    except Diverged as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(EXIT_DIVERGED)
    except KeyboardInterrupt:  # outside the loop, which stops at the end of a step and saves (deferred_signals)
        raise SystemExit("error: interrupted before the first training step or after the last one, which is saved")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
