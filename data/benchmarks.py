"""
The evaluation benchmarks, read from their files (mirror or download, see data/sources.py) and prepared the way
EleutherAI's lm-evaluation-harness prepares them, so that our numbers compare with published Pythia numbers.

  LAMBADA    lambada/lambada_test.jsonl      OpenAI's version (lm-eval's `lambada_openai`), 5,153 passages
  WikiText   wikitext/wiki.test.raw          WikiText-2 raw test split, cut into Wikipedia pages
             wikitext/wiki.valid.raw         WikiText-103 (= WikiText-2) raw validation: the paper's "PPL" lines
  HellaSwag  hellaswag/hellaswag_val.jsonl   validation split, 10,042 items
  ARC-Easy   arc/ARC-Easy-Test.jsonl         AI2's test split, 2,376 questions (lm-eval's `arc_easy`)
             arc/ARC-Easy-Dev.jsonl          AI2's validation split, 570 questions (the paper's)

Each reader returns plain Python data; scoring lives in lab/evaluation.py.
"""

import io
import json
import re
from dataclasses import dataclass
from pathlib import Path

from data.sources import SOURCES, DataError, fetch, read_text

LAMBADA = "lambada/lambada_test.jsonl"
WIKITEXT = "wikitext/wiki.test.raw"
WIKITEXT_VALID = "wikitext/wiki.valid.raw"
HELLASWAG = "hellaswag/hellaswag_val.jsonl"
ARC_EASY = {"test": "arc/ARC-Easy-Test.jsonl", "validation": "arc/ARC-Easy-Dev.jsonl"}


