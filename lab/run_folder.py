"""
What keeps a run folder whole while a run writes it (docs/reliability.md), and how a run that cannot go on stops.

    lock_run_folder   one process at a time writes a folder; the lock ends with the process, however it ends
    claim_folder      holding the lock: no other run's files, no stale temporaries, a metrics log cut back to the
                      checkpoint's step
    deferred_signals  Ctrl-C and SIGTERM wait for the end of the step, which saves before the run stops
    non_finite        what is wrong with weights about to be saved (a checkpoint is always one that can go on)
    diverged, interrupted   the one-line messages (and exit statuses) of a run that stops early

Every file is written atomically (data.sources.write_atomic, through lab.checkpoint.save_run_file).
"""

import fcntl
import json
import math
import os
import signal
import socket
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, TextIO

import torch
import torch.distributed as dist

from data.sources import write_atomic, write_error
from lab.checkpoint import CheckpointError, model_card, read_checkpoint, save_run_file

# The exit status of a training run whose loss or weights became non-finite, so that a caller (the study's grid)
# tells a diverged run from a failed one without reading its words.
EXIT_DIVERGED = 3


class Diverged(Exception):
    """The loss or the weights became non-finite; the message says which checkpoint is kept and what to do."""


def refuse_existing_run(folder: Path, resume: bool) -> None:
    """A new run never writes into a folder that already holds a run."""
    if not resume and (folder / "ckpt.pt").exists():
        raise SystemExit(f"error: {folder} already holds a run; pass --resume to continue it or pick another "
                         f"--out_dir")


@contextmanager
def lock_run_folder(folder: Path) -> Iterator[None]:
    """Hold the run folder for this process (creating it): a second run into it stops with a CheckpointError
    naming the holder. The lock is the kernel's (flock on .lock), so it ends with the process, however it ends:
    the .lock file a killed run leaves behind blocks nobody."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            raise CheckpointError(f"{folder} is in use by {holder}; wait for that run to end or pick another "
                                  f"--out_dir") from None
        f.seek(0)
        f.truncate()
        f.write(f"process {os.getpid()} on {socket.gethostname()}")
        f.flush()
        yield  # leaving the with block closes the file, which releases the lock


def claim_folder(folder: Path, resume: bool, step: int) -> TextIO:
    """Holding the folder's lock: check again that a new run finds no run there (another may have finished into
    it meanwhile), remove stale temporaries, write config.json anew from the checkpoint (a kill may have cut the
    first save short), and open metrics.jsonl cut back to `step`, completed with the checkpoint's own record of
    that step when a kill came between the checkpoint and its line."""
    refuse_existing_run(folder, resume)
    clean_temporaries(folder)
    saved_record = None
    if resume:
        ckpt = read_checkpoint(folder, mmap=True)
        save_run_file(folder, "config.json", model_card(ckpt))
        saved_record = ckpt.get("record")
    return open_metrics(folder, step, saved_record)


def clean_temporaries(folder: Path) -> None:
    """Remove the .<name>.<pid>.tmp files a killed or failed write left behind (call it holding the lock)."""
    for tmp in Path(folder).glob(".*.tmp"):
        tmp.unlink(missing_ok=True)


def open_metrics(folder: Path, step: int, saved_record: dict | None = None) -> TextIO:
    """metrics.jsonl for appending, cut back to the records up to `step`: the checkpoint a run resumes from, or 0
    for a new run, which starts it afresh. So no step is logged twice and no other run's records remain. The
    checkpoint's step itself is logged even when a kill came before its line: from saved_record, the checkpoint's
    copy (without the validation losses measured after it)."""
    path = Path(folder) / "metrics.jsonl"
    kept, last = [], 0
    if step and path.is_file():
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                last_here = json.loads(line)["step"]
                if last_here > step:
                    break
            except (ValueError, KeyError, TypeError):  # a line cut short by a kill: it and what follows go
                break
            kept.append(line + "\n")
            last = last_here
    if step and last < step and saved_record and saved_record.get("step") == step:
        kept.append(json.dumps(saved_record) + "\n")
    write_atomic(path, "".join(kept))
    return open(path, "a", encoding="utf-8")


def append_metrics(log: TextIO, record: dict) -> None:
    """One record (a JSON line), flushed at once so that a kill loses at most the line being written."""
    try:
        log.write(json.dumps(record) + "\n")
        log.flush()
    except OSError as e:
        raise write_error(Path(log.name), e) from e


# --- stopping cleanly: Ctrl-C, kill, NaN ---

@contextmanager
def deferred_signals() -> Iterator[list[int]]:
    """Within this block SIGINT and SIGTERM (Ctrl-C, kill, a scheduler's pre-emption) only note themselves in the
    list it yields: the loop finishes its step, saves a checkpoint and stops (stop_signal)."""
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


def stop_signal(received: list[int], device: str) -> int:
    """The signal that stops the run after this step (0 = none), the same in every process so that all stop and
    save at the same step."""
    signum = received[0] if received else 0
    if dist.is_initialized():
        t = torch.tensor([signum], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        signum = int(t.item())
    return signum


def non_finite(params: list[torch.Tensor], next_loss: Callable[[], float]) -> str | None:
    """What is wrong with weights about to be saved, or None: they must be finite and give a finite loss on the
    next batch, so that a kept checkpoint is always one that training can continue from."""
    if not all(torch.isfinite(p).all() for p in params):
        return "hold non-finite values"
    return None if math.isfinite(next_loss()) else "give a non-finite loss"


def diverged(what: str, folder: Path, saved_step: int | None) -> Diverged:
    kept = (f"the last good checkpoint, step {saved_step}, is kept in {folder}" if saved_step is not None
            else "there is no earlier checkpoint")
    return Diverged(f"{what}; stopped without saving it; {kept}. Lower --lr")


def interrupted(signum: int, step: int, folder: Path, master: bool) -> SystemExit:
    """Exit after a signal (exit status 128 + its number, as a shell reports it), saying how to go on."""
    if master:
        print(f"error: stopped by {signal.Signals(signum).name} after step {step}; the checkpoint is saved in "
              f"{folder}. Continue with: python train.py --out_dir {folder} --resume", file=sys.stderr)
    return SystemExit(128 + signum)
