"""
One training loop for the frozen probe (the paper's experiment), full fine-tuning and pre-training from scratch.

    python train.py --preproj --skip                              # frozen probe on the embedded base (CPU, offline)
    python train.py --init_from pythia-160m --preproj --skip --paper   # the paper's recipe on real Pythia (GPU)
    python train.py --init_from scratch --out_dir out/mine        # pre-train a small GPT-NeoX
    torchrun --nproc_per_node=2 train.py --preproj --skip         # the same result on several processes

Read it top down: the settings; train(), which builds the model, freezes the base, runs the loop and reports; the
loop; then the pieces they call. Whenever the base is pre-trained (anything but scratch), only the new parameters
train unless --full_finetune. The embedded base (`--init_from nano`) does not ship as weights: the first run
pre-trains it with this same loop (lab/recipes.py's NANO_BASE, a step of its own that main() prints) and caches
it in out/nano-base.
"""

import argparse
import math
import os
import resource
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np
import torch
import torch.distributed as dist
from tokenizers import Tokenizer
from tqdm import tqdm

from data import batches, prepare, text
from data.sources import DataError, write_error
from lab import checkpoint, cli, run_folder, run_report
from lab.checkpoint import CheckpointError
from lab.evaluation import TASKS, check_data, evaluate, val_loss
from lab.loss import TrainingObjective, training_loss
from lab.memory import step_memory
from lab.ops import sdpa_kernel_name
from lab.precision import (
    DTYPES,
    autocast,
    cpu_has_bf16,
    cuda_has_bf16,
    dtype_name,
    hold_as_paper,
    hold_matrices_in,
    prefer_flash_attention,
    resolve_dtype,
)
from lab.recipes import NANO_BASE, NANO_SHAPE, PAPER_PROBE, flags
from lab.run_folder import Diverged, diverged
from load_pythia import read_tokenizer
from model import CPU_BF16_EXPLICIT_MAX, GPT, GPTConfig

# --- settings ---

