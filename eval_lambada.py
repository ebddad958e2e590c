"""
Zero-shot LAMBADA, WikiText, HellaSwag and ARC-Easy from the command line; lm-eval's definitions by default, the
paper's protocol with --protocol paper (evaluation.py describes both). Writes a JSON summary (--out) and, beside
it, one JSON line per item (eval.json -> eval.items.jsonl) for paired comparisons with compare.py.

    python eval_lambada.py --init_from pythia-160m                        # lm-eval: all four tasks, full sets
    python eval_lambada.py --init_from out/run1 --tasks lambada --limit 500
    python eval_lambada.py --init_from pythia-160m --protocol paper --dtype bfloat16
    python eval_lambada.py --init_from out/run1 --harness piqa,winogrande   # any lm-eval task (docs/harness.md)
"""

import argparse
from pathlib import Path

from data.sources import DataError
from lab.checkpoint import CheckpointError, load_model, save_run_file
from lab.cli import ArgumentParser, add_model_args, format_table, name_list, out_file, positive_int, switches_of
from lab.evaluation import TASKS, check_request, evaluate, items_jsonl, items_path
from lab.precision import dtype_name, for_inference, resolve_dtype
from model import SWITCHES


def results_table(results: dict) -> str:
    """One row per task and metric, then a line for each task's truncation count and note."""
    rows = [[task, name, m["value"], m["stderr"], r["n"]]
            for task, r in results.items() for name, m in r["metrics"].items()]
    lines = [format_table(["task", "metric", "value", "stderr", "n"], rows)]
    for task, r in results.items():
        if r["truncated"]:
            lines.append(f"{task}: {r['truncated']} of {r['n']} items cut to fit the model's window")
        if "note" in r:
            lines.append(f"{task}: {r['note']}")
    return "\n".join(lines)


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--tasks", type=name_list, default=",".join(TASKS), help=f"comma-separated: {', '.join(TASKS)}")
    p.add_argument("--protocol", default="lm-eval", help="lm-eval (default) or paper")
    p.add_argument("--limit", type=positive_int, default=None,
                   help="score only the first N items (default: all; with --protocol paper the author's 500, "
                        "and for wikitext 300 raw lines)")
    p.add_argument("--batch_size", type=positive_int, default=32)
    p.add_argument("--out", type=out_file, default="eval.json",
                   help="where to write the JSON summary; the per-item records go beside it (.items.jsonl)")
    p.add_argument("--harness", type=name_list, default=None,
                   help="comma-separated lm-evaluation-harness tasks to run through harness.py instead of ours")
    p.add_argument("--harness_include", default=None, help="a folder of extra lm-eval task YAML files")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = get_args(argv)
    tasks = [t.strip() for t in (args.harness or args.tasks).split(",") if t.strip()]
    try:  # check the request before loading a model that may be large
        if args.harness:
            import harness  # lm-eval is optional: imported only when asked for
            manager = harness.task_manager(tasks, args.harness_include)
        else:
            check_request(tasks, args.protocol)
        model, tokenizer, base_ref = load_model(args.init_from, **switches_of(args), mirror=args.mirror)
        dtype = resolve_dtype(args.dtype, args.device)
        args.dtype = dtype_name(dtype)  # recorded as used, not as asked ('auto')
        print(f"evaluating {args.init_from} in {args.dtype} on {args.device} "
              f"({'lm-evaluation-harness' if args.harness else args.protocol + ' protocol'})")
        items: list[dict] = []
        with for_inference(model, args.device, dtype, whole_model=args.protocol == "paper"):
            if args.harness:
                lm = harness.HarnessLM(model, tokenizer, args.batch_size)
                results = harness.evaluate(lm, tasks, manager, args.limit)
            else:
                results = evaluate(model, tokenizer, tasks, args.protocol, args.limit, args.batch_size, args.mirror,
                                   items)
    except (CheckpointError, DataError, ValueError, ImportError) as e:
        raise SystemExit(f"error: {e}")
    print(results_table(results))
    config = {k: getattr(args, k) for k in ("init_from", *SWITCHES, "device", "dtype", "protocol", "limit",
                                             "batch_size", "mirror", "harness", "harness_include")}
    report = {"config": {**config, "tasks": tasks, "base": base_ref}, "results": results}
    out = Path(args.out)
    save_run_file(out.parent, items_path(out).name, items_jsonl(items))
    save_run_file(out.parent, out.name, report)
    print(f"wrote {out} and {items_path(out)} ({len(items)} items)")
    return report


if __name__ == "__main__":
    try:
        main()
    except DataError as e:  # the results could not be written (e.g. a full disk)
        raise SystemExit(f"error: {e}")
