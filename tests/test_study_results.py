"""The 500-step experiment's tables (study/results.py) from hand-written run records: every number against its
definition, computed here from the same records."""

import json
from pathlib import Path

import numpy as np

from lab.stats import paired_t
from study import design, layers, results

BASE = {"sotu_test": 5.9, "books_test": 5.1}
SEEDS = [42, 43, 44]


def write(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def eval_summary(acc: float, ppl: float, bpb: float) -> dict:
    return {"results": {"lambada": {"metrics": {"acc": {"value": acc}, "ppl": {"value": ppl}}},
                        "wikitext": {"metrics": {"bits_per_byte": {"value": bpb}, "word_perplexity": {"value": 9.0}}}}}


def layer_record(slope: float) -> dict:
    depth = np.arange(4)
    return {"terms": {"skip": {"zero": list(0.01 + 0.002 * depth), "mean": list(0.001 + 0 * depth),
                               "matrices": {"w_skip": {"norm": list(1 + slope * depth),
                                                       "growth": list(0.5 + slope * depth)}}}}}


def fake_grid(out: Path) -> dict[str, list[float]]:
    """A base with its baseline, pre-proj + skip (searched, chosen 0.004 on the grid's edge) and skip only; returns
    each method's per-seed sotu_test losses."""
    write(out / "grid.json", {"commit": "0123456789abcdef", "dirty": False, "cpu": "AMD EPYC",
                              "command": ["python", "-m", "study.grid"], "bases": {"b": "out/b"}, "steps": 500,
                              "batch_size": 16, "seq_len": 256, "seeds": SEEDS, "lrs": [0.002, 0.004],
                              "max_extend": 3, "paper_lr": 1e-5, "limits": {"lambada": 0, "wikitext": 0}})
    write(design.baseline_folder(out, "b") / "measures.json", BASE)
    write(design.baseline_folder(out, "b") / "eval-lambada-wikitext.json", eval_summary(0.0, 3e7, 2.80))
    losses = {"preproj_skip": [5.40, 5.42, 5.41], "skip": [5.50, 5.49, 5.53]}
    for method, per_seed in losses.items():
        folder = design.method_folder(out, "b", "ood", method)
        write(folder / "lr_search.json", {"split": "sotu_search", "losses": {"0.002": 5.6, "0.004": 5.5},
                                          "chosen": 0.004, "at_edge": method == "skip"})
        for seed, loss in zip(SEEDS, per_seed):
            run = design.Job("b", "ood", method, 0.004, seed).folder(out)
            write(run / "measures.json", {"sotu_test": loss, "books_test": 5.8 + loss - 5.4,
                                          "moved": {"w_up": 1.0, "w_down": 1.0, "w_skip": 1.0}})
            write(run / "windows.json", {"sotu_test": list(loss + np.linspace(-0.1, 0.1, 8))})
            write(run / "eval-lambada-wikitext.json", eval_summary(0.0, 2e7 + seed, 2.70 + (seed - 42) / 100))
            write(run / "timing.json", {"train_seconds": 100.0, "train_cpu_seconds": 190.0})
            write(run / layers.RECORD, layer_record(0.1 * (seed - 41)))
            (run / "metrics.jsonl").write_text("".join(json.dumps({"step": step, "loss": 5.0, "sotu_search_loss": v})
                                                       + "\n" for step, v in ((50, 5.7), (100, loss + 0.1))))
        write(design.Job("b", "ood", method, 0.002, 42).folder(out) / "timing.json",  # the search's other run
              {"train_seconds": 90.0, "train_cpu_seconds": 170.0})
    return losses


def test_each_method_against_the_frozen_base_takes_seeds_as_units(tmp_path):
    losses = fake_grid(tmp_path)
    collected = results.collect(tmp_path, ["b"])
    assert list(collected["b"]) == ["baseline", "preproj_skip", "skip"]
    table = results.against_baseline(collected["b"])
    t = paired_t(np.subtract(losses["preproj_skip"], BASE["sotu_test"]))
    assert f"| pre-proj + skip | 3 | {t['mean']:+.4f} [{t['low']:+.4f}, {t['high']:+.4f}] |" in table
    assert "LAMBADA acc: 0 for every run, at the floor, no claim." in table
    assert "Δ LAMBADA acc" not in table and "Δ WikiText bpb" in table
    bpb = paired_t([2.70 - 2.80, 2.71 - 2.80, 2.72 - 2.80])
    assert f"{bpb['mean']:+.4f} [{bpb['low']:+.4f}, {bpb['high']:+.4f}]" in table


def test_search_paper_rows_time_and_layers(tmp_path):
    fake_grid(tmp_path)
    collected = results.collect(tmp_path, ["b"])
    search = results.search_table(tmp_path, "b")
    assert "| skip only | 0.002: 5.6000, 0.004: 5.5000 | 0.004 | yes |" in search
    assert "| pre-proj + skip | 0.002: 5.6000, 0.004: 5.5000 | 0.004 | no |" in search
    # 6 x 100 + 2 x 90 s of wall time, 6 x 190 + 2 x 170 s of CPU time
    assert results.machine_time(tmp_path) == ("runs trained 8, 0.4 h of CPU time (AMD EPYC) and 0.2 h of wall "
                                              "time, which counts any pause of the grid or other work beside it; "
                                              "the median training 100 s of wall time and 190 s of CPU time; at "
                                              "commit 0123456.")
    assert "| pre-proj + skip | 3 |" in results.paper_rows(collected["b"])
    table = results.layer_table(collected["b"])
    slopes = paired_t([0.1, 0.2, 0.3])  # seed s's growth rises 0.1 (s - 41) per layer
    slope = f"{slopes['mean']:+.4f} [{slopes['low']:+.4f}, {slopes['high']:+.4f}]"
    assert f"| pre-proj + skip | skip | 3 | {slope} |" in table
    # Σ zero-ablation 4 x 0.01 + 0.002 (0 + 1 + 2 + 3) = 0.052, Σ mean-ablation 0.004, their ratio 0.077
    assert "| 0.0520 | 0.0040 | +0.08 [+0.08, +0.08] |" in table


def test_the_sections_lead_with_the_contrasts_and_link_their_figures(tmp_path):
    fake_grid(tmp_path / "grid")
    figures = tmp_path / "results" / "figures"
    parts = results.sections(tmp_path / "grid", ["b"], figures, resamples=200)
    assert parts[0] == "## The 500-step experiment: pre-registered contrasts"
    assert parts[1].startswith("- Pre-registered in docs/experiment.md (commit ed53c0c); run by `python -m study.grid` "
                               "at commit 0123456 on AMD EPYC.")
    assert "- Every run: 500 steps of 16 x 256 tokens" in parts[1] and "seeds 42, 43, 44 at the chosen rate" in parts[1]
    assert "| b | skip only | 3 |" in parts[2]
    assert parts[3].startswith("p (Holm): adjusted over the 4 pre-registered tests (4 contrasts on one base); the 3 "
                               "not run yet count as p = 1")
    assert parts[4].startswith("Machine time: runs trained 8,")
    assert parts[5:7] == ["![curves](figures/experiment_curves.png)", "![layers](figures/experiment_layers.png)"]
    assert all((figures / f"experiment_{n}.png").stat().st_size > 10_000 for n in ("curves", "layers"))
    curves = results.collect(tmp_path / "grid", ["b"])["b"]["skip"]
    assert [r.curve for r in curves][0] == {50: 5.7, 100: 5.6}


def test_the_learning_curves_in_numbers(tmp_path):
    losses = fake_grid(tmp_path)
    table = results.curve_table(results.collect(tmp_path, ["b"])["b"])
    assert table.splitlines()[0] == "| method | seeds | step 50 | step 100 |"
    at_100 = np.add(losses["skip"], 0.1)
    assert (f"| skip only | 3 | 5.7000 ± 0.0000 | {at_100.mean():.4f} ± {np.std(at_100, ddof=1):.4f} |"
            in table.splitlines())
    assert "baseline" not in table  # the frozen base has no curve
