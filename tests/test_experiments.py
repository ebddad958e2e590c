"""The study (study/design.py, study/grid.py, study/report.py): the capacity control, the held-out parts of the
corpus, the size rules, the learning-rate search, a diverged training recorded by either of train.py's divergence
paths, the share of weights that moved, the pooled paired statistics, the figure links of RESULTS.md, and the grid
end to end on a tiny random Pythia-shaped folder, resumed without retraining, then its report."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import MICRO, make_hf_model, run
from lab.checkpoint import ROOT, load_model, read_checkpoint, run_name
from load_pythia import hf_state_dict
from model import GPT, GPTConfig
from study import design, grid, report

# --- the size rules scale the paper's choices; at Pythia's widths they give the paper's own numbers ---


@pytest.mark.parametrize("d", [64, 192, 768, 1024])
def test_capacity_and_matched_lora_have_pre_proj_plus_skips_parameters(d):
    shape = dict(vocab_size=64, n_layer=2, n_head=1, n_embd=d)
    with torch.device("meta"):
        target = GPT(GPTConfig(**shape, preproj=True, skip=True)).num_params("new")
        capacity = GPT(GPTConfig(**shape, adapter_dim=design.capacity_dim(d))).num_params("new")
        lora = GPT(GPTConfig(**shape, lora_rank=design.matched_rank(d))).num_params("new")
        side_mlp = GPT(GPTConfig(**shape, skip=True, adapter_dim=design.side_mlp_dim(d))).num_params("new")
        linear = GPT(GPTConfig(**shape, preproj=True, preproj_linear=True, skip=True)).num_params("new")
    assert target == 2 * (2 * d * int(1.25 * d) + d * d)  # PAPER.md's count per layer
    assert side_mlp == linear == target  # the two controls of the 500-step experiment: exactly its parameters
    assert abs(capacity - target) <= 0.01 * target
    assert abs(lora - target) <= 0.01 * target


def test_paper_ranks_at_pythia_widths():
    """The paper's LoRA r = 480 / 640 and pre-proj + LoRA r = 64 at 160M / 410M: 26.5M / 94.4M and 21.2M (PAPER.md)."""
    assert design.paper_rank(768) == 480 and design.paper_rank(1024) == 640
    lora_160m = 12 * 6 * 768 * design.paper_rank(768)
    lora_410m = 24 * 6 * 1024 * design.paper_rank(1024)
    assert (round(lora_160m / 1e6, 1), round(lora_410m / 1e6, 1)) == (26.5, 94.4)
    flags = design.METHODS["preproj_lora"].flags(768)
    assert flags == ["--preproj", "--lora_rank", "64"]


# --- the capacity control ---

def attention_inputs(model: GPT, x: torch.Tensor) -> list[torch.Tensor]:
    seen = []
    handles = [b.attn.register_forward_hook(lambda m, args, y: seen.append(args[0])) for b in model.blocks]
    with torch.no_grad():
        logits = model(x)[0]
    for h in handles:
        h.remove()
    return [logits, *seen]


def test_capacity_control_starts_near_the_base_and_leaves_attentions_input_alone(micro_base):
    base, _, _ = load_model(micro_base)
    x = torch.randint(0, 8192, (2, 32))
    base_logits, base_in0 = attention_inputs(base.eval(), x)[:2]
    outputs = {}
    for name, switches in (("capacity", dict(adapter_dim=design.capacity_dim(32))),
                           ("preproj", dict(preproj=True))):
        model, _, _ = load_model(micro_base, **switches)
        outputs[name] = attention_inputs(model.eval(), x)
    # layer 0's attention reads exactly the base's input with the adapter; the pre-projection changes it
    assert torch.equal(outputs["capacity"][1], base_in0)
    assert not torch.equal(outputs["preproj"][1], base_in0)
    # near the base, not at it: drawn N(0, 0.01) like the pre-projection, it moves no log-probability by 0.01 nats
    shift = (outputs["capacity"][0].log_softmax(-1) - base_logits.log_softmax(-1)).abs().max().item()
    assert 0 < shift < 0.01


