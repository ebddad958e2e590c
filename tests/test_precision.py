"""bf16 compute: how `--dtype auto` chooses, how weights are held, the paper's precision, and what bf16 changes."""

import copy
import json
import math
from argparse import Namespace

import pytest
import torch

from conftest import MICRO, make_hf_model, run
from lab import precision
from lab.checkpoint import load_model, read_checkpoint
from model import GPT, GPTConfig

BF16_MICRO = MICRO.replace("--dtype float32", "--dtype bfloat16")


def test_auto_picks_bf16_only_with_native_support(monkeypatch):
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: True)
    assert precision.resolve_dtype("auto", "cpu") == torch.bfloat16
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: False)
    assert precision.resolve_dtype("auto", "cpu") == torch.float32
    assert precision.resolve_dtype("bfloat16", "cpu") == torch.bfloat16  # forcing works either way


def test_cpu_without_bf16_trains_in_fp32(micro_base, tmp_path, monkeypatch, capsys):
    """The path a CPU without bf16 units takes: auto means fp32, recorded and printed, every weight in fp32."""
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: False)
    flags = MICRO.replace("--dtype float32", "--dtype auto")
    model, _ = run(f"--init_from {micro_base} --skip {flags} --max_iters 2 --out_dir {tmp_path / 'p'}")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert read_checkpoint(tmp_path / "p")["train_args"]["dtype"] == "float32"
    assert capsys.readouterr().out.startswith("float32 compute on cpu")


def test_bf16_probe_holds_the_frozen_base_in_bf16_once(micro_base, tmp_path, capsys):
    base, _, _ = load_model(micro_base)
    model, results = run(f"--init_from {micro_base} --preproj --skip {BF16_MICRO} --max_iters 3 "
                         f"--out_dir {tmp_path / 'p'}")
    assert capsys.readouterr().out.startswith("bfloat16 compute on cpu")
    held = model.base_state_dict()
    for name, t in base.base_state_dict().items():  # the matrices in bf16, exactly the fp32 weights rounded
        is_matrix = name.endswith(("qkv.weight", "qkv.bias", "proj.weight", "proj.bias", "fc.weight", "fc.bias",
                                   "lm_head.weight"))
        assert held[name].dtype == (torch.bfloat16 if is_matrix else torch.float32), name
        assert torch.equal(held[name], t.to(held[name].dtype)), name
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}  # fp32 masters
    assert read_checkpoint(tmp_path / "p")["train_args"]["dtype"] == "bfloat16"
    assert json.loads((tmp_path / "p" / "config.json").read_text())["dtype"] == "bfloat16"
    eval_json = json.loads((tmp_path / "p" / "eval.json").read_text())
    assert eval_json["benchmarks"]["settings"]["dtype"] == "bfloat16"
    assert all(math.isfinite(v) for v in results["val_loss"]["trained"].values())


