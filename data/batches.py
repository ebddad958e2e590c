"""
What a training step reads: a run's training data and validation streams, and each step's batch.

Every batch is a pure function of (seed, step), so that a run resumes exactly and splits across processes exactly:
each process takes its rows of the same global batch.
"""

import numpy as np
import torch
from tokenizers import Tokenizer

from data import prepare, text


def load_data(init_from: str, data: str, seq_len: int, tokenizer: Tokenizer, mirror: str | None = None,
              val_splits: str | None = None) -> tuple[np.ndarray | list[np.ndarray], dict[str, np.ndarray],
                                                      dict | None]:
    """(training data, {validation name: token stream}, the record of your own text or None) of a run: pre-training
    reads the corpus's pre-training split; a probe reads the text --data names (prepare.probe_data), as a stream or
    as documents; a --data path, your own text's parts (data/text.py) for either. Validation is on the held-out
    splits of that text, or on val_splits (comma-separated prepare.HELDOUT names) when given."""
    record, own, heldout = None, {}, ()
    if text.is_path(data):
        streams, record = text.load_parts(text.read_source(data), tokenizer)
        text.check_sizes(record, seq_len)
        train, own = streams["train"], {"val": streams["val"]}
    elif init_from == "scratch":
        train, heldout = prepare.load_nano_split("pretrain"), ("val_books",)
    else:
        data = prepare.probe_data(data, init_from, tokenizer)
        train_split, heldout = prepare.PROBE_SPLITS[data]
        train = (prepare.wikitext103_probe_lines(tokenizer, max_tokens=seq_len, mirror=mirror) if data == "wikitext103"
                 else prepare.split_tokens(train_split, tokenizer, mirror))
    if val_splits:
        own, heldout = {}, [n for n in val_splits.split(",") if n]
    return train, {**own, **{n: prepare.heldout_stream(n, tokenizer, mirror) for n in heldout}}, record


def global_batch(data, step: int, rows: int, seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's whole batch: random windows of a token stream, or documents padded to the longest (pad label -100,
    at most seq_len)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    if isinstance(data, np.ndarray):  # a stream: windows of seq_len + 1 tokens
        starts = torch.randint(0, len(data) - seq_len - 1, (rows,), generator=g).tolist()
        chunk = torch.stack([torch.from_numpy(data[s:s + seq_len + 1].astype(np.int64)) for s in starts])
        return chunk[:, :-1], chunk[:, 1:]
    # documents, visited in a fresh random order each epoch (the paper's padded lines)
    order = []
    epoch = (step * rows) // len(data)
    while len(order) < (step * rows) % len(data) + rows:
        order += torch.randperm(len(data), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        epoch += 1
    first = (step * rows) % len(data)
    docs = [data[i][:seq_len + 1] for i in order[first:first + rows]]
    # padded on the right to the batch's longest row, not to seq_len: under causal attention no real token sees
    # the padding after it, so every loss is the same, and the WikiText-103 lines (~141 tokens of 512) cost less
    width = max(1, max(len(d) - 1 for d in docs))
    x = torch.zeros(rows, width, dtype=torch.long)
    y = torch.full((rows, width), -100, dtype=torch.long)
    for r, d in enumerate(docs):
        d = torch.from_numpy(d[:seq_len + 1])
        x[r, :len(d) - 1], y[r, :len(d) - 1] = d[:-1], d[1:]
    return x, y
