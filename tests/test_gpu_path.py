"""The GPU path, checked where there is no GPU: the memory estimate (the real code on the meta device, equal to what
autograd saves on the CPU), the dry run end to end on a tiny Pythia-shaped folder, DDP around the objective
with compiled blocks; and tests marked for CUDA, which tools/gpu_check.sh runs on a machine that has one."""

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train
from conftest import make_hf_model
from lab.loss import TrainingObjective, training_loss
from lab.memory import meta_model, saved_bytes, step_memory
from model import GPT, GPTConfig

PYTHIA_410M = GPTConfig(vocab_size=50304, n_layer=24, n_head=16, n_embd=1024, block_size=2048)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (tools/gpu_check.sh runs these)")


# --- the memory estimate ---

@pytest.mark.parametrize("switches", [dict(preproj=True, skip=True), dict(lora_rank=4), dict()])
def test_the_meta_count_equals_what_autograd_saves_on_the_cpu(switches):
    """In fp32 the CPU's fused attention keeps what CUDA's flash kernel keeps (q, k, v, output, log-sum-exp), so the
    count on the meta device must equal, byte for byte, the saved tensors of a real forward pass."""
    config = GPTConfig(vocab_size=512, n_layer=2, n_head=4, n_embd=64, block_size=128, **switches)
    torch.manual_seed(0)
    model = GPT(config)
    probe = bool(switches)
    if probe:
        model.freeze_base()
    params, saved = {id(p) for p in model.parameters()}, {}

    def pack(t):
        if id(t) not in params:
            saved[id(t)] = t
        return t

    x = torch.randint(0, 512, (4, 128))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        training_loss(model, x, x)
    measured = sum(t.numel() * t.element_size() for t in saved.values())
    assert saved_bytes(meta_model(config, probe), 4, 128) == measured > 0


def test_the_papers_410m_step_fits_a_16_gb_card():
    """--paper at pythia-410m (16 x 512, pre-proj + skip, bf16 throughout): under 14 GB in all, and the parts as
    the review behind issue 21 put them (about 6.3 GB of activations)."""
    est = step_memory(GPTConfig(**{**PYTHIA_410M.to_dict(), "preproj": True, "skip": True}), 16, 512, probe=True,
                      pure_bf16=True)
    assert est["total"] < 14e9 and 5.5e9 < est["activations"] < 7e9
    assert est["weights"] == 2 * (405_334_016 + 88_080_384)  # every weight in bf16
    assert est["optimizer"] == 2 * est["gradients"] == 2 * 2 * 88_080_384  # bf16 AdamW moments, no fp32 master
    fp32_masters = step_memory(GPTConfig(**{**PYTHIA_410M.to_dict(), "preproj": True, "skip": True}), 16, 512,
                               probe=True, pure_bf16=False)
    assert fp32_masters["optimizer"] == 2 * 4 * 88_080_384


# --- the dry run, end to end on the CPU ---

