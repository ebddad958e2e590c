"""
The embedded corpus: public-domain books split by whole documents, a byte-level BPE tokenizer, token streams.

    python -m data.prepare            # writes data/cache/nano/ (train.py also calls this on first use)

Splits (no document is in two of them):
  pretrain   the base's pre-training text: 12 Gutenberg books, the King James Bible, tinyshakespeare and the
             US inaugural addresses
  probe      the probe's training text: State of the Union addresses up to 1992 (a domain the base never saw;
             the paper's WikiText, by contrast, is Wikipedia, which Pythia's training data, the Pile, contains)
  val        held-out State of the Union addresses, 1993 onwards (the probe's domain)
  val_books  a held-out book, Chesterton's "The Man Who Was Thursday" (the base's domain)
The tokenizer (vocab 8192, `<|endoftext|>` = 0 between documents) is trained on `pretrain` only.

Parts of the held-out splits, for the experiment (study/, docs/experiment.md), which needs text of each
domain for three uses that must not overlap: training a probe, choosing its learning rate, the reported loss.
They are cut from `val` and `val_books` by whole documents or chapters and tokenised on demand; the four splits
above, their cached streams and so the embedded base stay exactly as they are.
  sotu_search  State of the Union addresses 1993-1996 (learning-rate search)
  sotu_test    State of the Union addresses 1997-2006 (reported held-out loss)
  books_train  the held-out book's front matter and chapters I-IX: the in-distribution probe's training text
  books_search its chapters X-XI (learning-rate search)
  books_test   its chapters XII-XV (reported held-out loss)

For real Pythia runs the probe text is the paper's: the first 2,000 lines of WikiText-103 train with more than
50 characters, unstripped (downloaded; see `wikitext103_probe_lines`).
"""

import argparse
import io
import json
import os
import re
import zipfile
from pathlib import Path
from typing import Iterable

import numpy as np
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from data.sources import CACHE, DataError, archive, fetch, fetch_folder, mirror_dir, read_text, sha256, write_atomic

NANO_DATA = CACHE / "nano"
EOT = "<|endoftext|>"
VOCAB_SIZE = 8192
HELD_OUT_BOOK = "chesterton-thursday.txt"
PROBE_LAST_YEAR = 1992
SPLITS = ("pretrain", "probe", "val", "val_books")
SEARCH_LAST_YEAR = 1996  # val addresses up to this year form sotu_search, the later ones sotu_test
BOOK_PARTS = {"books_train": (0, 9), "books_search": (10, 11), "books_test": (12, 15)}  # chapters; 0 = front matter
PARTS = ("sotu_search", "sotu_test", *BOOK_PARTS)
HELDOUT = ("val", "val_books", *PARTS, "wikitext")  # the splits a run may validate on (train.py --val_splits)
# train.py's --data for the embedded corpus: (the split a probe trains on, the held-out splits it reports)
PROBE_SPLITS = {"corpus": ("probe", ("val", "val_books")), "books": ("books_train", ("val", "books_test")),
                "wikitext103": ("", ("wikitext",))}  # WikiText-103 validation lines: no corpus is read
WIKITEXT103 = "https://wikitext.smerity.com/wikitext-103-raw-v1.zip"
# The archive's published sha256 (191,984,949 bytes), the digest public dataset loaders pin for this file
WIKITEXT103_SHA256 = "91c00ae287f0d699e18605c84afc9e45c192bc6b7797ff8837e5474655a33794"
WIKITEXT103_TRAIN = "wikitext103/wiki.train.raw"  # its mirror slot: the archive's wikitext-103-raw/wiki.train.raw


def corpus_splits(mirror: str | None = None) -> dict[str, list[Path]]:
    """The corpus files of each split, in a fixed order."""
    books = fetch_folder("gutenberg", mirror)
    sotu = fetch_folder("state_union", mirror)
    return {
        "pretrain": [b for b in books if b.name != HELD_OUT_BOOK] + [fetch("corpus/kjv.txt", mirror),
                    fetch("corpus/tinyshakespeare.txt", mirror)] + fetch_folder("inaugural", mirror),
        "probe": [s for s in sotu if int(s.name[:4]) <= PROBE_LAST_YEAR],
        "val": [s for s in sotu if int(s.name[:4]) > PROBE_LAST_YEAR],
        "val_books": [b for b in books if b.name == HELD_OUT_BOOK],
    }


def read_docs(paths: list[Path]) -> list[str]:
    """Each file's text, stripped; a file that is not UTF-8 is a DataError naming it."""
    return [read_text(p).strip() for p in paths]