def test_capacity_probe_trains_only_the_adapter_and_reattaches(micro_base, tmp_path):
    out = tmp_path / "capacity"
    model, results = run(f"--init_from {micro_base} --adapter_dim 48 --data books {MICRO} --max_iters 3 "
                         f"--eval_tokens 64 --out_dir {out}")
    base, _, _ = load_model(micro_base)
    for name, t in base.base_state_dict().items():
        assert torch.equal(t, model.base_state_dict()[name]), name
    ckpt = read_checkpoint(out)
    assert ckpt["kind"] == "probe"
    assert {k.split(".")[2] for k in ckpt["model"]} == {"w_a_up", "w_a_down"}
    assert ckpt["model"]["blocks.0.w_a_up.weight"].shape == (48, 32)
    reloaded, _, _ = load_model(str(out))
    x = torch.randint(0, 8192, (2, 16))
    model.eval()
    with torch.no_grad():
        assert torch.equal(reloaded(x)[0], model(x)[0])
    # --data books trains on the book's first chapters and reports its last ones, never the whole book
    assert set(results["val_loss"]["trained"]) == {"val", "books_test"}
    assert run_name({"init_from": "nano", "adapter_dim": 48}) == "nano-adapter48"
    assert run_name({"init_from": "nano", "skip": True, "data": "books"}) == "nano-skip-books"
    assert run_name({"init_from": "nano", "skip": True, "data": "auto"}) == "nano-skip"
    with pytest.raises(ValueError, match="capacity adapter"):  # no GPT-NeoX folder can hold it
        hf_state_dict(model)


# --- the held-out parts of the corpus ---

def test_parts_split_the_held_out_text_without_changing_the_splits(mirror):
    from data.prepare import PARTS, SPLITS, corpus_splits, part_docs, read_docs
    splits = corpus_splits(mirror)
    book = read_docs(splits["val_books"])[0]
    parts = {name: part_docs(name, mirror) for name in PARTS}
    assert "\n".join(parts[n][0] for n in ("books_train", "books_search", "books_test")) == book
    assert parts["books_train"][0].count("CHAPTER ") == 9 and parts["books_test"][0].startswith("CHAPTER XII\n")
    assert parts["sotu_search"] + parts["sotu_test"] == read_docs(splits["val"])
    assert len(parts["sotu_search"]) == 4  # 1993-1996
    assert not set(PARTS) & set(SPLITS)  # prepare_nano builds exactly the four splits it always built


# --- the learning-rate search and the finished-run logic, without training anything ---

def test_search_picks_the_lowest_search_loss_and_skips_finished_runs(tmp_path, monkeypatch):
    args = SimpleNamespace(out=tmp_path, lrs=(1e-4, 1e-3, 1e-2), full_lrs=(1e-5,), seeds=[42], steps=5,
                           dry_run=False, seq_len=32, batch_size=4, heldout_tokens=0, device=None, dtype=None,
                           mirror=None, max_extend=3)
    for lr, loss in ((1e-4, 3.2), (1e-3, 2.9), (1e-2, None)):
        folder = design.Job("b", "indist", "skip", lr, 42).folder(tmp_path)
        folder.mkdir(parents=True)
        if loss is None:  # this one diverged
            (folder / "diverged.json").write_text("{}")
        else:
            (folder / "eval.json").write_text("{}")
            (folder / "measures.json").write_text(json.dumps({"books_search": loss}))
    monkeypatch.setattr(grid.subprocess, "Popen", lambda *a, **k: pytest.fail("nothing should run"))
    assert grid.search("b", "base", 32, "indist", "skip", args, {}) == 1e-3
    record = json.loads((tmp_path / "b" / "indist" / "skip" / "lr_search.json").read_text())
    assert record["losses"] == {"0.0001": 3.2, "0.001": 2.9, "0.01": float("inf")}
    assert record["split"] == "books_search"
    # fixed rates need no search; the paper's precision takes pre-proj + skip's chosen rate
    assert grid.search("b", "base", 32, "indist", "preproj_skip_lr1e-5", args, {}) == 1e-5
    assert grid.search("b", "base", 32, "indist", "full_ft", args, {}) == 1e-5
    (tmp_path / "b" / "indist" / "preproj_skip").mkdir()
    (tmp_path / "b" / "indist" / "preproj_skip" / "lr_search.json").write_text('{"chosen": 0.003}')
    assert grid.search("b", "base", 32, "indist", "preproj_skip_bf16", args, {}) == 0.003


def finished_search_run(out: Path, method: str, lr: float, loss: float) -> None:
    folder = design.Job("b", "ood", method, lr, 42).folder(out)
    folder.mkdir(parents=True)
    (folder / "eval.json").write_text("{}")
    (folder / "measures.json").write_text(json.dumps({"sotu_search": loss}))


