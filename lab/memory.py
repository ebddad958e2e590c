"""
What one training step holds in memory, estimated without a GPU: the real model and loss run once on PyTorch's
meta device (shapes and dtypes, no data, no time), and autograd's saved-tensor hooks count what the forward pass
keeps for backward. Weights, gradients and AdamW state are counted from the parameters.

    estimate = step_memory(config, rows=16, seq_len=512, probe=True, pure_bf16=True)   # bytes, by part

Attention is counted as CUDA's fused kernels keep it (flash attention: q, k, v, the output and one fp32
log-sum-exp per query, never the [T, T] scores), since that is where a large run goes; the CPU's bf16 path writes
the scores out (model.attention) and holds more. Not counted: temporaries that live within one operation, the
allocator's fragmentation, and the CUDA context (a few hundred MB).
"""

import torch

import model as model_module
from lab.loss import training_loss
from lab.precision import hold_as_paper, hold_matrices_in
from load_pythia import skeleton
from model import GPT, GPTConfig


class _FlashLike(torch.autograd.Function):
    """Attention as the memory count sees CUDA's flash kernel: it saves q, k, v, the output and the log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def step_memory(config: GPTConfig, rows: int, seq_len: int, probe: bool, pure_bf16: bool,
                dtype: torch.dtype = torch.bfloat16) -> dict[str, int]:
    """Bytes of one training step of `rows` sequences of seq_len tokens (one micro-batch): {"weights",
    "gradients", "optimizer", "activations", "total"}. probe: only the new parameters train; pure_bf16: the
    paper's precision (everything in bf16, AdamW state too), else fp32 masters for what trains; dtype: the compute
    dtype (the activations')."""
    held = meta_model(config, probe)  # its weights as the run holds them (lab/precision.py)
    if pure_bf16:
        hold_as_paper(held)
    elif dtype != torch.float32:
        hold_matrices_in(held, dtype)  # frozen matrices in bf16; what trains keeps its fp32 master
    trainable = [p for p in held.parameters() if p.requires_grad]
    parts = {"weights": sum(p.numel() * p.element_size() for p in held.parameters()),
             "gradients": sum(p.numel() * p.element_size() for p in trainable),
             "optimizer": sum(2 * p.numel() * p.element_size() for p in trainable),  # AdamW: two moments
             "activations": saved_bytes(meta_model(config, probe).to(dtype), rows, seq_len)}
    return {**parts, "total": sum(parts.values())}


def meta_model(config: GPTConfig, probe: bool) -> GPT:
    model = skeleton(config)
    if probe:
        model.freeze_base()
    return model


def saved_bytes(model: GPT, rows: int, seq_len: int) -> int:
    """What autograd keeps for backward in one forward pass of the training loss, the model in one dtype (as bf16
    autocast computes), parameters not counted (they are the weights)."""
    params = {id(p) for p in model.parameters()}
    saved: dict[int, torch.Tensor] = {}  # by identity: a tensor that two operations save is held once

    def pack(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in params:
            saved[id(t)] = t
        return t

    x = torch.zeros(rows, seq_len, dtype=torch.long, device="meta")
    real_attention = model_module.attention
    model_module.attention = _FlashLike.apply
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            training_loss(model, x, x)
    finally:
        model_module.attention = real_attention
    return sum(t.numel() * t.element_size() for t in saved.values())
