"""Layer analysis and sampling: known values on hand-built models, the figures, bad inputs."""

import csv
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import analyze_layers
import sample
from model import GPT, GPTConfig
from train import get_args, train

STREAM = np.random.default_rng(0).integers(0, 64, 1025).astype(np.uint16)  # 32 windows of 32 tokens
SEQ, TOKENS = 32, 1024
MICRO = ("--init_from scratch --n_head 2 --n_embd 32 --block_size 32 --batch_size 8 --max_iters 3 "
         "--eval_tasks none --eval_tokens 512")
FAST = ["--tokens", "512", "--seq_len", "32", "--device", "cpu"]


def hand_built(**switches) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=16, **switches)).eval()


def measure(model: GPT) -> tuple[dict, list[float]]:
    shares, loss = analyze_layers.skip_shares(model, STREAM, SEQ, TOKENS)
    return shares, analyze_layers.causal_weights(model, STREAM, SEQ, TOKENS, loss)


def test_zeroed_skip_has_share_and_causal_weight_zero():
    model = hand_built(preproj=True, skip=True)
    with torch.no_grad():
        model.blocks[0].w_skip.weight.zero_()
        model.blocks[1].w_skip.weight.copy_(torch.eye(16))
    shares, causal = measure(model)
    assert shares["share_attn"][0] == shares["share_x"][0] == causal[0] == 0.0
    assert shares["share_attn"][1] > 0 and shares["share_x"][1] > 0 and causal[1] != 0.0


def test_share_matches_a_hand_computation():
    """With W_skip = I and no pre-projection, layer 0's skip output is LN(x) for x = the token embeddings."""
    model = hand_built(skip=True)
    with torch.no_grad():
        model.blocks[0].w_skip.weight.copy_(torch.eye(16))
        idx = torch.from_numpy(STREAM[:TOKENS].astype(np.int64)).view(-1, SEQ)
        x = model.wte(idx)
        x_hat = F.layer_norm(x, (16,), eps=model.config.layer_norm_eps)
        attn_out = model.blocks[0].attn(x_hat, *model.rotary(0, SEQ, x.dtype))
    shares, _ = analyze_layers.skip_shares(model, STREAM, SEQ, TOKENS)
    skip = x_hat.norm(dim=-1)
    assert shares["share_x"][0] == pytest.approx((skip / x.norm(dim=-1)).mean().item(), rel=1e-5)
    assert shares["share_attn"][0] == pytest.approx((skip / attn_out.norm(dim=-1)).mean().item(), rel=1e-5)


def test_scaled_skip_scales_norm_and_share():
    model = hand_built(preproj=True, skip=True)
    norms = analyze_layers.weight_norms(model)
    init = analyze_layers.expected_init_norms(model)
    for key in ("norm_skip", "norm_up", "norm_down"):  # a fresh model sits at the expected initial norm
        assert all(v == pytest.approx(init[key], rel=0.1) for v in norms[key]), key
    shares, _ = analyze_layers.skip_shares(model, STREAM, SEQ, TOKENS)
    with torch.no_grad():
        model.blocks[0].w_skip.weight.mul_(3.0)
    scaled, _ = analyze_layers.skip_shares(model, STREAM, SEQ, TOKENS)
    assert analyze_layers.weight_norms(model)["norm_skip"][0] == pytest.approx(3 * norms["norm_skip"][0], rel=1e-6)
    # layer 0's x and attn_out do not depend on its own W_skip, so its shares scale exactly
    for key in ("share_attn", "share_x"):
        assert scaled[key][0] == pytest.approx(3 * shares[key][0], rel=1e-5)


