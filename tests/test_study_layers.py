"""The experiment's layer analysis (study/layers.py): each ablation against the model with that term removed by
hand, the growth against the run's own initial weights, the statistics over seeds against their definitions."""

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

from conftest import MICRO, run
from data.prepare import split_tokens
from lab.checkpoint import load_model
from lab.evaluation import val_loss
from lab.stats import paired_t
from study import design, layers

TOKENS, SEQ = 512, 32


def probe(micro_base: str, folder: Path, flags: str, lr: str = "3e-3") -> Path:
    run(f"--init_from {micro_base} {flags} {MICRO} --max_iters 4 --warmup_iters 1 --lr {lr} --min_lr {lr} "
        f"--eval_tokens 64 --out_dir {folder}")
    return folder


def heldout_loss(model, stream) -> float:
    return val_loss(model, stream, SEQ, TOKENS)


class Constant(nn.Module):
    """A layer's term replaced by one vector at every position."""

    def __init__(self, value: torch.Tensor):
        super().__init__()
        self.value = value

    def forward(self, x):
        return self.value.expand(*x.shape[:-1], -1)


def skip_input_mean(model, layer: int, stream) -> torch.Tensor:
    """The mean over the held-out positions of what W_skip reads in one layer (x̃)."""
    seen = []
    handle = model.blocks[layer].w_skip.register_forward_pre_hook(lambda m, args: seen.append(args[0].flatten(0, -2)))
    heldout_loss(model, stream)
    handle.remove()
    return torch.cat(seen).double().mean(0).float()


# what removing a term from one layer means, written against the weights rather than with hooks
REMOVED = {"skip": lambda b: b.w_skip.weight.zero_(), "preproj": lambda b: b.w_down.weight.zero_(),
           "side_mlp": lambda b: b.w_a_down.weight.zero_(),
           "lora": lambda b: (b.attn.qkv.lora_b.zero_(), b.attn.proj.lora_b.zero_())}


@pytest.mark.parametrize("flags, terms", [("--preproj --skip", ["skip", "preproj"]),
                                          ("--skip --adapter_dim 16", ["skip", "side_mlp"]),
                                          ("--lora_rank 4", ["lora"])])
def test_each_ablation_equals_the_model_with_that_layers_term_removed(micro_base, tmp_path, mirror, flags, terms):
    folder = probe(micro_base, tmp_path / "run", flags)
    record = layers.measure_run(folder, TOKENS, SEQ, dtype="float32", mirror=mirror)
    assert list(record["terms"]) == terms and record["tokens"] == TOKENS and record["step"] == 4
    model, tok, _ = load_model(str(folder))
    stream = split_tokens("sotu_test", tok, mirror)
    intact = heldout_loss(model, stream)
    assert record["loss"] == pytest.approx(intact, abs=1e-6)
    for term in terms:
        for i in range(model.config.n_layer):
            cut = copy.deepcopy(model)
            with torch.no_grad():
                REMOVED[term](cut.blocks[i])
            assert record["terms"][term]["zero"][i] == pytest.approx(heldout_loss(cut, stream) - intact, abs=1e-5)
    if "skip" in terms:  # mean-ablation: W_skip's output replaced by W_skip times the mean of what it reads
        for i in range(model.config.n_layer):
            cut = copy.deepcopy(model)
            with torch.no_grad():
                cut.blocks[i].w_skip = Constant(model.blocks[i].w_skip(skip_input_mean(model, i, stream)))
            assert record["terms"]["skip"]["mean"][i] == pytest.approx(heldout_loss(cut, stream) - intact, abs=1e-5)
    assert any(abs(v) > 1e-4 for t in terms for v in record["terms"][t]["zero"])  # the probe learned something