# The flags a resumed run takes from its command line; every other setting comes from its checkpoint, so that it
# continues exactly. A flag given with --resume that would change another setting is refused, never ignored.
HONOURED_ON_RESUME = ("out_dir", "resume", "stop_at", "device", "compile", "mirror")


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_model_args(p)
    g = p.add_argument_group("run")
    g.add_argument("--out_dir", type=cli.out_folder, default=None, help="run folder (default: out/<init>-<switches>)")
    g.add_argument("--resume", action="store_true",
                   help="continue the run in --out_dir exactly where it stopped, with its saved settings; of the "
                        "other flags it takes only --stop_at, --device, --compile and --mirror")
    g.add_argument("--stop_at", type=cli.nonneg_int, default=0,
                   help="end this invocation after this step (resume later)")
    g.add_argument("--full_finetune", action="store_true", help="train every weight, not only the new ones")
    g.add_argument("--paper", action="store_true",
                   help="the paper's probe recipe (lab/recipes.py, PAPER_PROBE) as defaults; explicit flags win")
    g.add_argument("--pure_bf16", action=argparse.BooleanOptionalAction, default=False,
                   help="the paper's precision: weights and AdamW state in bf16 with no fp32 master copy, LoRA "
                        "adapters in fp32 (on with --paper; --no-pure_bf16 keeps fp32 masters)")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile each block for the training steps (evaluation stays eager)")
    g.add_argument("--dry_run", action="store_true",
                   help="check this run end to end without training it or writing anything: the device, every file "
                        "it reads, one full step (time, peak memory, projected time), the attention kernel, a few "
                        "LAMBADA items under both protocols")
    g.add_argument("--data", default="auto",
                   help="training text: your own (a UTF-8 file, a folder of *.txt or a pattern; data/text.py), or "
                        "a built-in probe text: the embedded corpus's State of the Union speeches (corpus), its "
                        "held-out book's first chapters (books, the base's own domain), the paper's WikiText-103 "
                        "lines (wikitext103, needs network); auto: corpus, or wikitext103 for a Hub model")
    g.add_argument("--val_splits", type=cli.name_list, default=None,
                   help=f"held-out splits validated every --eval_interval, comma-separated from "
                        f"{', '.join(prepare.HELDOUT)} (default: those of --data)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--max_iters", type=cli.positive_int, default=150)
    g.add_argument("--batch_size", type=cli.positive_int, default=16,
                   help="sequences per optimizer step, all processes together")
    g.add_argument("--grad_accum", type=cli.positive_int, default=1, help="micro-batches per step (per process)")
    g.add_argument("--seq_len", type=cli.nonneg_int, default=0, help="training sequence length (0 = block_size)")
    g.add_argument("--lr", type=cli.positive_float, default=1e-3)
    g.add_argument("--min_lr", type=cli.nonneg_float, default=1e-4)
    g.add_argument("--warmup_iters", type=cli.nonneg_int, default=15)
    g.add_argument("--weight_decay", type=cli.nonneg_float, default=0.0)
    g.add_argument("--beta2", type=cli.fraction, default=0.99)
    g.add_argument("--grad_clip", type=cli.nonneg_float, default=1.0, help="gradient norm limit (0 = none)")
    g.add_argument("--eval_interval", type=cli.positive_int, default=50)
    g.add_argument("--eval_tokens", type=cli.positive_int, default=65536, help="validation tokens per evaluation")
    g.add_argument("--ckpt_interval", type=cli.positive_int, default=50)
    g.add_argument("--eval_tasks", type=cli.name_list, default=None,
                   help="benchmarks at the end for base and trained model ('none' to skip; default "
                        "lambada,wikitext,hellaswag, none for your own --data text)")
    g.add_argument("--hellaswag_limit", type=cli.nonneg_int, default=500, help="HellaSwag items at the end (0 = all)")
    g = p.add_argument_group("model shape (scratch only; the default is the embedded base's)")
    for name in ("n_layer", "n_head", "n_embd", "block_size"):
        g.add_argument(f"--{name}", type=cli.positive_int, default=NANO_SHAPE[name])
    if p.parse_known_args(argv)[0].paper:  # the recipe becomes the defaults, so any form of a flag overrides it
        p.set_defaults(**PAPER_PROBE)
    args = p.parse_args(argv)
    explicit = cli.explicit_flags(p, argv)
    check_args(p, args, explicit)
    return saved_settings(args, explicit) if args.resume else args


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace, explicit: set[str]) -> None:
    """What no single flag's type can check, at parse time: the shape, the device a run would land on, the
    validation splits; and the benchmarks' default, which depends on --data."""
    if args.n_embd % args.n_head and not args.resume:  # a resumed run keeps its saved shape (saved_settings)
        p.error(f"--n_embd {args.n_embd} is not divisible by --n_head {args.n_head}")
    if args.eval_tasks is None:
        args.eval_tasks = "none" if text.is_path(args.data) else "lambada,wikitext,hellaswag"
    if args.device == "cpu" and "device" not in explicit and (args.paper or cli.is_hub_name(args.init_from)):
        p.error(f"no CUDA GPU is visible to this torch ({torch.__version__}, CUDA build "
                f"{torch.version.cuda or 'none'}), and a {'--paper run' if args.paper else 'Hub model'} would train "
                f"on the CPU; pass --device cpu to do that on purpose, or install torch with CUDA")
    unknown = [n for n in (args.val_splits or "").split(",") if n and n not in prepare.HELDOUT]
    if unknown:
        p.error(f"--val_splits: {unknown[0]!r} is no held-out split; choose from {', '.join(prepare.HELDOUT)}")


def run_dir(args: argparse.Namespace) -> Path:
    return Path(args.out_dir or checkpoint.ROOT / "out" / checkpoint.run_name(vars(args)))


