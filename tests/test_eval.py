"""Evaluation: per-document parity with a plain transformers computation, known answers, and bad inputs."""

import json
import math
import os
import shutil

import pytest
import torch
from tokenizers import Tokenizer

import eval_lambada
from conftest import make_hf_model
from data import benchmarks
from data.sources import DataError
from lab import evaluation as ev
from load_pythia import load_pythia

LP_TOL = 1e-4  # max |summed log-probability difference| per document against transformers, fp32 (docs/evaluation.md
# has the measured differences)
WINDOW = 64  # a short window, so that real LAMBADA passages get left-truncated and WikiText needs many windows


@pytest.fixture(scope="module")
def setup(tmp_path_factory, mirror):
    """A tiny random Pythia-shaped model with Pythia's vocabulary and tokenizer:
    (transformers model, our model, its folder, our tokenizer, transformers' tokenizer)."""
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tiny_pythia_50k")
    hf = make_hf_model(vocab=50304, max_pos=WINDOW)
    hf.save_pretrained(folder)
    tok_file = f"{mirror}/tokenizers/20B_tokenizer.json"
    shutil.copy(tok_file, folder / "tokenizer.json")
    ours = load_pythia(str(folder))
    hf_tok = PreTrainedTokenizerFast(tokenizer_file=tok_file)
    return hf, ours, str(folder), Tokenizer.from_file(tok_file), hf_tok


# --- the independent reference: one example at a time, transformers model and tokenizer ---

