"""
Which precision a run computes in, and how the model's weights are held for it.

    float32    everything in fp32
    bfloat16   matrix products in bf16 (torch.autocast); trainable weights keep fp32 master copies, frozen weights
               are held in bf16 once (autocast would cast them at every step: the same numbers, more work);
               the loss's log-softmax over the vocabulary stays in fp32 (lab/loss.py)
    paper      the author's recipe: the whole model in bf16, trained with no fp32 master copy (AdamW state in bf16
               too), except LoRA adapters, which peft keeps in fp32 (autocast_adapter_dtype=True); bf16 autocast
    auto       bfloat16 on a CPU with native bf16 matrix instructions (AVX512-BF16 or AMX) and on CUDA devices
               that multiply bf16 natively (compute capability 8 or more: A100, H100, RTX 30xx and later);
               float32 elsewhere, including GPUs that only emulate bf16 (T4, V100)

Evaluation in bf16 (for_inference) holds every Linear layer's weights in bf16 under autocast, so it gives the numbers
the end of a bf16 training run gives; under the paper's protocol it casts the whole model to bf16, as the author
evaluates. Its log-softmax over the vocabulary stays in fp32 either way.
"""

from contextlib import nullcontext

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (else bf16 would be emulated, and slower than fp32)."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def cuda_has_bf16(device: str) -> bool:
    """Whether the CUDA device the run uses (not the current one) multiplies bf16 natively: compute capability 8
    or more. torch.cuda.is_bf16_supported() also counts emulation (T4, V100), which is slower than fp32."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability(torch.device(device))[0] >= 8


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """The compute dtype for --dtype NAME on DEVICE; 'auto' picks bf16 where the hardware does it natively."""
    if name != "auto":
        return DTYPES[name]
    if device.startswith("cuda"):
        return torch.bfloat16 if cuda_has_bf16(device) else torch.float32
    return torch.bfloat16 if cpu_has_bf16() else torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def autocast(device: str, dtype: torch.dtype):
    """The context a training step runs in: bf16 autocast, or nothing for fp32."""
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device.split(":")[0], dtype=dtype)


def prefer_flash_attention() -> None:
    """Leave cuDNN's kernel out of the ones F.scaled_dot_product_attention may pick on CUDA, so that flash attention
    (or the memory-efficient kernel) serves bf16 attention. PyTorch 2.11 picked cuDNN's on an H200, where its first
    call at each new sequence length was slow: evaluation and generation meet many lengths, and a training step ran
    slower too (docs/reproduce.md, "cuDNN's attention or flash"). Every entry point calls it first; no effect on the
    CPU, and none on fp32, which cuDNN's kernel does not take."""
    torch.backends.cuda.enable_cudnn_sdp(False)


@torch.no_grad()
def hold_matrices_in(model: torch.nn.Module, dtype: torch.dtype, only_frozen: bool = True) -> None:
    """Store the weights of Linear layers (the matrix-product operands; by default only frozen ones) in dtype.
    Autocast would cast them to dtype at every step anyway, so the numbers are the same, with less work.
    Embeddings and norms stay in fp32, and so does the residual stream."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            for p in module.parameters(recurse=False):
                if not (only_frozen and p.requires_grad):
                    p.data = p.data.to(dtype)


def for_inference(model: torch.nn.Module, device: str, dtype: torch.dtype, whole_model: bool = False):
    """Move a model to device for evaluation or sampling in dtype; returns the context to run it in.
    whole_model casts every weight (embeddings and norms too) and runs without autocast, as the paper evaluates."""
    model.to(device).eval()
    if whole_model:
        model.to(dtype)
        return nullcontext()
    if dtype != torch.float32:
        hold_matrices_in(model, dtype, only_frozen=False)
    return autocast(device, dtype)


@torch.no_grad()
def hold_as_paper(model: torch.nn.Module) -> None:
    """The paper's precision: every weight in bf16 with no master copy, LoRA adapters in fp32 (as peft)."""
    model.to(torch.bfloat16)
    for name, p in model.named_parameters():
        if name.rsplit(".", 1)[-1] in ("lora_a", "lora_b"):
            p.data = p.data.float()