def saved_settings(args: argparse.Namespace, explicit: set[str]) -> argparse.Namespace:
    """A resumed run's saved settings, with the flags it honours from this command line; explicit flags that
    disagree with the saved settings stop it in one line."""
    out_dir = run_dir(args)
    if not (out_dir / "ckpt.pt").is_file():
        raise SystemExit(f"error: --resume: {out_dir} holds no checkpoint to continue; start the run without "
                         f"--resume (or name its folder with --out_dir)")
    try:
        saved = checkpoint.read_checkpoint(out_dir, mmap=True)["train_args"]  # mmap: the settings, not the weights
    except (CheckpointError, KeyError) as e:
        raise SystemExit(f"error: --resume: {out_dir} holds no checkpoint of train.py ({e})")
    ignored = sorted(k for k in explicit - set(HONOURED_ON_RESUME) if saved.get(k) != getattr(args, k))
    if ignored:
        given = ", ".join(f"--{k} {getattr(args, k)} (saved: {saved.get(k)})" for k in ignored)
        raise SystemExit(f"error: --resume continues {out_dir} with its saved settings and would ignore {given}; "
                         f"drop them, or start a new run in another --out_dir")
    return argparse.Namespace(**{**vars(args), **{k: v for k, v in saved.items() if k not in HONOURED_ON_RESUME}})


class Settings(argparse.Namespace):
    """A run's settings, resolved once (the sequence length and dtype as used, not as asked) and read-only from
    then on: the checkpoint records them as the run's train_args."""

    def __init__(self, **settings):
        self.__dict__.update(settings)

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"a run's settings are read-only (tried to set {name})")


def resolve_settings(args: argparse.Namespace, block_size: int, device: str) -> Settings:
    dtype = torch.bfloat16 if args.pure_bf16 else resolve_dtype(args.dtype, device)
    return Settings(**{**vars(args), "seq_len": args.seq_len or block_size, "dtype": dtype_name(dtype)})


# --- one training job, top to bottom ---

@dataclass
class Run:
    """One training job, ready to step: the model, its optimizer and data, and where it writes."""
    settings: Settings
    out_dir: Path
    model: GPT
    step_model: torch.nn.Module  # the training objective as the loop calls it (objective())
    tokenizer: Tokenizer
    optimizer: torch.optim.Optimizer
    train_data: object
    vals: dict[str, np.ndarray]
    data_source: dict | None  # your own --data text: its files' sha256, the split, each part's tokens
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


def train(args: argparse.Namespace) -> tuple[GPT, dict]:
    """Run one training job; returns the model and the final metrics (empty when it stops early). Bad input stops
    it with a one-line SystemExit before anything is written."""
    rank, world, device = cli.setup_distributed(args.device)
    out_dir = run_dir(args)
    refuse_input_as_output(args, out_dir)
    run_folder.refuse_existing_run(out_dir, args.resume)
    torch.manual_seed(args.seed)
    with cli.first_rank_first(rank, world):  # under torchrun one process fetches and prepares, then the others read
        check_request(args, world)
        model, tokenizer, base_ref, base_model = build_model(args)
        probe = args.init_from != "scratch" and not args.full_finetune
        if probe:
            check_probe(model)
            model.freeze_base()  # the frozen probe: from here on only the new parameters learn
        s = resolve_settings(args, model.config.block_size, device)
        train_data, vals, data_source = batches.load_data(s.init_from, s.data, s.seq_len, tokenizer, s.mirror,
                                                          s.val_splits)
    check_lengths(s, model, vals)
    put_on_device(s, model, base_model, device)
    optimizer = make_optimizer(model, s)
    step = restore(s, out_dir, model, optimizer, probe, base_ref, data_source, device) if s.resume else 0
    run = Run(settings=s, out_dir=out_dir, model=model, step_model=objective(model, s, world), tokenizer=tokenizer,
              optimizer=optimizer, train_data=train_data, vals=vals, data_source=data_source, base_ref=base_ref,
              base_model=base_model,
              probe=probe, rank=rank, world=world, device=device, ctx=autocast(device, DTYPES[s.dtype]),
              step=step, saved_step=step if s.resume else None)
    with run_folder.lock_run_folder(out_dir) if run.master else nullcontext():
        log = run_folder.claim_folder(out_dir, s.resume, run.step) if run.master else None
        base_losses = base_val_losses(run)
        announce(run)
        try:
            train_loop(run, log)
        finally:
            if log:
                log.close()
        if not run.master or run.step < s.max_iters:
            return model, {}
        results = final_report(run, base_losses)
        checkpoint.save_run_file(out_dir, "eval.json", {**results, "step": run.step})
    return model, results


