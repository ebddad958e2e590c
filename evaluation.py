"""
Zero-shot evaluation on LAMBADA, WikiText and HellaSwag: the one log-likelihood scorer and the tasks built on it.
The command line is eval_lambada.py.

By default every number follows EleutherAI's lm-evaluation-harness (the definitions behind every published Pythia
figure); `--protocol paper` re-measures the paper's Table 2 with its custom protocol instead.

    python eval_lambada.py --init_from pythia-160m                        # lm-eval: all three tasks, full sets
    python eval_lambada.py --init_from out/run1 --tasks lambada --limit 500
    python eval_lambada.py --init_from pythia-160m --protocol paper --dtype bfloat16

lm-eval protocol
  lambada    lambada_openai, 5,153 passages: acc (every target token is the greedy argmax) and
             ppl = exp(-mean over passages of the target's summed log-probability)
  wikitext   WikiText-2 raw test pages, lm-eval's detokenizer, disjoint rolling windows of the model's context;
             word_perplexity, byte_perplexity, bits_per_byte counted on the original page text
  hellaswag  lm-eval's preprocessing; acc (argmax of summed log-probability) and acc_norm (divided by the
             ending's character length)
paper protocol (first 500 items of each set)
  lambada    acc only; the same target (last word with its leading space)
  wikitext   "PPL": paragraphs of >= 50 characters and >= 10 tokens, each scored alone (at most 512 tokens),
             exp(unweighted mean over paragraphs of the mean token loss); WikiText-2 test paragraphs, since the
             paper's WikiText-103 validation split is not in the offline mirror
  hellaswag  ctx + " " + ending, score = mean log-probability per ending token, acc

Standard errors: acc as lm-eval (sample standard deviation / sqrt(n)); perplexities over documents by the delta
method, ppl * stderr(per-document loss) (lm-eval bootstraps LAMBADA's instead); none for WikiText's weighted
perplexities, as lm-eval reports none.
"""

import math
import re
import time
from contextlib import nullcontext
from typing import Callable, NamedTuple

import numpy as np
import torch
from tokenizers import Tokenizer

from data import benchmarks
from data.sources import fetch, sha256

TASKS = ("lambada", "wikitext", "hellaswag")
PROTOCOLS = ("lm-eval", "paper")
PAPER_LIMIT = 500  # the paper scores the first 500 items of each set
PAPER_MAX_TOKENS = 512  # and at most 512 tokens per WikiText paragraph
PAPER_MIN_TOKENS = 10

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
def score_pairs(model: torch.nn.Module, pairs: list[Pair], batch_size: int = 32) -> list[Score]:
    """Log-likelihood of each continuation given its context, in batches of similar length.

    The longest requests go first (an out-of-memory batch size fails at once, and padding stays small);
    results come back in the order of `pairs`. Runs where the model's weights are.
    """
    order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
    scores: list[Score | None] = [None] * len(pairs)
    for start in range(0, len(order), batch_size):
        batch = order[start:start + batch_size]
        for i, score in zip(batch, _score_batch(model, [pairs[i] for i in batch])):
            scores[i] = score
    return scores


def _score_batch(model: torch.nn.Module, pairs: list[Pair]) -> list[Score]:
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
    # is a third of a small model's compute): logits [n_scored, V].
    logits = model.lm_head(model.hidden_states(x.to(device))[r, c])
    # Full-vocabulary log-softmax in fp32 whatever the weights' dtype: log p(token) = logit - logsumexp(logits).
    logits = logits.float()
    token_lp = (logits.gather(1, t[:, None])[:, 0] - logits.logsumexp(dim=-1)).double().cpu()
    misses = (logits.argmax(dim=-1) != t).double().cpu()
    owner = torch.tensor(rows, dtype=torch.long)  # which request each scored token belongs to
    lp_sum = torch.zeros(len(pairs), dtype=torch.float64).index_add_(0, owner, token_lp)
    n_miss = torch.zeros(len(pairs), dtype=torch.float64).index_add_(0, owner, misses)
    return [Score(lp_sum[b].item(), n_miss[b].item() == 0, len(cont), len(ctx) + len(cont) > window + 1)
            for b, (ctx, cont) in enumerate(pairs)]


# --- statistics ---

def mean_stderr(xs: list[float]) -> float | None:
    """Standard error of a mean: sample standard deviation (n - 1) / sqrt(n), lm-eval's mean_stderr."""
    n = len(xs)
    if n < 2:
        return None
    mu = sum(xs) / n
    return math.sqrt(sum((x - mu) ** 2 for x in xs) / (n - 1) / n)


def mean_metric(xs: list[float]) -> dict:
    return {"value": sum(xs) / len(xs), "stderr": mean_stderr(xs)}