def test_held_weights_give_exactly_what_autocast_gives():
    """Holding frozen matrices in bf16 saves autocast's cast at every step; the numbers must be the same."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64, preproj=True, skip=True)
    fp32 = GPT(cfg)
    fp32.freeze_base()
    held = copy.deepcopy(fp32)
    precision.hold_matrices_in(held, torch.bfloat16)
    x, y = torch.randint(0, 256, (2, 32)), torch.randint(0, 256, (2, 32))
    grads = []
    for m in (fp32, held):
        with precision.autocast("cpu", torch.bfloat16):
            _, loss = m(x, y)
            logits, _ = m(x)
        loss.backward()
        grads.append((loss.detach(), logits, [p.grad for p in m.parameters() if p.requires_grad]))
    (l0, z0, g0), (l1, z1, g1) = grads
    assert torch.equal(l0, l1) and torch.equal(z0, z1)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))


def test_paper_precision_holds_tensors_where_the_author_does(micro_base, tmp_path):
    model, _ = run(f"--init_from {micro_base} --preproj --skip --lora_rank 4 {MICRO} --max_iters 2 --pure_bf16 "
                   f"--out_dir {tmp_path / 'p'}")
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert {dtypes[n] for n in dtypes if n.endswith(("lora_a", "lora_b"))} == {torch.float32}  # as peft
    assert {dtypes[n] for n in dtypes if not n.endswith(("lora_a", "lora_b"))} == {torch.bfloat16}
    ckpt = read_checkpoint(tmp_path / "p")
    assert ckpt["train_args"]["dtype"] == "bfloat16"
    state = ckpt["optimizer"]["state"]  # AdamW's moments live where their weights do: no fp32 copy
    assert {s["exp_avg"].dtype for s in state.values()} == {torch.bfloat16, torch.float32}


def test_paper_precision_loses_updates_below_half_a_bf16_step():
    """One AdamW step at lr 1e-5 moves every weight by about 1e-5 (Adam's first step is lr * sign(g)). A bf16
    weight w in [2^e, 2^(e+1)) has a step (ulp) of 2^(e-7); an update below half of it rounds back to w. So under
    the paper's precision only weights with |w| < 2^-8 can move (half-ulp 2^-17 ... 7.6e-6 < 1e-5): about 30% of
    W_up ~ N(0, 0.01), and all of W_skip ~ N(0, 1e-4). With fp32 master weights every entry moves."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64, preproj=True, skip=True)
    ours = GPT(cfg)
    ours.freeze_base()
    paper = copy.deepcopy(ours)
    precision.hold_as_paper(paper)
    x, y = torch.randint(0, 256, (4, 32)), torch.randint(0, 256, (4, 32))
    from train import make_optimizer
    moved = {}
    for name, m in (("ours", ours), ("paper", paper)):
        before = {n: p.detach().clone() for n, p in m.named_parameters() if p.requires_grad}
        opt = make_optimizer(m, Namespace(lr=1e-5, weight_decay=0.0, beta2=0.999))
        with precision.autocast("cpu", torch.bfloat16):
            _, loss = m(x, y)
        loss.backward()
        opt.step()
        moved[name] = {n: (p.detach() != before[n]).float().mean().item() for n, p in m.named_parameters()
                       if p.requires_grad}
        if name == "paper":
            w_up = before["blocks.0.w_up.weight"].float()
            predicted = (w_up.abs() < 2.0 ** -8).float().mean().item()
    share = moved["paper"]["blocks.0.w_up.weight"]
    assert 0.25 < predicted < 0.36  # P(|N(0, 0.01)| < 2^-8) = 0.305
    assert abs(share - predicted) < 0.02, (share, predicted)
    assert moved["paper"]["blocks.0.w_skip.weight"] > 0.98
    assert min(moved["ours"].values()) > 0.98


def test_bf16_parity_with_transformers():
    """Our bf16 compute against transformers' own bf16 autocast on the same random Pythia-shaped weights.
    Tolerance: 0.05 of the logits' scale (bf16 keeps 8 significant bits: ~0.4% per rounding)."""
    import tempfile

    from load_pythia import load_pythia
    hf = make_hf_model()
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        ours = load_pythia(folder).eval()
    x = torch.randint(0, 512, (2, 48))
    with torch.no_grad():
        ref32 = hf(x).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref16 = hf(x).logits.float()
        with precision.for_inference(ours, "cpu", torch.bfloat16):
            mine, _ = ours(x)
    scale = ref32.abs().max().item()
    assert (mine.float() - ref16).abs().max().item() < 0.05 * scale
    assert (mine.float() - ref32).abs().max().item() < 0.05 * scale
    assert (mine.float() - ref32).abs().max().item() > 0  # it really ran in bf16


@pytest.mark.parametrize("whole_model", [False, True])
def test_bf16_lambada_against_fp32(micro_base, mirror, whole_model):
    """Per-document LAMBADA log-probs in bf16 against fp32 on the same model (first 100 passages)."""
    from lab.evaluation import lambada
    scores = {}
    for dtype in (torch.float32, torch.bfloat16):
        model, tok, _ = load_model(micro_base)
        with precision.for_inference(model, "cpu", dtype, whole_model=whole_model):
            scores[dtype] = lambada(model, tok, limit=100, mirror=mirror)["items"]
    diffs = [abs(a["logprob"] - b["logprob"]) for a, b in zip(scores[torch.float32], scores[torch.bfloat16])]
    assert 0 < sum(diffs) / len(diffs) < 0.1 and max(diffs) < 0.5


def test_auto_is_bf16_only_on_gpus_that_multiply_it_natively(monkeypatch):
    """Compute capability 8 or more on the device the run uses, not the current one: a V100 or T4 (7.x) only
    emulates bf16 (torch.cuda.is_bf16_supported() says yes), slower than fp32."""
    from lab import precision
    capability = {0: (8, 0), 1: (7, 5)}  # an A100 as cuda:0 (the current device), a T4 as cuda:1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: capability[d.index or 0])
    assert precision.resolve_dtype("auto", "cuda") == torch.bfloat16
    assert precision.resolve_dtype("auto", "cuda:0") == torch.bfloat16
    assert precision.resolve_dtype("auto", "cuda:1") == torch.float32
    assert precision.resolve_dtype("bfloat16", "cuda:1") == torch.bfloat16  # asked for: given