def train_loop(run: Run, log: TextIO | None) -> None:
    """Step until --max_iters, --stop_at or a signal. The master checkpoints every --ckpt_interval steps,
    validates every --eval_interval and logs every step."""
    s, model, opt = run.settings, run.model, run.optimizer
    rows = s.batch_size // run.world  # this process's share of every batch
    t0, tokens, signum = time.time(), 0, 0
    model.train()
    bar = tqdm(total=s.max_iters, initial=run.step, disable=not run.master, dynamic_ncols=True)
    with run_folder.deferred_signals() as received, bar:
        while run.step < s.max_iters and not (s.stop_at and run.step >= s.stop_at):
            lr = lr_at(run.step, s)
            for group in opt.param_groups:
                group["lr"] = lr
            x, y = batches.global_batch(run.train_data, run.step, s.batch_size, s.seq_len, s.seed)
            n_tokens = int((y != -100).sum())  # the step's target tokens, every process and micro-batch together
            x, y = (t[run.rank * rows:(run.rank + 1) * rows].to(run.device) for t in (x, y))
            loss = accumulate_gradients(run, x, y, n_tokens)
            if not math.isfinite(loss):  # the same loss in every process: all stop here
                leave_together(run)
                raise diverged(f"the loss became {loss} at step {run.step + 1}", run.out_dir, run.saved_step)
            if s.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], s.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            run.step += 1
            tokens += n_tokens
            signum = run_folder.stop_signal(received, run.device)
            if run.master:
                record = {"step": run.step, "loss": loss, "lr": lr, "tok_per_s": round(tokens / (time.time() - t0))}
                if run.step % s.ckpt_interval == 0 or run.step in (s.max_iters, s.stop_at) or signum:
                    save_checked(run, record)  # first, so that whatever fails after it loses no training
                if run.step % s.eval_interval == 0 or run.step == s.max_iters:
                    record.update({f"{n}_loss": v for n, v in trained_val_losses(run).items()})
                run_folder.append_metrics(log, record)
                bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{record['tok_per_s']:,}")
                bar.update(1)
            if signum:
                break
    leave_together(run)  # after a signal, the others also wait for the master's checkpoint
    if signum:
        raise run_folder.interrupted(signum, run.step, run.out_dir, run.master)


def leave_together(run: Run) -> None:
    """The processes of a multi-process run leave the loop at a barrier, so that none exits just after a
    collective whose tensor gloo's worker thread may still hold: that thread's release of it during the
    interpreter's shutdown aborts the process (docs/reliability.md, "Several processes")."""
    if run.world > 1:
        dist.barrier()


def accumulate_gradients(run: Run, x: torch.Tensor, y: torch.Tensor, n_tokens: int) -> float:
    """Forward and backward over this process's rows in --grad_accum micro-batches; returns the step's loss.

    The objective is the mean over the step's n_tokens target tokens, however they are split: each micro-batch
    adds its tokens' losses over n_tokens, and as DDP averages the processes' gradients (once, on the last
    micro-batch), each process scales its own by the number of processes."""
    accum = run.settings.grad_accum
    micro = len(x) // accum
    loss_sum = torch.zeros((), device=x.device)
    for m in range(accum):
        sync = m == accum - 1 or run.world == 1
        with (nullcontext() if sync else run.step_model.no_sync()), run.ctx:
            loss = run.step_model(x[m * micro:(m + 1) * micro], y[m * micro:(m + 1) * micro], n_tokens)
            (loss * run.world).backward()
        loss_sum += loss.detach()
    if run.world > 1:
        dist.all_reduce(loss_sum)
    return loss_sum.item()


def save_checked(run: Run, record: dict) -> None:
    """A checkpoint, only of weights that are finite and give a finite loss on the next batch: the kept checkpoint
    is always one that training can continue from. It keeps the step's metrics record too, which a resume logs if
    a kill came before the record's own line."""
    trained = [p for p in run.model.parameters() if p.requires_grad]
    problem = run_folder.non_finite(trained, lambda: next_batch_loss(run))
    if problem:
        raise diverged(f"the weights after step {run.step} {problem}", run.out_dir, run.saved_step)
    extra = {"train_args": vars(run.settings), "data_source": run.data_source, "record": record}
    checkpoint.save_checkpoint(run.out_dir, run.model, probe=run.probe, base_ref=run.base_ref, step=run.step,
                               optimizer_state=run.optimizer.state_dict(), extra=extra, tokenizer=run.tokenizer)
    run.saved_step = run.step


