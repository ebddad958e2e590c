"""
Zero-shot evaluation on LAMBADA, WikiText, HellaSwag and ARC-Easy: the one log-likelihood scorer, the tasks built on
it, and their metrics computed from per-item records. The command line is eval_lambada.py.

By default every number follows EleutherAI's lm-evaluation-harness (the definitions behind every published Pythia
figure); `--protocol paper` re-measures the paper's Table 2 exactly as the author's code does (07_benchmarks.py's
run_all_evals; docs/protocol.md lists both protocols side by side).

    python eval_lambada.py --init_from pythia-160m                        # lm-eval: all four tasks, full sets
    python eval_lambada.py --init_from out/run1 --tasks lambada --limit 500
    python eval_lambada.py --init_from pythia-160m --protocol paper --dtype bfloat16

lm-eval protocol
  lambada    lambada_openai, 5,153 passages: acc (every target token is the greedy argmax) and
             ppl = exp(-mean over passages of the target's summed log-probability)
  wikitext   WikiText-2 raw test pages, lm-eval's detokenizer, disjoint rolling windows of the model's context;
             word_perplexity, byte_perplexity, bits_per_byte counted on the original page text
  hellaswag  lm-eval's preprocessing; acc (argmax of summed log-probability) and acc_norm (divided by the
             ending's character length)
  arc_easy   ARC-Easy test, 2,376 questions: "Question: " + stem + "\nAnswer:" then " " + choice; acc, acc_norm
paper protocol (the author's evaluate_lambada, evaluate_perplexity, evaluate_hellaswag, evaluate_arc_easy)
  lambada    first 500 passages; context and " " + last word tokenised separately; acc only; passages over
             512 tokens left out
  wikitext   "PPL": of the first 300 raw lines of WikiText-103 validation, those of >= 50 stripped characters,
             unstripped, cut to 512 tokens, >= 10 tokens; exp(unweighted mean over lines of the mean token loss)
  hellaswag  first 500; ctx + " " + ending cut to 512 tokens, the ending = the tokens after as many as ctx has
             alone; mean log-probability per ending token; acc
  arc_easy   ARC-Easy validation, first 500; stem + " " + choice, scored as hellaswag; acc

Standard errors: acc as lm-eval (sample standard deviation / sqrt(n)); perplexities over documents by the delta
method, ppl * stderr(per-document loss) (lm-eval bootstraps LAMBADA's instead); none for WikiText's weighted
perplexities, as lm-eval reports none.
"""

import hashlib
import json
import math
import re
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import torch
from tokenizers import Tokenizer

from data import benchmarks
from data.sources import DataError, fetch, sha256
from lab.loss import LOSS_CHUNK, row_losses

TASKS = ("lambada", "wikitext", "hellaswag", "arc_easy")
PROTOCOLS = ("lm-eval", "paper")
# The author's max_samples: items of each set (for wikitext, raw lines of the validation file)
PAPER_LIMITS = {"lambada": 500, "wikitext": 300, "hellaswag": 500, "arc_easy": 500}
PAPER_MAX_TOKENS = 512  # every sequence of the author's evaluation is cut (or, for LAMBADA, left out) beyond this
PAPER_MIN_TOKENS = 10  # "PPL" lines shorter than this are left out
PAPER_MIN_CHARS = 50  # ... and so are lines whose stripped text is shorter than this

Pair = tuple[list[int], list[int]]  # (context tokens, continuation tokens)


class Score(NamedTuple):
    logprob: float  # summed log-probability of the continuation tokens
    greedy: bool  # every continuation token is the argmax of its prediction
    n_tokens: int  # continuation tokens scored
    truncated: bool  # the context was cut on the left to fit the model's window


# --- tokenisation, as lm-eval's HFLM ---

def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def eot_id(tokenizer: Tokenizer) -> int:
    """The <|endoftext|> token, which stands in for an empty context and starts rolling windows."""
    i = tokenizer.token_to_id("<|endoftext|>")
    if i is None:
        raise ValueError("the tokenizer has no <|endoftext|> token, which evaluation uses as the empty context")
    return i