def test_the_dry_run_checks_a_paper_run_and_writes_nothing(tmp_path, mirror, wikitext103_archive, capsys):
    base = tmp_path / "pythia-tiny"
    make_hf_model(vocab=50304, d=64, max_pos=64).save_pretrained(base)
    shutil.copy(f"{mirror}/tokenizers/20B_tokenizer.json", base / "tokenizer.json")
    out = tmp_path / "run"
    args = train.get_args(["--init_from", str(base), "--paper", "--preproj", "--skip", "--device", "cpu",
                           "--batch_size", "4", "--seq_len", "64", "--eval_tokens", "256", "--eval_tasks", "lambada",
                           "--out_dir", str(out), "--dry_run", "--mirror", mirror])
    report = train.dry_run(args)
    printed = capsys.readouterr().out
    assert not out.exists() and f"dry run of {out}: nothing was written" in printed
    assert report["device"] == "cpu" and report["torch"] == torch.__version__ and report["data"] == "wikitext103"
    # the probe text it trains on and the one task it scores, each with its sha256 (the archive's: its pin, checked)
    assert list(report["files"]) == ["wikitext-103-raw-v1.zip", "lambada/lambada_test.jsonl"]
    assert report["files"]["wikitext-103-raw-v1.zip"] == hashlib.sha256(
        (tmp_path / "cache/downloads/archives/wikitext-103-raw-v1.zip").read_bytes()).hexdigest()
    assert report["files"]["lambada/lambada_test.jsonl"].startswith("4aa8d02c")
    assert report["memory_estimate_gb"]["total"] > 0 and report["step_seconds"] > 0 and report["peak_memory_gb"] > 0
    assert report["projected_minutes"] > 0 and report["attention_kernel"].startswith("cpu: ")
    assert set(report["lambada"]) == {"lm-eval", "paper"} and "ppl" in report["lambada"]["lm-eval"]
    assert torch.isfinite(torch.tensor(report["step_loss"]))
    (out / "ckpt.pt").parent.mkdir()
    (out / "ckpt.pt").write_bytes(b"a run")  # a folder the real run would refuse: so does the dry run
    with pytest.raises(SystemExit):
        train.dry_run(args)


# --- DDP and torch.compile ---

def test_ddp_wraps_the_objective_whose_blocks_are_compiled(monkeypatch):
    """--compile compiles each block for the training objective (regional compilation) and DDP wraps that
    objective; the model's own blocks are left as they were."""
    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", lambda m: ("ddp", m))
    monkeypatch.setattr(torch, "compile", lambda m: ("compiled", m))
    model = GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=16, block_size=16))
    blocks = list(model.blocks)
    wrapped = train.objective(model, train.Settings(compile=True), world=2)
    assert wrapped[0] == "ddp" and isinstance(wrapped[1], TrainingObjective)
    assert wrapped[1].compiled_blocks == [("compiled", block) for block in blocks] and list(model.blocks) == blocks
    assert train.objective(model, train.Settings(compile=False), world=1).compiled_blocks is None


def test_compiled_blocks_run_for_the_training_loss_only(monkeypatch):
    """The objective runs its compiled blocks in the model's blocks' place; the model called directly (evaluation,
    generation) and training_loss without them run the model's own blocks."""
    ran = []

    def compile_stand_in(block):
        def compiled(*args):
            ran.append(block)
            return block(*args)
        return compiled
    monkeypatch.setattr(torch, "compile", compile_stand_in)
    model = GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=16, block_size=16))
    x = torch.randint(0, 64, (2, 16))
    loss = TrainingObjective(model, compile_blocks=True)(x, x)
    assert ran == list(model.blocks) and torch.allclose(loss, training_loss(model, x, x))
    ran.clear()
    model(x, x)
    training_loss(model, x, x)
    assert ran == []


# --- on a CUDA GPU (skipped here, run by tools/gpu_check.sh) ---

@CUDA
def test_cuda_bf16_step_matches_the_cpu_fp32_step():
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=512, n_layer=2, n_head=4, n_embd=64, block_size=128, preproj=True, skip=True)
    cpu = GPT(config)
    cuda = GPT(config).cuda()
    cuda.load_state_dict(cpu.state_dict())
    x = torch.randint(0, 512, (4, 128))
    ref = training_loss(cpu, x, x)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = training_loss(cuda, x.cuda(), x.cuda())
    assert abs(got.item() - ref.item()) < 0.02


@pytest.fixture
def cudnn_attention_restored():
    """The process-wide choice of attention kernels as it was before the test."""
    enabled = torch.backends.cuda.cudnn_sdp_enabled()
    yield
    torch.backends.cuda.enable_cudnn_sdp(enabled)


