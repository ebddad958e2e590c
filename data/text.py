"""
Your own text: what train.py --data reads when it names a path instead of a built-in text.

    python train.py --init_from scratch --data notes.txt --out_dir out/mine   # pre-train on it, its own tokenizer
    python train.py --preproj --skip --data notes.txt                         # probe the embedded base on it
    python train.py --preproj --skip --data 'notes/*.md'                      # a folder (its *.txt) or a pattern

A path is a UTF-8 text file, a folder (every *.txt under it) or a glob pattern; each file is one document.
The split into training, validation and held-out text (the layer analysis's) is deterministic and the same for
every model: with SPLIT_MIN_DOCS documents or more, whole documents in path order, the last ones held out (the
last HELDOUT_SHARE of the characters, then the VAL_SHARE before them); otherwise by position, the documents joined
and cut at the line breaks nearest those shares. A run records the split, each part's size in tokens and every
file's sha256 (`source_record`). Tokenised parts are cached by content (the files' bytes and the tokenizer), so a
changed file is never read from a stale cache and an unchanged one is not tokenised twice.
"""

import glob
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from data.prepare import VOCAB_SIZE, encode_stream, train_tokenizer
from data.sources import CACHE, DataError, write_atomic

BUILT_IN = ("auto", "corpus", "books", "wikitext103")  # train.py --data names that are not paths
PARTS = ("train", "val", "test")  # test: the held-out text of analyze_layers.py
VAL_SHARE = HELDOUT_SHARE = 0.05
SPLIT_MIN_DOCS = 3  # fewer documents cannot each go whole to one of three parts
TEXT_CACHE = CACHE / "text"


@dataclass(frozen=True)
class TextSource:
    spec: str  # the path or pattern as given
    files: tuple[Path, ...]
    docs: tuple[str, ...]
    sha256: tuple[str, ...]  # of each file's bytes

    def digest(self) -> str:
        """One digest of every file's name and bytes: what the cache and a resumed run check."""
        h = hashlib.sha256()
        for f, d in zip(self.files, self.sha256):
            h.update(f"{f.name}\0{d}\0".encode())
        return h.hexdigest()


def is_path(data: str) -> bool:
    return data not in BUILT_IN


def source_name(spec: str) -> str:
    """A short name for run folders: the file's stem, or the folder of a folder or pattern (notes/*.md -> notes)."""
    parts = Path(spec).parts
    plain = [p for p in parts[:next((i for i, p in enumerate(parts) if glob.has_magic(p)), len(parts))]]
    name = Path(*plain).stem if plain else "text"
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name) or "text"


def read_source(spec: str) -> TextSource:
    """The documents a --data path names, each file read as strict UTF-8; one-line DataErrors otherwise."""
    path = Path(spec)
    if glob.has_magic(spec):
        files = sorted(Path(f) for f in glob.glob(spec, recursive=True) if Path(f).is_file())
        if not files:
            raise DataError(f"--data {spec}: no file matches this pattern")
    elif path.is_dir():
        files = sorted(f for f in path.rglob("*.txt") if f.is_file())
        if not files:
            raise DataError(f"--data {spec}: the folder holds no .txt file; name a pattern for other files, e.g. "
                            f"--data '{path / '*.md'}'")
    elif path.is_file():
        files = [path]
    else:
        raise DataError(f"--data {spec}: no such file or folder (nor one of the built-in texts: "
                        f"{', '.join(BUILT_IN)})")
    read = [read_file(f) for f in files]
    if not any(text.strip() for text, _ in read):
        raise DataError(f"--data {spec}: " + ("the file is empty" if files == [path] else
                                              f"every file is empty ({len(files)} of them)"))
    kept = [(f, text, digest) for f, (text, digest) in zip(files, read) if text.strip()]
    return TextSource(spec, *(tuple(column) for column in zip(*kept)))