def encode_pair(tokenizer: Tokenizer, context: str, continuation: str) -> Pair:
    """Tokens of (context, continuation) as lm-eval makes them.

    Trailing whitespace moves from the context to the continuation, and the continuation's tokens are those of
    encode(context + continuation) after encode(context), so a BPE merge across the boundary is scored as the
    model would see it. An empty context becomes <|endoftext|>.
    """
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    if not context:
        return [eot_id(tokenizer)], encode(tokenizer, continuation)
    ctx = encode(tokenizer, context)
    return ctx, encode(tokenizer, context + continuation)[len(ctx):]


def paper_pair(tokenizer: Tokenizer, prefix: str, text: str) -> Pair:
    """Tokens of (prefix, rest) as the author's evaluate_hellaswag and evaluate_arc_easy split them.

    `text` (prefix + " " + choice) is tokenised and cut to 512 tokens; the choice is taken to start after as many
    tokens as `prefix` has when tokenised alone, whether or not a BPE merge crosses the boundary. A choice pushed
    wholly past 512 tokens is empty (the author's score for it is then 0).
    """
    ids = encode(tokenizer, text)[:PAPER_MAX_TOKENS]
    n = len(encode(tokenizer, prefix))
    return ids[:n], ids[n:]


def rolling_windows(tokens: list[int], prefix: int, window: int) -> list[Pair]:
    """A whole document as disjoint (context, continuation) pairs: lm-eval's loglikelihood_rolling.

    That is get_rolling_token_windows(max_seq_len=window, context_len=1) + make_disjoint_window: blocks of
    `window` tokens are predicted in turn, the first from the prefix token alone, each later one from the token
    just before it, and the last (short) block from as many earlier tokens as fill the window.
    """
    pairs = []
    for start in range(0, len(tokens), window):
        end = min(start + window, len(tokens))
        context = [prefix] if start == 0 else tokens[end - window - 1:start]
        pairs.append((context, tokens[start:end]))
    return pairs


# --- the one scorer ---

