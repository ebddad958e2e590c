"""--protocol paper against the author's code, the paper's probe text, and the bad inputs of the new data files.

The author's four evaluation functions (07_benchmarks.py in cs-cmyk/preprojection: evaluate_lambada,
evaluate_perplexity, evaluate_hellaswag, evaluate_arc_easy) are transcribed below, statement by statement, on a
transformers tokenizer and a stand-in model whose log-probabilities are a formula. Hand-made data files hit each of
their rules; our protocol must keep the same items and give the same predictions and numbers. Nothing here calls
our scorer except through evaluation.evaluate.
"""

import json
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

import eval_lambada
from data import benchmarks, sources
from data.batches import global_batch
from data.prepare import probe_lines
from data.sources import DataError
from lab import evaluation as ev

V = 50304  # Pythia's padded vocabulary


class FormulaLM(torch.nn.Module):
    """A stand-in language model: after token p the logits over the vocabulary are 3 sin(0.37 p + 0.11 v) (zero
    everywhere when uniform), whatever came before, in the model's dtype. `logits(ids)` is the model as the author's
    code calls it; hidden_states and lm_head are the two halves our scorer calls."""

    def __init__(self, uniform: bool = False, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = SimpleNamespace(block_size=2048, vocab_size=V)
        self.anchor = torch.nn.Parameter(torch.zeros(1, dtype=dtype))  # where the weights are, and their dtype
        self.uniform = uniform

    def logits(self, ids) -> torch.Tensor:
        prev = torch.as_tensor(ids, dtype=torch.float32)
        if self.uniform:
            return torch.zeros(len(prev), V, dtype=self.anchor.dtype)
        return (3 * torch.sin(0.37 * prev[:, None] + 0.11 * torch.arange(V, dtype=torch.float32))).to(self.anchor.dtype)

    def hidden_states(self, idx):
        return idx[..., None]

    def lm_head(self, h):
        return self.logits(h[:, 0])


# --- the author's code, transcribed (model(ids).logits is lm.logits(ids)) ---

def author_lambada(texts: list[str], tok, lm, max_samples: int = 500) -> dict[int, tuple[bool, int]]:
    """evaluate_lambada: {passage index: (all target tokens greedy, target tokens)} for the passages it counts."""
    out = {}
    for i in range(min(max_samples, len(texts))):
        words = texts[i].rsplit(" ", 1)
        if len(words) != 2:
            continue
        context, target_word = words
        context_ids = tok(context)["input_ids"]
        target_ids = tok(" " + target_word)["input_ids"]
        if len(context_ids) + len(target_ids) > 512:
            continue
        all_correct, current = True, list(context_ids)
        for target in target_ids:
            if lm.logits(current[-1:])[-1].argmax().item() != target:  # the formula reads the last token only
                all_correct = False
                break
            current.append(target)
        out[i] = all_correct, len(target_ids)
    return out


def author_ppl(rows: list[str], tok, lm, max_samples: int = 300) -> tuple[dict[int, float], float]:
    """evaluate_perplexity: ({row index: the causal-LM loss}, exp of their mean as torch computes it)."""
    losses = {}
    for i, text in enumerate(rows):
        if i >= max_samples:
            break
        if len(text.strip()) < 50:
            continue
        ids = tok(text, truncation=True, max_length=512)["input_ids"]
        if len(ids) < 10:
            continue
        # transformers (since 4.46) upcasts the logits to fp32 in its causal-LM loss
        losses[i] = F.cross_entropy(lm.logits(ids)[:-1].float(), torch.tensor(ids[1:])).item()
    return losses, torch.exp(torch.tensor(sum(losses.values()) / len(losses))).item()


def author_choice(prefix: str, choices: list[str], tok, lm) -> int:
    """The inner loop of evaluate_hellaswag and evaluate_arc_easy: the choice of best mean log-prob per token."""
    best_score, best_idx = float("-inf"), -1
    for j, choice in enumerate(choices):
        input_ids = tok(prefix + " " + choice, truncation=True, max_length=512)["input_ids"]
        logits = lm.logits(input_ids)
        ctx_len = len(tok(prefix)["input_ids"])
        shift_logits = logits[ctx_len - 1:-1]
        shift_labels = torch.tensor(input_ids[ctx_len:], dtype=torch.long)
        token_log_probs = torch.log_softmax(shift_logits, dim=-1).gather(1, shift_labels[:, None])[:, 0]
        score = token_log_probs.sum().item() / max(len(shift_labels), 1)
        if score > best_score:
            best_score, best_idx = score, j
    return best_idx


def hf_rows(path) -> list[str]:
    """The Hugging Face `wikitext` rows of a raw file: one per line, newline kept, blank lines empty."""
    with open(path, encoding="utf-8") as f:
        return [line if line.strip() else "" for line in f]


# --- hand-made data, each case aimed at a rule ---

def of_length(n: int) -> str:
    s = ("lorem ipsum dolor sit amet, consectetur " * 4)[:n]
    assert len(s.strip()) == n  # the case is what it claims
    return s


def wiki_lines() -> list[str]:
    lines = [" \n", " = Title = \n", " \n",
             " The first paragraph , with WikiText 's spacing , is long enough to be kept by the rule .\n",
             f" {of_length(49)}\n",  # 49 stripped characters: out
             f" {of_length(50)}\n",  # exactly 50: in (>= 50)
             " " + "=" * 60 + " \n",  # 60 characters but 4 tokens: out (< 10 tokens)
             "   Extra spaces at either end count as they are in the raw line , and are tokenised .  \n"]
    lines += [" \n"] * (299 - len(lines))
    lines += [" The last line the author reads is line 299 , this one , kept since it is long enough .\n",
              " Line 300 is beyond the first 300 lines , so it is never read , however long it is .\n"]
    return lines


def greedy_passage(tok, lm) -> str:
    """A passage whose one-token target word is the formula's argmax after the context: a correct case."""
    for word in ("cat", "dog", "house", "river", "tree", "stone", "bird", "cloud", "road", "lamp", "door"):
        context = f"The old man looked at the {word}"
        best = lm.logits(tok(context)["input_ids"][-1:])[-1].argmax().item()
        target = tok.decode([best])
        if target.startswith(" ") and target[1:].isalpha() and tok(target)["input_ids"] == [best]:
            return context + target
    raise AssertionError("no greedy passage among the candidates")


def hellaswag_rows() -> list[dict]:
    def row(ctx, endings, label):
        return {"activity_label": "Test", "ctx_a": ctx, "ctx_b": "", "ctx": ctx, "endings": endings, "label": label}
    return [row("A man is sitting on a roof. he", ["is using wrap.", "starts pulling up roofing.", "sings.",
                                                   "is ripping tiles off."], 0),
            row("The cat sat ", ["mat.", "on the mat.", "down slowly.", "x"], 1),  # ctx ends in a space
            row("go" + " go" * 509, ["one two three", "alpha beta gamma", "up down", "left right"], 2)]  # 510 tokens


def arc_rows() -> list[dict]:
    def row(i, stem, texts, labels, key):
        return {"id": f"hand_{i}", "question": {"stem": stem, "choices": [{"text": t, "label": lab}
                                                                           for t, lab in zip(texts, labels)]},
                "answerKey": key}
    return [row(0, "Which gas do plants take in?", ["oxygen", "carbon dioxide", "helium", "neon"], "ABCD", "B"),
            row(1, "What melts ice fastest?", ["salt", "sand", "paper", "wood"], "1234", "1"),
            row(2, "Which is a mammal?", ["shark", "whale", "trout"], "ABC", "A"),
            row(3, "Which is a planet?", ["Mars", "Moon", "Sun", "Vega", "Io"], "ABCDE", "A"),
            row(4, "Why?  ", ["Because it rains.", "No reason."], "AB", "B"),  # the stem ends in spaces
            # a near tie that the author's bf16 log_softmax and sum decide otherwise than fp32 would
            row(5, "Which colour is it?", ["green gold pink purple the in blue white",
                                           "a on green gold pink purple the in"], "AB", "A")]


def write_jsonl(path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


@pytest.fixture()
def hand_mirror(tmp_path, monkeypatch, mirror):
    """A mirror folder of hand-made files (their sha256 pins lifted) and the real tokenizer."""
    from transformers import PreTrainedTokenizerFast

    tok_file = f"{mirror}/tokenizers/20B_tokenizer.json"
    hf_tok = PreTrainedTokenizerFast(tokenizer_file=tok_file)
    lm = FormulaLM()
    lambada = ["The cat sat on the mat and then the cat sat on the mat", greedy_passage(hf_tok, lm),
               "Alpha beta gamma signs\n\nHe", "She looked at him and said  yes",  # two spaces: " " ends the context
               "word " * 600 + "end"]  # over 512 tokens
    write_jsonl(tmp_path / benchmarks.LAMBADA, [{"text": t} for t in lambada])
    (tmp_path / "wikitext").mkdir()
    (tmp_path / benchmarks.WIKITEXT_VALID).write_text("".join(wiki_lines()), encoding="utf-8")
    write_jsonl(tmp_path / benchmarks.HELLASWAG, hellaswag_rows())
    write_jsonl(tmp_path / benchmarks.ARC_EASY["validation"], arc_rows())
    for rel in (benchmarks.LAMBADA, benchmarks.WIKITEXT_VALID, benchmarks.HELLASWAG, benchmarks.ARC_EASY["validation"]):
        monkeypatch.setitem(sources.SOURCES, rel, sources.Source(sources.SOURCES[rel].url))
    return str(tmp_path), Tokenizer.from_file(tok_file), hf_tok, lambada


def paper_items(lm, tok, folder) -> dict[str, list[dict]]:
    records = []
    results = ev.evaluate(lm, tok, ev.TASKS, "paper", batch_size=3, mirror=folder, items=records)
    return results, {task: [r for r in records if r["task"] == task] for task in ev.TASKS}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paper_protocol_is_the_authors_code(hand_mirror, dtype):
    """In bf16 too: the author's log_softmax and sums then run in bf16, which our scorer's rounding reproduces."""
    folder, tok, hf_tok, lambada = hand_mirror
    lm = FormulaLM(dtype=dtype)
    results, items = paper_items(lm, tok, folder)
    # the hand-made cases hit the rules they are meant to
    assert len(hf_tok(lambada[-1])["input_ids"]) > 512
    alone = hf_tok("The cat sat ")["input_ids"]
    assert hf_tok("The cat sat  mat.")["input_ids"][:len(alone)] != alone  # a token ("  ") crosses the boundary
    assert len(hf_tok(hellaswag_rows()[2]["ctx"])["input_ids"]) == 510  # its endings are cut at 512

    expected = author_lambada(lambada, hf_tok, lm)
    assert {r["item"]: (r["correct"], r["tokens"]) for r in items["lambada"]} == expected
    assert list(expected) == [0, 1, 2, 3]  # the long passage is left out
    assert expected[1][0] or dtype == torch.bfloat16  # right in fp32; in bf16 another token can tie for the maximum
    assert results["lambada"]["metrics"]["acc"]["value"] == pytest.approx(sum(c for c, _ in expected.values()) / 4)
    assert "1 passages over 512 tokens left out" in results["lambada"]["note"]

    losses, ppl = author_ppl(hf_rows(f"{folder}/{benchmarks.WIKITEXT_VALID}"), hf_tok, lm)
    assert list(losses) == [3, 5, 7, 299]  # the 49-character, 4-token and beyond-300 lines are out
    ours = {r["item"]: -r["logprob"] / r["tokens"] for r in items["wikitext"]}
    assert list(ours) == list(losses) and max(abs(ours[i] - losses[i]) for i in ours) < 1e-4
    assert results["wikitext"]["metrics"]["ppl"]["value"] == pytest.approx(ppl, rel=1e-5)

    rows = hellaswag_rows()
    assert [r["pred"] for r in items["hellaswag"]] == [author_choice(r["ctx"], r["endings"], hf_tok, lm)
                                                       for r in rows]
    assert items["hellaswag"][2]["choice_tokens"] == [2, 2, 2, 2]  # 512 - 510 tokens of each ending
    arc = [author_choice(r["question"]["stem"], [c["text"] for c in r["question"]["choices"]], hf_tok, lm)
           for r in arc_rows()]
    assert [r["pred"] for r in items["arc_easy"]] == arc
    gold = [1, 0, 0, 0, 1, 0]
    assert [r["gold"] for r in items["arc_easy"]] == gold  # answerKey "1" of labels 1-4 is index 0
    assert results["arc_easy"]["metrics"]["acc"]["value"] == pytest.approx(sum(p == g for p, g in zip(arc, gold)) / 6)
    near_tie = arc_rows()[5]["question"]
    choices = [c["text"] for c in near_tie["choices"]]
    assert author_choice(near_tie["stem"], choices, hf_tok, FormulaLM(dtype=torch.bfloat16)) != \
        author_choice(near_tie["stem"], choices, hf_tok, FormulaLM())  # the case bites


def test_paper_protocol_known_answers_of_a_uniform_model(hand_mirror):
    """All logits equal: every token has log-probability -log V, so PPL = V, no target is the argmax (token 0,
    <|endoftext|>, wins every tie), and every choice ties, so the first is picked."""
    folder, tok, _, _ = hand_mirror
    results, items = paper_items(FormulaLM(uniform=True), tok, folder)
    assert results["wikitext"]["metrics"]["ppl"]["value"] == pytest.approx(V, rel=1e-5)
    assert results["lambada"]["metrics"]["acc"]["value"] == 0.0
    assert all(r["pred"] == 0 for task in ("hellaswag", "arc_easy") for r in items[task])
    assert results["hellaswag"]["metrics"]["acc"]["value"] == pytest.approx(1 / 3)  # gold 0 once in 3
    assert results["arc_easy"]["metrics"]["acc"]["value"] == pytest.approx(4 / 6)


# --- the paper's probe text ---

def test_probe_lines_are_the_authors(mirror):
    """More than 50 stripped characters, the first n of them, unstripped; padded to the sequence length with the
    pad label ignored, exactly as the author's tokenizer call and DataCollatorForLanguageModeling do."""
    from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast

    raw = [" \n", f" {of_length(50)}\n", f" {of_length(51)}\n", " = Heading = \n",
           " A second line that is comfortably longer than fifty characters , as WikiText writes .\n",
           " A third long line , which n_lines = 2 leaves out although it passes the length rule .\n"]
    kept = probe_lines(raw, n_lines=2)
    assert kept == [raw[2], raw[4]]  # 50 characters is not more than 50
    tok = PreTrainedTokenizerFast(tokenizer_file=f"{mirror}/tokenizers/20B_tokenizer.json", eos_token="<|endoftext|>")
    tok.pad_token = tok.eos_token  # as the author's main()
    seq_len = 16  # the second line is longer: cut, as truncation=True cuts it
    batch = DataCollatorForLanguageModeling(tokenizer=tok, mlm=False)(
        [tok(t, truncation=True, max_length=seq_len, padding="max_length") for t in kept])
    for row, text in enumerate(kept):
        ids = tok(text)["input_ids"][:seq_len]  # what wikitext103_probe_lines keeps of a line
        x, y = global_batch([torch.tensor(ids).numpy()], 0, 1, seq_len, 0)
        # the author's model shifts inside its loss: input t predicts label t + 1. Our batch stops at its longest
        # row; the author's pads to seq_len, and every label past our width is ignored there
        width, labels = y.size(1), batch["labels"][row, 1:].tolist()
        assert y[0].tolist() == labels[:width] and set(labels[width:]) <= {-100}
        real = y[0] != -100
        assert x[0][real].tolist() == batch["input_ids"][row, :width][real].tolist()


# --- bad inputs ---

def linked_mirror(tmp_path, mirror, skip: str):
    """A mirror folder of links to the real files, all but `skip`."""
    folder = tmp_path / "mirror"
    for root, _, files in os.walk(mirror):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), mirror)
            if rel != skip and not rel.startswith("corpus"):
                (folder / rel).parent.mkdir(parents=True, exist_ok=True)
                (folder / rel).symlink_to(os.path.join(root, name))
    return folder


