"""
EleutherAI's lm-evaluation-harness (0.4.x) on any of our models: every task it knows (PIQA, Winogrande,
ARC-Challenge, MMLU, ...) for anything `--init_from` accepts, probe checkpoints included.

    python -m tools.harness --init_from out/run --tasks piqa,winogrande --limit 200
    python -m tools.harness --init_from out/run --tasks arc_easy_local --include_path tasks   # local task YAMLs

    import lm_eval
    from tools.harness import HarnessLM
    lm = HarnessLM.from_init("out/run", device="cuda")
    results = lm_eval.simple_evaluate(model=lm, tasks=["arc_challenge"])

HarnessLM is a thin adapter: log-likelihoods go through our one scorer (evaluation.score_pairs, with the same
tokenisation as our own tasks), generation through GPT.generate with its K/V cache. The harness is an optional
dependency: without it this module still imports, and the command stops with one line saying how to install it.
"""

import argparse
from collections import Counter
from pathlib import Path

import torch
from tokenizers import Tokenizer

from data.sources import DataError
from lab.checkpoint import CheckpointError, load_model, save_run_file
from lab.cli import ArgumentParser, add_model_args, name_list, out_file, positive_int, results_table, switches_of
from lab.evaluation import encode, encode_pair, eot_id, rolling_windows, score_pairs
from lab.precision import dtype_name, for_inference, prefer_flash_attention, resolve_dtype
from model import GPT, SWITCHES

try:
    from lm_eval.api.model import LM
except ImportError:  # optional: HarnessLM cannot be made without it, and the command says how to install it
    LM = None

NOT_INSTALLED = "lm-evaluation-harness is not installed; install it with `pip install lm-eval` (version 0.4.x)"


def require_lm_eval() -> None:
    if LM is None:
        raise ImportError(NOT_INSTALLED)


class HarnessLM(LM or object):
    """One of our models as an lm-eval model: `lm_eval.simple_evaluate(model=HarnessLM(model, tokenizer), ...)`.

    Requests are scored as lm-eval's own Hugging Face model (HFLM) scores them: the same (context, continuation)
    tokens, left-truncation to the window, rolling windows for perplexities, greedy generation cut at the first
    stop string. It also counts, per task, the requests it served and how many were left-truncated.
    """

    def __init__(self, model: GPT, tokenizer: Tokenizer, batch_size: int = 32, max_gen_toks: int = 256):
        require_lm_eval()
        super().__init__()
        self.model, self.tokenizer = model.eval(), tokenizer
        self.batch_size, self.max_gen_toks = batch_size, max_gen_toks
        self.window = model.config.block_size
        self.eot = eot_id(tokenizer)
        self._device = next(model.parameters()).device
        self.requests, self.truncated = Counter(), Counter()

    @classmethod
    def from_init(cls, init_from: str, device: str = "cpu", dtype: torch.dtype = torch.float32,
                  batch_size: int = 32, mirror: str | None = None, **switches) -> "HarnessLM":
        """Load a model as every script does (checkpoint.load_model) and wrap it."""
        model, tokenizer, _ = load_model(init_from, **switches, mirror=mirror)
        return cls(model.to(device=device, dtype=dtype), tokenizer, batch_size)

    def _count(self, requests: list, truncated: list[bool]) -> None:
        for request, cut in zip(requests, truncated):
            self.requests[request.task_name] += 1
            self.truncated[request.task_name] += cut

    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(summed log-probability of the continuation, whether greedy decoding would produce it)."""
        scores = score_pairs(self.model, [encode_pair(self.tokenizer, *r.args) for r in requests], self.batch_size)
        self._count(requests, [s.truncated for s in scores])
        results = [(s.logprob, s.greedy) for s in scores]
        for request, result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", request.args, result)
        return results

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Log-probability of whole documents, each in disjoint windows of the model's context."""
        docs = [rolling_windows(encode(self.tokenizer, r.args[0]), self.eot, self.window) for r in requests]
        scores = iter(score_pairs(self.model, [pair for doc in docs for pair in doc], self.batch_size))
        results = [sum(next(scores).logprob for _ in doc) for doc in docs]
        self._count(requests, [False] * len(requests))  # every window fits by construction
        for request, result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, result)
        return results

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        results = [self._generate(*r.args) for r in requests]
        self._count(requests, [cut for _, cut in results])
        for request, (text, _) in zip(requests, results):
            self.cache_hook.add_partial("generate_until", request.args, text)
        return [text for text, _ in results]

    def _generate(self, context: str, gen_kwargs: dict) -> tuple[str, bool]:
        """(the continuation of one prompt, whether the prompt was left-truncated), as HFLM makes it.

        GPT.generate has no stop hook, so it runs all max_gen_toks tokens; the text is then cut at the first
        <|endoftext|> and at the first stop string, which gives HFLM's result.
        """
        until = gen_kwargs.get("until") or []
        until = [until] if isinstance(until, str) else until
        n_new = gen_kwargs.get("max_gen_toks", self.max_gen_toks)
        if n_new >= self.window:
            raise ValueError(f"max_gen_toks={n_new} leaves no room for a prompt in a window of {self.window} tokens")
        # greedy unless the task asks for sampling (do_sample, or a temperature above 0 without do_sample)
        sample = gen_kwargs.get("do_sample", gen_kwargs.get("temperature", 0.0) > 0)
        temperature = gen_kwargs.get("temperature", 1.0) if sample else 0.0
        ids = encode(self.tokenizer, context) or [self.eot]
        prompt = ids[-(self.window - n_new):]  # keep room for the new tokens, as HFLM
        idx = torch.tensor([prompt], device=self._device)
        new = self.model.generate(idx, n_new, temperature, gen_kwargs.get("top_k"))[0, len(prompt):].tolist()
        text = self.tokenizer.decode(new[:new.index(self.eot)] if self.eot in new else new)
        for stop in until:
            text = text.split(stop)[0] if stop else text
        return text, len(prompt) < len(ids)