@torch.inference_mode()
def score_pairs(model: torch.nn.Module, pairs: list[Pair], batch_size: int = 32,
                round_to: torch.dtype | None = None) -> list[Score]:
    """Log-likelihood of each continuation given its context, in batches of similar length.

    The longest requests go first (an out-of-memory batch size fails at once, and padding stays small);
    results come back in the order of `pairs`. Runs where the model's weights are. An empty continuation scores
    log-probability 0 with no forward pass. With `round_to`, each token's log-probability and each continuation's
    sum are rounded to that dtype, as code that normalises in a bf16 model's own dtype does (the author's).
    """
    scores: list[Score | None] = [Score(0.0, True, 0, False) if not cont else None for _, cont in pairs]
    order = sorted((i for i, s in enumerate(scores) if s is None),
                   key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
    for start in range(0, len(order), batch_size):
        batch = order[start:start + batch_size]
        for i, score in zip(batch, _score_batch(model, [pairs[i] for i in batch], round_to)):
            scores[i] = score
    return scores


def _score_batch(model: torch.nn.Module, pairs: list[Pair], round_to: torch.dtype | None) -> list[Score]:
    window = model.config.block_size
    device = next(model.parameters()).device
    inputs, rows, cols, targets = [], [], [], []
    for b, (ctx, cont) in enumerate(pairs):
        if not ctx or len(cont) > window:
            raise ValueError(f"cannot score a continuation of {len(cont)} tokens after {len(ctx)} context tokens "
                             f"with a window of {window}")
        # As lm-eval: keep the last window + 1 tokens (dropping the oldest context), feed all but the last.
        seq = (ctx + cont)[-(window + 1):][:-1]
        inputs.append(seq)
        rows += [b] * len(cont)
        cols += range(len(seq) - len(cont), len(seq))  # the positions that predict the continuation
        targets += cont
    # Right padding: under causal attention no real position sees the pad, so no mask is needed.
    x = torch.zeros(len(inputs), max(map(len, inputs)), dtype=torch.long)
    for b, seq in enumerate(inputs):
        x[b, :len(seq)] = torch.tensor(seq)
    r, c, t = (torch.tensor(v, dtype=torch.long, device=device) for v in (rows, cols, targets))
    # Only the scored positions need the output layer (LAMBADA scores ~2 of ~100 positions, and the output layer
    # is a third of a small model's compute): logits [n_scored, V], a chunk of rows at a time (WikiText scores
    # every position), with the full-vocabulary log-softmax in fp32 whatever the weights' dtype.
    h = model.hidden_states(x.to(device))[r, c]
    token_lp, misses = [], []
    chunk = max(1, LOSS_CHUNK // model.config.vocab_size)  # rows
    for i in range(0, len(h), chunk):
        logits, t_i = model.lm_head(h[i:i + chunk]).float(), t[i:i + chunk]
        token_lp.append(torch.log_softmax(logits, dim=-1).gather(1, t_i[:, None])[:, 0])
        misses.append(logits.argmax(dim=-1) != t_i)
    token_lp = torch.cat(token_lp)
    token_lp = (token_lp if round_to is None else token_lp.to(round_to)).double().cpu()
    misses = torch.cat(misses).double().cpu()
    owner = torch.tensor(rows, dtype=torch.long)  # which request each scored token belongs to
    lp_sum = torch.zeros(len(pairs), dtype=torch.float64).index_add_(0, owner, token_lp)
    if round_to is not None:
        lp_sum = lp_sum.to(round_to).double()
    n_miss = torch.zeros(len(pairs), dtype=torch.float64).index_add_(0, owner, misses)
    return [Score(lp_sum[b].item(), n_miss[b].item() == 0, len(cont), len(ctx) + len(cont) > window + 1)
            for b, (ctx, cont) in enumerate(pairs)]


# --- per-item records, and the metrics computed from them ---

def item_record(task: str, protocol: str, item: int, logprob: float, tokens: int, truncated: bool,
                correct: bool | None, **extra) -> dict:
    """One item's result, with the same fields for every task (a line of the .items.jsonl file).

    item: its index in the task's data (a passage, a WikiText page or raw line, a question); logprob: the summed
    log-probability of what is scored (the target word, the page or line, the gold choice); tokens: how many
    tokens that is; truncated: whether it was cut to fit the model's window; correct: None where the task has no
    accuracy.
    Multiple choice adds per-choice `logprobs` and `choice_tokens`, `pred` and `gold` (and `pred_norm`,
    `correct_norm` under lm-eval); WikiText pages add `words` and `bytes`.
    """
    return {"task": task, "protocol": protocol, "item": item, "logprob": logprob, "tokens": tokens,
            "truncated": truncated, "correct": correct, **extra}


class Metric(NamedTuple):
    """A metric as transform(sum over items of num / sum over items of den). One definition gives its value, its
    standard error and its paired bootstrap (lab/stats.py)."""
    num: Callable[[dict], float]
    den: Callable[[dict], float]
    transform: Callable
    accuracy: bool = False  # a mean of right/wrong outcomes, to which McNemar's test applies


ONE = lambda r: 1.0
IDENTITY = lambda x: x
NLL = lambda r: -r["logprob"]
ACC = Metric(lambda r: float(r["correct"]), ONE, IDENTITY, accuracy=True)
ACC_NORM = Metric(lambda r: float(r["correct_norm"]), ONE, IDENTITY, accuracy=True)


def task_metrics(task: str, protocol: str) -> dict[str, Metric]:
    """The metrics a task reports under a protocol."""
    if task == "wikitext" and protocol == "paper":  # exp of the unweighted mean over lines of the mean token loss
        return {"ppl": Metric(lambda r: -r["logprob"] / r["tokens"], ONE, np.exp)}
    if task == "wikitext":  # lm-eval: weighted by the original page's words and bytes
        return {"word_perplexity": Metric(NLL, lambda r: r["words"], np.exp),
                "byte_perplexity": Metric(NLL, lambda r: r["bytes"], np.exp),
                "bits_per_byte": Metric(NLL, lambda r: r["bytes"], lambda x: x / math.log(2))}
    if protocol == "paper":  # the paper reports accuracy only
        return {"acc": ACC}
    return {"acc": ACC, "ppl": Metric(NLL, ONE, np.exp)} if task == "lambada" else {"acc": ACC, "acc_norm": ACC_NORM}


def mean_stderr(xs: list[float]) -> float | None:
    """Standard error of a mean: sample standard deviation (n - 1) / sqrt(n), lm-eval's mean_stderr."""
    n = len(xs)
    if n < 2:
        return None
    mu = sum(xs) / n
    return math.sqrt(sum((x - mu) ** 2 for x in xs) / (n - 1) / n)


def metric_value(metric: Metric, records: list[dict]) -> dict:
    """{"value", "stderr"}: a mean over items has lm-eval's standard error, exp of a mean the delta method's
    (ppl * stderr of the mean loss); a ratio of sums (WikiText's words and bytes) none, as lm-eval."""
    nums, dens = [metric.num(r) for r in records], [metric.den(r) for r in records]
    value = float(metric.transform(sum(nums) / sum(dens)))
    se = mean_stderr(nums) if all(d == 1 for d in dens) else None
    if se is not None and metric.transform is np.exp:
        se *= value  # d exp(m) = exp(m) dm
    return {"value": value, "stderr": se}


def argmax(xs: list[float]) -> int:
    return max(range(len(xs)), key=lambda i: (xs[i], -i))  # the first of equal maxima, as numpy and the author


def _limit(task: str, protocol: str, limit: int | None) -> int | None:
    return limit if limit is not None else (PAPER_LIMITS[task] if protocol == "paper" else None)


def _result(task: str, protocol: str, records: list[dict], scores: list[Score], data: str, mirror: str | None,
            note: str | None = None) -> dict:
    """A task's result: metrics from its records, counts, the data file's sha256, and the records under "items"."""
    if not records:
        raise ValueError(f"{task}: no item of the first ones asked for can be scored under the {protocol} protocol; "
                         f"raise --limit")
    metrics = {name: metric_value(m, records) for name, m in task_metrics(task, protocol).items()}
    result = {"metrics": metrics, "n": len(records), "requests": len(scores),
              "truncated": sum(r["truncated"] for r in records), "data": {data: sha256(fetch(data, mirror))}}
    if note:
        result["note"] = note
    return {**result, "items": records}


# --- the tasks ---

def lambada(model: torch.nn.Module, tokenizer: Tokenizer, protocol: str = "lm-eval", limit: int | None = None,
            batch_size: int = 32, mirror: str | None = None) -> dict:
    passages = benchmarks.lambada(mirror)[:_limit("lambada", protocol, limit)]
    if protocol == "paper":  # the author tokenises the context and " " + word each on its own
        pairs = [(encode(tokenizer, c), encode(tokenizer, t)) for c, t in passages]
    else:
        pairs = [encode_pair(tokenizer, c, t) for c, t in passages]
    # The author leaves out passages over 512 tokens (with Pythia's tokenizer LAMBADA has none: at most 224)
    kept = [i for i, (c, t) in enumerate(pairs) if protocol == "lm-eval" or len(c) + len(t) <= PAPER_MAX_TOKENS]
    scores = score_pairs(model, [pairs[i] for i in kept], batch_size)
    records = [item_record("lambada", protocol, i, s.logprob, s.n_tokens, s.truncated, s.greedy)
               for i, s in zip(kept, scores)]
    left_out = len(pairs) - len(kept)
    note = f"{left_out} passages over {PAPER_MAX_TOKENS} tokens left out, as the author's code" if left_out else None
    return _result("lambada", protocol, records, scores, benchmarks.LAMBADA, mirror, note)


def wikitext(model: torch.nn.Module, tokenizer: Tokenizer, protocol: str = "lm-eval", limit: int | None = None,
             batch_size: int = 32, mirror: str | None = None) -> dict:
    if protocol == "paper":
        return _wikitext_paper(model, tokenizer, limit, batch_size, mirror)
    pages = benchmarks.wikitext_pages(mirror)[:limit]
    prefix = eot_id(tokenizer)
    windows = [rolling_windows(encode(tokenizer, benchmarks.wikitext_detokenize(p)), prefix,
                               model.config.block_size) for p in pages]
    flat = score_pairs(model, [w for page in windows for w in page], batch_size)
    records, k = [], 0
    for i, (page, page_windows) in enumerate(zip(pages, windows)):
        s = flat[k:k + len(page_windows)]
        k += len(page_windows)
        # lm-eval counts words and bytes on the original page, before detokenisation
        records.append(item_record("wikitext", "lm-eval", i, sum(x.logprob for x in s),
                                   sum(x.n_tokens for x in s), any(x.truncated for x in s), None,
                                   words=len(re.split(r"\s+", page)), bytes=len(page.encode("utf-8"))))
    return _result("wikitext", "lm-eval", records, flat, benchmarks.WIKITEXT, mirror)


def _wikitext_paper(model: torch.nn.Module, tokenizer: Tokenizer, limit: int | None, batch_size: int,
                    mirror: str | None) -> dict:
    """The author's evaluate_perplexity: each line alone from its first token, the mean loss over the rest (the
    Hugging Face causal-LM loss), no <|endoftext|> before it."""
    lines = benchmarks.wikitext_paper_lines(mirror, _limit("wikitext", "paper", limit), PAPER_MIN_CHARS)
    cut = [(i, encode(tokenizer, line)[:PAPER_MAX_TOKENS]) for i, line in lines]
    kept = [(i, ids) for i, ids in cut if len(ids) >= PAPER_MIN_TOKENS]
    fits = model.config.block_size + 1  # a window of inputs predicts one token more (the last input's is unused)
    scores = score_pairs(model, [(ids[:1], ids[1:fits]) for _, ids in kept], batch_size)
    records = [item_record("wikitext", "paper", i, s.logprob, s.n_tokens, len(ids) > fits, None)
               for (i, ids), s in zip(kept, scores)]
    return _result("wikitext", "paper", records, scores, benchmarks.WIKITEXT_VALID, mirror)


def _choices(model: torch.nn.Module, task: str, protocol: str, items: list[tuple[int, list[Pair], int, list[str]]],
             batch_size: int) -> tuple[list[dict], list[Score]]:
    """Multiple choice: items as (index, a pair per choice, gold index, choice texts); every choice of every item
    is scored in one call to the scorer. The paper's scores are rounded to the model's dtype, as the author's
    log_softmax and sum run in it (in bf16 that can tie or swap close choices)."""
    round_to = next(model.parameters()).dtype if protocol == "paper" else None
    scores = score_pairs(model, [p for _, pairs, _, _ in items for p in pairs], batch_size, round_to)
    records, k = [], 0
    for index, pairs, gold, texts in items:
        s = scores[k:k + len(pairs)]
        k += len(pairs)
        lps, ns = [x.logprob for x in s], [x.n_tokens for x in s]
        extra = {"logprobs": lps, "choice_tokens": ns, "gold": gold}
        if protocol == "paper":  # the author: mean log-probability per choice token (an empty choice scores 0)
            extra["pred"] = argmax([lp / max(n, 1) for lp, n in zip(lps, ns)])
        else:  # lm-eval: summed log-probability, and divided by the choice's length in characters
            extra["pred"] = argmax(lps)
            extra["pred_norm"] = argmax([lp / len(t) for lp, t in zip(lps, texts)])
            extra["correct_norm"] = extra["pred_norm"] == gold
        records.append(item_record(task, protocol, index, lps[gold], ns[gold], any(x.truncated for x in s),
                                   extra["pred"] == gold, **extra))
    return records, scores


def hellaswag(model: torch.nn.Module, tokenizer: Tokenizer, protocol: str = "lm-eval", limit: int | None = None,
              batch_size: int = 32, mirror: str | None = None) -> dict:
    items = benchmarks.hellaswag(mirror)[:_limit("hellaswag", protocol, limit)]
    if protocol == "paper":  # the raw ctx and endings
        mc = [(i, [paper_pair(tokenizer, it.ctx, it.ctx + " " + e) for e in it.endings], it.gold, it.endings)
              for i, it in enumerate(items)]
    else:  # lm-eval puts a space between query and choice (its target_delimiter)
        mc = [(i, [encode_pair(tokenizer, it.query, " " + c) for c in it.choices], it.gold, it.choices)
              for i, it in enumerate(items)]
    records, scores = _choices(model, "hellaswag", protocol, mc, batch_size)
    return _result("hellaswag", protocol, records, scores, benchmarks.HELLASWAG, mirror)


def arc_easy(model: torch.nn.Module, tokenizer: Tokenizer, protocol: str = "lm-eval", limit: int | None = None,
             batch_size: int = 32, mirror: str | None = None) -> dict:
    """lm-eval: the test split, "Question: " + stem + "\\nAnswer:" then " " + choice. The paper: the validation
    split, stem + " " + choice split where the stem's own tokens end."""
    split = "validation" if protocol == "paper" else "test"
    items = benchmarks.arc_easy(split, mirror)[:_limit("arc_easy", protocol, limit)]
    if protocol == "paper":
        mc = [(i, [paper_pair(tokenizer, it.stem, it.stem + " " + c) for c in it.choices], it.gold, it.choices)
              for i, it in enumerate(items)]
    else:
        mc = [(i, [encode_pair(tokenizer, f"Question: {it.stem}\nAnswer:", " " + c) for c in it.choices], it.gold,
               it.choices) for i, it in enumerate(items)]
    records, scores = _choices(model, "arc_easy", protocol, mc, batch_size)
    return _result("arc_easy", protocol, records, scores, benchmarks.ARC_EASY[split], mirror)


TASK_FNS: dict[str, Callable[..., dict]] = {"lambada": lambada, "wikitext": wikitext, "hellaswag": hellaswag,
                                            "arc_easy": arc_easy}
# The reader of each task's data file: check_data runs them to find a bad file before a long run, not after it.
TASK_DATA: dict[str, Callable[..., list]] = {"lambada": benchmarks.lambada, "wikitext": benchmarks.wikitext_pages,
                                            "hellaswag": benchmarks.hellaswag,
                                            "arc_easy": lambda mirror: benchmarks.arc_easy("test", mirror)}


def check_data(tasks: tuple[str, ...] | list[str], mirror: str | None = None) -> None:
    """Read the data file of every task (present, sha256 where pinned, well-formed), or raise its DataError."""
    for task in tasks:
        TASK_DATA[task](mirror)


def check_request(tasks: tuple[str, ...] | list[str], protocol: str) -> None:
    """ValueError naming the first unknown task or protocol."""
    unknown = [t for t in tasks if t not in TASK_FNS]
    if unknown:
        raise ValueError(f"unknown task {unknown[0]!r}; choose from {', '.join(TASKS)}")
    twice = [t for i, t in enumerate(tasks) if t in tasks[:i]]
    if twice:
        raise ValueError(f"the task list names {twice[0]} twice; name each task once")
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; choose lm-eval or paper")


def evaluate(model: torch.nn.Module, tokenizer: Tokenizer, tasks: tuple[str, ...] | list[str] = TASKS,
             protocol: str = "lm-eval", limit: int | None = None, batch_size: int = 32,
             mirror: str | None = None, items: list[dict] | None = None) -> dict:
    """{task: {"metrics": {name: {"value", "stderr"}}, "n", "requests", "truncated", "data", "seconds"}}.

    The model runs where its weights are and in their dtype. Given a list as `items`, the per-item records
    (item_record) of every task are appended to it, task by task.
    """
    check_request(tasks, protocol)
    was_training = model.training
    model.eval()
    results = {}
    for task in tasks:
        t0 = time.time()
        result = TASK_FNS[task](model, tokenizer, protocol, limit, batch_size, mirror)
        records = result.pop("items")
        if items is not None:
            items.extend(records)
        results[task] = {**result, "seconds": round(time.time() - t0, 2)}
    model.train(was_training)
    return results


def items_path(summary: str | Path) -> Path:
    """Where the per-item records of an evaluation's JSON summary live: eval.json -> eval.items.jsonl."""
    summary = Path(summary)
    return summary.with_name((summary.stem if summary.suffix == ".json" else summary.name) + ".items.jsonl")


def items_jsonl(records: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def items_entry(summary: Path, text: str) -> dict:
    """What a JSON summary records of its per-item records, so that a reader can tell them from another run's
    (a disk that fills between the two writes leaves new records beside an old summary)."""
    return {"file": items_path(summary).name, "sha256": hashlib.sha256(text.encode()).hexdigest(),
            "lines": text.count("\n")}


def read_items(path: str | Path) -> list[dict]:
    """The per-item records of an evaluation, given its .items.jsonl file or its JSON summary beside it; refused
    when the summary beside them records other records than these."""
    path = Path(path)
    if not path.name.endswith(".items.jsonl"):
        path = items_path(path)
    if not path.is_file():
        raise DataError(f"{path} does not exist; eval_lambada.py writes it beside its JSON summary")
    summary = path.with_name(path.name[:-len(".items.jsonl")] + ".json")
    try:
        recorded = json.loads(summary.read_text()).get("items") if summary.is_file() else None
    except (ValueError, OSError, AttributeError) as e:
        raise DataError(f"{summary} beside {path.name} is not a readable evaluation summary; evaluate again") from e
    if recorded and recorded["sha256"] != hashlib.sha256(path.read_bytes()).hexdigest():
        raise DataError(f"{path} is not the set of records that {summary.name} was written with (their digests "
                        f"differ: a write was cut short, or another run wrote one of them); evaluate again")
    fields = set(item_record("", "", 0, 0.0, 0, False, None))
    records = []
    for lineno, row in benchmarks.read_jsonl(path):
        if not fields <= set(row):
            raise DataError(f"{path}:{lineno}: not an item record (needs {', '.join(sorted(fields))})")
        records.append(row)
    return records

# --- held-out loss on a token stream (training's validation, the layer analysis) ---

@torch.no_grad()
def val_loss(model: torch.nn.Module, stream: np.ndarray, seq_len: int, max_tokens: int, ctx=None) -> float:
    """Mean next-token loss over consecutive windows of a held-out stream (its first max_tokens tokens)."""
    return float(np.mean(window_losses(model, stream, seq_len, max_tokens, ctx)))


def window_losses(model: torch.nn.Module, stream: np.ndarray, seq_len: int, max_tokens: int,
                  ctx=None) -> list[float]:
    """The mean next-token loss of each consecutive window of seq_len tokens in a held-out stream (of its first
    max_tokens tokens), in order: val_loss's terms, kept for statistics over windows."""
    n = min(max_tokens, len(stream) - 1) // seq_len
    if n < 1:
        raise ValueError(f"a held-out stream of {len(stream)} tokens (limit {max_tokens}) holds no window of "
                         f"{seq_len} tokens")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    losses = []
    for i in range(0, n, 8):
        chunk = torch.stack([torch.from_numpy(stream[r * seq_len:(r + 1) * seq_len + 1].astype(np.int64))
                             for r in range(i, min(i + 8, n))]).to(device)
        with ctx or nullcontext():
            losses += row_losses(model, chunk[:, :-1], chunk[:, 1:]).tolist()
    model.train(was_training)
    return losses