def test_the_hook_recipe_of_docs_layers_reads_and_patches_one_layers_skip():
    """docs/layers.md's recipe, run as written: read_skip gives W_skip x_tilde of that layer, and patching it to
    zero gives the logits of the model with that one W_skip zeroed."""
    text = (Path(analyze_layers.ROOT) / "docs" / "layers.md").read_text()
    recipe = re.search(r"## One layer's skip.*?```python\n(.*?)```", text, re.S).group(1)
    scope: dict = {}
    exec(recipe, scope)
    model = hand_built(preproj=True, skip=True)
    with torch.no_grad():
        model.blocks[1].w_skip.weight.normal_(0.0, 0.3)
    idx = torch.from_numpy(STREAM[:20].astype(np.int64))[None]
    x_tilde = []
    handle = model.blocks[1].attn.register_forward_hook(lambda m, args, out: x_tilde.append(args[0]))
    with torch.no_grad():
        logits = model(idx)[0]
    handle.remove()
    read = scope["read_skip"](model, 1, idx)
    assert torch.allclose(read, x_tilde[0] @ model.blocks[1].w_skip.weight.T, atol=1e-6)
    patched = scope["patched_logits"](model, 1, idx, torch.zeros_like)
    with torch.no_grad():
        model.blocks[1].w_skip.weight.zero_()
        assert torch.allclose(patched, model(idx)[0], atol=1e-6) and not torch.allclose(patched, logits, atol=1e-3)
    assert not model.blocks[1].w_skip._forward_hooks  # both hooks removed


def test_trend_is_last_quarter_over_the_rest():
    assert analyze_layers.trend([1, 1, 1, 1, 1, 1, 2, 2]) == pytest.approx(2.0)
    assert analyze_layers.trend([1.0] * 12) == pytest.approx(1.0)


def test_the_papers_statistic_is_last_layer_over_first():
    assert analyze_layers.last_over_first([2, 9, 9, 9, 9, 3]) == pytest.approx(1.5)
    lines = analyze_layers.trend_lines(analyze_layers.paper_series()[0]).splitlines()
    assert lines[0] == "trend paper, Pythia-160M, last quarter / first three quarters of layers (ours): |W_skip| 1.88x"
    assert lines[1] == "trend paper, Pythia-160M, last layer / first layer (the paper's statistic): |W_skip| 2.28x"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, mirror):
    """Micro models trained by train.py: two seeds of one run, a deeper one, pre-projection only, no switches."""
    root = tmp_path_factory.mktemp("runs")
    shapes = {"seed1": "--n_layer 2 --preproj --skip --seed 1", "seed2": "--n_layer 2 --preproj --skip --seed 2",
              "deep": "--n_layer 3 --preproj --skip", "preproj": "--n_layer 2 --preproj", "plain": "--n_layer 2"}
    for name, flags in shapes.items():
        train(get_args(f"{MICRO} {flags} --out_dir {root / name}".split()))
    return {name: str(root / name) for name in shapes}


def assert_pngs(paths):
    for p in paths:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, p