def run_cli(model_dir, folder, tmp_path, *args):
    out = tmp_path / "out" / "eval.json"
    with pytest.raises(SystemExit) as e:
        eval_lambada.main(["--init_from", model_dir, "--mirror", str(folder), "--device", "cpu", "--out", str(out),
                           *args])
    assert not out.parent.exists()  # nothing written
    return str(e.value)


def test_missing_wiki_valid(pythia_vocab_dir, tmp_path, mirror):
    folder = linked_mirror(tmp_path, mirror, benchmarks.WIKITEXT_VALID)
    message = run_cli(pythia_vocab_dir, folder, tmp_path, "--tasks", "wikitext", "--protocol", "paper")
    assert message.startswith("error: wikitext/wiki.valid.raw is missing from the mirror folder")
    assert "get it from https://wikitext.smerity.com/wikitext-2-raw-v1.zip" in message and "\n" not in message


def test_corrupt_arc_line(pythia_vocab_dir, tmp_path, mirror, monkeypatch):
    rel = benchmarks.ARC_EASY["test"]
    folder = linked_mirror(tmp_path, mirror, rel)
    good = open(f"{mirror}/{rel}", encoding="utf-8").readlines()[:2]
    (folder / rel).write_text(good[0] + '{"id": "broken", "question": {"stem"\n' + good[1], encoding="utf-8")
    message = run_cli(pythia_vocab_dir, folder, tmp_path, "--tasks", "arc_easy")  # the sha256 pin catches it first
    assert message.startswith("error: ") and "has the wrong sha256" in message and "\n" not in message
    monkeypatch.setitem(sources.SOURCES, rel, sources.Source(sources.SOURCES[rel].url))  # no pin: the reader
    message = run_cli(pythia_vocab_dir, folder, tmp_path, "--tasks", "arc_easy")
    assert message.startswith("error: ") and "ARC-Easy-Test.jsonl:2: malformed JSON line" in message
    (folder / rel).write_text(good[0] + good[1].replace('"answerKey":"', '"answerKey":"Z'), encoding="utf-8")
    with pytest.raises(DataError, match=r"ARC-Easy-Test.jsonl:2: answerKey 'Z.' is not one of the labels"):
        benchmarks.arc_easy("test", str(folder))


def test_online_fetch_takes_members_from_one_download(tmp_path, monkeypatch, mirror):
    """Without a mirror, AI2's zip is downloaded once, kept, and each split read from its member path and pinned."""
    import io
    import zipfile
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as z:
        for split in ("Dev", "Test"):
            z.write(f"{mirror}/arc/ARC-Easy-{split}.jsonl", f"ARC-V1-Feb2018-2/ARC-Easy/ARC-Easy-{split}.jsonl")
    downloads = []
    monkeypatch.setattr(sources, "download", lambda url: downloads.append(url) or archive.getvalue())
    monkeypatch.setattr(sources, "CACHE", tmp_path)
    monkeypatch.delenv(sources.MIRROR_ENV, raising=False)
    assert len(benchmarks.arc_easy("validation")) == 570 and len(benchmarks.arc_easy("test")) == 2376
    assert downloads == [sources.ARC]
    (tmp_path / "downloads" / "arc" / "ARC-Easy-Dev.jsonl").write_text("{}\n")  # a corrupted cached copy
    with pytest.raises(DataError, match="ARC-Easy-Dev.jsonl has the wrong sha256"):
        benchmarks.arc_easy("validation")