def task_manager(tasks: list[str], include_path: str | None = None):
    """An lm-eval TaskManager that knows every requested task; ValueError naming the first unknown one.

    Tasks all found in include_path load without indexing lm-eval's own task files, the slow part of a TaskManager.
    """
    from lm_eval.tasks import TaskManager

    if include_path:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(local.match_tasks([t]) for t in tasks):
            return local
    manager = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if not manager.match_tasks([t])]
    if unknown:
        raise ValueError(f"lm-eval knows no task {unknown[0]!r}; `lm-eval ls tasks` lists them, and "
                         f"--include_path adds a folder of task YAML files")
    return manager


def run_harness(lm: HarnessLM, tasks: list[str], manager=None, limit: int | None = None, **kwargs) -> dict:
    """Run lm-eval tasks through the adapter: {task: {"metrics": {name: {"value", "stderr"}}, "n", "requests",
    "truncated", "n_shot", "version"}}, the layout of evaluation.evaluate, so one table printer (cli.results_table)
    shows both.

    Metric names are lm-eval's; a filter other than "none" is kept in the name (e.g. "exact_match,strict-match").
    Extra keyword arguments go to lm_eval.simple_evaluate (num_fewshot, gen_kwargs, ...).
    """
    from lm_eval import simple_evaluate

    lm.requests.clear()
    lm.truncated.clear()
    try:
        out = simple_evaluate(model=lm, tasks=tasks, task_manager=manager or task_manager(tasks), limit=limit,
                              log_samples=False, **kwargs)
    except ConnectionError as e:  # most tasks read their data from the Hugging Face Hub
        raise ValueError(f"{e}; offline, write a task YAML that reads local files and pass its folder with "
                         f"--include_path (docs/harness.md)") from e
    results = {}
    for task, raw in out["results"].items():
        metrics = {}
        for key, value in raw.items():
            name, _, filt = key.partition(",")
            if not filt or name.endswith("_stderr"):
                continue
            stderr = raw.get(f"{name}_stderr,{filt}")
            metrics[name if filt == "none" else key] = {  # lm-eval writes "N/A" for a missing stderr
                "value": float(value), "stderr": float(stderr) if isinstance(stderr, (int, float)) else None}
        results[task] = {"metrics": metrics, "n": out["n-samples"].get(task, {}).get("effective"),
                         "requests": lm.requests[task], "truncated": lm.truncated[task],
                         "n_shot": out["n-shot"].get(task), "version": out["versions"].get(task)}
    return results


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(prog="python -m tools.harness", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--tasks", type=name_list, required=True,
                   help="comma-separated lm-evaluation-harness task (or group) names, e.g. piqa,winogrande")
    p.add_argument("--include_path", default=None, help="a folder of extra lm-eval task YAML files")
    p.add_argument("--limit", type=positive_int, default=None, help="score only the first N items of each task")
    p.add_argument("--batch_size", type=positive_int, default=32)
    p.add_argument("--out", type=out_file, default="harness.json", help="where to write the JSON summary")
    args = p.parse_args(argv)
    if args.include_path and not Path(args.include_path).is_dir():  # else the task name would take the blame
        p.error(f"--include_path {args.include_path}: no such folder of task YAML files")
    return args


def main(argv: list[str] | None = None) -> dict:
    prefer_flash_attention()
    args = get_args(argv)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    try:
        require_lm_eval()
        manager = task_manager(tasks, args.include_path)  # the names are checked before a large model loads
        model, tokenizer, base_ref = load_model(args.init_from, **switches_of(args), mirror=args.mirror)
        dtype = resolve_dtype(args.dtype, args.device)
        args.dtype = dtype_name(dtype)  # recorded as used, not as asked ('auto')
        print(f"evaluating {args.init_from} in {args.dtype} on {args.device} (lm-evaluation-harness)")
        with for_inference(model, args.device, dtype):
            results = run_harness(HarnessLM(model, tokenizer, args.batch_size), tasks, manager, args.limit)
        print(results_table(results))
        config = {k: getattr(args, k) for k in ("init_from", *SWITCHES, "device", "dtype", "limit", "batch_size",
                                                 "mirror", "include_path")}
        report = {"config": {**config, "tasks": tasks, "base": base_ref}, "results": results}
        out = Path(args.out)
        save_run_file(out.parent, out.name, report)
    except (CheckpointError, DataError, ValueError, ImportError) as e:  # DataError: the results could not be written
        raise SystemExit(f"error: {e}")
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