def read_csv(path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def test_figures_for_one_checkpoint_with_the_paper(runs, tmp_path, capsys):
    analyze_layers.main(["--ckpt", f"{runs['seed1']}/ckpt.pt", "--paper", "--out", str(tmp_path), *FAST])
    out = capsys.readouterr().out
    assert "trend seed1, last quarter" in out and "trend seed1, last layer / first layer (the paper's" in out
    assert "trend paper, Pythia-410M, last layer / first layer (the paper's statistic): |W_skip| 1.40x" in out
    assert "x is depth fraction" in out  # the paper's 12 and 24 layers against our 2
    # a model pre-trained here from scratch: its own domain is the held-out book
    assert "tokens of a held-out book (`val_books`, the embedded base's pre-training domain)" in out
    assert_pngs([tmp_path / "layers.png"] + [tmp_path / f"layers_{k}.png" for k in analyze_layers.MEASURES])
    rows = read_csv(tmp_path / "layers.csv")
    assert [r["layer"] for r in rows] == ["0", "1"] and all(r["causal"] and r["share_x"] for r in rows)
    assert {r["heldout_text"] for r in rows} == {"val_books"}


def test_heldout_text_is_the_runs_own_domain(runs, tmp_path, capsys, mirror):
    from data.prepare import NANO_DATA
    from load_pythia import load_tokenizer
    nano = load_tokenizer(str(NANO_DATA / "tokenizer.json"))
    pythia = load_tokenizer(f"{mirror}/tokenizers/20B_tokenizer.json")
    assert analyze_layers.heldout_of({"init_from": "scratch", "data": "auto"}, nano) == "val_books"
    assert analyze_layers.heldout_of({"init_from": "nano", "data": "auto"}, nano) == "val"
    assert analyze_layers.heldout_of({"init_from": "pythia-160m", "data": "auto"}, pythia) == "wikitext"
    assert analyze_layers.heldout_of({"init_from": "pythia-160m", "data": "corpus"}, pythia) == "val"
    assert analyze_layers.heldout_of(None, pythia) == "val"
    # a run whose probe read WikiText is measured on WikiText validation
    run = tmp_path / "wikitext-run"
    shutil.copytree(runs["seed1"], run)
    ckpt = torch.load(run / "ckpt.pt", weights_only=True)
    ckpt["train_args"].update(init_from="nano", data="wikitext103")
    torch.save(ckpt, run / "ckpt.pt")
    analyze_layers.main(["--ckpt", str(run), "--out", str(tmp_path / "out"), *FAST])
    assert "tokens of WikiText-103 validation lines (the paper's probe domain)" in capsys.readouterr().out
    assert {r["heldout_text"] for r in read_csv(tmp_path / "out" / "layers.csv")} == {"wikitext"}


def test_figures_for_seeds_and_depths(runs, tmp_path, capsys):
    analyze_layers.main(["--ckpt", runs["seed1"], runs["seed2"], runs["deep"], "--out", str(tmp_path), *FAST])
    out = capsys.readouterr().out
    assert "x is depth fraction" in out and "models have 2, 3 layers" in out
    assert "mean of 2 seeds" in out  # the two seeds are one series; the deeper model is another
    assert_pngs(list(tmp_path.glob("layers*.png")))
    rows = read_csv(tmp_path / "layers.csv")
    assert len(rows) == 2 + 2 + 3
    assert [r["depth_fraction"] for r in rows[-3:]] == ["0.0000", "0.5000", "1.0000"]


def test_checkpoint_without_skip_shows_the_norms_that_apply(runs, tmp_path, capsys):
    analyze_layers.main(["--ckpt", runs["preproj"], "--out", str(tmp_path), *FAST])
    assert "preproj has no content skip" in capsys.readouterr().out
    rows = read_csv(tmp_path / "layers.csv")
    assert all(r["norm_up"] and r["norm_down"] and not r["norm_skip"] and not r["causal"] for r in rows)
    assert_pngs([tmp_path / "layers.png", tmp_path / "layers_norm_up.png"])
    assert not (tmp_path / "layers_causal.png").exists()


def test_bad_inputs(runs, tmp_path):
    with pytest.raises(SystemExit, match="error: .*nothing to measure"):
        analyze_layers.main(["--ckpt", runs["plain"], "--out", str(tmp_path), *FAST])
    with pytest.raises(SystemExit, match=r"error: .*missing/ckpt.pt does not exist"):
        analyze_layers.main(["--ckpt", str(tmp_path / "missing" / "ckpt.pt"), *FAST])
    with pytest.raises(SystemExit, match="error: .*nowhere does not exist"):
        analyze_layers.main(["--ckpt", str(tmp_path / "nowhere"), *FAST])
    with pytest.raises(SystemExit, match="error: .*not a checkpoint of this project"):
        (tmp_path / "foreign").mkdir()
        (tmp_path / "foreign" / "config.json").write_text('{"kind": "full"}')
        torch.save({"weights": {}}, tmp_path / "foreign" / "ckpt.pt")
        analyze_layers.main(["--ckpt", str(tmp_path / "foreign"), *FAST])
    assert not list(tmp_path.glob("layers*"))


def test_sample_is_seeded_and_greedy_is_deterministic(runs, capsys):
    common = ["--init_from", runs["seed1"], "--prompt", "The", "--max_new_tokens", "10", "--device", "cpu"]
    a = sample.main(common + ["--num_samples", "2", "--seed", "3"])
    assert sample.main(common + ["--num_samples", "2", "--seed", "3"]) == a
    assert all(t.startswith("The") and len(t) > 3 for t in a)
    greedy = sample.main(common + ["--num_samples", "2", "--temperature", "0"])
    assert greedy[0] == greedy[1]
    assert "--- sample 2 of 2" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="error: .*exceeds block_size=32"):
        sample.main(common + ["--max_new_tokens", "40"])