def hf_tokens(hf_tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    if context.rstrip() != context:
        k = len(context) - len(context.rstrip())
        context, continuation = context[:-k], context[-k:] + continuation
    ctx = hf_tok(context, add_special_tokens=False)["input_ids"]
    whole = hf_tok(context + continuation, add_special_tokens=False)["input_ids"]
    return ctx, whole[len(ctx):]


@torch.no_grad()
def hf_score(hf, ids: list[int], n_cont: int) -> tuple[float, bool]:
    """Summed log-probability of the last n_cont tokens of ids, and whether each is the argmax."""
    ids = ids[-(WINDOW + 1):]
    logp = torch.log_softmax(hf(torch.tensor([ids[:-1]])).logits[0].double(), dim=-1)[-n_cont:]
    target = torch.tensor(ids[-n_cont:])
    return logp.gather(1, target[:, None]).sum().item(), bool((logp.argmax(-1) == target).all())


def max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


# --- parity on the real files ---

def test_lambada_parity(setup, mirror):
    hf, ours, _, tok, hf_tok = setup
    res = ev.lambada(ours, tok, limit=40, batch_size=8, mirror=mirror)
    ref = []
    for context, target in benchmarks.lambada(mirror)[:40]:
        ctx, cont = hf_tokens(hf_tok, context, target)
        ref.append(hf_score(hf, ctx + cont, len(cont)))
    diff = max_diff([d["logprob"] for d in res["items"]], [r[0] for r in ref])
    print(f"LAMBADA x40: max |dlogprob| = {diff:.2e}, {res['truncated']} truncated")
    assert diff <= LP_TOL
    assert [d["correct"] for d in res["items"]] == [r[1] for r in ref]
    assert res["truncated"] > 0  # the short window really cut contexts
    losses = [-r[0] for r in ref]
    assert math.isclose(res["metrics"]["ppl"]["value"], math.exp(sum(losses) / 40), rel_tol=1e-3)


def test_wikitext_parity(setup, mirror):
    """A whole page in disjoint windows: block [start, end) is predicted from ([EOT] + page)[end - W:end]."""
    hf, ours, _, tok, hf_tok = setup
    res = ev.wikitext(ours, tok, limit=1, batch_size=8, mirror=mirror)
    page = benchmarks.wikitext_pages(mirror)[0]
    tokens = hf_tok(benchmarks.wikitext_detokenize(page), add_special_tokens=False)["input_ids"]
    seq, total = [0] + tokens, 0.0  # 0 = <|endoftext|>
    for start in range(0, len(tokens), WINDOW):
        end = min(start + WINDOW, len(tokens))
        total += hf_score(hf, seq[max(0, end - WINDOW):end + 1], end - start)[0]
    doc = res["items"][0]
    print(f"WikiText page 0 ({len(tokens)} tokens): |dlogprob| = {abs(doc['logprob'] - total):.2e}")
    assert abs(doc["logprob"] - total) <= LP_TOL
    words, n_bytes = len(page.split()), len(page.encode())
    assert doc["bytes"] == n_bytes and abs(doc["words"] - words) <= 2  # re.split counts the empty edges
    assert math.isclose(res["metrics"]["word_perplexity"]["value"], math.exp(-doc["logprob"] / doc["words"]))
    assert math.isclose(res["metrics"]["bits_per_byte"]["value"], -doc["logprob"] / n_bytes / math.log(2))


def test_hellaswag_parity(setup, mirror):
    hf, ours, _, tok, hf_tok = setup
    items = benchmarks.hellaswag(mirror)[:6]
    for protocol in ev.PROTOCOLS:
        res = ev.hellaswag(ours, tok, protocol, limit=6, batch_size=8, mirror=mirror)
        for it, doc in zip(items, res["items"]):
            ctx_text, ends = (it.ctx, it.endings) if protocol == "paper" else (it.query, it.choices)
            ref = []
            for e in ends:
                ctx, cont = hf_tokens(hf_tok, ctx_text, " " + e)
                ref.append((hf_score(hf, ctx + cont, len(cont))[0], len(cont)))
            assert max_diff(doc["logprobs"], [r[0] for r in ref]) <= LP_TOL
            if protocol == "paper":  # mean log-probability per ending token
                assert doc["pred"] == max(range(4), key=lambda i: ref[i][0] / ref[i][1])
            else:  # acc_norm divides by the ending's length in characters
                assert doc["pred"] == max(range(4), key=lambda i: ref[i][0])
                assert doc["pred_norm"] == max(range(4), key=lambda i: ref[i][0] / len(ends[i]))


def arc_subset(mirror) -> list[str]:
    """Raw lines of ARC-Easy test: the first eight, and the first with labels 1-4, with 3 and with 5 choices."""
    lines = open(f"{mirror}/arc/ARC-Easy-Test.jsonl", encoding="utf-8").readlines()
    rows = [json.loads(line)["question"]["choices"] for line in lines]
    picks = list(range(8))
    for wanted in (lambda c: c[0]["label"] == "1", lambda c: len(c) == 3, lambda c: len(c) == 5):
        picks.append(next(i for i, c in enumerate(rows) if wanted(c)))
    return [lines[i] for i in picks]


def test_arc_easy_agrees_with_lm_eval(setup, mirror, tmp_path, monkeypatch):
    """lm-evaluation-harness's own arc_easy task (its YAML, run on these items from a local JSON file in the
    Hugging Face layout) against ours: log-likelihoods, acc and acc_norm per question."""
    import lm_eval
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from data import sources

    _, ours, folder, tok, _ = setup
    raw = arc_subset(mirror)
    (tmp_path / "arc").mkdir()
    (tmp_path / "arc" / "ARC-Easy-Test.jsonl").write_text("".join(raw), encoding="utf-8")
    monkeypatch.setitem(sources.SOURCES, "arc/ARC-Easy-Test.jsonl",
                        sources.Source(sources.SOURCES["arc/ARC-Easy-Test.jsonl"].url))  # a subset of the file
    res = ev.arc_easy(ours, tok, limit=None, batch_size=8, mirror=str(tmp_path))

    hf_layout = tmp_path / "arc_hf.jsonl"  # allenai/ai2_arc's fields: question = stem, choices = {text, label}
    with open(hf_layout, "w") as f:
        for line in raw:
            r = json.loads(line)
            choices = r["question"]["choices"]
            f.write(json.dumps({"id": r["id"], "question": r["question"]["stem"], "answerKey": r["answerKey"],
                                "choices": {"text": [c["text"] for c in choices],
                                            "label": [c["label"] for c in choices]}}) + "\n")
    yaml = os.path.join(os.path.dirname(lm_eval.__file__), "tasks", "arc", "arc_easy.yaml")
    (tmp_path / "arc_local.yaml").write_text(
        f"include: {yaml}\ntask: arc_easy_local\ntag: []\ndataset_path: json\ndataset_name: null\n"
        f"dataset_kwargs:\n  data_files:\n    test: {hf_layout}\n  cache_dir: {tmp_path / 'hf_cache'}\n"
        f"training_split: null\nvalidation_split: null\ntest_split: test\n")
    out = simple_evaluate(model=HFLM(pretrained=folder, dtype="float32", device="cpu", batch_size=8),
                          tasks=["arc_easy_local"], log_samples=True,
                          task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False))
    samples = sorted(out["samples"]["arc_easy_local"], key=lambda s: s["doc_id"])
    assert len(samples) == len(res["items"]) == 11
    diff = max(max_diff(d["logprobs"], [r[0][0] for r in s["resps"]]) for d, s in zip(res["items"], samples))
    print(f"ARC-Easy x11 against lm-eval {lm_eval.__version__}: max |dlogprob| = {diff:.2e}")
    assert diff <= LP_TOL
    assert [float(d["correct"]) for d in res["items"]] == [s["acc"] for s in samples]
    assert [float(d["correct_norm"]) for d in res["items"]] == [s["acc_norm"] for s in samples]
    assert [d["gold"] for d in res["items"]] == [s["target"] for s in samples]
    for name in ("acc", "acc_norm"):
        assert res["metrics"][name]["value"] == pytest.approx(out["results"]["arc_easy_local"][f"{name},none"])
        assert res["metrics"][name]["stderr"] == pytest.approx(
            out["results"]["arc_easy_local"][f"{name}_stderr,none"])


