"""
Zero-shot LAMBADA, WikiText and HellaSwag from the command line; lm-eval's definitions by default, the paper's
protocol with --protocol paper (evaluation.py describes both).

    python eval_lambada.py --init_from pythia-160m                        # lm-eval: all three tasks, full sets
    python eval_lambada.py --init_from out/run1 --tasks lambada --limit 500
    python eval_lambada.py --init_from pythia-160m --protocol paper --dtype bfloat16
"""

import argparse
from pathlib import Path

from checkpoint import CheckpointError, load_model, save_run_file
from cli import DTYPES, ArgumentParser, add_model_args, format_table, name_list, out_file, positive_int, switches_of
from data.sources import DataError
from evaluation import TASKS, check_request, evaluate
from model import SWITCHES


def results_table(results: dict) -> str:
    """One row per task and metric, then a line for each task's truncation count and note."""
    rows = [[task, name, m["value"], m["stderr"], r["n"]]
            for task, r in results.items() for name, m in r["metrics"].items()]
    lines = [format_table(["task", "metric", "value", "stderr", "n"], rows)]
    for task, r in results.items():
        if r["truncated"]:
            lines.append(f"{task}: {r['truncated']} of {r['requests']} requests left-truncated to the window")
        if "note" in r:
            lines.append(f"{task}: {r['note']}")
    return "\n".join(lines)


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--tasks", type=name_list, default=",".join(TASKS),
                   help="comma-separated: lambada, wikitext, hellaswag")
    p.add_argument("--protocol", default="lm-eval", help="lm-eval (default) or paper")
    p.add_argument("--limit", type=positive_int, default=None,
                   help="score only the first N documents (default: all; 500 with --protocol paper)")
    p.add_argument("--batch_size", type=positive_int, default=32)
    p.add_argument("--out", type=out_file, default="eval.json", help="where to write the JSON results")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = get_args(argv)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    try:
        check_request(tasks, args.protocol)  # before loading a model that may be large
        model, tokenizer, base_ref = load_model(args.init_from, **switches_of(args), mirror=args.mirror)
        model.to(device=args.device, dtype=DTYPES[args.dtype])
        results = evaluate(model, tokenizer, tasks, args.protocol, args.limit, args.batch_size, args.mirror)
    except (CheckpointError, DataError, ValueError) as e:
        raise SystemExit(f"error: {e}")
    print(results_table(results))
    config = {k: getattr(args, k) for k in ("init_from", *SWITCHES, "device", "dtype", "protocol", "limit",
                                             "batch_size", "mirror")}
    report = {"config": {**config, "tasks": tasks, "base": base_ref}, "results": results}
    out = Path(args.out)
    save_run_file(out.parent, out.name, report)
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    try:
        main()
    except DataError as e:  # the results could not be written (e.g. a full disk)
        raise SystemExit(f"error: {e}")