def test_growth_is_measured_from_the_runs_own_initial_weights(micro_base, tmp_path, mirror):
    """A run whose weights never moved (lr 1e-30) has growth 0; a trained run's growth is its distance from that
    run's weights, which share its seed: so the initial weights are drawn again exactly."""
    flags = "--preproj --skip --lora_rank 2"
    # measured in bf16 as the experiment is: the growth must come from the saved weights, not bf16 copies of them
    still = layers.measure_run(probe(micro_base, tmp_path / "still", flags, "1e-30"), TOKENS, SEQ, dtype="bfloat16",
                               mirror=mirror)
    moved = layers.measure_run(probe(micro_base, tmp_path / "moved", flags), TOKENS, SEQ, dtype="float32",
                               mirror=mirror)
    start, end = (load_model(str(tmp_path / k))[0] for k in ("still", "moved"))
    for term, matrices in (("skip", ["w_skip"]), ("preproj", ["w_up", "w_down"]), ("lora", ["qkv", "proj"])):
        for name in matrices:
            assert still["terms"][term]["matrices"][name]["growth"] == [0.0, 0.0]
            for i, block in enumerate(end.blocks):
                w, w0 = (layers.TERMS[term][1](b)[name].detach() for b in (block, start.blocks[i]))
                assert moved["terms"][term]["matrices"][name]["growth"][i] == pytest.approx((w - w0).norm().item(),
                                                                                           rel=1e-5)
                assert moved["terms"][term]["matrices"][name]["norm"][i] == pytest.approx(w.norm().item(), rel=1e-6)
    assert min(moved["terms"]["skip"]["matrices"]["w_skip"]["growth"]) > 0


def test_depth_statistics_take_the_seed_as_the_unit():
    layer = np.arange(5)
    per_seed = np.array([1.0 + s * 0.1 + (0.2 + 0.05 * s) * layer for s in range(4)])  # slope 0.2 + 0.05 s
    stats = layers.depth_statistics(per_seed)
    slopes = 0.2 + 0.05 * np.arange(4)
    assert stats["slope, all layers"]["mean"] == pytest.approx(slopes.mean())
    assert stats["slope, all layers"]["low"] == pytest.approx(paired_t(slopes)["low"])
    assert stats["slope, without layer 0"]["mean"] == pytest.approx(slopes.mean())  # a line has one slope
    first, second, last = per_seed[:, 0], per_seed[:, 1], per_seed[:, -1]
    assert stats["last / first, all layers"]["mean"] == pytest.approx(np.mean(last / first))
    assert stats["last / first, without layer 0"]["mean"] == pytest.approx(np.mean(last / second))
    records = [{"terms": {"skip": {"zero": list(row), "matrices": {"w_skip": {"growth": list(2 * row)}}}}}
               for row in per_seed]
    zero = layers.summary(records, "skip", "zero")
    assert [r["mean"] for r in zero["layers"]] == pytest.approx(per_seed.mean(0))
    assert zero["layers"][2]["high"] == pytest.approx(paired_t(per_seed[:, 2])["high"])
    growth = layers.summary(records, "skip", "growth", "w_skip")
    assert growth["slope, all layers"]["mean"] == pytest.approx(2 * slopes.mean())


def test_the_experiments_runs_are_the_seeds_at_each_chosen_rate(tmp_path):
    def finished(method, lr, seed, done=True):
        folder = design.Job("b", "ood", method, lr, seed).folder(tmp_path)
        folder.mkdir(parents=True)
        if done:
            (folder / "ckpt.pt").write_bytes(b"")
            (folder / "timing.json").write_text("{}")
        return folder
    (tmp_path / "b" / "ood" / "skip").mkdir(parents=True)
    (tmp_path / "b" / "ood" / "skip" / "lr_search.json").write_text(json.dumps({"chosen": 0.002}))
    chosen = [finished("skip", 0.002, 42), finished("skip", 0.002, 43)]
    finished("skip", 0.004, 42)  # a search run at another rate
    finished("skip", 0.002, 44, done=False)  # still training
    paper = finished("preproj_skip_lr1e-5", 1e-5, 42)  # a fixed rate, no search
    searching = finished("lora_matched", 0.001, 42)  # its search has not chosen yet
    runs = layers.experiment_runs(tmp_path, ["b"])
    assert runs == [*chosen, paper] and searching not in runs


