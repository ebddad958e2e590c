"""
GPT-NeoX (the architecture of EleutherAI's Pythia models) in one file, with the two optional changes to every
attention block from arXiv 2604.10791, each behind its own switch:

  pre-projection   x_tilde = x_hat + W_down · SiLU(W_up · x_hat)     Q, K, V are computed from x_tilde
  content skip     out     = x + attn(x_tilde) + W_skip · x_tilde (+ mlp)

One block (without pre-projection x_tilde = x_hat; without the skip its branch is absent):

    x ──┬────────────────────────────────────────────────────────── + ──> h ────── + ──> out
        │                                                           ↑              ↑
        ├─ ln_1 ─> x_hat ─> pre-projection ─> x_tilde ─┬─> attention┤              │
        │                                              └─> W_skip ──┘              │
        └─ ln_2 ─> MLP ────────────────────────────────────────────────────────────┘
                   (a sequential block feeds h to ln_2 instead of x)

Pythia's block is parallel, as drawn: out = x + attn + skip + mlp(ln_2 x).
A parallel MLP adapter (`adapter_dim`) is the capacity control of our comparison: as many new parameters as
pre-projection + skip, none of them on attention's input. LoRA, the paper's baseline, is attached after the model
is built, in its own section at the bottom. Everything here is plain PyTorch with no I/O; loading Hugging Face
weights lives in load_pythia.py, and the training loop's faster loss in lab/loss.py.

Reading order: GPTConfig, CausalSelfAttention, MLP, Block, GPT; then attention, RoPE and the K/V cache for
generation; then LoRA.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

# The research switches: what a probe adds to a base. Scripts expose them as flags, checkpoints store them,
# run names are built from them.
SWITCHES = ("preproj", "preproj_linear", "skip", "lora_rank", "lora_alpha", "adapter_dim")
# Names that mark the parameters those switches add on top of a GPT-NeoX base.
NEW_PARAM_MARKERS = ("w_up", "w_down", "w_skip", "lora_a", "lora_b", "w_a_up", "w_a_down")


@dataclass
class GPTConfig:
    vocab_size: int = 50304
    block_size: int = 2048  # longest sequence the model handles (Pythia's max_position_embeddings)
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    intermediate_size: int = 0  # MLP width; 0 means 4 * n_embd
    rotary_pct: float = 0.25  # share of each head's dims that RoPE rotates (Pythia: the first 25%)
    rotary_base: float = 10000.0
    parallel_residual: bool = True  # Pythia: x + attn(LN1 x) + mlp(LN2 x)
    layer_norm_eps: float = 1e-5
    bias: bool = True  # biases on every Linear of the base model (Pythia has them)
    # --- research switches; each works on its own ---
    preproj: bool = False
    preproj_linear: bool = False  # a control: the pre-projection without its SiLU, x_hat + W_down · W_up · x_hat
    preproj_expansion: float = 1.25
    skip: bool = False
    lora_rank: int = 0
    lora_alpha: float = 0.0  # 0 means 2 * lora_rank (the paper's alpha = 2r)
    adapter_dim: int = 0  # capacity control: inner size of a parallel MLP adapter on x_hat (0 = off)
    preproj_init_std: float = 0.01
    skip_init_std: float = 1e-4

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.intermediate_size == 0:
            self.intermediate_size = 4 * self.n_embd
        if self.preproj_linear and not self.preproj:
            raise ValueError("preproj_linear=True changes the pre-projection: it needs preproj=True")
        if self.lora_rank and not self.lora_alpha:
            self.lora_alpha = 2.0 * self.lora_rank

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def rotary_ndims(self) -> int:
        return int(self.head_dim * self.rotary_pct)

    @property
    def preproj_dim(self) -> int:
        return int(self.n_embd * self.preproj_expansion)

    def to_dict(self) -> dict:
        return asdict(self)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        d = config.n_embd
        # Fused projection in Hugging Face's layout: rows grouped per head as [q | k | v].
        self.qkv = nn.Linear(d, 3 * d, bias=config.bias)
        self.proj = nn.Linear(d, d, bias=config.bias)
        self.n_head, self.head_dim = config.n_head, config.head_dim

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        B, T, C = x.shape  # batch, sequence length, n_embd
        qkv = self.qkv(x).view(B, T, self.n_head, 3 * self.head_dim).transpose(1, 2)  # (B, n_head, T, 3*head_dim)
        q, k, v = qkv.chunk(3, dim=-1)  # each (B, n_head, T, head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)  # RoPE on the first rotary_ndims dims
        if cache is not None:
            end = cache.pos + T
            cache.k[layer, :, :, cache.pos:end] = k
            cache.v[layer, :, :, cache.pos:end] = v
            k, v = cache.k[layer, :, :, :end], cache.v[layer, :, :, :end]  # (B, n_head, pos + T, head_dim)
        y = attention(q, k, v)  # (B, n_head, T, head_dim)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))  # heads side by side again: (B, T, C)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))  # exact (erf) GELU, as Pythia


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        d = config.n_embd
        self.parallel = config.parallel_residual
        self.ln_1 = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.ln_2 = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.attn = CausalSelfAttention(config)
        self.mlp = MLP(config)
        # The research switches; a module that is off is None. Pre-projection is position-agnostic: it runs on the
        # normed input, before RoPE.
        e = config.preproj_dim
        self.w_up = nn.Linear(d, e, bias=False) if config.preproj else None
        self.w_down = nn.Linear(e, d, bias=False) if config.preproj else None
        self.preproj_linear = config.preproj_linear
        self.w_skip = nn.Linear(d, d, bias=False) if config.skip else None
        # The capacity control (not in the paper): W_a_down · SiLU(W_a_up · x_hat) added to the residual stream.
        # It reads the same x_hat as the pre-projection and is the same kind of MLP, but Q, K and V never see it:
        # sized to pre-projection + skip's parameter count, it tells "a better input to Q/K/V" apart from "more
        # trainable parameters in every block".
        a = config.adapter_dim
        self.w_a_up = nn.Linear(d, a, bias=False) if a else None
        self.w_a_down = nn.Linear(a, d, bias=False) if a else None

    def pre_projection(self, x_hat: torch.Tensor) -> torch.Tensor:
        """x_tilde = x_hat + W_down · SiLU(W_up · x_hat); the identity when pre-projection is off. The linear control
        drops the SiLU: x_tilde = x_hat + W_down · W_up · x_hat, the same parameters with no nonlinearity."""
        if self.w_up is None:
            return x_hat
        u = self.w_up(x_hat)
        return x_hat + self.w_down(u if self.preproj_linear else F.silu(u))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        x_hat = self.ln_1(x)
        x_tilde = self.pre_projection(x_hat)
        h = x + self.attn(x_tilde, cos, sin, cache, layer)
        if self.w_skip is not None:  # content skip: x_tilde reaches the residual without attention
            h = h + self.w_skip(x_tilde)
        if self.w_a_up is not None:  # capacity control: beside attention, never in front of it
            h = h + self.w_a_down(F.silu(self.w_a_up(x_hat)))
        # Parallel: the MLP reads the block input; sequential: it reads the attention output.
        return h + self.mlp(self.ln_2(x if self.parallel else h))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)  # untied, as in Pythia
        self.apply(self._init_weights)
        if config.lora_rank:
            attach_lora(self)
        self.init_new_params()

    def _init_weights(self, module: nn.Module) -> None:
        """Initialisation for training from scratch (GPT-2 style); loaded models overwrite it."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, Block):  # residual projections shrink with depth
            for proj in (module.attn.proj, module.mlp.proj):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))

    @torch.no_grad()
    def init_new_params(self) -> None:
        """The paper's initialisation: W_up, W_down ~ N(0, 0.01); W_skip ~ N(0, 1e-4); LoRA B = 0.

        The capacity control's W_a_up, W_a_down are drawn as the pre-projection's, N(0, 0.01): the two arms then
        differ only in where the MLP's output goes. It starts near, not at, the base (its output is ~1e-2 of a
        normed input, as x_tilde - x_hat is); a zero W_a_down would start exactly at the base but leave W_a_up
        without a gradient at first, a different optimisation path from the pre-projection it controls for."""
        c = self.config
        for block in self.blocks:
            if c.preproj:
                nn.init.normal_(block.w_up.weight, std=c.preproj_init_std)
                nn.init.normal_(block.w_down.weight, std=c.preproj_init_std)
            if c.adapter_dim:
                nn.init.normal_(block.w_a_up.weight, std=c.preproj_init_std)
                nn.init.normal_(block.w_a_down.weight, std=c.preproj_init_std)
            if c.skip:
                nn.init.normal_(block.w_skip.weight, std=c.skip_init_std)
            for m in (block.attn.qkv, block.attn.proj):
                if isinstance(m, LoRALinear):
                    m.reset_lora()

    def rotary(self, start: int, T: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of RoPE for positions start..start+T-1, computed in fp32 whatever the weights' dtype."""
        n, device = self.config.rotary_ndims, self.wte.weight.device
        inv_freq = 1.0 / (self.config.rotary_base ** (torch.arange(0, n, 2, device=device, dtype=torch.float32) / n))
        freqs = torch.outer(torch.arange(start, start + T, device=device, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def hidden_states(self, idx: torch.Tensor, cache: KVCache | None = None,
                      blocks: list[nn.Module] | None = None) -> torch.Tensor:
        """The final norm's output [B, T, d], which the output layer reads. Scorers that need logits at only a
        few positions apply lm_head to just those rows (the output layer is a large share of a small model).
        blocks runs in place of self.blocks: the same blocks compiled, for the training loss (lab/loss.py)."""
        T = idx.size(1)
        start = cache.pos if cache is not None else 0
        if start + T > self.config.block_size:
            raise ValueError(f"sequence of {start + T} tokens is longer than block_size={self.config.block_size}")
        x = self.wte(idx)
        cos, sin = self.rotary(start, T, x.dtype)
        for i, block in enumerate(self.blocks if blocks is None else blocks):
            x = block(x, cos, sin, cache, i)
        if cache is not None:
            cache.pos += T
        return self.ln_f(x)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                cache: KVCache | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits for every position [B, T, V], the mean cross-entropy against targets or None; -100 = ignore).
        The log-softmax is taken in fp32 whatever the compute dtype. Training computes the same loss without the
        full logits (lab/loss.py)."""
        logits = self.lm_head(self.hidden_states(idx, cache))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, use_cache: bool = True,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Continue idx ([B, T]) by max_new_tokens tokens. temperature 0 means greedy."""
        T = idx.size(1)
        if T + max_new_tokens > self.config.block_size:
            raise ValueError(f"prompt of {T} tokens + {max_new_tokens} new tokens exceeds block_size="
                             f"{self.config.block_size}; shorten the prompt or ask for fewer tokens")
        cache = None
        if use_cache:
            cache = KVCache(self.config, idx.size(0), T + max_new_tokens, idx.device, self.wte.weight.dtype)
        step_input = idx
        for _ in range(max_new_tokens):
            logits, _ = self(step_input if use_cache else idx, cache=cache)
            logits = logits[:, -1, :].float()
            if temperature == 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                    logits[logits < v[:, [-1]]] = -float("inf")
                nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat((idx, nxt), dim=1)
            step_input = nxt
        return idx

    # --- bookkeeping for the frozen probe ---

    @staticmethod
    def is_new(name: str) -> bool:
        """True for the parameters this project adds (pre-projection, skip, LoRA), False for the base."""
        return any(part in NEW_PARAM_MARKERS for part in name.split("."))

    def num_params(self, which: str = "all") -> int:
        """Parameter count: which = 'all', 'trainable', 'new' (added by the switches) or 'base'."""
        keep = {"all": lambda n, p: True, "trainable": lambda n, p: p.requires_grad,
                "new": lambda n, p: self.is_new(n), "base": lambda n, p: not self.is_new(n)}[which]
        return sum(p.numel() for n, p in self.named_parameters() if keep(n, p))

    def freeze_base(self) -> None:
        """The frozen probe: only the new parameters keep requires_grad."""
        for n, p in self.named_parameters():
            p.requires_grad_(self.is_new(n))

    def new_state_dict(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.named_parameters() if self.is_new(n)}

    def base_state_dict(self) -> dict[str, torch.Tensor]:
        return {n: p for n, p in self.state_dict().items() if not self.is_new(n)}


# --- supporting pieces: attention, RoPE, the K/V cache ---

# The longest window that bf16 attention on a CPU writes out as two matrix products (see attention(); the
# crossover is measured in docs/performance.md).
CPU_BF16_EXPLICIT_MAX = 512


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax(q k^T / sqrt(head_dim)) v over [B, n_head, T, head_dim]. The T queries are the last T of the
    S key positions (S > T after a K/V cache's earlier tokens), and each sees every key up to its own position.

    Two ways to compute the same thing. PyTorch's fused kernel (F.scaled_dot_product_attention) never holds the
    [T, S] scores, but on a CPU it is no faster in bf16 than in fp32. So in bf16 on a CPU, for windows of up to
    CPU_BF16_EXPLICIT_MAX keys, the scores are written out: two bf16 matrix products around a softmax, faster
    there (docs/performance.md); past that their size costs more than the products save."""
    T, S = q.size(-2), k.size(-2)
    fused = q.dtype != torch.bfloat16 or q.device.type != "cpu" or S > CPU_BF16_EXPLICIT_MAX
    if fused and T == S:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)  # query i sits at position S - T + i
    if fused:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    bias = torch.zeros(T, S, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    # scores = q k^T / sqrt(head_dim) + bias, [B, n_head, T, S]: one baddbmm scales and masks inside the product
    # instead of two more passes over q and over the scores.
    scores = torch.baddbmm(bias, q.flatten(0, 1), k.flatten(0, 1).transpose(-1, -2), alpha=q.size(-1) ** -0.5)
    # PyTorch's CPU softmax of bf16 scores sums in fp32 and rounds once: what an fp32 softmax cast to bf16 gives,
    # in one pass instead of three (its backward runs in bf16).
    return torch.softmax(scores.view(*q.shape[:-1], S), dim=-1) @ v


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (rotate-half style) on the first cos.shape[-1] dims of each head; the rest pass through.

    The rotated dims form two halves (x1, x2) turned by the angles in cos/sin, whose two halves are equal:
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), written as x cos + (-x2, x1) sin over all of them at once
    (the same numbers in fewer operations). Computed in x's dtype: under bf16 autocast, fp32 cos/sin would promote
    q and k to fp32."""
    n = cos.shape[-1]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    # The rotated dims copied out first: as a view of q or k they are short strided rows, on which the multiplies
    # and adds below (forward and backward) run slower than the copy costs.
    x_rot, x_pass = x[..., :n].contiguous(), x[..., n:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    return torch.cat((x_rot * cos + torch.cat((-x2, x1), dim=-1) * sin, x_pass), dim=-1)


class KVCache:
    """Keys and values of every layer, so that generation computes each position once; preallocated.

    It holds only K and V, whose shapes ([B, n_head, T, head_dim]) do not depend on the research switches:
    the pre-projection changes what K and V are computed from, not their size.
    """

    def __init__(self, config: GPTConfig, batch: int, max_len: int, device, dtype: torch.dtype):
        shape = (config.n_layer, batch, config.n_head, max_len, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.pos = 0  # number of positions already written

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


# ====================================================================================================================
# LoRA, the baseline of the paper's comparison: attached after the model is built, not part of the architecture.
# It keeps the base layers' names (blocks.N.attn.qkv.weight, ...) and adds lora_a and lora_b beside them.
# ====================================================================================================================

def attach_lora(model: GPT) -> None:
    """Replace every block's fused QKV and attention output projections by LoRA layers around the same weights."""
    c = model.config
    for block in model.blocks:
        for name in ("qkv", "proj"):
            base = getattr(block.attn, name)
            setattr(block.attn, name, LoRALinear(base, c.lora_rank, c.lora_alpha))


class LoRALinear(nn.Linear):
    """y = W x + b + (alpha / r) · B A x: a Linear layer (sharing the weight and bias of `base`) plus a low-rank
    update whose B starts at zero, so that the model starts exactly at the base."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        # on the meta device nn.Linear allocates and draws nothing: its weight and bias are base's
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
        self.weight, self.bias = base.weight, base.bias
        self.rank, self.scaling = rank, alpha / rank
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, device=base.weight.device))
        self.lora_b = nn.Parameter(torch.empty(base.out_features, rank, device=base.weight.device))
        self.reset_lora()

    @torch.no_grad()
    def reset_lora(self) -> None:
        """peft's initialisation: A Kaiming-uniform, B zero, so the update starts at exactly zero."""
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b)

    def merged_weight(self) -> torch.Tensor:
        """W + (alpha / r) · B A, summed in fp32: a plain Linear with this weight computes what this layer does."""
        return (self.weight.float() + self.scaling * (self.lora_b.float() @ self.lora_a.float())).to(self.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scaling
