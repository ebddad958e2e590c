"""
Which ATen operators a piece of code runs, read off the dispatcher: what the fused attention call chose
(train.py's dry run) and the operands of a step's matrix products (tools/bench.py, section 6).

    with OpRecorder() as ops:
        step()
    ops.calls   # [(torch.ops.aten.addmm, [(shape, stride, dtype) of each tensor argument]), ...], backward included

A dispatch mode rather than the profiler: the profiler's record of argument shapes, strides and dtypes differs
between PyTorch releases (2.11 has no structured shapes), what the dispatcher passes does not.
"""

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class OpRecorder(TorchDispatchMode):
    """Records each operator run under it and the (shape, stride, dtype) of its tensor arguments, in order; the
    tensors themselves are not kept."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[torch._ops.OpOverloadPacket, list[tuple]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [(a.shape, a.stride(), a.dtype) for a in args if isinstance(a, torch.Tensor)]
        self.calls.append((func.overloadpacket, tensors))
        return func(*args, **(kwargs or {}))


def sdpa_kernel_name(q: torch.Tensor) -> str:
    """The kernel F.scaled_dot_product_attention chooses for causal attention with q as query, key and value (its
    shape, dtype, device and requires_grad decide): flash_attention, cudnn_attention, efficient_attention,
    flash_attention_for_cpu, or math when none of the fused kernels takes it (the scores written out)."""
    with OpRecorder() as ops:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    fused = [op.__name__ for op, _ in ops.calls
             if op.__name__.startswith("_scaled_dot_product_") and "_math" not in op.__name__]
    return fused[0].removeprefix("_scaled_dot_product_") if fused else "math"