def ppl_metric(losses: list[float]) -> dict:
    """exp(mean loss) with a delta-method standard error: ppl * stderr(mean loss)."""
    ppl = math.exp(sum(losses) / len(losses))
    se = mean_stderr(losses)
    return {"value": ppl, "stderr": None if se is None else ppl * se}


def argmax(xs: list[float]) -> int:
    return max(range(len(xs)), key=lambda i: (xs[i], -i))  # the first of equal maxima, as numpy


def _result(metrics: dict, docs: list[dict], scores: list[Score], data: str, mirror: str | None,
            note: str | None = None) -> dict:
    """A task's result: metrics, counts, the data file's sha256, and the per-document numbers under "docs"."""
    result = {"metrics": metrics, "n": len(docs), "requests": len(scores),
              "truncated": sum(s.truncated for s in scores), "data": {data: sha256(fetch(data, mirror))}}
    if note:
        result["note"] = note
    return {**result, "docs": docs}


def _limit(protocol: str, limit: int | None) -> int | None:
    return limit if limit is not None else (PAPER_LIMIT if protocol == "paper" else None)


# --- the tasks ---

def lambada(model: torch.nn.Module, tokenizer: Tokenizer, protocol: str = "lm-eval", limit: int | None = None,
            batch_size: int = 32, mirror: str | None = None) -> dict:
    items = benchmarks.lambada(mirror)[:_limit(protocol, limit)]
    scores = score_pairs(model, [encode_pair(tokenizer, c, t) for c, t in items], batch_size)
    docs = [{"logprob": s.logprob, "greedy": s.greedy, "n_tokens": s.n_tokens} for s in scores]
    metrics = {"acc": mean_metric([float(s.greedy) for s in scores])}
    if protocol == "lm-eval":  # the paper reports accuracy only
        metrics["ppl"] = ppl_metric([-s.logprob for s in scores])
    return _result(metrics, docs, scores, benchmarks.LAMBADA, mirror)


def wikitext(model: torch.nn.Module, tokenizer: Tokenizer, protocol: str = "lm-eval", limit: int | None = None,
             batch_size: int = 32, mirror: str | None = None) -> dict:
    window = model.config.block_size
    if protocol == "paper":
        return _wikitext_paper(model, tokenizer, limit, batch_size, mirror, window)
    pages = benchmarks.wikitext_pages(mirror)[:limit]
    prefix = eot_id(tokenizer)
    windows = [rolling_windows(encode(tokenizer, benchmarks.wikitext_detokenize(p)), prefix, window) for p in pages]
    flat = score_pairs(model, [w for page in windows for w in page], batch_size)
    docs, k = [], 0
    for page, page_windows in zip(pages, windows):
        logprob = sum(s.logprob for s in flat[k:k + len(page_windows)])
        k += len(page_windows)
        # lm-eval counts words and bytes on the original page, before detokenisation
        docs.append({"logprob": logprob, "words": len(re.split(r"\s+", page)), "bytes": len(page.encode("utf-8")),
                     "n_tokens": sum(len(c) for _, c in page_windows)})
    nll = -sum(d["logprob"] for d in docs)
    words, n_bytes = sum(d["words"] for d in docs), sum(d["bytes"] for d in docs)
    metrics = {"word_perplexity": {"value": math.exp(nll / words), "stderr": None},
               "byte_perplexity": {"value": math.exp(nll / n_bytes), "stderr": None},
               "bits_per_byte": {"value": nll / n_bytes / math.log(2), "stderr": None}}
    return _result(metrics, docs, flat, benchmarks.WIKITEXT, mirror)


def _wikitext_paper(model: torch.nn.Module, tokenizer: Tokenizer, limit: int | None, batch_size: int,
                    mirror: str | None, window: int) -> dict:
    """Each paragraph alone from its first token: the mean loss over the rest, as a plain causal-LM loss."""
    max_tokens = min(PAPER_MAX_TOKENS, window)  # a sequence the model can take in one go
    paragraphs = [ids for ids in (encode(tokenizer, p) for p in benchmarks.wikitext_paragraphs(mirror))
                  if len(ids) >= PAPER_MIN_TOKENS]
    paragraphs = paragraphs[:_limit("paper", limit)]
    scores = score_pairs(model, [(ids[:1], ids[1:max_tokens]) for ids in paragraphs], batch_size)
    losses = [-s.logprob / s.n_tokens for s in scores]
    docs = [{"mean_loss": loss, "n_tokens": s.n_tokens} for loss, s in zip(losses, scores)]
    return _result({"ppl": ppl_metric(losses)}, docs, scores, benchmarks.WIKITEXT, mirror,
                   note="WikiText-2 test paragraphs; the paper used WikiText-103 validation (not in the mirror)")


