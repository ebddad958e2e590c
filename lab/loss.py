"""
The training loss, computed without the full logits: the same number as `model(x, y)[1]` (model.py's plain
F.cross_entropy), with less memory and fewer passes over the largest tensors of a step. Training, held-out losses
and the benchmark scorer use it; tests/test_model.py holds it equal to the plain path in value and gradient.

    loss = training_loss(model, x, y)          # what train.py minimises
    step_model = TrainingObjective(model)      # the same as a module, for DDP to wrap (and to compile)
"""

import torch
import torch.nn as nn

from model import GPT

# Logits per chunk of the training loss and of the benchmark scorer (2**26 floats = 256 MB in fp32): large enough
# that the output layer's matrix products stay efficient, small enough that the full [tokens, vocab] logits never
# exist.
LOSS_CHUNK = 2**26


def training_loss(model: GPT, idx: torch.Tensor, targets: torch.Tensor, n_tokens: int | None = None,
                  blocks: list[nn.Module] | None = None) -> torch.Tensor:
    """The mean cross-entropy of model on (idx, targets), -100 = ignore, as model(idx, targets)[1] computes it.

    With n_tokens, the sum of the token losses here over n_tokens instead: a step split into micro-batches or
    processes passes the whole step's count of target tokens, so that its pieces add up to the step's mean however
    their tokens are shared out (padded rows hold unequal numbers). blocks: model's blocks compiled, run in their
    place (TrainingObjective)."""
    h = model.hidden_states(idx, blocks=blocks)
    return LinearCrossEntropy.apply(h.flatten(0, 1), model.lm_head.weight, targets.flatten(), torch.is_grad_enabled(),
                                    n_tokens)


def row_losses(model: GPT, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each row's mean cross-entropy [B] (-100 = ignore), without gradients: held-out windows scored one by one,
    for statistics whose unit is the window."""
    with torch.no_grad():
        h = model.hidden_states(idx)
        return torch.stack([LinearCrossEntropy.apply(h_r, model.lm_head.weight, t_r, False) for h_r, t_r in
                            zip(h, targets)])


class TrainingObjective(nn.Module):
    """training_loss as a module: what the loop calls, and what DistributedDataParallel wraps (DDP synchronises the
    gradients of the module it wraps only when called through its forward).

    compile_blocks runs each block through torch.compile (regional compilation: the layers reuse what one block
    compiles, and the loss, whose data-dependent branch would split a graph, stays eager). The compiled blocks are
    wrappers around the model's own, sharing their weights; the model itself stays eager, so evaluation and
    generation never wait for a compile."""

    def __init__(self, model: GPT, compile_blocks: bool = False):
        super().__init__()
        self.model = model
        # a plain list, not a ModuleList: the wrappers' weights are the model's and must not be registered twice
        self.compiled_blocks = [torch.compile(block) for block in model.blocks] if compile_blocks else None

    def forward(self, idx: torch.Tensor, targets: torch.Tensor, n_tokens: int | None = None) -> torch.Tensor:
        return training_loss(self.model, idx, targets, n_tokens, self.compiled_blocks)


def target_logprob(logits: torch.Tensor, p_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """log p[target] for each row, from the target's softmax probability p_t (fp32). Where p_t underflowed to 0
    (a target some 100 nats below the best logit), the row's fp32 log-softmax gives the exact value instead of -inf."""
    logp = p_t.log()
    lost = torch.isinf(logp).squeeze(1)
    if logp.device.type != "meta" and lost.any():  # meta tensors (lab/memory.py's count) hold no values
        logp[lost] = torch.log_softmax(logits[lost].float(), dim=-1).gather(1, t[lost])
    return logp


class LinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of the logits h @ W^T against targets (-100 = ignore; over n_tokens when given),
    LOSS_CHUNK logits at a time.

    Why not F.cross_entropy(lm_head(h)): with a 50k vocabulary the [tokens, vocab] logits are the largest tensors
    of a step, and the standard path makes three more of their size (log-softmax, the loss's zero-filled gradient,
    the log-softmax's gradient). Here each chunk's softmax, taken straight from the logits, becomes its own
    gradient, softmax - one_hot, in place while it is at hand, and backward only scales what forward computed.
    That saves memory (past LOSS_CHUNK the full logits never exist) and passes over them. It equals the standard
    path to float rounding (tests).
    """

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, grad_enabled: bool,
                n_tokens: int | None = None):
        need_h, need_w = (grad_enabled and need for need in ctx.needs_input_grad[:2])
        valid = targets != -100
        scale = 1.0 / (valid.sum().clamp(min=1) if n_tokens is None else n_tokens)  # what the mean divides by
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.empty(weight.shape, dtype=torch.float32, device=h.device) if need_w else None
        # The matrix products and the softmax run in the autocast dtype when autocast is on (bf16 on this project's
        # CPUs); the loss is summed in fp32, and grad_w accumulates in fp32 over the chunks.
        device = h.device.type
        autocast = device != "meta" and torch.is_autocast_enabled(device)  # meta: lab/memory.py's count
        mm = torch.get_autocast_dtype(device) if autocast else h.dtype
        w = weight.to(mm)
        rows = max(1, LOSS_CHUNK // weight.size(0))
        for i in range(0, len(h), rows):
            h_c = h[i:i + rows].to(mm)
            t_c = targets[i:i + rows].clamp(min=0).unsqueeze(1)  # ignored rows pick any column, weighted 0
            w_row = (valid[i:i + rows] * scale).unsqueeze(1)  # each row's weight in the mean: 1 / n_valid or 0
            logits = h_c @ w.T
            # Probabilities straight from the logits, in their dtype: a bf16 softmax sums in fp32 and rounds once,
            # as the fp32 softmax cast to bf16 for the gradient's product would, with half the bytes moved. The
            # loss is the log of the target's probability taken in fp32: its bf16 rounding moves a token's loss by
            # at most 2^-8 (0.004 nats), less than the bf16 logits' own rounding.
            p = torch.softmax(logits, dim=-1)
            at = (torch.arange(len(t_c), device=p.device), t_c.squeeze(1))  # each row's target: p[at] [rows]
            p_t = p[at].float().unsqueeze(1)
            loss -= (target_logprob(logits, p_t, t_c) * w_row).sum()
            if need_h or need_w:  # d loss / d logits = (softmax - one_hot) * w_row, the row weights applied to
                p[at] = (p_t - 1).squeeze(1).to(p.dtype)  # the small operands (indexing: bf16 scatter is slow)
                g = p  # the softmax, now its own gradient
                if need_h:
                    grad_h[i:i + rows] = (g @ w) * w_row
                if need_w and mm == torch.float32:  # beta=0 on the first chunk: the empty buffer is written, not read
                    grad_w.addmm_(g.T, h_c * w_row, beta=float(i > 0))
                elif need_w:  # a bf16 product, accumulated in fp32; computed transposed, as (h^T g)^T, so that
                    g_w = ((h_c * w_row.to(mm)).T @ g).T  # the large g is read in its own layout, not copied
                    if i == 0:
                        grad_w.copy_(g_w)
                    else:
                        grad_w.add_(g_w)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.w_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors  # ours alone: scaled in place
        return (None if grad_h is None else grad_h.mul_(grad_loss.to(grad_h.dtype)),
                None if grad_w is None else grad_w.mul_(grad_loss).to(ctx.w_dtype), None, None, None)
