"""Your own text (data/text.py, train.py --data PATH): files, folders and patterns read as UTF-8 documents, the
deterministic split and its record, the cache by content, every bad input as one line with nothing written, and
the recipes end to end: pre-training with a tokenizer of its own, sampling from it, probing a base, analysing the
layers on the held-out part, refusing to resume on a changed file."""

import hashlib
import json
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import analyze_layers
from conftest import MICRO, ROOT, make_hf_model, run
from data import text
from data.sources import DataError
from lab.checkpoint import load_model, read_checkpoint
from load_pythia import read_tokenizer

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex bold jugglers".split()


def prose(n_lines: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return "".join(" ".join(rng.choice(WORDS) for _ in range(12)) + ".\n" for _ in range(n_lines))


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    """A text cache of the test's own, so that no test reads another's."""
    monkeypatch.setattr(text, "TEXT_CACHE", tmp_path / "cache")
    return tmp_path / "cache"


# --- reading: files, folders, patterns; bad input ---

def test_a_file_a_folder_and_a_pattern(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "sub").mkdir()
    for name, body in (("b.txt", "two\n"), ("a.txt", "one\n"), ("sub/c.txt", "three\n"), ("d.md", "four\n"),
                       ("e.txt", "  \n")):
        (tmp_path / "notes" / name).write_text(body)
    folder = text.read_source(str(tmp_path / "notes"))  # every .txt below it, in path order; blank files skipped
    assert [f.name for f in folder.files] == ["a.txt", "b.txt", "c.txt"] and folder.docs == ("one\n", "two\n",
                                                                                              "three\n")
    pattern = text.read_source(str(tmp_path / "notes" / "*.md"))
    assert pattern.docs == ("four\n",) and text.source_name(str(tmp_path / "notes" / "*.md")) == "notes"
    one = text.read_source(str(tmp_path / "notes" / "a.txt"))
    assert one.sha256 == (hashlib.sha256(b"one\n").hexdigest(),)
    assert text.source_name(str(tmp_path / "notes" / "a.txt")) == "a" and folder.digest() != pattern.digest()


def bad_input(kind: str, p):
    """A path of each kind of bad --data input, made under p."""
    if kind == "missing":
        return p / "missing.txt"
    if kind in ("empty file", "only blank files"):
        (p / "dir").mkdir()
        (p / "dir" / "x.txt").write_text("" if kind == "empty file" else "\n \n")
        return p / "dir" / "x.txt" if kind == "empty file" else p / "dir"
    if kind == "folder without .txt":
        (p / "dir").mkdir()
        (p / "dir" / "x.md").write_text("text")
        return p / "dir"
    if kind == "unmatched pattern":
        return p / "*.none"
    if kind == "binary":
        (p / "b.bin").write_bytes(b"text\x00\x01")
        return p / "b.bin"
    (p / "l1.txt").write_bytes("caf\xe9".encode("latin-1"))  # not UTF-8
    return p / "l1.txt"


@pytest.mark.parametrize("kind, words", [
    ("missing", "no such file or folder (nor one of the built-in texts"),
    ("empty file", "the file is empty"),
    ("only blank files", "every file is empty"),
    ("folder without .txt", "the folder holds no .txt file; name a pattern for other files"),
    ("unmatched pattern", "no file matches this pattern"),
    ("binary", "is not a text file (a NUL byte at offset 4)"),
    ("not UTF-8", "is not UTF-8 (byte 0xe9 at offset 3)"),
])
def test_bad_text_is_one_line_naming_the_problem(tmp_path, kind, words):
    with pytest.raises(DataError) as e:
        text.read_source(str(bad_input(kind, tmp_path)))
    assert words in str(e.value) and "\n" not in str(e.value)


def test_bad_text_stops_train_py_before_anything_is_written(tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"ok\n" * 50 + "\xe9t\xe9".encode("latin-1"))
    proc = subprocess.run([sys.executable, "train.py", "--init_from", "scratch", "--data", str(bad), "--out_dir",
                           str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == f"error: --data: {bad} is not UTF-8 (byte 0xe9 at offset 150); " \
                                                   f"convert it, e.g. iconv -t UTF-8"
    assert not (tmp_path / "out").exists()


# --- the split: deterministic, by whole documents or by position, recorded ---

def test_one_file_splits_by_position_at_line_breaks():
    body = prose(400)
    parts, how = text.split_docs(text.TextSource("x", (), (body,), ("",)))
    assert how == "position" and "".join(parts["train"] + parts["val"] + parts["test"]) == body
    assert all(p[0].endswith("\n") for p in (parts["train"], parts["val"]))  # cut after a line break
    assert [round(len(parts[p][0]) / len(body), 2) for p in text.PARTS] == [0.9, 0.05, 0.05]


def test_several_documents_go_whole_the_last_held_out():
    docs = tuple(f"{i:03d}".ljust(99) + "\n" for i in range(45))  # 100 characters each: 5% is 2.25 documents
    parts, how = text.split_docs(text.TextSource("x", (), docs, ("",) * 45))
    assert how == "documents" and parts["train"] + parts["val"] + parts["test"] == list(docs)
    assert (len(parts["train"]), len(parts["val"]), len(parts["test"])) == (39, 3, 3)  # at least 5% each, whole
    # two documents cannot fill three parts: by position instead
    assert text.split_docs(text.TextSource("x", (), docs[:2], ("", "")))[1] == "position"


def test_parts_are_cached_by_content(tmp_path, cache, monkeypatch):
    path = tmp_path / "notes.txt"
    path.write_text(prose(300))
    tok = text.own_tokenizer(text.read_source(str(path)))
    first, record = text.load_parts(text.read_source(str(path)), tok)
    assert record["split"] == "position" and record["tokens"] == {p: len(first[p]) for p in text.PARTS}
    assert record["files"] == {str(path): hashlib.sha256(path.read_bytes()).hexdigest()}
    encode = text.encode_stream
    monkeypatch.setattr(text, "encode_stream", lambda *a: pytest.fail("an unchanged text is tokenised again"))
    again, _ = text.load_parts(text.read_source(str(path)), tok)
    assert all(np.array_equal(first[p], again[p]) for p in text.PARTS)
    monkeypatch.setattr(text, "encode_stream", encode)
    path.write_text(prose(300, seed=1))  # the same size, other words: a new key, never the stale parts
    changed, changed_record = text.load_parts(text.read_source(str(path)), tok)
    assert changed_record["sha256"] != record["sha256"] and not np.array_equal(changed["train"], first["train"])


def test_too_little_text_says_how_much_is_needed():
    record = {"path": "n.txt", "tokens": {"train": 900, "val": 50, "test": 50}}
    with pytest.raises(DataError) as e:
        text.check_sizes(record, 256)
    assert str(e.value) == ("--data n.txt: 1,000 tokens (train 900, val 50, test 50), and a run of --seq_len 256 "
                            "needs a window of 257 tokens in each part, about 5,140 tokens of text in all; give more "
                            "text, or a smaller --seq_len")
    text.check_sizes(record, 48)  # 49 tokens fit in every part


# --- the recipes, end to end on a text that is in no mirror ---

def test_pretrain_on_your_text_then_sample_probe_and_analyse(tmp_path, cache, micro_base, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text(prose(600))
    mine = tmp_path / "mine"
    model, _ = run(f"--init_from scratch --data {notes} {MICRO} --max_iters 6 --lr 1e-2 --out_dir {mine}")
    ckpt = read_checkpoint(mine)
    tok = read_tokenizer(str(mine / "tokenizer.json"))
    assert tok.to_str() == text.own_tokenizer(text.read_source(str(notes))).to_str()  # trained on the text
    assert tok.get_vocab_size() < 8192 and model.config.vocab_size == tok.get_vocab_size()  # its own, small
    assert ckpt["data_source"]["split"] == "position" and ckpt["data_source"]["tokens"]["val"] > 32
    assert ckpt["train_args"]["eval_tasks"] == "none"  # no benchmarks by default on your own text
    subprocess.run([sys.executable, "sample.py", "--init_from", str(mine), "--max_new_tokens", "8", "--num_samples",
                    "1"], cwd=ROOT, check=True, capture_output=True)
    assert (tmp_path / "mine" / "metrics.jsonl").is_file()

    probe = tmp_path / "probe"  # a probe of a base keeps the base's tokenizer
    run(f"--init_from {micro_base} --preproj --skip --data {notes} {MICRO} --max_iters 3 --out_dir {probe}")
    base_tok = load_model(micro_base)[1]
    assert read_tokenizer(str(probe / "tokenizer.json")).to_str() == base_tok.to_str()
    record = read_checkpoint(probe)["data_source"]
    streams, _ = text.load_parts(text.read_source(str(notes)), base_tok)
    assert record["tokens"] == {p: len(streams[p]) for p in text.PARTS}
    train_args = read_checkpoint(probe)["train_args"]
    assert analyze_layers.heldout_of(train_args, base_tok) == str(notes)
    assert np.array_equal(analyze_layers.heldout_tokens(str(notes), base_tok, None), streams["test"])

    notes.write_text(prose(600, seed=3))  # the text changed: a resume stops, the checkpoint untouched
    before = (probe / "ckpt.pt").read_bytes()
    with pytest.raises(SystemExit, match="the text of --data .* changed since .* started training on it"):
        run(f"--out_dir {probe} --resume")
    assert (probe / "ckpt.pt").read_bytes() == before


def test_probe_a_pythia_shaped_base_on_your_text(tmp_path, cache, mirror):
    """A Hugging Face base reads your text through its own tokenizer (Pythia's), not the embedded one."""
    base = tmp_path / "base"
    make_hf_model(vocab=50304, d=64, max_pos=64).save_pretrained(base)
    shutil.copy(f"{mirror}/tokenizers/20B_tokenizer.json", base / "tokenizer.json")
    notes = tmp_path / "notes.txt"
    notes.write_text(prose(300))
    out = tmp_path / "p"
    run(f"--init_from {base} --skip --data {notes} --batch_size 2 --seq_len 32 --max_iters 2 "
        f"--eval_tokens 256 --dtype float32 --out_dir {out}")
    record = read_checkpoint(out)["data_source"]
    pythia = read_tokenizer(str(base / "tokenizer.json"))
    assert record["tokens"]["train"] == len(pythia.encode(text.split_docs(text.read_source(str(notes)))[0]["train"][0]
                                                          ).ids) + 1  # + <|endoftext|>
    assert torch.isfinite(torch.tensor(json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["loss"]))