def test_paper_wikitext_is_the_plain_causal_lm_loss(setup, mirror):
    """Each kept line of WikiText-103 validation, unstripped, scored alone: the transformers causal-LM loss."""
    hf, ours, _, tok, hf_tok = setup
    res = ev.wikitext(ours, tok, "paper", limit=40, batch_size=4, mirror=mirror)
    with open(f"{mirror}/wikitext/wiki.valid.raw", encoding="utf-8") as f:
        lines = [(i, line) for i, line in enumerate(f) if i < 40 and len(line.strip()) >= 50]
    assert [d["item"] for d in res["items"]] == [i for i, _ in lines] and len(lines) >= 4
    for (_, line), doc in zip(lines[:4], res["items"]):
        assert line.startswith(" ") and line.endswith("\n")  # what the author tokenises
        ids = torch.tensor([hf_tok(line, add_special_tokens=False)["input_ids"][:WINDOW + 1]])
        with torch.no_grad():
            loss = hf(input_ids=ids, labels=ids).loss.item()
        assert abs(-doc["logprob"] / doc["tokens"] - loss) <= 1e-4
    assert res["data"]["wikitext/wiki.valid.raw"].startswith("4cd0f687")  # WikiText-103 validation
    assert res["truncated"] == sum(len(hf_tok(line)["input_ids"]) > WINDOW + 1 for _, line in lines) > 0


# --- known answers on hand-made cases ---

class FirstTokenLM(torch.nn.Module):
    """Every position predicts from the first input token only: logits[b, t] = TABLE[idx[b, 0]]."""

    def __init__(self, vocab: int = 12, window: int = 6):
        super().__init__()
        self.config = type("Config", (), {"block_size": window, "vocab_size": vocab})()
        self.table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0))
        self.lm_head = torch.nn.Linear(vocab, vocab, bias=False)  # one-hot of the first token -> its table row
        self.lm_head.weight.data = self.table.T.contiguous()

    def hidden_states(self, idx):
        return torch.nn.functional.one_hot(idx[:, :1], self.table.size(0)).float().expand(-1, idx.size(1), -1)

    def logp(self, first: int, token: int) -> float:
        return torch.log_softmax(self.table[first].double(), -1)[token].item()


def test_known_answers():
    lm = FirstTokenLM()
    best = lm.table.argmax(-1).tolist()
    cases = [([3, 4], [5, 6, 7]),  # a continuation of several tokens
             ([0], [best[0], best[0]]),  # an empty context is <|endoftext|> (0 here): greedy twice
             ([1, 2, 3, 4, 5], [6, 7, 8])]  # 8 tokens > window + 1 = 7: the context loses its first token
    scores = ev.score_pairs(lm, cases, batch_size=2)
    for (_, cont), s, first in zip(cases, scores, [3, 0, 2]):
        assert s.logprob == pytest.approx(sum(lm.logp(first, t) for t in cont), abs=1e-5)
        assert s.greedy == all(t == best[first] for t in cont) and s.n_tokens == len(cont)
    assert scores[1].greedy
    assert [s.truncated for s in scores] == [False, False, True]
    with pytest.raises(ValueError, match="window"):
        ev.score_pairs(lm, [([1], list(range(7)))])