@torch.no_grad()
def next_batch_loss(run: Run) -> float:
    """The loss of the current weights on (one micro-batch of) the next step's batch."""
    s = run.settings
    x, y = batches.global_batch(run.train_data, run.step, s.batch_size // run.world // s.grad_accum, s.seq_len, s.seed)
    with run.ctx:
        return training_loss(run.model, x.to(run.device), y.to(run.device)).item()


# --- the schedule ---

def lr_at(step: int, s: Settings) -> float:
    """Linear warm-up, then cosine decay from lr to min_lr at max_iters."""
    if step < s.warmup_iters:
        return s.lr * (step + 1) / s.warmup_iters
    t = (step - s.warmup_iters) / max(1, s.max_iters - s.warmup_iters)
    return s.min_lr + 0.5 * (1 + math.cos(math.pi * min(t, 1.0))) * (s.lr - s.min_lr)


# --- building: the model, where and in which precision it runs, its optimizer ---

def build_model(args: argparse.Namespace) -> tuple[GPT, Tokenizer, dict | None, GPT | None]:
    """(the model with its switches, its tokenizer, the base reference, the untouched base for comparison)."""
    switches = cli.switches_of(args)
    if args.init_from == "scratch":
        if text.is_path(args.data):  # a tokenizer trained on the text, as the embedded base's is on its corpus
            tokenizer = text.own_tokenizer(text.read_source(args.data))
        else:
            prepare.prepare_nano(args.mirror)
            tokenizer = read_tokenizer(str(prepare.NANO_DATA / "tokenizer.json"))
        model = GPT(GPTConfig(vocab_size=tokenizer.get_vocab_size(), block_size=args.block_size,
                              n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, **switches))
        return model, tokenizer, None, None
    if args.init_from == "nano":
        prepare.prepare_nano(args.mirror)
    model, tokenizer, base_ref = checkpoint.load_model(args.init_from, **switches, mirror=args.mirror)
    base_model, _, _ = checkpoint.load_model(args.init_from, mirror=args.mirror)
    return model, tokenizer, base_ref, base_model.requires_grad_(False)


def put_on_device(s: Settings, model: GPT, base_model: GPT | None, device: str) -> None:
    """The model on its device, its weights held for the run's precision (lab/precision.py)."""
    model.to(device)
    for m in (model, base_model):  # the base as the model, so that the two columns of the report compare
        if m is not None and s.pure_bf16:
            hold_as_paper(m)
        elif m is not None and s.dtype != "float32":  # frozen weights in the compute dtype once, not at every step
            hold_matrices_in(m, DTYPES[s.dtype])


def make_optimizer(model: GPT, s: Settings) -> torch.optim.AdamW:
    """AdamW over the trainable parameters only; no weight decay on biases and norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": s.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    # fused: one kernel over all tensors; on a CPU the optimizer is a large share of a step
    return torch.optim.AdamW(groups, lr=s.lr, betas=(0.9, s.beta2), fused=True)


def objective(model: GPT, s: Settings, world: int) -> torch.nn.Module:
    """What the loop calls: the training loss as a module, its blocks compiled with --compile, wrapped for DDP
    when there are several processes."""
    step_model = TrainingObjective(model, compile_blocks=s.compile)
    return torch.nn.parallel.DistributedDataParallel(step_model) if world > 1 else step_model


def restore(s: Settings, out_dir: Path, model: GPT, optimizer: torch.optim.Optimizer, probe: bool,
            base_ref: dict | None, data_source: dict | None, device: str) -> int:
    """A resumed run's weights and optimizer state from its checkpoint (a probe only onto the very base it was
    trained on, any run only on the very text it was trained on); returns its step."""
    saved = checkpoint.read_checkpoint(out_dir)
    if probe:
        checkpoint.check_base(saved["base"], base_ref["sha256"], out_dir)
    was = (saved.get("data_source") or {}).get("sha256")
    if data_source and was != data_source["sha256"]:
        raise SystemExit(f"error: --resume: the text of --data {s.data} changed since {out_dir} started training on "
                         f"it (sha256 {str(was)[:12]}, now {data_source['sha256'][:12]}); restore it, or train anew "
                         f"in another --out_dir")
    model.load_state_dict({k: v.to(device) for k, v in saved["model"].items()}, strict=not probe)
    optimizer.load_state_dict(saved["optimizer"])
    if s.stop_at and s.stop_at <= saved["step"]:
        raise SystemExit(f"error: --stop_at {s.stop_at} is not after the checkpoint's step {saved['step']}")
    return saved["step"]


# --- checks before anything is written ---

def check_request(args: argparse.Namespace, world: int) -> None:
    """The end-of-run benchmarks exist and their data files read well (checked before training, not after), and
    the batch divides into the processes and micro-batches."""
    tasks = run_report.benchmark_settings(args.eval_tasks, args.hellaswag_limit, args.dtype)["tasks"]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise SystemExit(f"error: unknown --eval_tasks entry {unknown[0]!r}; choose from {', '.join(TASKS)} or none")
    check_data(tasks, args.mirror)
    if args.batch_size % (world * args.grad_accum):
        raise SystemExit(f"error: --batch_size {args.batch_size} must divide into {world} processes x "
                         f"{args.grad_accum} micro-batches")


def refuse_input_as_output(args: argparse.Namespace, out_dir: Path) -> None:
    """A run never writes into the folder it reads: a base's folder (a Hugging Face model or another run), or a
    --data folder."""
    inputs = {"--init_from": args.init_from, "--data": args.data}
    for flag, value in inputs.items():
        if not args.resume and Path(value).is_dir() and Path(value).resolve() == out_dir.resolve():
            raise SystemExit(f"error: --out_dir {out_dir} is the {flag} folder, which this run reads; write the run "
                             f"to another folder")


def check_probe(model: GPT) -> None:
    if model.num_params("new") == 0:
        raise SystemExit("error: a frozen probe needs something to train: add --preproj, --skip or --lora_rank "
                         "(or pass --full_finetune)")


def check_lengths(s: Settings, model: GPT, vals: dict[str, np.ndarray]) -> None:
    """--seq_len fits the model, and every validation stream holds a window of it within --eval_tokens."""
    if s.seq_len > model.config.block_size:
        raise SystemExit(f"error: --seq_len {s.seq_len} is beyond the model's {model.config.block_size} "
                         f"positions; use at most {model.config.block_size}")
    for name, stream in vals.items():
        if min(s.eval_tokens, len(stream) - 1) < s.seq_len:
            raise SystemExit(f"error: --eval_tokens {s.eval_tokens} holds no window of --seq_len {s.seq_len} "
                             f"tokens of the {name} split ({len(stream)} tokens); pass --eval_tokens {s.seq_len} "
                             f"or more")


# --- validation and the report at the end: frozen base and trained model side by side ---

def val_losses(run: Run, model: GPT) -> dict[str, float]:
    """Held-out loss of a model on every validation stream of the run."""
    s = run.settings
    return {name: val_loss(model, stream, s.seq_len, s.eval_tokens, run.ctx) for name, stream in run.vals.items()}


def base_val_losses(run: Run) -> dict[str, float]:
    """The frozen base's validation losses (none for a model trained from scratch), measured by the master."""
    if run.base_model is None or not run.master:
        return {}
    losses = val_losses(run, run.base_model.to(run.device))
    run.base_model.cpu()
    return losses