def hellaswag(model: torch.nn.Module, tokenizer: Tokenizer, protocol: str = "lm-eval", limit: int | None = None,
              batch_size: int = 32, mirror: str | None = None) -> dict:
    items = benchmarks.hellaswag(mirror)[:_limit(protocol, limit)]
    if protocol == "paper":
        pairs = [encode_pair(tokenizer, it.ctx, " " + e) for it in items for e in it.endings]
    else:  # lm-eval puts a space between query and choice (its target_delimiter)
        pairs = [encode_pair(tokenizer, it.query, " " + c) for it in items for c in it.choices]
    scores = score_pairs(model, pairs, batch_size)
    docs, k = [], 0
    for it in items:
        s = scores[k:k + len(it.choices)]
        k += len(it.choices)
        lps = [x.logprob for x in s]
        doc = {"logprobs": lps, "n_tokens": [x.n_tokens for x in s], "gold": it.gold}
        if protocol == "paper":
            doc["pred"] = argmax([x.logprob / max(x.n_tokens, 1) for x in s])
        else:
            doc["pred"] = argmax(lps)
            doc["pred_norm"] = argmax([lp / len(c) for lp, c in zip(lps, it.choices)])
        docs.append(doc)
    metrics = {"acc": mean_metric([float(d["pred"] == d["gold"]) for d in docs])}
    if protocol == "lm-eval":
        metrics["acc_norm"] = mean_metric([float(d["pred_norm"] == d["gold"]) for d in docs])
    return _result(metrics, docs, scores, benchmarks.HELLASWAG, mirror)


TASK_FNS: dict[str, Callable[..., dict]] = {"lambada": lambada, "wikitext": wikitext, "hellaswag": hellaswag}
# The reader of each task's data file: check_data runs them to find a bad file before a long run, not after it.
TASK_DATA: dict[str, Callable[..., list]] = {"lambada": benchmarks.lambada, "wikitext": benchmarks.wikitext_pages,
                                            "hellaswag": benchmarks.hellaswag}


def check_data(tasks: tuple[str, ...] | list[str], mirror: str | None = None) -> None:
    """Read the data file of every task (present, sha256 where pinned, well-formed), or raise its DataError."""
    for task in tasks:
        TASK_DATA[task](mirror)


def check_request(tasks: tuple[str, ...] | list[str], protocol: str) -> None:
    """ValueError naming the first unknown task or protocol."""
    unknown = [t for t in tasks if t not in TASK_FNS]
    if unknown:
        raise ValueError(f"unknown task {unknown[0]!r}; choose from {', '.join(TASKS)}")
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; choose lm-eval or paper")


def evaluate(model: torch.nn.Module, tokenizer: Tokenizer, tasks: tuple[str, ...] | list[str] = TASKS,
             protocol: str = "lm-eval", limit: int | None = None, batch_size: int = 32,
             mirror: str | None = None) -> dict:
    """{task: {"metrics": {name: {"value", "stderr"}}, "n", "requests", "truncated", "data", "seconds"}}.

    The model runs where its weights are and in their dtype; per-document numbers are left out
    (call the task functions for them).
    """
    check_request(tasks, protocol)
    was_training = model.training
    model.eval()
    results = {}
    for task in tasks:
        t0 = time.time()
        result = TASK_FNS[task](model, tokenizer, protocol, limit, batch_size, mirror)
        result.pop("docs")
        results[task] = {**result, "seconds": round(time.time() - t0, 2)}
    model.train(was_training)
    return results


# --- held-out loss on a token stream (training's validation, the layer analysis) ---

@torch.no_grad()
def val_loss(model: torch.nn.Module, stream: np.ndarray, seq_len: int, max_tokens: int, ctx=None) -> float:
    """Mean next-token loss over consecutive windows of a held-out stream (its first max_tokens tokens)."""
    n = min(max_tokens, len(stream) - 1) // seq_len
    if n < 1:
        raise ValueError(f"a held-out stream of {len(stream)} tokens (limit {max_tokens}) holds no window of "
                         f"{seq_len} tokens")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total = 0.0
    for i in range(0, n, 8):
        rows = range(i, min(i + 8, n))
        chunk = torch.stack([torch.from_numpy(stream[r * seq_len:(r + 1) * seq_len + 1].astype(np.int64))
                             for r in rows]).to(device)
        with ctx or nullcontext():
            _, loss = model(chunk[:, :-1], chunk[:, 1:])
        total += loss.item() * len(rows)
    model.train(was_training)
    return total / n