def test_rolling_windows_are_lm_evals():
    # lm-eval, max_seq_len=4, context_len=1: P 0 1 2 -> 0 1 2 3; 3 -> 4 5 6 7; 5 6 7 -> 8 9
    assert ev.rolling_windows(list(range(10)), 99, 4) == [([99], [0, 1, 2, 3]), ([3], [4, 5, 6, 7]),
                                                         ([5, 6, 7], [8, 9])]
    assert ev.rolling_windows([], 99, 4) == []


def test_tokenisation_follows_lm_eval(setup, mirror):
    _, _, _, tok, _ = setup
    ctx, cont = ev.encode_pair(tok, "The cat sat on the ", "mat")  # the trailing space moves to the target
    assert tok.decode(ctx) == "The cat sat on the" and tok.decode(cont) == " mat"
    ctx, cont = ev.encode_pair(tok, "He said", " signs\n\nHe")  # a LAMBADA target containing newlines
    assert tok.decode(cont) == " signs\n\nHe" and ctx + cont == tok.encode("He said signs\n\nHe").ids
    assert ev.encode_pair(tok, "", "Hello") == ([0], tok.encode("Hello").ids)  # empty context: <|endoftext|>
    newline_targets = [t for _, t in benchmarks.lambada(mirror) if "\n" in t]
    assert len(newline_targets) == 7


# --- the command line and bad inputs ---

def run_cli(monkeypatch, *args) -> None:
    eval_lambada.main(list(args))


def test_cli_writes_json(setup, mirror, tmp_path, monkeypatch, capsys):
    out = tmp_path / "eval.json"
    run_cli(monkeypatch, "--init_from", setup[2], "--tasks", "lambada,hellaswag", "--limit", "3",
            "--device", "cpu", "--mirror", mirror, "--out", str(out))
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"lambada", "hellaswag"} and report["config"]["protocol"] == "lm-eval"
    lam = report["results"]["lambada"]
    assert lam["n"] == 3 and set(lam["metrics"]) == {"acc", "ppl"}
    assert lam["data"]["lambada/lambada_test.jsonl"].startswith("4aa8d02c")
    assert "acc_norm" in capsys.readouterr().out
    # one record per item beside the summary, whose metrics they reproduce
    items = [json.loads(line) for line in (tmp_path / "eval.items.jsonl").read_text().splitlines()]
    assert [(r["task"], r["item"]) for r in items] == [("lambada", i) for i in range(3)] + [("hellaswag", i)
                                                                                         for i in range(3)]
    assert all({"logprob", "correct", "tokens", "truncated", "protocol"} <= set(r) for r in items)
    assert all(len(r["logprobs"]) == 4 and r["pred"] in range(4) for r in items[3:])
    acc = sum(r["correct"] for r in items[3:]) / 3
    assert report["results"]["hellaswag"]["metrics"]["acc"]["value"] == pytest.approx(acc)
    ppl = math.exp(-sum(r["logprob"] for r in items[:3]) / 3)
    assert lam["metrics"]["ppl"]["value"] == pytest.approx(ppl)


@pytest.mark.parametrize("args,message", [
    (["--tasks", "lambada,arc"], "unknown task 'arc'"),
    (["--protocol", "helm"], "unknown protocol 'helm'"),
])
def test_cli_rejects_unknown_names(setup, monkeypatch, args, message):
    with pytest.raises(SystemExit, match=f"^error: {message}"):
        run_cli(monkeypatch, "--init_from", setup[2], *args)


def test_cli_checkpoint_that_does_not_load(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text('{"kind": "full"}')
    (tmp_path / "ckpt.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(SystemExit, match="^error: .*ckpt.pt is not a readable checkpoint"):
        run_cli(monkeypatch, "--init_from", str(tmp_path))


def test_missing_and_malformed_data(setup, tmp_path, monkeypatch, mirror):
    with pytest.raises(SystemExit, match="^error: lambada/lambada_test.jsonl is missing .* get it from https://"):
        run_cli(monkeypatch, "--init_from", setup[2], "--tasks", "lambada", "--mirror", str(tmp_path))
    bad = tmp_path / "hellaswag" / "hellaswag_val.jsonl"
    bad.parent.mkdir()
    good = open(f"{mirror}/hellaswag/hellaswag_val.jsonl").readlines()[:2]
    bad.write_text("".join(good) + '{"ctx_a": "broken\n')
    with pytest.raises(DataError, match=r"hellaswag_val.jsonl:3: malformed JSON line"):
        benchmarks.hellaswag(str(tmp_path))
