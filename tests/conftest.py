"""Shared fixtures: tiny random Pythia-shaped Hugging Face checkpoints, the offline data mirror, and a test's two
processes, ended as train.py ends those that torchrun starts."""

import json
import os
import sys
from functools import partial
from typing import Callable

import pytest
import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lab.cli import exit_without_interpreter_shutdown  # noqa: E402  (the project root is on the path from here)


def make_hf_model(rotary_pct: float = 0.25, parallel: bool = True, vocab: int = 512, d: int = 64,
                  n_layer: int = 2, n_head: int = 4, max_pos: int = 128, seed: int = 0):
    """A transformers GPTNeoXForCausalLM with every weight random (biases and norms included), eager attention."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(vocab_size=vocab, hidden_size=d, num_hidden_layers=n_layer, num_attention_heads=n_head,
                        intermediate_size=4 * d, rotary_pct=rotary_pct, use_parallel_residual=parallel,
                        max_position_embeddings=max_pos, attn_implementation="eager")
    torch.manual_seed(seed)
    model = GPTNeoXForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name or "layer_norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith("weight") else 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.05)
    return model


def hub_names(state: dict) -> dict:
    """transformers 5 calls the output layer `lm_head` in memory; the Hub's files call it `embed_out`."""
    return {("embed_out.weight" if k == "lm_head.weight" else k): v for k, v in state.items()}


def save_old_style(model, folder) -> str:
    """Write a checkpoint as older Pythia revisions ship it: pytorch_model.bin with the attention buffers and a
    config.json in the old `rotary_pct` / `rotary_emb_base` style (transformers 5 only writes safetensors)."""
    os.makedirs(folder, exist_ok=True)
    c = model.config
    state = hub_names(model.state_dict())
    for i in range(c.num_hidden_layers):  # the buffers old checkpoints carry, which loaders must ignore
        state[f"gpt_neox.layers.{i}.attention.bias"] = torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()
        state[f"gpt_neox.layers.{i}.attention.masked_bias"] = torch.tensor(-1e9)
        state[f"gpt_neox.layers.{i}.attention.rotary_emb.inv_freq"] = torch.ones(4)
    torch.save(state, os.path.join(folder, "pytorch_model.bin"))
    old = {"model_type": "gpt_neox", "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
           "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
           "intermediate_size": c.intermediate_size, "hidden_act": "gelu",
           "rotary_pct": c.rope_parameters["partial_rotary_factor"], "rotary_emb_base": 10000,
           "max_position_embeddings": c.max_position_embeddings, "layer_norm_eps": 1e-5,
           "use_parallel_residual": c.use_parallel_residual, "tie_word_embeddings": False}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(old, f)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory):
    """A tiny random Pythia-shaped checkpoint in the Hub's file format (config.json + model.safetensors)."""
    folder = tmp_path_factory.mktemp("tiny_pythia")
    model = make_hf_model()
    model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def pythia_vocab_dir(tmp_path_factory):
    """A tiny random checkpoint with Pythia's vocabulary and no tokenizer.json: it loads with Pythia's tokenizer
    from the mirror, which fits it (a folder whose vocabulary is smaller than the tokenizer's is refused)."""
    folder = tmp_path_factory.mktemp("tiny_pythia_vocab")
    make_hf_model(vocab=50304, d=64, max_pos=64).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def mirror():
    """The offline data mirror (PREPROJ_MIRROR); tests that read real data need it and skip without it.
    CI never skips them: .ci/run stops when the mirror is missing."""
    path = os.environ.get("PREPROJ_MIRROR")
    if not path or not os.path.isdir(path):
        pytest.skip("needs the offline data mirror: set PREPROJ_MIRROR (see README, 'Data')")
    return path


# --- training helpers shared by the test files ---

# fp32 so that exactness tests are exact (tests/test_precision.py covers bf16); the CPU on any machine, a GPU's
# own tests asking for cuda by name (tests/test_gpu_path.py)
MICRO = ("--n_layer 2 --n_head 2 --n_embd 32 --block_size 32 --batch_size 8 --eval_tasks none --eval_tokens 2048 "
         "--dtype float32 --device cpu")


def run(argv: str) -> tuple:
    """train.py in-process, from a command line: returns (model, final metrics)."""
    from train import get_args, train
    return train(get_args(argv.split()))


def losses(folder) -> list[float]:
    return [json.loads(line)["loss"] for line in open(os.path.join(folder, "metrics.jsonl"))]


@pytest.fixture(scope="session")
def micro_base(tmp_path_factory, mirror):
    """A micro GPT-NeoX pre-trained from scratch on the corpus by train.py itself."""
    out = tmp_path_factory.mktemp("base")
    run(f"--init_from scratch {MICRO} --max_iters 30 --lr 1e-2 --warmup_iters 3 --out_dir {out}")
    return str(out)


@pytest.fixture
def wikitext103_archive(tmp_path, mirror, monkeypatch) -> str:
    """The paper's probe text served from a local archive in place of the download (WikiText-2's validation lines
    standing in for WikiText-103 train), with a data cache of the test's own; returns that raw text."""
    import hashlib
    import io
    import zipfile

    import data.prepare
    import data.sources
    raw = open(os.path.join(mirror, "wikitext", "wiki.valid.raw"), encoding="utf-8").read()
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("wikitext-103-raw/wiki.train.raw", raw)
    monkeypatch.setattr(data.sources, "CACHE", tmp_path / "cache")
    monkeypatch.setattr(data.sources, "download", lambda url: archive.getvalue())
    # the stand-in is pinned by its own digest, so that the check on the real archive's digest runs as it is
    monkeypatch.setattr(data.prepare, "WIKITEXT103_SHA256", hashlib.sha256(archive.getvalue()).hexdigest())
    return raw


def spawn_two_ranks(fn: Callable, *args) -> None:
    """fn(rank, *args) in two processes, each ended as train.py ends a process that torchrun started: without the
    interpreter's shutdown, where a gloo worker thread that DDP keeps alive can abort it (docs/reliability.md,
    "Several processes")."""
    mp.spawn(rank_without_shutdown, args=(fn, *args), nprocs=2)


def rank_without_shutdown(rank: int, fn: Callable, *args) -> None:
    exit_without_interpreter_shutdown(partial(fn, rank, *args))