@pytest.mark.parametrize("max_extend, chosen, searched, at_edge", [(3, 2e-3, 4, False), (1, 2e-3, 3, True),
                                                                   (0, 1e-3, 2, True)])
def test_a_search_that_lands_on_an_edge_adds_the_next_point(tmp_path, monkeypatch, max_extend, chosen, searched,
                                                            at_edge):
    """Losses falling to the top of the grid: 1e-3 (its edge) adds 2e-3, which wins and adds 4e-3, which loses;
    the search stops inside the grid, or at --max_extend points beyond it, saying it stopped on an edge."""
    for lr, loss in ((5e-4, 3.0), (1e-3, 2.9), (2e-3, 2.8), (4e-3, 2.85)):
        finished_search_run(tmp_path, "skip", lr, loss)
    args = SimpleNamespace(out=tmp_path, lrs=(5e-4, 1e-3), full_lrs=(1e-5,), seeds=[42], steps=5, dry_run=False,
                           max_extend=max_extend)
    monkeypatch.setattr(grid.subprocess, "Popen", lambda *a, **k: pytest.fail("nothing should run"))
    assert grid.search("b", "base", 32, "ood", "skip", args, {}) == chosen
    record = json.loads((tmp_path / "b" / "ood" / "skip" / "lr_search.json").read_text())
    assert len(record["losses"]) == searched and record["at_edge"] is at_edge


def test_beyond_edge_steps_out_by_the_grids_factor():
    lrs = [5e-4, 1e-3, 2e-3, 4e-3]
    assert grid.beyond_edge(lrs, 4e-3) == 0.008 and grid.beyond_edge(lrs, 5e-4) == 0.00025
    assert grid.beyond_edge(lrs, 1e-3) is None and grid.beyond_edge([3e-4, 1e-3, 3e-3], 3e-3) == 0.009


# --- a diverged training is recorded, whichever way it diverged: the grid reads train.py's exit status ---

@pytest.mark.parametrize("steps, lr, message", [
    # one step at lr 1e39 overflows the new weights; the checkpoint after the last step refuses them (save_checked)
    (1, 1e39, "the weights after step 1 hold non-finite values"),
    # one step at lr 1e19 leaves them finite but huge; the second step's loss is not
    (2, 1e19, "the loss became nan at step 2"),
])
def test_a_diverged_training_is_recorded_not_fatal(micro_base, tmp_path, capsys, steps, lr, message):
    args = SimpleNamespace(out=tmp_path, steps=steps, batch_size=2, seq_len=32, heldout_tokens=512, dry_run=False,
                           device=None, dtype="float32", mirror=None, version=design.code_version(), command=[])
    job = design.Job("micro", "indist", "preproj_skip", lr, 42)
    assert grid.train_job(job, micro_base, 32, args) is False
    folder = job.folder(tmp_path)
    error = json.loads((folder / "diverged.json").read_text())["error"]
    assert error.startswith(f"error: {message}; stopped without saving it"), error
    assert not (folder / "ckpt.pt").exists() and not (folder / "eval.json").exists()
    assert f"diverged: error: {message}" in capsys.readouterr().out
    assert grid.train_job(job, micro_base, 32, args) is False  # recorded: not trained again
    assert "[train]" not in capsys.readouterr().out