def trained_val_losses(run: Run) -> dict[str, float]:
    """The trained model's validation losses at the current step: the loop's last evaluation when it was at this
    step (the last step always evaluates), else measured now."""
    if run.val_at is None or run.val_at[0] != run.step:
        run.val_at = (run.step, val_losses(run, run.model))
    return run.val_at[1]


def announce(run: Run) -> None:
    s = run.settings
    if run.master:
        print(f"{s.dtype} compute{' (the paper precision)' if s.pure_bf16 else ''} on {run.device} x{run.world}: "
              f"{'probe' if run.probe else 'training'} {run.model.num_params('trainable'):,} of "
              f"{run.model.num_params():,} parameters; {s.batch_size} x {s.seq_len} tokens per step -> {run.out_dir}")
        if run.base_ref and run.base_ref.get("revision"):
            print(f"base: {checkpoint.pinned_name(run.base_ref)} (the Hub commit it resolved to)")


def final_report(run: Run, base_losses: dict) -> dict:
    """Validation losses and lm-eval benchmarks of the frozen base and the trained model, printed side by side."""
    s, final = run.settings, trained_val_losses(run)
    run_report.print_side_by_side("validation loss", {n: (base_losses.get(n), v) for n, v in final.items()})
    settings = run_report.benchmark_settings(s.eval_tasks, s.hellaswag_limit, s.dtype)
    with run.ctx:
        bench = run_report.benchmarks(run.model, run.base_model, run.tokenizer, settings, s.init_from, run.device,
                                      s.mirror)
    return {"val_loss": {"base": base_losses, "trained": final}, "benchmarks": bench}