def part_docs(name: str, mirror: str | None = None) -> list[str]:
    """The documents of a PARTS entry: whole addresses of `val`, or a run of whole chapters of the held-out book
    (chapters joined by the newline that separated them, so the three book parts rejoin into the book)."""
    splits = corpus_splits(mirror)
    if name.startswith("sotu_"):
        search = name == "sotu_search"
        return read_docs([p for p in splits["val"] if (int(p.name[:4]) <= SEARCH_LAST_YEAR) == search])
    first, last = BOOK_PARTS[name]
    chapters = re.split(r"\n(?=CHAPTER [IVXL]+\n)", read_docs(splits["val_books"])[0])
    return ["\n".join(chapters[first:last + 1])]


def train_tokenizer(docs: list[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Byte-level BPE like GPT-NeoX's own (NFC, no prefix space), with <|endoftext|> as id 0."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


def encode_stream(tok: Tokenizer, docs: list[str]) -> np.ndarray:
    """All documents as one token stream, each followed by <|endoftext|>."""
    eot = tok.token_to_id(EOT)
    ids = []
    for enc in tok.encode_batch(docs):
        ids.extend(enc.ids)
        ids.append(eot)
    dtype = np.uint16 if tok.get_vocab_size() <= 65536 else np.uint32
    return np.array(ids, dtype=dtype)


def prepare_nano(mirror: str | None = None, force: bool = False) -> Path:
    """Build data/cache/nano/ once: tokenizer.json, <split>.bin (uint16) and meta.json (what was used)."""
    meta_path = NANO_DATA / "meta.json"
    if meta_path.exists() and not force:
        return NANO_DATA
    splits = corpus_splits(mirror)
    docs = {name: read_docs(paths) for name, paths in splits.items()}
    tok = train_tokenizer(docs["pretrain"])
    NANO_DATA.mkdir(parents=True, exist_ok=True)
    tok.save(str(NANO_DATA / "tokenizer.json"))
    meta = {"vocab_size": tok.get_vocab_size(), "splits": {}}
    for name in SPLITS:
        stream = encode_stream(tok, docs[name])
        stream.tofile(NANO_DATA / f"{name}.bin")
        meta["splits"][name] = {"tokens": int(stream.size),
                                "files": {f"{p.parent.name}/{p.name}": sha256(p) for p in splits[name]}}
    write_atomic(meta_path, json.dumps(meta, indent=2))  # written last: its presence means the folder is complete
    return NANO_DATA


def load_nano_split(name: str) -> np.ndarray:
    meta = json.loads((NANO_DATA / "meta.json").read_text())
    if not (NANO_DATA / f"{name}.bin").is_file():
        raise DataError(f"{NANO_DATA / name}.bin is missing from the prepared corpus; rebuild it with "
                        f"`python -m data.prepare --force`")
    stream = np.fromfile(NANO_DATA / f"{name}.bin", dtype=np.uint16)
    if stream.size != meta["splits"][name]["tokens"]:
        raise DataError(f"{NANO_DATA / name}.bin has {stream.size} tokens, meta.json says "
                        f"{meta['splits'][name]['tokens']}; delete {NANO_DATA} and run `python -m data.prepare`")
    return stream


def is_nano_tokenizer(tok: Tokenizer) -> bool:
    """Whether a model speaks the embedded corpus's tokenizer (then its pre-tokenised splits apply)."""
    path = NANO_DATA / "tokenizer.json"
    return path.exists() and Tokenizer.from_file(str(path)).to_str() == tok.to_str()


def split_tokens(name: str, tok: Tokenizer, mirror: str | None = None) -> np.ndarray:
    """A corpus split (or a part of one, PARTS) in a model's own tokens: the cached stream for the embedded
    tokenizer, otherwise the split encoded afresh with the model's tokenizer (e.g. Pythia's, for offline runs of
    Pythia-shaped models). Parts are small and always encoded afresh."""
    if name in PARTS:
        return encode_stream(tok, part_docs(name, mirror))
    if is_nano_tokenizer(tok):
        return load_nano_split(name)
    return encode_stream(tok, read_docs(corpus_splits(mirror)[name]))


def probe_data(data: str, init_from: str, tok: Tokenizer) -> str:
    """What a run's --data means: `auto` is the embedded corpus for the embedded tokenizer or a local model folder,
    and the paper's WikiText-103 lines for a model from the Hub."""
    if data != "auto":
        return data
    return "corpus" if is_nano_tokenizer(tok) or os.path.isdir(init_from) else "wikitext103"


def probe_lines(lines: Iterable[str], n_lines: int | None = 2000, min_chars: int = 50) -> list[str]:
    """The author's rule (prepare_training_data in 07_benchmarks.py): of the lines in order, the first n_lines
    (None: all) whose stripped text is longer than min_chars, kept as they are: with WikiText's leading space and
    the trailing newline, which the probe then learns to predict as well."""
    kept = []
    for line in lines:
        if len(line.strip()) > min_chars:
            kept.append(line)
        if n_lines is not None and len(kept) >= n_lines:
            break
    return kept


def wikitext103_probe_lines(tok: Tokenizer, n_lines: int = 2000, min_chars: int = 50, max_tokens: int = 512,
                            mirror: str | None = None) -> list[np.ndarray]:
    """The paper's probe data: probe_lines of WikiText-103 train, each tokenised and cut to max_tokens (the
    training batch pads it, pad labels ignored). From the mirror's WIKITEXT103_TRAIN when it holds the file (an
    offline machine), else downloaded (about 190 MB) and cached."""
    local = wikitext103_local(mirror)
    if local:
        with open(local, encoding="utf-8") as f:
            lines = probe_lines(f, n_lines, min_chars)
    else:
        try:
            path = archive(WIKITEXT103, WIKITEXT103_SHA256)
        except DataError as e:
            raise DataError(f"the paper's probe text, WikiText-103 train, is not in the mirror ({WIKITEXT103_TRAIN}) "
                            f"and could not be downloaded ({e}); put wiki.train.raw from {WIKITEXT103} there") from e
        # Read as the Hugging Face dataset reads it: text mode, a row per line, the newline kept
        with zipfile.ZipFile(path) as z, z.open("wikitext-103-raw/wiki.train.raw") as f:
            lines = probe_lines(io.TextIOWrapper(f, encoding="utf-8"), n_lines, min_chars)
    return [np.array(enc.ids[:max_tokens], dtype=np.int64) for enc in tok.encode_batch(lines)]


def wikitext103_local(mirror: str | None) -> Path | None:
    """The mirror's copy of WikiText-103 train (its WIKITEXT103_TRAIN slot), or None where it has none."""
    root = mirror_dir(mirror)
    return root / WIKITEXT103_TRAIN if root is not None and (root / WIKITEXT103_TRAIN).is_file() else None


def wikitext103_files(mirror: str | None = None) -> dict[str, str]:
    """{file: sha256} of the paper's probe text as wikitext103_probe_lines reads it: the mirror's copy, else the
    archive (which that function has checked against its pin)."""
    local = wikitext103_local(mirror)
    if local:
        return {WIKITEXT103_TRAIN: sha256(local)}
    return {WIKITEXT103.rsplit("/", 1)[-1]: WIKITEXT103_SHA256}


# Held-out text in each training domain, for measurements on a trained model (analyze_layers.py)
HELDOUT_TEXT = {
    "val": "held-out State of the Union speeches 1993-2006 (`val`, the embedded probe's domain)",
    "val_books": "a held-out book (`val_books`, the embedded base's pre-training domain)",
    "books_test": "the held-out book's last chapters (`books_test`; the in-distribution probe trains on its first)",
    "wikitext": "WikiText-103 validation lines (the paper's probe domain)",
}


def heldout_stream(name: str, tok: Tokenizer, mirror: str | None = None) -> np.ndarray:
    """A HELDOUT_TEXT entry as one token stream; WikiText validation is its lines that the probe's rule keeps,
    unstripped, in order (the text a WikiText probe trains on, from the validation split)."""
    if name != "wikitext":
        return split_tokens(name, tok, mirror)
    with open(fetch("wikitext/wiki.valid.raw", mirror), encoding="utf-8") as f:
        return encode_stream(tok, ["".join(probe_lines(f, n_lines=None))])


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m data.prepare",
                                description="Prepare the embedded corpus (splits, BPE tokenizer, token streams).")
    p.add_argument("--mirror", default=None, help="offline data mirror folder (default: $PREPROJ_MIRROR)")
    p.add_argument("--force", action="store_true", help="rebuild even if data/cache/nano exists")
    args = p.parse_args()
    try:
        folder = prepare_nano(args.mirror, args.force)
    except DataError as e:
        raise SystemExit(f"error: {e}")
    meta = json.loads((folder / "meta.json").read_text())
    for name, s in meta["splits"].items():
        print(f"{name:10s} {len(s['files']):4d} files {s['tokens']:>10,d} tokens")


if __name__ == "__main__":
    main()