def test_sigterm_to_the_grid_lets_its_training_save_its_last_step(micro_base, tmp_path):
    """Stopping the grid (SIGTERM to it alone, as a scheduler does) first stops its running training the way
    train.py stops: after its step, with a checkpoint of that step; no step since the last interval is lost."""
    out = tmp_path / "grid"
    proc = subprocess.Popen([sys.executable, "-m", "study.grid", "--bases", f"micro={micro_base}", "--only",
                             "preproj_skip", "--seeds", "1", "--lrs", "1e-3", "--steps", "5000", "--seq_len", "32",
                             "--batch_size", "2", "--heldout_tokens", "512", "--dtype", "float32", "--out", str(out)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    folder = design.Job("micro", "ood", "preproj_skip", 1e-3, 42).folder(out)
    deadline = time.time() + 120
    while time.time() < deadline and len(records(folder)) < 60:  # past the checkpoint of step 50
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "error: stopped by SIGTERM; run the same command again to resume" in err
    saved = read_checkpoint(folder)["step"]
    assert saved > 50 and saved == records(folder)[-1]["step"]  # the step it stopped at, not the interval's
    assert "stopped by SIGTERM after step" in (folder / "log.txt").read_text()


def records(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


# --- the share of weights that moved: initial values drawn again exactly; bf16 loses small updates ---

def test_moved_shares(micro_base, tmp_path):
    args = SimpleNamespace(mirror=None)
    common = f"--init_from {micro_base} --preproj --skip {MICRO} --max_iters 2 --warmup_iters 1 --eval_tokens 64"
    run(f"{common} --lr 1e-30 --min_lr 0 --out_dir {tmp_path / 'still'}")
    assert grid.moved_shares(tmp_path / "still", args) == {"w_up": 0.0, "w_down": 0.0, "w_skip": 0.0}
    run(f"{common} --lr 1e-5 --min_lr 1e-5 --out_dir {tmp_path / 'fp32'}")
    run(f"{common} --lr 1e-5 --min_lr 1e-5 --pure_bf16 --out_dir {tmp_path / 'bf16'}")
    fp32, bf16 = (grid.moved_shares(tmp_path / k, args) for k in ("fp32", "bf16"))
    assert min(fp32.values()) > 0.95  # fp32 masters keep every update of ~1e-5
    # in bf16 an update of 1e-5 is below half a step for entries of N(0, 0.01) beyond ~0.003; W_skip (1e-4) moves
    assert bf16["w_up"] < 0.5 and bf16["w_down"] < 0.5 and bf16["w_skip"] > 0.95


# --- the screen's comparisons: seeds as the unit, Holm over the whole screen ---

def fake_run(seed, **values):
    return report.RunRecord(Path(f"s{seed}"), seed, values, {"trainable": 0}, 0.0)


def test_the_screens_comparisons_take_seeds_as_units_and_adjust_over_the_screen():
    from lab.stats import holm, paired_t
    methods = {"baseline": (None, [fake_run(None, sotu_test=5.0, books_test=5.0, **{"lambada/acc": 0.0})]),
               "lora_matched": (1e-3, [fake_run(s, sotu_test=4.8 + d, books_test=5.2, **{"lambada/acc": 0.0})
                                       for s, d in ((42, 0.01), (43, -0.01), (44, 0.0))]),
               "skip": (1e-3, [fake_run(s, sotu_test=4.7 + d, books_test=5.3, **{"lambada/acc": 0.0})
                               for s, d in ((42, 0.02), (43, 0.0))])}
    found = report.comparisons(methods)
    assert found[("baseline", "skip", "sotu_test")] == paired_t([4.72 - 5.0, 4.70 - 5.0])
    # paired by seed against LoRA: only the seeds both have (42, 43)
    assert found[("lora_matched", "skip", "sotu_test")] == paired_t([4.72 - 4.81, 4.70 - 4.79])
    assert not any(key == "lambada/acc" for _, _, key in found)  # at the floor in every run: no comparison
    books = found[("baseline", "skip", "books_test")]  # the same difference for every seed: no p-value
    assert not report.spread(books)
    cells = {("cell",): found}
    n = report.adjust(cells)
    with_p = {k: t["p"] for k, t in found.items() if report.spread(t)}
    assert n == len(with_p) and books["p_holm"] == 1.0
    assert all(found[k]["p_holm"] == holm(with_p)[k] for k in with_p)
    section = report.comparison_section(methods, found, "baseline")
    assert "| skip only | -0.29 [" in section and "+0.3 (every seed)" in section
    assert section.endswith("LAMBADA acc: 0 for every run, at the floor.")


# --- RESULTS.md: its figures where its links say, relative to it, as the report writes them ---

def figure_links(results: Path) -> list[str]:
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", results.read_text())
    missing = [link for link in links if not (results.parent / link).is_file()]
    assert links and not missing, missing
    return links


def test_the_studys_results_rebuild_byte_for_byte_from_the_committed_records(tmp_path):
    """RESULTS.md and every figure it links, rebuilt from the committed records alone (no checkpoints, no
    training), equal the committed files byte for byte."""
    committed = ROOT / "study" / "RESULTS.md"
    shutil.copy(committed, tmp_path / "RESULTS.md")  # the hand-written reading comes from the file it rebuilds
    report.main(["--results", str(tmp_path / "RESULTS.md")])
    assert (tmp_path / "RESULTS.md").read_text() == committed.read_text()
    for link in figure_links(committed):
        assert (tmp_path / link).read_bytes() == (committed.parent / link).read_bytes(), link
    assert sorted(p.name for p in (committed.parent / "figures").iterdir()) == sorted(
        p.name for p in (tmp_path / "figures").iterdir())  # no figure left behind that nothing links


def test_the_studys_results_link_its_figures_and_keep_their_reading():
    results = ROOT / "study" / "RESULTS.md"
    assert all(link.startswith("figures/") for link in figure_links(results))
    reading = report.kept_reading(results)
    assert reading.startswith(report.READING[0]) and "## Reading" in reading and reading in results.read_text()


def test_every_number_in_the_studys_reading_is_in_its_tables():
    assert report.unquoted_numbers((ROOT / "study" / "RESULTS.md").read_text()) == []


def test_a_number_the_tables_do_not_show_is_caught():
    tables = "| skip only | -0.0143 [-0.0257, -0.00287] | 4,476,672 | 2.974e+07 |"
    reading = ("{0}\nThe skip: -0.0143 [-0.0257, -0.00287] of 4,476,672 parameters, {quote}; `--lr 1e-3` on "
               "pythia-160m (arXiv 2603.13381, He et al. 2022, Table 2).\n{1}")
    text = lambda quote: reading.format(*report.READING, quote=quote) + "\n" + tables  # noqa: E731
    assert report.unquoted_numbers(text("perplexity 2.974e+07")) == []
    assert report.unquoted_numbers(text("perplexity 2.97e+07")) == ["2.97e+07"]  # rounded otherwise: not shown
    assert report.unquoted_numbers(text("-0.0144 nats")) == ["0.0144"]  # mistyped
    assert report.unquoted_numbers(text("3.0x faster, 12.5%")) == ["12.5", "3.0"]  # ratios and shares count


def test_each_part_of_the_reading_is_checked_against_its_own_grids_tables():
    """The reading's experiment part against the experiment's tables, its screen part against the screen's: a
    stale figure that happens to match a cell of the other grid is caught."""
    def text(experiment_quote: str, screen_quote: str) -> str:
        reading = (f"{report.READING[0]}\nThe experiment: {experiment_quote}.\n{report.SCREEN_READING}\n"
                   f"The screen: {screen_quote}.\n{report.READING[1]}")
        return "\n".join([reading, "| skip only | -0.2546 [-0.2600, -0.2492] |", f"{report.SCREEN_HEADING} (short)",
                          "| skip only | 5.832 |"])
    assert report.unquoted_numbers(text("-0.2546 [-0.2600, -0.2492]", "5.832")) == []
    assert report.unquoted_numbers(text("5.832", "5.832")) == ["5.832"]  # the screen's cell in the experiment's part
    assert report.unquoted_numbers(text("-0.2546", "-0.2546")) == ["0.2546"]  # and the other way round


# --- the grid end to end on a tiny Pythia-shaped folder ---

@pytest.fixture(scope="module")
def tiny_pythia(tmp_path_factory, mirror):
    folder = tmp_path_factory.mktemp("tiny_pythia_tok")
    make_hf_model(vocab=50304, d=64, max_pos=64).save_pretrained(folder)
    shutil.copy(os.path.join(mirror, "tokenizers", "20B_tokenizer.json"), folder / "tokenizer.json")
    return str(folder)


def test_dry_run_lists_the_experiment_and_runs_nothing(tiny_pythia, tmp_path, capsys):
    """The default grid is the pre-registered 500-step experiment (docs/experiment.md): on the primary base, six
    methods searched over four rates then four more seeds each, and the paper's two recipe rows at three seeds;
    the second base replicates all but the primary-only rows."""
    grid.main(["--dry_run", "--bases", f"tiny={tiny_pythia},again={tiny_pythia}", "--out", str(tmp_path / "grid")])
    out = capsys.readouterr().out
    assert not (tmp_path / "grid").exists()
    for flags in ("--preproj --skip --data corpus", "--skip --data corpus", "--skip --adapter_dim 80 --data",
                  "--preproj --skip --preproj_linear --data", "--lora_rank 37 --data", "--adapter_dim 112 --data",
                  "--lr 1e-05", "--pure_bf16 --data", "--max_iters 500 --batch_size 16 --seq_len 256",
                  "--lr 0.0005 ", "--lr 0.004 ", "--val_splits sotu_search --eval_interval 50"):
        assert flags in out, flags
    assert "--data books" not in out and "--full_finetune" not in out and "--lora_rank 40" not in out
    primary = 6 * 4 + 6 * 4 + 2 * 3  # search grids, later seeds (42 is the search's), the paper's rows
    assert out.count("python train.py") == primary + 5 * 4 + 5 * 4
    assert "[train] again/ood/capacity" not in out and "[train] again/ood/preproj_skip_lr1e-5" not in out
    assert "--lr LR --min_lr LR/10" in out and "--seed 46 " in out and "--seed 47 " not in out
    assert "--tasks lambada,wikitext --out" in out


def test_grid_runs_resumes_without_retraining_and_builds_the_tables(tiny_pythia, tmp_path, capsys):
    out, results = tmp_path / "grid", tmp_path / "RESULTS.md"
    argv = ["--bases", f"tiny={tiny_pythia}", "--only", "baseline,preproj_skip", "--seeds", "1", "--steps", "2",
            "--lrs", "1e-3", "--tasks", "lambada,arc_easy", "--limit", "4", "--seq_len", "32",
            "--batch_size", "2", "--heldout_tokens", "512", "--out", str(out), "--dtype", "float32"]
    grid.main(argv)
    ckpts = {s: out / "tiny" / s / "preproj_skip" / "lr0.001-s42" / "ckpt.pt" for s in design.EXPERIMENT_SETTINGS}
    mtimes = {s: os.stat(p).st_mtime_ns for s, p in ckpts.items()}
    capsys.readouterr()
    grid.main(argv)  # everything is finished: nothing trains or evaluates again
    again = capsys.readouterr().out
    assert "[train]" not in again and "[eval]" not in again and "[measure]" not in again
    assert {s: os.stat(p).st_mtime_ns for s, p in ckpts.items()} == mtimes
    report.main(["--out", str(out), "--bases", "tiny", "--results", str(results), "--resamples", "500"])
    text = results.read_text()
    assert "## The 500-step experiment: pre-registered contrasts" in text
    assert "## tiny: each method against the frozen base (secondary, unadjusted)" in text
    assert "(no method has two seeds yet)" in text and "Machine time: runs trained 1, " in text
    assert "# The 30-step screen (a short horizon" in text
    assert "| method | lr | trainable | train s | loss SOTU |" in text  # the screen's tables, from its records
    figures = results.parent / "figures"
    assert (figures / "experiment_curves.png").stat().st_size > 1000
    charts = sorted(f"figures/{p.name}" for p in figures.glob("screen_delta_*.png"))
    assert len(charts) == 6  # the screen's seven columns but LAMBADA accuracy, 0 for every run
    assert sorted(figure_links(results)) == sorted([*charts, "figures/experiment_curves.png"])  # relative links
    folder = ckpts["ood"].parent
    measures = json.loads((folder / "measures.json").read_text())
    assert set(design.TEST_SPLITS) <= set(measures) and measures["trainable"] == 28_672
    windows = json.loads((folder / "windows.json").read_text())  # 512 held-out tokens: 16 windows of 32
    assert {k: len(v) for k, v in windows.items()} == {"sotu_test": 16, "books_test": 16}
    assert measures["sotu_test"] == pytest.approx(np.mean(windows["sotu_test"]))
    job, grid_json = (json.loads((p / name).read_text()) for p, name in ((folder, "job.json"), (out, "grid.json")))
    assert job["commit"] == grid_json["commit"] == design.code_version()["commit"] and len(job["commit"]) == 40
    assert job["grid_command"] == grid_json["command"] == ["python", "-m", "study.grid", *argv]
    curve = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in curve if "sotu_search_loss" in r] == [2]
    timing = json.loads((folder / "timing.json").read_text())
    assert timing["train_cpu_seconds"] > 0 and timing["invocations"] == 1
    results.write_text(text.replace("(To be written", "We read: nothing yet (to be written"))
    report.main(["--out", str(out), "--bases", "tiny", "--results", str(results), "--resamples", "500"])
    assert "We read: nothing yet" in results.read_text()  # the hand-written reading survives a rebuild
    assert np.isfinite(measures["sotu_test"])
    (out / "grid.json").write_text(json.dumps({**grid_json, "commit": "0" * 40}))  # a grid of another commit
    with pytest.raises(SystemExit, match="holds a grid run at commit 000000000000, this checkout is at"):
        grid.main(argv)


# --- the pre-registered contrasts, from run folders (study/contrasts.py) ---

def fake_experiment(out: Path, shifts: dict[str, list[float]], windows: int = 40) -> None:
    """Run folders of the 500-step experiment with per-window losses: each method's seed s is the baseline's
    windows plus shifts[method][s]."""
    rng = np.random.default_rng(0)
    base = rng.normal(5.5, 0.2, windows)
    for method, per_seed in shifts.items():
        folder = design.method_folder(out, "b", "ood", method)
        folder.mkdir(parents=True)
        (folder / "lr_search.json").write_text(json.dumps({"chosen": 0.002}))
        for i, shift in enumerate(per_seed):
            run = design.Job("b", "ood", method, 0.002, 42 + i).folder(out)
            run.mkdir()
            (run / "windows.json").write_text(json.dumps({"sotu_test": list(base + shift)}))
        stray = design.Job("b", "ood", method, 0.004, 42).folder(out)  # a search run at another rate: not counted
        stray.mkdir()
        (stray / "windows.json").write_text(json.dumps({"sotu_test": list(base - 1.0)}))


def test_the_contrasts_pair_seeds_and_adjust_over_the_family(tmp_path):
    from lab.stats import holm, paired_t
    from study import contrasts
    shifts = {"preproj_skip": [0.00, 0.01, -0.01, 0.00, 0.005],
              "skip_sidemlp": [0.02, 0.03, 0.01, 0.025, 0.02],  # clearly worse than pre-proj + skip
              "linear_preproj_skip": [0.01, -0.01, 0.0, 0.01, -0.005],  # no difference to speak of
              "lora_matched": [0.02, 0.01],  # two seeds only: the contrast uses the common ones
              "skip": [0.0]}  # one seed: no contrast
    fake_experiment(tmp_path, shifts)
    rows = {r["control"]: r for r in contrasts.contrasts(tmp_path, ["b"], resamples=500)}
    assert set(rows) == {"skip_sidemlp", "linear_preproj_skip", "lora_matched"}
    diffs = np.subtract(shifts["preproj_skip"], shifts["skip_sidemlp"])  # the shifts are the seed-mean differences
    expect = paired_t(diffs)
    mech = rows["skip_sidemlp"]
    assert mech["mean"] == pytest.approx(diffs.mean()) and mech["p"] == pytest.approx(expect["p"])
    assert mech["seeds"] == [42, 43, 44, 45, 46] and rows["lora_matched"]["seeds"] == [42, 43]
    assert mech["boot_low"] < mech["mean"] < mech["boot_high"] < 0
    # the family is every pre-registered test: "skip" has no contrast yet and counts as p = 1
    adjusted = holm({c: r["p"] for c, r in rows.items()} | {"skip": 1.0})
    assert all(r["p_holm"] == pytest.approx(adjusted[c]) for c, r in rows.items())
    assert mech["p_holm"] == pytest.approx(min(1.0, 4 * mech["p"]))  # the smallest of 4, not of the 3 that ran
    two_bases = {r["control"]: r for r in contrasts.contrasts(tmp_path, ["b", "nothing-run-yet"], resamples=500)}
    assert two_bases["skip_sidemlp"]["p_holm"] == pytest.approx(min(1.0, 8 * mech["p"]))
    assert mech["verdict"] == "supported" and rows["linear_preproj_skip"]["verdict"] == "not shown"
    assert "| b | skip + side-MLP | 5 |" in contrasts.table(list(rows.values()))


def test_a_contrast_the_control_wins_reads_reversed(tmp_path):
    from study import contrasts
    fake_experiment(tmp_path, {"preproj_skip": [0.00, 0.01, -0.01, 0.00, 0.005],
                               "skip_sidemlp": [-0.03, -0.02, -0.04, -0.03, -0.025]})  # clearly better
    (mech,) = contrasts.contrasts(tmp_path, ["b"], resamples=500)
    assert mech["mean"] > 0 and mech["p_holm"] < contrasts.ALPHA and mech["verdict"] == "reversed"
    assert contrasts.verdict(-0.1, 0.01) == "supported" and contrasts.verdict(-0.1, 0.05) == "not shown"