# --- the dry run: a first run on a new machine that checks itself ---

def dry_run(args: argparse.Namespace) -> dict:
    """Everything the run would do before its loop, then one full step and a few evaluation items, writing
    nothing (no run folder, no checkpoint): what a first GPU run prints and checks before spending hours."""
    rank, world, device = cli.setup_distributed(args.device)
    check_request(args, world)
    refuse_input_as_output(args, run_dir(args))
    run_folder.refuse_existing_run(run_dir(args), args.resume)  # what the real run would refuse, it refuses
    report = {"torch": torch.__version__, "cuda_build": torch.version.cuda, "device": device,
              **device_facts(device)}
    model, tokenizer, base_ref, base_model = build_model(args)
    probe = args.init_from != "scratch" and not args.full_finetune
    if probe:
        model.freeze_base()
    s = resolve_settings(args, model.config.block_size, device)
    train_data, vals, data_source = batches.load_data(s.init_from, s.data, s.seq_len, tokenizer, s.mirror,
                                                      s.val_splits)
    check_lengths(s, model, vals)
    report.update(base=base_ref and checkpoint.pinned_name(base_ref), base_sha256=base_ref and base_ref["sha256"],
                  data=data_source or s.data, files={**probe_text_files(s, tokenizer),
                                                     **run_report.data_files(s.eval_tasks, s.mirror)},
                  memory_estimate_gb={k: round(v / 1e9, 3) for k, v in step_memory(
                      model.config, s.batch_size // world // s.grad_accum, s.seq_len, probe, s.pure_bf16,
                      DTYPES[s.dtype]).items()})
    put_on_device(s, model, base_model, device)
    run = Run(settings=s, out_dir=run_dir(args), model=model, step_model=objective(model, s, world),
              tokenizer=tokenizer, optimizer=make_optimizer(model, s), train_data=train_data, vals=vals,
              data_source=data_source, base_ref=base_ref, base_model=base_model, probe=probe, rank=rank, world=world,
              device=device, ctx=autocast(device, DTYPES[s.dtype]), step=0)
    report.update(timed_step(run), attention_kernel=attention_kernel(model.config, s, device))
    with run.ctx:
        report["lambada"] = {protocol: evaluate(model, tokenizer, ["lambada"], protocol, 4, mirror=s.mirror)
                             ["lambada"]["metrics"] for protocol in ("lm-eval", "paper")}
    for key, value in report.items():
        print(f"{key:16s} {value}")
    print(f"dry run of {run.out_dir}: nothing was written")
    return report


def probe_text_files(s: Settings, tokenizer: Tokenizer) -> dict[str, str]:
    """{file: sha256} of the paper's probe text where the run trains on it (own text's files are in its record)."""
    if s.init_from == "scratch" or text.is_path(s.data) or prepare.probe_data(s.data, s.init_from,
                                                                              tokenizer) != "wikitext103":
        return {}
    return prepare.wikitext103_files(s.mirror)


def device_facts(device: str) -> dict:
    """Capability, native bf16 and free memory of the device the run uses."""
    if device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info(torch.device(device))
        return {"capability": torch.cuda.get_device_capability(torch.device(device)),
                "native_bf16": cuda_has_bf16(device), "free_memory_gb": round(free / 1e9, 2),
                "total_memory_gb": round(total / 1e9, 2)}
    return {"native_bf16": cpu_has_bf16(), "free_memory_gb": round(os.sysconf("SC_AVPHYS_PAGES") *
                                                                   os.sysconf("SC_PAGE_SIZE") / 1e9, 2)}