@CUDA
@pytest.mark.parametrize("training", [True, False])
def test_flash_attention_serves_pythias_shape_in_bf16(training, cudnn_attention_restored):
    """What the entry points run on a GPU: with cuDNN's kernel left out (lab.precision.prefer_flash_attention),
    flash attention takes pythia-160m's bf16 attention in a training step and in evaluation, never the scores written
    out; and the dry run names it."""
    from lab.ops import sdpa_kernel_name
    from lab.precision import prefer_flash_attention
    prefer_flash_attention()
    q = torch.randn(4, 12, 512, 64, device="cuda", dtype=torch.bfloat16, requires_grad=training)
    assert sdpa_kernel_name(q) == "flash_attention"
    config = GPTConfig(vocab_size=50304, n_layer=12, n_head=12, n_embd=768)
    assert train.attention_kernel(config, train.Settings(dtype="bfloat16", seq_len=512), "cuda") == \
        "cuda: flash_attention"


ENTRY_POINTS = ["train", "eval_lambada", "sample", "analyze_layers", "tools.harness", "tools.bench"]


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_every_entry_point_leaves_cudnns_attention_out_first(name, monkeypatch, cudnn_attention_restored):
    """Each entry point turns cuDNN's attention off before anything else, so that --help, a bad flag and a real run
    all leave the process alike (on the CPU the switch is there, unused)."""
    import importlib
    main = importlib.import_module(name).main
    torch.backends.cuda.enable_cudnn_sdp(True)
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    with pytest.raises(SystemExit):
        main() if name == "train" else main(["--help"])
    assert not torch.backends.cuda.cudnn_sdp_enabled()


def test_the_attention_kernel_is_read_off_the_operators_it_runs():
    """The dry run names the kernel scaled_dot_product_attention dispatches to, as the dispatcher sees it: on the
    CPU its fused kernel; with only the math backend allowed, math (the scores written out by batched products)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from lab.ops import OpRecorder, sdpa_kernel_name
    q = torch.randn(2, 3, 16, 8, requires_grad=True)
    assert sdpa_kernel_name(q) == "flash_attention_for_cpu"
    with sdpa_kernel(SDPBackend.MATH):
        assert sdpa_kernel_name(q) == "math"
        with OpRecorder() as ops:
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert [op for op, _ in ops.calls].count(torch.ops.aten.bmm) == 2  # the scores, then their product with v


# --- tools/gpu_check.sh: what can be checked of it without a GPU ---

def test_the_gpu_check_stops_at_once_without_a_python_that_has_torch(tmp_path):
    """A machine whose `python` lacks torch (a bare image with python3 beside the environment's) gets one line that
    says what to do and exit status 2, before any step runs."""
    from conftest import ROOT
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text("#!/bin/sh\necho \"No module named 'torch'\" >&2\nexit 1\n")
    (bin_dir / "python").chmod(0o755)
    out = tmp_path / "check"
    done = subprocess.run(["bash", str(Path(ROOT) / "tools" / "gpu_check.sh"), str(out)], capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"})
    assert done.returncode == 2
    assert done.stdout.strip().splitlines() == ["error: 'python' cannot import torch; activate the environment "
                                                "that has it, or put its python first on PATH"]
    assert (out / "report.txt").read_text() == done.stdout  # the report holds it too


def test_the_gpu_check_script_parses_and_its_random_pythia_loads(tmp_path, mirror):
    from conftest import ROOT
    from lab.checkpoint import load_model
    script = (Path(ROOT) / "tools" / "gpu_check.sh").read_text()
    assert subprocess.run(["bash", "-n", str(Path(ROOT) / "tools" / "gpu_check.sh")]).returncode == 0
    maker = re.search(r"<<'EOF'\n(.*?)\nEOF", script, re.S).group(1)  # the random-weights folder, tiny here
    subprocess.run([sys.executable, "-c", maker, str(tmp_path / "rand"), "2", "2", "64"], cwd=ROOT, check=True,
                   env={**os.environ, "PREPROJ_MIRROR": mirror})
    model, tok, _ = load_model(str(tmp_path / "rand"))
    assert model.config.n_layer == 2 and model.config.vocab_size == 50304 and tok.get_vocab_size() > 50000
    for flag in ("--dry_run", "--paper", "--device cuda", "--max_iters 100"):
        assert flag in script
