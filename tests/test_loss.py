"""The training loss without full logits (lab/loss.py) against the plain path it replaces (model.py's
F.cross_entropy): the same value and gradients, in fp32 and under bf16 autocast."""

import pytest
import torch
import torch.nn.functional as F

from lab import loss as fast
from lab.evaluation import val_loss, window_losses
from lab.loss import LinearCrossEntropy, TrainingObjective, row_losses, training_loss
from model import GPT, GPTConfig


@pytest.mark.parametrize("frozen_head", [False, True])
def test_chunked_loss_matches_cross_entropy(monkeypatch, frozen_head):
    """Over several chunks it equals F.cross_entropy on the full logits: loss, d h, d W, and the loss alone under
    no_grad."""
    torch.manual_seed(0)
    vocab, n = 1000, 70
    monkeypatch.setattr(fast, "LOSS_CHUNK", 16 * vocab)  # chunks of 16 rows: four full ones and a short one
    h = torch.randn(n, 16, requires_grad=True)
    w = (0.3 * torch.randn(vocab, 16)).requires_grad_(not frozen_head)
    targets = torch.randint(0, vocab, (n,))
    targets[::7] = -100
    ref = F.cross_entropy(h @ w.T, targets, ignore_index=-100)
    ref_grads = torch.autograd.grad(ref, [h] if frozen_head else [h, w])
    loss = LinearCrossEntropy.apply(h, w, targets, True)
    grads = torch.autograd.grad(loss, [h] if frozen_head else [h, w])
    assert abs(loss.item() - ref.item()) < 1e-5
    for g, r in zip(grads, ref_grads):
        assert (g - r).abs().max().item() < 1e-6
    with torch.no_grad():
        assert abs(LinearCrossEntropy.apply(h, w, targets, False).item() - ref.item()) < 1e-5


def test_chunked_loss_under_bf16_autocast():
    """The path bf16 training takes (autocast, fp32 weights) gives fp32 gradients near the fp32 ones."""
    torch.manual_seed(0)
    h = torch.randn(40, 16, requires_grad=True)
    w = (0.3 * torch.randn(1000, 16)).requires_grad_()
    targets = torch.randint(0, 1000, (40,))
    ref = F.cross_entropy(h @ w.T, targets)
    ref_grads = torch.autograd.grad(ref, [h, w])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = LinearCrossEntropy.apply(h, w, targets, True)
    grads = torch.autograd.grad(loss, [h, w])
    assert loss.dtype == torch.float32 and abs(loss.item() - ref.item()) < 0.02
    for g, r in zip(grads, ref_grads):
        assert g.dtype == torch.float32 and (g - r).abs().max().item() < 0.01 * r.abs().max().item()


def grads_of(model: GPT, loss: torch.Tensor) -> list[torch.Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    return [g.float() for g in torch.autograd.grad(loss, params)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_loss_equals_the_models_plain_loss(monkeypatch, dtype):
    """training_loss(model, x, y) and TrainingObjective equal model(x, y)'s F.cross_entropy in value and in every
    parameter's gradient, with ignored targets and the loss split over several chunks; fp32 to float rounding,
    bf16 autocast to bf16 rounding. A loss that dropped the ignore rule or a chunk would be off by far more."""
    monkeypatch.setattr(fast, "LOSS_CHUNK", 7 * 96)  # 7 rows a chunk: 64 positions in 10 chunks
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=2, n_embd=32, preproj=True, skip=True))
    x, y = torch.randint(0, 96, (2, 32)), torch.randint(0, 96, (2, 32))
    y[:, -5:] = -100  # padding
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        plain = model(x, y)[1]
        plain_grads = grads_of(model, plain)
        fast_loss = training_loss(model, x, y)
        fast_grads = grads_of(model, fast_loss)
        module_loss = TrainingObjective(model)(x, y)
    assert plain.dtype == fast_loss.dtype == torch.float32
    value_tol, grad_tol = (1e-6, 1e-4) if dtype == torch.float32 else (2e-3, 2e-2)
    assert abs(fast_loss.item() - plain.item()) < value_tol and module_loss.item() == fast_loss.item()
    for g, r in zip(fast_grads, plain_grads):
        assert (g - r).norm() <= grad_tol * r.norm() + 1e-12
    shifted = F.cross_entropy(model(x)[0].float().flatten(0, 1), y.roll(1, dims=1).flatten(), ignore_index=-100)
    assert abs(shifted.item() - plain.item()) > 10 * value_tol  # the check can see a wrong target alignment


def test_a_target_whose_probability_underflows_keeps_its_exact_loss():
    """A target 200 nats below the best logit has probability 0 in fp32; its loss is still log-softmax's 200, not
    inf (which the loop would take for a diverged run)."""
    from lab.loss import target_logprob

    logits = torch.zeros(3, 50)
    logits[1, 0] = 200.0  # row 1's target (column 7) sits 200 below its best logit
    t = torch.tensor([[3], [7], [0]])
    p = torch.softmax(logits, dim=-1)
    assert p[1, 7] == 0
    exact = torch.log_softmax(logits, dim=-1).gather(1, t)
    assert torch.allclose(target_logprob(logits, p.gather(1, t), t), exact) and exact[1].item() < -199


def test_window_losses_are_each_windows_plain_loss():
    """Held-out windows scored one by one (the study's unit of replication): each equals the plain loss of that
    window alone, and val_loss is their mean."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=200, block_size=16, n_layer=2, n_head=2, n_embd=32)).eval()
    stream = torch.randint(0, 200, (16 * 11 + 5,)).numpy()
    found = window_losses(model, stream, 16, len(stream), None)
    assert len(found) == 11  # whole windows only, over two chunks of 8
    with torch.no_grad():
        for i in (0, 7, 8, 10):
            w = torch.from_numpy(stream[16 * i:16 * i + 17]).long()[None]
            assert found[i] == pytest.approx(model(w[:, :-1], w[:, 1:])[1].item(), abs=1e-5)
    assert val_loss(model, stream, 16, len(stream)) == pytest.approx(sum(found) / 11, abs=1e-6)
    x = torch.randint(0, 200, (3, 16))
    y = x.clone()
    y[1, 5:] = -100  # a padded row counts its own targets only
    assert torch.allclose(row_losses(model, x, y), torch.stack(
        [model(x[r:r + 1], y[r:r + 1])[1] for r in range(3)]).detach(), atol=1e-5)