def timed_step(run: Run) -> dict:
    """Two full steps at the run's batch (the first warms up), the second's time, the peak memory, and the run's
    projected time."""
    s = run.settings
    if run.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(run.device)
    rows = s.batch_size // run.world
    for step in range(2):
        x, y = batches.global_batch(run.train_data, step, s.batch_size, s.seq_len, s.seed)
        t0 = time.time()
        loss = accumulate_gradients(run, x[:rows].to(run.device), y[:rows].to(run.device), int((y != -100).sum()))
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        if run.device.startswith("cuda"):
            torch.cuda.synchronize(run.device)
    step_s = time.time() - t0
    t0 = time.time()
    val_losses(run, run.model)
    val_s = time.time() - t0
    evals = s.max_iters // s.eval_interval + 2  # the loop's, the last step's and the base's
    peak = (torch.cuda.max_memory_allocated(run.device) if run.device.startswith("cuda") else
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"step_loss": round(loss, 4), "step_seconds": round(step_s, 3), "peak_memory_gb": round(peak / 1e9, 2),
            "projected_minutes": round((step_s * s.max_iters + val_s * evals) / 60, 1)}


def attention_kernel(config: GPTConfig, s: Settings, device: str) -> str:
    """Which kernel serves attention at the run's shape. On CUDA, the one F.scaled_dot_product_attention chooses for
    the run's causal attention (q, k, v in the compute dtype, needing gradients; lab.ops.sdpa_kernel_name)."""
    if not device.startswith("cuda"):
        return "cpu: " + ("bf16 scores written out (model.attention)" if s.dtype == "bfloat16" and
                          s.seq_len <= CPU_BF16_EXPLICIT_MAX else "fused scaled_dot_product_attention")
    q = torch.zeros(1, config.n_head, s.seq_len, config.head_dim, device=device, dtype=DTYPES[s.dtype],
                    requires_grad=True)
    return "cuda: " + sdpa_kernel_name(q)


# --- the command line ---

def nano_base_args(args: argparse.Namespace) -> argparse.Namespace | None:
    """The command that pre-trains the embedded base, or finishes a first pre-training that was stopped, when this
    run needs the base and it is not ready."""
    if args.init_from != "nano" or args.resume or checkpoint.nano_status() == "ready":
        return None
    argv = ["--out_dir", str(checkpoint.NANO_DIR), "--device", args.device]
    argv += ["--mirror", args.mirror] if args.mirror else []
    if checkpoint.nano_status() == "not finished":
        return get_args(argv + ["--resume"])
    return get_args(flags(NANO_BASE) + argv + ["--seed", str(args.seed)])


def main() -> None:
    prefer_flash_attention()
    args = get_args()
    cli.keep_freed_memory()
    try:
        if args.dry_run:
            dry_run(args)
            return
        base_args = nano_base_args(args)
        if base_args is not None:  # step 1 of 2: the embedded base, once; later runs load it from out/nano-base
            how = f"--out_dir {checkpoint.NANO_DIR} --resume" if base_args.resume else \
                f"{' '.join(flags(NANO_BASE))} --out_dir {checkpoint.NANO_DIR}"
            what = "finishing the embedded base's pre-training" if base_args.resume else \
                "pre-training the embedded base first (once)"
            print(f"{what}: python train.py {how}")
            train(base_args)
        train(args)
    except (CheckpointError, DataError) as e:
        raise SystemExit(f"error: {e}")
    except OSError as e:  # the run folder cannot be made or locked: a read-only file system, say
        raise SystemExit(f"error: {write_error(Path(e.filename or args.out_dir or '.'), e)}")
    except Diverged as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(run_folder.EXIT_DIVERGED)
    except KeyboardInterrupt:  # outside the loop, which stops at the end of a step and saves (deferred_signals)
        raise SystemExit("error: interrupted before the first training step or after the last one, which is saved")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" in os.environ:  # a process that torchrun started
        cli.exit_without_interpreter_shutdown(main)
    main()