def read_file(path: Path) -> tuple[str, str]:
    """(text, sha256) of one file, which must be UTF-8 text: a NUL byte or invalid UTF-8 names the byte."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"--data: cannot read {path} ({e.strerror})") from e
    nul = raw.find(b"\0")
    if nul != -1:
        raise DataError(f"--data: {path} is not a text file (a NUL byte at offset {nul}); give UTF-8 text")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"--data: {path} is not UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start}); convert it, "
                        f"e.g. iconv -t UTF-8") from e
    return text, hashlib.sha256(raw).hexdigest()


def split_docs(source: TextSource) -> tuple[dict[str, list[str]], str]:
    """({part: documents}, how it was split): whole documents where there are enough, by position otherwise."""
    docs = list(source.docs)
    if len(docs) >= SPLIT_MIN_DOCS:
        test_from = tail_start(docs, len(docs), HELDOUT_SHARE)
        val_from = tail_start(docs, test_from, VAL_SHARE)
        if val_from >= 1 and sum(map(len, docs[:val_from])) >= 0.5 * sum(map(len, docs)):
            return {"train": docs[:val_from], "val": docs[val_from:test_from], "test": docs[test_from:]}, "documents"
    text = "\n".join(docs)
    val_at = line_break_near(text, 1 - VAL_SHARE - HELDOUT_SHARE)
    test_at = line_break_near(text, 1 - HELDOUT_SHARE)
    return {"train": [text[:val_at]], "val": [text[val_at:test_at]], "test": [text[test_at:]]}, "position"


def tail_start(docs: list[str], end: int, share: float) -> int:
    """Where the run of documents ending before `end` begins that holds at least `share` of all the text (at least
    one document)."""
    total, start = sum(map(len, docs)), end - 1
    held = len(docs[start])
    while start > 0 and held < share * total:
        start -= 1
        held += len(docs[start])
    return start


def line_break_near(text: str, share: float) -> int:
    """The position after the first line break at or past share of the text (the exact position if none)."""
    at = int(len(text) * share)
    found = text.find("\n", at)
    return found + 1 if found != -1 else at


def own_tokenizer(source: TextSource) -> Tokenizer:
    """A byte-level BPE trained on the source's training part, as the embedded corpus's is on its own (cached)."""
    path = TEXT_CACHE / f"tokenizer-{source.digest()[:16]}.json"
    if path.is_file():
        return Tokenizer.from_file(str(path))
    tok = train_tokenizer(split_docs(source)[0]["train"], VOCAB_SIZE)
    write_atomic(path, tok.to_str())
    return tok


def load_parts(source: TextSource, tok: Tokenizer) -> tuple[dict[str, np.ndarray], dict]:
    """({part: token stream}, the record a run keeps), tokenised once per content and tokenizer."""
    key = hashlib.sha256(f"{source.digest()}\0{tok.to_str()}".encode()).hexdigest()[:16]
    folder = TEXT_CACHE / key
    meta_path = folder / "meta.json"
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        dtype = np.dtype(meta["dtype"])
        return {p: np.fromfile(folder / f"{p}.bin", dtype=dtype) for p in PARTS}, meta["record"]
    parts, how = split_docs(source)
    streams = {p: encode_stream(tok, parts[p]) for p in PARTS}
    record = {"path": source.spec, "split": how, "files": {str(f): d for f, d in zip(source.files, source.sha256)},
              "sha256": source.digest(), "tokens": {p: int(s.size) for p, s in streams.items()},
              "documents": {p: len(parts[p]) for p in PARTS}}
    for p, s in streams.items():
        write_atomic(folder / f"{p}.bin", s.tobytes())
    write_atomic(meta_path, json.dumps({"dtype": streams["train"].dtype.name, "record": record}, indent=2))
    return streams, record


def check_sizes(record: dict, seq_len: int) -> None:
    """Each part holds what a run of seq_len needs: training draws windows of seq_len + 1 tokens from anywhere in
    its part (seq_len + 2 tokens at least), validation and the held-out text score one such window at least."""
    need = {"train": seq_len + 2, "val": seq_len + 1, "test": seq_len + 1}
    if all(record["tokens"][p] >= need[p] for p in PARTS):
        return
    share = {"train": 1 - VAL_SHARE - HELDOUT_SHARE, "val": VAL_SHARE, "test": HELDOUT_SHARE}
    total = int(np.ceil(max(need[p] / share[p] for p in PARTS)))
    have = ", ".join(f"{p} {record['tokens'][p]:,}" for p in PARTS)
    raise DataError(f"--data {record['path']}: {sum(record['tokens'].values()):,} tokens ({have}), and a run of "
                    f"--seq_len {seq_len} needs a window of {seq_len + 1} tokens in each part, about {total:,} tokens "
                    f"of text in all; give more text, or a smaller --seq_len")
