"""
The report at the end of a training run: lm-eval benchmarks of the frozen base and the trained model, side by side.
train.py prints it and keeps it in the run folder's eval.json.
"""

import json
from pathlib import Path

from tokenizers import Tokenizer

from data.benchmarks import ARC_EASY, HELLASWAG, LAMBADA, WIKITEXT
from data.sources import fetch, sha256
from lab.checkpoint import NANO_DIR
from lab.cli import format_table
from lab.evaluation import check_data, evaluate
from model import GPT

# The file each task reads under the lm-eval protocol
TASK_FILES = {"lambada": LAMBADA, "wikitext": WIKITEXT, "hellaswag": HELLASWAG, "arc_easy": ARC_EASY["test"]}


def benchmark_settings(eval_tasks: str, hellaswag_limit: int, dtype: str) -> dict:
    """What a run's end-of-run benchmarks measure (train.py's --eval_tasks, --hellaswag_limit and the dtype used);
    a base's saved results are reused only when these are equal."""
    tasks = [t for t in eval_tasks.split(",") if t and t != "none"]
    return {"tasks": tasks, "hellaswag_limit": hellaswag_limit, "protocol": "lm-eval", "dtype": dtype}


def data_files(eval_tasks: str, mirror: str | None = None) -> dict[str, str]:
    """{file: sha256} of each benchmark file a run reads (its end-of-run tasks, and LAMBADA, which a dry run scores),
    each fetched and verified first (present, its pinned digest or full count, well-formed)."""
    tasks = sorted({*benchmark_settings(eval_tasks, 0, "")["tasks"], "lambada"})
    check_data(tasks, mirror)
    return {TASK_FILES[t]: sha256(fetch(TASK_FILES[t], mirror)) for t in tasks}


def benchmarks(model: GPT, base_model: GPT | None, tokenizer: Tokenizer, settings: dict, init_from: str,
               device: str, mirror: str | None = None) -> dict:
    """{"settings", "trained", "base"} (or "error"), printed side by side. Run it in the run's precision context."""
    results = {"settings": settings}
    if not settings["tasks"]:
        return results
    try:
        results["trained"] = run_benchmarks(model, tokenizer, settings, mirror)
        if base_model is not None:
            results["base"] = base_benchmarks(base_model.to(device), tokenizer, settings, init_from, mirror)
            base_model.cpu()
        print_benchmarks(results)
    except ValueError as e:  # e.g. a window too short for HellaSwag's endings; the checkpoint is saved
        results["error"] = str(e)
        print(f"benchmarks not run: {e} (choose others with --eval_tasks)")
    return results


def run_benchmarks(model: GPT, tokenizer: Tokenizer, settings: dict, mirror: str | None = None) -> dict:
    """lm-eval's LAMBADA and WikiText in full; HellaSwag on its first hellaswag_limit items (0 = all)."""
    tasks = settings["tasks"]
    full = [t for t in tasks if t != "hellaswag"]
    results = evaluate(model, tokenizer, full, mirror=mirror) if full else {}
    if "hellaswag" in tasks:
        results.update(evaluate(model, tokenizer, ["hellaswag"], limit=settings["hellaswag_limit"] or None,
                                mirror=mirror))
    return results


def base_benchmarks(base_model: GPT, tokenizer: Tokenizer, settings: dict, init_from: str,
                    mirror: str | None = None) -> dict:
    """The frozen base's benchmarks: reused from the base's own run folder when it measured the same ones."""
    saved = Path(init_from if init_from != "nano" else NANO_DIR) / "eval.json"
    if saved.is_file():
        bench = json.loads(saved.read_text()).get("benchmarks", {})
        if bench.get("settings") == settings and "trained" in bench:
            return bench["trained"]
    return run_benchmarks(base_model, tokenizer, settings, mirror)


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