def test_the_records_tarball_is_portable_deterministic_and_leaves_out_checkpoints(tmp_path):
    from study import records
    root = tmp_path / "project"
    out = root / "out" / "experiment-500"
    run_dir = design.Job("b", "ood", "skip", 0.002, 42).folder(out)
    run_dir.mkdir(parents=True)
    (out / "grid.json").write_text(json.dumps({"commit": "abc", "bases": {"b": str(root / "out" / "b-base")}}))
    (run_dir / "job.json").write_text(json.dumps({"train": ["/opt/venv/bin/python", "train.py", "--out_dir",
                                                            str(run_dir)]}))
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "lo')  # a line being written
    for kept_out in ("ckpt.pt", "tokenizer.json", "log.txt", "eval-lambada.items.jsonl"):
        (run_dir / kept_out).write_text("x")
    (run_dir / "eval-lambada.json").write_text(json.dumps({"results": {}}))
    first, second = tmp_path / "a.tar.gz", tmp_path / "b.tar.gz"
    assert records.pack(out, first) == 4
    records.pack(out, second)
    assert first.read_bytes() == second.read_bytes()
    grid = records.unpack(first, tmp_path / "unpacked")
    assert sorted(p.relative_to(grid).as_posix() for p in grid.rglob("*") if p.is_file()) == [
        "b/ood/skip/lr0.002-s42/eval-lambada.json", "b/ood/skip/lr0.002-s42/job.json",
        "b/ood/skip/lr0.002-s42/metrics.jsonl", "grid.json"]
    assert json.loads((grid / "grid.json").read_text())["bases"] == {"b": "out/b-base"}
    assert json.loads((grid / "b/ood/skip/lr0.002-s42/job.json").read_text())["train"] == [
        "python", "train.py", "--out_dir", "out/experiment-500/b/ood/skip/lr0.002-s42"]
    assert (grid / "b/ood/skip/lr0.002-s42/metrics.jsonl").read_text() == '{"step": 1, "loss": 5.0}\n'
    assert all(str(tmp_path) not in p.read_text() for p in grid.rglob("*.json*"))


def test_the_bases_tarball_keeps_the_grids_own_bases_without_optimizer_state(tmp_path, micro_base):
    """A later sitting continues the grid on the very same base: the kept weights have the base's fingerprint, the
    optimizer state is dropped, the bytes are the same on every pack, and a base from elsewhere is not kept."""
    import shutil

    from lab.checkpoint import read_checkpoint, weights_sha256
    from study import records
    root = tmp_path / "project"
    base = root / "out" / "b-base"
    shutil.copytree(micro_base, base)
    assert read_checkpoint(base)["optimizer"] is not None
    out = root / "out" / "experiment-500"
    out.mkdir(parents=True)
    (out / "grid.json").write_text(json.dumps({"bases": {"b": str(base), "other": micro_base}}))
    first, second = tmp_path / "a.tar.gz", tmp_path / "b.tar.gz"
    assert records.pack_bases(out, first) == ["b-base"]
    records.pack_bases(out, second)
    assert first.read_bytes() == second.read_bytes()
    restored = records.unpack(first, tmp_path / "restored")
    assert sorted(p.name for p in restored.iterdir()) == sorted(
        n for n in records.BASE_FILES if (base / n).is_file())
    assert "eval.json" in {p.name for p in restored.iterdir()}  # what tells the grid the base is finished
    assert read_checkpoint(restored)["optimizer"] is None
    assert load_model(str(restored))[2]["sha256"] == weights_sha256(load_model(str(base))[0])
    assert str(tmp_path) not in (restored / "config.json").read_text()


def test_restored_records_let_the_grid_skip_what_finished(tmp_path, monkeypatch, capsys):
    """A run finished in an earlier sitting is not trained again from its records alone (no checkpoint): the
    record files include train.py's eval.json, which is what study.grid.train_job looks for."""
    from types import SimpleNamespace

    from study import grid, records
    out = tmp_path / "project" / "out" / "experiment-500"
    job = design.Job("b", "ood", "skip", 0.002, 42)
    folder = job.folder(out)
    folder.mkdir(parents=True)
    (out / "grid.json").write_text("{}")
    for name in ("eval.json", "job.json", "timing.json", "ckpt.pt"):
        (folder / name).write_text("{}")
    records.pack(out, tmp_path / "r.tar.gz")
    restored = records.unpack(tmp_path / "r.tar.gz", tmp_path / "sitting-2")
    assert not (job.folder(restored) / "ckpt.pt").exists()
    monkeypatch.setattr(grid, "execute", lambda *a: pytest.fail("a finished run was trained again"))
    args = SimpleNamespace(out=restored, dry_run=False)
    assert grid.train_job(job, "unused", 32, args) is True
    assert "[train]" not in capsys.readouterr().out
