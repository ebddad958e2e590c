"""
The report at the end of a training run: lm-eval benchmarks of the frozen base and the trained model, side by side.
train.py prints it and keeps it in the run folder's eval.json.
"""

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer

from lab.checkpoint import NANO_DIR
from lab.cli import format_table
from lab.evaluation import evaluate
from model import GPT


def benchmark_settings(s: argparse.Namespace) -> dict:
    """What a run's end-of-run benchmarks measure, from its settings; a base's saved results are reused only when
    these are equal."""
    tasks = [t for t in s.eval_tasks.split(",") if t and t != "none"]
    return {"tasks": tasks, "hellaswag_limit": s.hellaswag_limit, "protocol": "lm-eval", "dtype": s.dtype}


def benchmarks(model: GPT, base_model: GPT | None, tokenizer: Tokenizer, s: argparse.Namespace, device: str) -> dict:
    """{"settings", "trained", "base"} (or "error"), printed side by side. Run it in the run's precision context."""
    results = {"settings": benchmark_settings(s)}
    if not results["settings"]["tasks"]:
        return results
    try:
        results["trained"] = run_benchmarks(model, tokenizer, s)
        if base_model is not None:
            results["base"] = base_benchmarks(base_model.to(device), tokenizer, s)
            base_model.cpu()
        print_benchmarks(results)
    except ValueError as e:  # e.g. a window too short for HellaSwag's endings; the checkpoint is saved
        results["error"] = str(e)
        print(f"benchmarks not run: {e} (choose others with --eval_tasks)")
    return results


def run_benchmarks(model: GPT, tokenizer: Tokenizer, s: argparse.Namespace) -> dict:
    """lm-eval's LAMBADA and WikiText in full; HellaSwag on its first --hellaswag_limit items (0 = all)."""
    tasks = benchmark_settings(s)["tasks"]
    full = [t for t in tasks if t != "hellaswag"]
    results = evaluate(model, tokenizer, full, mirror=s.mirror) if full else {}
    if "hellaswag" in tasks:
        results.update(evaluate(model, tokenizer, ["hellaswag"], limit=s.hellaswag_limit or None, mirror=s.mirror))
    return results


def base_benchmarks(base_model: GPT, tokenizer: Tokenizer, s: argparse.Namespace) -> dict:
    """The frozen base's benchmarks: reused from the base's own run folder when it measured the same ones."""
    saved = Path(s.init_from if s.init_from != "nano" else NANO_DIR) / "eval.json"
    if saved.is_file():
        bench = json.loads(saved.read_text()).get("benchmarks", {})
        if bench.get("settings") == benchmark_settings(s) and "trained" in bench:
            return bench["trained"]
    return run_benchmarks(base_model, tokenizer, s)


def print_side_by_side(title: str, rows: dict[str, tuple]) -> None:
    print(format_table([title, "frozen base", "trained"], [[name, base, trained]
                                                           for name, (base, trained) in rows.items()]))


def print_benchmarks(bench: dict) -> None:
    rows = {}
    for task, r in bench["trained"].items():
        for metric, m in r["metrics"].items():
            base = bench.get("base", {}).get(task, {}).get("metrics", {}).get(metric, {}).get("value")
            rows[f"{task} {metric} (n={r['n']})"] = (base, m["value"])
    print_side_by_side("benchmark (lm-eval)", rows)
