"""
Zero-shot LAMBADA, WikiText, HellaSwag and ARC-Easy from the command line; lm-eval's definitions by default, the
paper's protocol with --protocol paper (lab/evaluation.py describes both). Writes a JSON summary (--out) and, beside
it, one JSON line per item (eval.json -> eval.items.jsonl) for paired comparisons with `python -m tools.compare`.

    python eval_lambada.py --init_from pythia-160m                        # lm-eval: all four tasks, full sets
    python eval_lambada.py --init_from out/run1 --tasks lambada --limit 500
    python eval_lambada.py --init_from pythia-160m --protocol paper --dtype bfloat16

Any other lm-evaluation-harness task runs through our scorer with `python -m tools.harness` (docs/harness.md).
"""

import argparse
from pathlib import Path

from data.sources import DataError
from lab.checkpoint import CheckpointError, load_model, save_run_file
from lab.cli import ArgumentParser, add_model_args, name_list, out_file, positive_int, results_table, switches_of
from lab.evaluation import TASKS, check_request, evaluate, items_entry, items_jsonl, items_path
from lab.precision import dtype_name, for_inference, prefer_flash_attention, resolve_dtype
from model import SWITCHES


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
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    prefer_flash_attention()
    args = get_args(argv)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    try:
        check_request(tasks, args.protocol)  # before loading a model that may be large
        model, tokenizer, base_ref = load_model(args.init_from, **switches_of(args), mirror=args.mirror)
        dtype = resolve_dtype(args.dtype, args.device)
        args.dtype = dtype_name(dtype)  # recorded as used, not as asked ('auto')
        print(f"evaluating {args.init_from} in {args.dtype} on {args.device} ({args.protocol} protocol)")
        items: list[dict] = []
        with for_inference(model, args.device, dtype, whole_model=args.protocol == "paper"):
            results = evaluate(model, tokenizer, tasks, args.protocol, args.limit, args.batch_size, args.mirror, items)
    except (CheckpointError, DataError, ValueError) as e:
        raise SystemExit(f"error: {e}")
    print(results_table(results))
    config = {k: getattr(args, k) for k in ("init_from", *SWITCHES, "device", "dtype", "protocol", "limit",
                                             "batch_size", "mirror")}
    out = Path(args.out)
    text = items_jsonl(items)
    report = {"config": {**config, "tasks": tasks, "base": base_ref}, "results": results,
              "items": items_entry(out, text)}
    try:
        save_run_file(out.parent, items_path(out).name, text)  # first: the summary names what it was written with
        save_run_file(out.parent, out.name, report)
    except DataError as e:  # the results could not be written (e.g. a full disk)
        raise SystemExit(f"error: {e}")
    print(f"wrote {out} and {items_path(out)} ({len(items)} items)")
    return report


if __name__ == "__main__":
    main()