def read_jsonl(path: Path) -> list[tuple[int, dict]]:
    """(line number, object) for every non-blank line; a bad line, bytes that are not UTF-8 or a file without
    items are a DataError naming the file (and line)."""
    rows = []
    for lineno, line in enumerate(read_text(path).split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: malformed JSON line ({e.msg}); replace the file") from e
        if not isinstance(row, dict):
            raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
        rows.append((lineno, row))
    if not rows:
        raise DataError(f"{path} holds no items; replace the file")
    return rows


def _field(row: dict, key: str, kind: type, path: Path, lineno: int):
    if not isinstance(row.get(key), kind):
        raise DataError(f"{path}:{lineno}: no {kind.__name__} field {key!r}; the file has another schema")
    return row[key]


# --- LAMBADA ---

def lambada(mirror: str | None = None) -> list[tuple[str, str]]:
    """(context, target) per passage: the target is the last space-separated word with its leading space.

    As lm-eval's lambada_openai: context = all words but the last joined by spaces, target = " " + last word.
    A few targets contain a newline; they stay as they are.
    """
    path = fetch(LAMBADA, mirror)
    items = []
    for lineno, row in read_jsonl(path):
        context, word = _field(row, "text", str, path, lineno).rsplit(" ", 1)
        items.append((context, " " + word))
    return items


# --- WikiText ---

def wikitext_pages(mirror: str | None = None) -> list[str]:
    """The Wikipedia pages of the WikiText-2 raw test split, each with WikiText's own spacing (" @-@ ", " , ").

    lm-eval's `wikitext` task reads EleutherAI/wikitext_document_level (its `page` field), which that dataset
    builds from this very file: a new page starts at every top-level heading line " = Title = " (second-level
    headings " = = Section = = " stay inside their page), a page is its lines joined by "\\n", and blank pieces
    before the first heading are dropped. We split the same way, so our pages are those `page` strings
    (62 pages for the test split).
    """
    pages, lines = [], []
    for line in wikitext_lines(mirror):
        if _is_title(line):
            if "\n".join(lines).strip():
                pages.append("\n".join(lines))
            lines = []
        lines.append(line)
    pages.append("\n".join(lines))
    return pages


def _is_title(line: str) -> bool:
    """A top-level heading " = Title = "; lower levels read " = = Section = = " and do not count."""
    s = line.replace("= = =", "===").replace("= =", "==").strip()
    return s.startswith("= ") and s.endswith(" =")


def wikitext_detokenize(text: str) -> str:
    """Undo WikiText's tokenisation as lm-eval's wikitext task does, so the model reads ordinary text.

    The rules and their order are lm-eval's (preprocess_wikitext.wikitext_detokenizer); word and byte counts
    for the metrics are still taken on the original page.
    """
    # contractions and possessives
    text = text.replace("s '", "s'")
    text = re.sub(r"/' [0-9]/", r"/'[0-9]/", text)  # lm-eval's rule as written (the slashes are literal)
    # numbers: 1 @,@ 000 -> 1,000
    for sep in "-,.":
        text = text.replace(f" @{sep}@ ", sep)
    # punctuation that WikiText detached on the left
    for p in ":;.!?,":
        text = text.replace(f" {p} ", f"{p} ")
    # spaces inside brackets and quotes
    text = re.sub(r"\(\s*([^\)]*?)\s*\)", r"(\1)", text)
    text = re.sub(r"\[\s*([^\]]*?)\s*\]", r"[\1]", text)
    text = re.sub(r"{\s*([^}]*?)\s*}", r"{\1}", text)
    text = re.sub(r"\"\s*([^\"]*?)\s*\"", r'"\1"', text)
    text = re.sub(r"'\s*([^']*?)\s*'", r"'\1'", text)
    # headings, degrees, line edges, numbers masked as N, possessive 's
    text = text.replace("= = = =", "====").replace("= = =", "===").replace("= =", "==")
    text = text.replace(" \N{DEGREE SIGN} ", "\N{DEGREE SIGN}")
    text = text.replace(" \n", "\n").replace("\n ", "\n")
    text = text.replace(" N ", " 1 ")
    return text.replace(" 's", "'s")


def wikitext_paper_lines(mirror: str | None = None, n_lines: int = 300, min_chars: int = 50) -> list[tuple[int, str]]:
    """The paper's "PPL" text: (line number, line) for each of the first n_lines raw lines of WikiText-103
    validation (empty lines count) whose stripped text has at least min_chars characters.

    As the author's evaluate_perplexity, which streams the Hugging Face `wikitext-103-raw-v1` validation rows (one
    per line of this file, newline kept): the line is returned unstripped, leading space and newline included,
    because that is what was tokenised.
    """
    lines = io.StringIO(read_text(fetch(WIKITEXT_VALID, mirror)))  # a line at a time, its newline kept
    return [(i, line) for i, line in zip(range(n_lines), lines) if len(line.strip()) >= min_chars]


def wikitext_lines(mirror: str | None = None) -> list[str]:
    path = fetch(WIKITEXT, mirror)
    text = read_text(path)
    if not text.strip():
        raise DataError(f"{path} is empty; replace the file")
    return text.split("\n")


# --- HellaSwag ---

@dataclass(frozen=True)
class HellaSwagItem:
    query: str  # lm-eval: preprocess(activity_label + ": " + ctx_a + " " + ctx_b.capitalize())
    choices: list[str]  # lm-eval: preprocess(ending), scored as " " + choice
    gold: int
    ctx: str  # the raw `ctx` field and endings, which the paper's protocol scores as ctx + " " + ending
    endings: list[str]


def hellaswag_preprocess(text: str) -> str:
    """lm-eval's clean-up: strip, " [title]" -> ". ", drop WikiHow's "[...]" markers, collapse double spaces."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def hellaswag(mirror: str | None = None) -> list[HellaSwagItem]:
    path = fetch(HELLASWAG, mirror)
    items = []
    for lineno, row in read_jsonl(path):
        ctx_a, ctx_b = _field(row, "ctx_a", str, path, lineno), _field(row, "ctx_b", str, path, lineno)
        label, endings = _field(row, "activity_label", str, path, lineno), _field(row, "endings", list, path, lineno)
        if not all(isinstance(e, str) for e in endings):
            raise DataError(f"{path}:{lineno}: endings is not a list of strings; replace the file")
        gold = row.get("label")
        if str(gold) not in {str(i) for i in range(len(endings))}:
            raise DataError(f"{path}:{lineno}: label {gold!r} does not name one of the {len(endings)} endings")
        query = hellaswag_preprocess(f"{label}: {ctx_a} {ctx_b.capitalize()}")
        items.append(HellaSwagItem(query, [hellaswag_preprocess(e) for e in endings], int(gold),
                                   _field(row, "ctx", str, path, lineno), endings))
    full = SOURCES[HELLASWAG].items  # not pinned by digest: its count is what tells a cut copy
    if full and len(items) != full:
        raise DataError(f"{path} holds {len(items):,} items, HellaSwag's validation set {full:,}: the file is "
                        f"incomplete; replace it (--limit scores fewer items on purpose)")
    return items


# --- ARC-Easy ---

@dataclass(frozen=True)
class ArcItem:
    id: str
    stem: str  # the question
    choices: list[str]  # answer texts, in the file's order
    labels: list[str]  # their labels: A-E, or 1-4 in some questions
    gold: int  # index of answerKey among the labels


def arc_easy(split: str = "test", mirror: str | None = None) -> list[ArcItem]:
    """The questions of one split in AI2's raw format: {"id", "question": {"stem", "choices": [{"text",
    "label"}]}, "answerKey"}.

    As lm-eval's arc_easy (doc_to_target = choices.label.index(answerKey)): any number of choices, labels as they
    are (1-4 as well as A-E); an answer key that names none of the labels stops with the file and line, where
    lm-eval stops with a traceback.
    """
    path = fetch(ARC_EASY[split], mirror)
    items = []
    for lineno, row in read_jsonl(path):
        question = _field(row, "question", dict, path, lineno)
        stem, choices = _field(question, "stem", str, path, lineno), _field(question, "choices", list, path, lineno)
        if not choices or not all(isinstance(c, dict) for c in choices):
            raise DataError(f"{path}:{lineno}: question.choices is not a list of {{text, label}} objects")
        texts = [_field(c, "text", str, path, lineno) for c in choices]
        labels = [_field(c, "label", str, path, lineno) for c in choices]
        key = row.get("answerKey")
        if key not in labels:
            raise DataError(f"{path}:{lineno}: answerKey {key!r} is not one of the labels {labels}; "
                            f"replace the file")
        items.append(ArcItem(_field(row, "id", str, path, lineno), stem, texts, labels, labels.index(key)))
    return items
