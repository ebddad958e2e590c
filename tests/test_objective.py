"""One step means the same objective however it is split: the mean over the step's target tokens, for padded rows
(the paper's WikiText lines, 33-261 real tokens of 512) under --grad_accum 1, 2 and 4 and on one or two processes."""

import os
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from conftest import spawn_two_ranks
from lab.loss import TrainingObjective
from model import GPT, GPTConfig
from train import accumulate_gradients

LENGTHS = [31, 5, 12, 31, 3, 20, 8, 26]  # real tokens per row of a padded batch of 8 rows of 32


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    x = torch.randint(0, 64, (len(LENGTHS), 32))
    y = torch.randint(0, 64, (len(LENGTHS), 32))
    for row, n in enumerate(LENGTHS):
        x[row, n:], y[row, n:] = 0, -100
    return x, y


def tiny_model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32, preproj=True, skip=True))


def step(model: GPT, step_model, x, y, grad_accum: int, world: int = 1, rank: int = 0) -> tuple[float, dict]:
    """The loss and gradients of one step over this process's share of (x, y), as train.py takes it."""
    n_tokens = int((y != -100).sum())
    rows = len(x) // world
    run = SimpleNamespace(settings=SimpleNamespace(grad_accum=grad_accum), world=world, step_model=step_model,
                          ctx=nullcontext())
    loss = accumulate_gradients(run, x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows], n_tokens)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss, grads


def test_the_objective_does_not_depend_on_grad_accum():
    model = tiny_model()
    x, y = padded_batch()
    ref_loss, ref_grads = step(model, TrainingObjective(model), x, y, grad_accum=1)
    assert abs(ref_loss - model(x, y)[1].item()) < 1e-6  # the mean over every target token of the step
    for accum in (2, 4):
        loss, grads = step(model, TrainingObjective(model), x, y, grad_accum=accum)
        assert abs(loss - ref_loss) < 1e-6
        for name, g in grads.items():
            assert torch.allclose(g, ref_grads[name], rtol=1e-5, atol=1e-7), name
    # the rows are unequal enough that a mean of per-micro-batch means (the objective before) is another one, by
    # a thousand times the tolerance above
    halves = [model(x[i:i + 4], y[i:i + 4])[1].item() for i in (0, 4)]
    assert abs(sum(halves) / 2 - ref_loss) > 1e-3


def ddp_rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    model = tiny_model()
    x, y = padded_batch()
    loss, grads = step(model, torch.nn.parallel.DistributedDataParallel(TrainingObjective(model)), x, y,
                       grad_accum=2, world=2, rank=rank)
    if rank == 0:
        torch.save({"loss": loss, "grads": grads}, out)
    dist.destroy_process_group()


def test_two_processes_optimise_the_same_objective_as_one(tmp_path):
    """Rank 0 holds rows of 31, 5, 12, 31 real tokens and rank 1 rows of 3, 20, 8, 26: unequal shares of the step."""
    model = tiny_model()
    x, y = padded_batch()
    ref_loss, ref_grads = step(model, TrainingObjective(model), x, y, grad_accum=1)
    out = tmp_path / "rank0.pt"
    spawn_two_ranks(ddp_rank, 29500 + os.getpid() % 1000, str(out))
    two = torch.load(out)
    assert two["loss"] == pytest.approx(ref_loss, abs=1e-6)
    for name, g in two["grads"].items():
        assert torch.allclose(g, ref_grads[name], rtol=1e-5, atol=1e-7), name


def test_a_batch_of_documents_is_padded_to_its_longest_row_with_the_same_objective():
    """global_batch pads documents to the batch's longest row, not to seq_len: under causal attention with right
    padding every real token's loss is the same, so the step's loss and gradients equal those of the batch padded
    to seq_len (fp32, float rounding), with fewer positions computed."""
    import numpy as np

    from data.batches import global_batch

    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 64, n + 1).astype(np.uint16) for n in (7, 19, 4, 12, 25, 9, 3, 16)]
    x, y = global_batch(docs, step=0, rows=4, seq_len=32, seed=3)
    longest = max(int((row != -100).sum()) for row in y)
    assert x.shape == (4, longest) and longest < 32 and bool((y[:, -1] != -100).any())
    full_x = torch.zeros(4, 32, dtype=torch.long)
    full_y = torch.full((4, 32), -100, dtype=torch.long)
    full_x[:, :longest], full_y[:, :longest] = x, y
    model = tiny_model()
    loss, grads = step(model, TrainingObjective(model), x, y, grad_accum=1)
    full_loss, full_grads = step(model, TrainingObjective(model), full_x, full_y, grad_accum=1)
    assert abs(loss - full_loss) < 1e-6
    for name, g in grads.items():
        assert torch.allclose(g, full_grads[name], rtol=1e-5, atol=1e-7), name
    long_doc = [rng.integers(1, 64, 100).astype(np.uint16)] * 2  # a document beyond the window is cut to seq_len
    assert global_batch(long_doc, step=0, rows=2, seq_len=32, seed=0)[0].shape == (2, 32)


def test_under_torchrun_rank_0_fetches_first_and_the_others_wait(monkeypatch):
    """train.py reads its data inside cli.first_rank_first: rank 0 runs the block while the others wait at a
    barrier, then they run it and find the downloads and the prepared corpus in place."""
    from lab import cli
    events = []
    monkeypatch.setattr(dist, "barrier", lambda: events.append("barrier"))
    for rank in (0, 1):
        with cli.first_rank_first(rank, world=2):
            events.append(f"rank {rank} reads")
    with cli.first_rank_first(0, world=1):
        events.append("alone")
    assert events == ["rank 0 reads", "barrier", "barrier", "rank 1 reads", "alone"]
