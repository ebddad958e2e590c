"""lm-evaluation-harness on our models (tools/harness.py) and the Hugging Face export (tools/export.py).

The harness runs local task definitions (YAML written here) that read the mirror's LAMBADA and ARC-Easy files,
so nothing is downloaded; its numbers are compared per item with our own scorer, and the exported folders with
transformers and with lm-eval's own Hugging Face model (HFLM).
"""

import importlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from tokenizers import Tokenizer

import eval_lambada
import load_pythia
import tools
from conftest import ROOT, make_hf_model
from data import benchmarks
from lab import evaluation as ev
from lab.checkpoint import load_model, save_checkpoint, weights_sha256
from tools import export, harness

WINDOW = 64  # short, so that LAMBADA passages are left-truncated
N = 6  # items per task
GEN_TOKENS = 8  # max_gen_toks of the generation task
# |log-likelihood difference| per item, harness path against our scorer: the same scorer, but the harness batches
# other requests together (other padding, other matrix shapes), so float rounding differs (docs/harness.md has
# the measured differences)
LP_TOL = 1e-5
LOGIT_TOL = 1e-4  # exported folder in transformers against our model, fp32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, mirror):
    """A tiny random Pythia-shaped model with Pythia's tokenizer: (its folder, our model, the tokenizer)."""
    folder = tmp_path_factory.mktemp("tiny_pythia_50k")
    make_hf_model(vocab=50304, max_pos=WINDOW).save_pretrained(folder)
    shutil.copy(f"{mirror}/tokenizers/20B_tokenizer.json", folder / "tokenizer.json")
    model, tok, _ = load_model(str(folder))
    return str(folder), model, tok


def mirror_task(name: str, data: str, folder, **config) -> None:
    """A task YAML reading one of the mirror's JSON-lines files through the `datasets` json loader."""
    task = {"task": name, "dataset_path": "json", "test_split": "test",
            "dataset_kwargs": {"data_files": {"test": data}, "cache_dir": str(folder / "datasets")}, **config}
    (folder / f"{name}.yaml").write_text(yaml.safe_dump(task, allow_unicode=True))


def mean(metric: str) -> dict:
    return {"metric": metric, "aggregation": "mean", "higher_is_better": True}


def greedy_text(model, tok, context: str) -> str:
    """The reference for generate_until: GPT.generate greedy, on the prompt cut to leave room for the new tokens."""
    prompt = ev.encode(tok, context)[-(WINDOW - GEN_TOKENS):]
    out = model.generate(torch.tensor([prompt]), GEN_TOKENS, temperature=0)[0, len(prompt):].tolist()
    return tok.decode(out[:out.index(0)] if 0 in out else out)  # 0 = <|endoftext|>, where HFLM stops


@pytest.fixture(scope="module")
def tasks(tmp_path_factory, tiny, mirror):
    """Three local tasks: lm-eval's lambada_openai and arc_easy definitions on the mirror's files, and a
    generate_until task whose stop string occurs in the first item's greedy output (so `until` must cut it)."""
    folder = tmp_path_factory.mktemp("tasks")
    _, model, tok = tiny
    lambada_text = {"doc_to_text": "{{text.split(' ')[:-1]|join(' ')}}", "doc_to_target": "{{' '+text.split(' ')[-1]}}"}
    mirror_task("lambada_mirror", f"{mirror}/lambada/lambada_test.jsonl", folder, output_type="loglikelihood",
                **lambada_text, metric_list=[{"metric": "perplexity", "aggregation": "perplexity",
                                              "higher_is_better": False},
                                             mean("acc")])
    mirror_task("arc_easy_mirror", f"{mirror}/arc/ARC-Easy-Test.jsonl", folder, output_type="multiple_choice",
                doc_to_text="Question: {{question.stem}}\nAnswer:",
                doc_to_choice="{{question.choices|map(attribute='text')|list}}",
                doc_to_target="{{(question.choices|map(attribute='label')|list).index(answerKey)}}",
                metric_list=[mean("acc"), mean("acc_norm")])
    first = greedy_text(model, tok, benchmarks.lambada(mirror)[0][0])
    stop = first[len(first) // 2:][:3]
    assert stop.strip(), f"no usable stop string in {first!r}"
    mirror_task("lambada_generate", f"{mirror}/lambada/lambada_test.jsonl", folder, output_type="generate_until",
                **lambada_text, generation_kwargs={"until": [stop], "max_gen_toks": GEN_TOKENS, "do_sample": False},
                metric_list=[mean("exact_match")])
    return str(folder), stop


@pytest.fixture(scope="module")
def run(tiny, tasks):
    """One simple_evaluate over the three tasks through the adapter, samples logged: (adapter, lm-eval output)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    lm = harness.HarnessLM(tiny[1], tiny[2], batch_size=8)
    manager = TaskManager(include_path=tasks[0], include_defaults=False)
    out = lm_eval.simple_evaluate(model=lm, tasks=["lambada_mirror", "arc_easy_mirror", "lambada_generate"],
                                  task_manager=manager, limit=N, log_samples=True, bootstrap_iters=0)
    return lm, out


def max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


# --- the harness on our models ---

def test_lambada_through_the_harness_equals_our_scorer(tiny, run, mirror):
    _, model, tok = tiny
    lm, out = run
    ours = ev.lambada(model, tok, limit=N, batch_size=4, mirror=mirror)
    samples = sorted(out["samples"]["lambada_mirror"], key=lambda s: s["doc_id"])
    theirs = [s["filtered_resps"][0] for s in samples]
    diff = max_diff([lp for lp, _ in theirs], [d["logprob"] for d in ours["items"]])
    print(f"LAMBADA x{N} through lm-eval: max |dlogprob| = {diff:.2e}")
    assert diff <= LP_TOL
    assert [bool(g) for _, g in theirs] == [d["correct"] for d in ours["items"]]
    assert [tuple(s["arguments"][0]) for s in samples] == benchmarks.lambada(mirror)[:N]
    result = out["results"]["lambada_mirror"]
    assert result["acc,none"] == pytest.approx(ours["metrics"]["acc"]["value"])
    # exp(-mean log-likelihood): its relative difference is at most the largest log-likelihood difference
    assert result["perplexity,none"] == pytest.approx(ours["metrics"]["ppl"]["value"], rel=LP_TOL)
    assert lm.truncated["lambada_mirror"] == ours["truncated"] > 0  # the short window cut real passages


def test_arc_easy_through_the_harness_equals_our_scorer(tiny, run, mirror):
    _, model, tok = tiny
    samples = sorted(run[1]["samples"]["arc_easy_mirror"], key=lambda s: s["doc_id"])
    rows = [json.loads(line) for line in open(f"{mirror}/arc/ARC-Easy-Test.jsonl").readlines()[:N]]
    pairs, accs = [], []
    for s, row in zip(samples, rows):  # lm-eval's arc_easy prompt, built here from the raw file
        q = row["question"]
        expected = [["Question: " + q["stem"] + "\nAnswer:", " " + c["text"]] for c in q["choices"]]
        assert [list(a) for a in s["arguments"]] == expected
        scores = ev.score_pairs(model, [ev.encode_pair(tok, c, t) for c, t in expected])
        pairs.append(([lp for lp, _ in s["filtered_resps"]], [x.logprob for x in scores]))
        gold = [c["label"] for c in q["choices"]].index(row["answerKey"])
        accs.append(float(ev.argmax([x.logprob for x in scores]) == gold))
        assert s["acc"] == accs[-1]
    diff = max(max_diff(a, b) for a, b in pairs)
    print(f"ARC-Easy x{N} ({sum(len(a) for a, _ in pairs)} choices) through lm-eval: max |dlogprob| = {diff:.2e}")
    assert diff <= LP_TOL
    assert run[1]["results"]["arc_easy_mirror"]["acc,none"] == pytest.approx(sum(accs) / N)


def test_generate_until_is_greedy_generate_cut_at_the_stop_string(tiny, tasks, run, mirror):
    _, model, tok = tiny
    stop = tasks[1]
    samples = sorted(run[1]["samples"]["lambada_generate"], key=lambda s: s["doc_id"])
    full = [greedy_text(model, tok, context) for context, _ in benchmarks.lambada(mirror)[:N]]
    got = [s["filtered_resps"][0] for s in samples]
    assert got == [text.split(stop)[0] for text in full]
    assert len(got[0]) < len(full[0])  # `until` really cut the first one
    assert run[0].truncated["lambada_generate"] > 0  # prompts were cut to leave room for max_gen_toks


def test_loglikelihood_rolling(tiny, mirror):
    """A short text: the model's plain causal-LM loss after <|endoftext|>; a whole WikiText page: our task."""
    from lm_eval.api.instance import Instance

    folder, model, tok = tiny
    lm = harness.HarnessLM(model, tok)
    page = benchmarks.wikitext_detokenize(benchmarks.wikitext_pages(mirror)[0])
    short = "The quick brown fox jumps over the lazy dog."
    lps = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), i)
                                    for i, text in enumerate([short, page])])
    ids = torch.tensor([[0] + ev.encode(tok, short)])
    with torch.no_grad():
        _, loss = model(ids[:, :-1], ids[:, 1:])
    assert lps[0] == pytest.approx(-loss.item() * (ids.size(1) - 1), abs=1e-4)
    assert lps[1] == pytest.approx(ev.wikitext(model, tok, limit=1, mirror=mirror)["items"][0]["logprob"], abs=1e-6)


@pytest.fixture(scope="module")
def probe(tiny, tmp_path_factory):
    """A probe checkpoint (pre-projection + skip, new parameters randomised) on the tiny base."""
    folder, _, tok = tiny
    model, _, _ = load_model(folder, preproj=True, skip=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if model.is_new(name):
                p.normal_(0.0, 0.05)
    base_ref = {"init_from": folder, "sha256": weights_sha256(load_model(folder)[0])}
    out = tmp_path_factory.mktemp("probe")
    save_checkpoint(out, model, probe=True, base_ref=base_ref, step=1, optimizer_state=None, extra={}, tokenizer=tok)
    return str(out)


def test_cli_runs_harness_tasks_on_a_probe(probe, tasks, tmp_path, mirror, capsys):
    out = tmp_path / "harness.json"
    harness.main(["--init_from", probe, "--dtype", "float32", "--tasks", "lambada_mirror",
                  "--include_path", tasks[0], "--limit", "3", "--device", "cpu", "--out", str(out)])
    report = json.loads(out.read_text())
    result = report["results"]["lambada_mirror"]
    model, tok, _ = load_model(probe)
    ours = ev.lambada(model, tok, limit=3, mirror=mirror)
    assert result["n"] == 3 and result["requests"] == 3 and result["truncated"] == ours["truncated"]
    assert result["metrics"]["acc"]["value"] == pytest.approx(ours["metrics"]["acc"]["value"])
    assert result["metrics"]["perplexity"]["value"] == pytest.approx(ours["metrics"]["ppl"]["value"], rel=LP_TOL)
    assert model.config.preproj and model.config.skip and report["config"]["tasks"] == ["lambada_mirror"]
    assert "perplexity" in capsys.readouterr().out


def test_cli_unknown_harness_task(tiny, tasks, monkeypatch):
    """The name is checked before the model loads. (lm-eval's own task files are left out of the index here only to
    keep the test fast: the lookup is the same.)"""
    import functools

    import lm_eval.tasks

    monkeypatch.setattr(lm_eval.tasks, "TaskManager",
                        functools.partial(lm_eval.tasks.TaskManager, include_defaults=False))
    with pytest.raises(SystemExit, match="^error: lm-eval knows no task 'piqa_nowhere'"):
        harness.main(["--init_from", "no/such/model", "--tasks", "piqa_nowhere", "--include_path", tasks[0]])


def test_cli_task_whose_data_is_out_of_reach(tiny, tmp_path, monkeypatch):
    """Most lm-eval tasks read the Hugging Face Hub; offline that is one line pointing at --include_path."""
    import datasets
    import huggingface_hub

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # fail at once instead of retrying the network
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    (tmp_path / "hub.yaml").write_text(yaml.safe_dump({
        "task": "hub_task", "dataset_path": "no-such-owner/no-such-data", "output_type": "loglikelihood",
        "test_split": "test", "doc_to_text": "{{text}}", "doc_to_target": "{{text}}", "metric_list": [mean("acc")]}))
    with pytest.raises(SystemExit, match="^error: Couldn't reach 'no-such-owner/no-such-data' .*--include_path"):
        harness.main(["--init_from", tiny[0], "--tasks", "hub_task", "--include_path", str(tmp_path),
                      "--out", str(tmp_path / "never.json")])
    assert not (tmp_path / "never.json").exists()


def test_without_lm_eval(tiny, monkeypatch, mirror, tmp_path):
    """lm-eval is optional: our own tasks run without it, the adapter's module still imports, and its command says
    in one line how to install it, before loading the model and writing anything."""
    for name in [m for m in sys.modules if m == "lm_eval" or m.startswith("lm_eval.")] + ["tools.harness"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delattr(tools, "harness")  # restored afterwards, with the module above
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # makes `import lm_eval` fail
    eval_lambada.main(["--init_from", tiny[0], "--tasks", "lambada", "--limit", "2", "--mirror", mirror,
                       "--out", str(tmp_path / "eval.json")])
    assert "tools.harness" not in sys.modules  # eval_lambada imports no tool
    without = importlib.import_module("tools.harness")
    with pytest.raises(SystemExit, match=r"^error: lm-evaluation-harness is not installed; .*`pip install lm-eval`"):
        without.main(["--init_from", "no/such/model", "--tasks", "piqa", "--out", str(tmp_path / "never.json")])
    with pytest.raises(ImportError, match="lm-evaluation-harness is not installed"):
        without.HarnessLM(tiny[1], tiny[2])
    assert not (tmp_path / "never.json").exists()


# --- export to a Hugging Face folder ---

@torch.no_grad()
def hf_logits(folder: str, x: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder).eval()(x).logits


def test_export_round_trip(tiny, tmp_path):
    from safetensors import safe_open
    from transformers import AutoTokenizer

    folder, model, tok = tiny
    out = tmp_path / "hf"
    load_pythia.save_hf_folder(model, tok, str(out))
    x = torch.randint(0, 50304, (2, WINDOW))
    with torch.no_grad():
        diff = (hf_logits(str(out), x) - model(x)[0]).abs().max().item()
    print(f"exported folder in transformers: max |dlogit| = {diff:.2e}")
    assert diff <= LOGIT_TOL
    with safe_open(f"{folder}/model.safetensors", "pt") as f:  # names transformers wrote itself
        assert set(load_pythia.hf_state_dict(model)) == set(f.keys())
    assert load_pythia.config_from_hf(json.loads((out / "config.json").read_text())) == model.config
    text = "He said  \"naïve\" things\n\nabout café."  # double spaces, non-ASCII, newlines
    assert AutoTokenizer.from_pretrained(str(out))(text)["input_ids"] == tok.encode(text).ids


def test_export_merges_lora(tiny, tmp_path):
    folder, base, tok = tiny
    model, _, _ = load_model(folder, lora_rank=4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.1)
    out = tmp_path / "merged"
    load_pythia.save_hf_folder(model, tok, str(out))
    x = torch.randint(0, 50304, (2, WINDOW))
    with torch.no_grad():
        ours, plain = model(x)[0], base(x)[0]
    assert (ours - plain).abs().max().item() > 1.0  # LoRA really changes the model
    diff = (hf_logits(str(out), x) - ours).abs().max().item()
    print(f"LoRA merged into the exported weights: max |dlogit| = {diff:.2e}")
    assert diff <= LOGIT_TOL


def test_export_refuses_a_used_folder_and_weights_that_are_not_finite(probe, tiny, tmp_path, capsys):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit, match="^error: .*taken already exists and is not empty"):
        export.main(["--init_from", tiny[0], "--out", str(tmp_path / "taken")])
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"
    diverged = tmp_path / "diverged"
    shutil.copytree(probe, diverged)
    ckpt = torch.load(diverged / "ckpt.pt", weights_only=True)
    next(v for k, v in ckpt["model"].items() if "w_skip" in k)[0, 0] = float("nan")
    torch.save(ckpt, diverged / "ckpt.pt")
    with pytest.raises(SystemExit, match="^error: .*holds weights that are not finite .*nothing to export$"):
        export.main(["--init_from", str(diverged), "--out", str(tmp_path / "nan-hf")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["diverged", "taken"]  # nothing half-written, no temp


# --- every switch out: a remote-code folder that runs this project's model.py ---

def randomised(folder: str, **switches):
    """The tiny base with switches on, their new parameters drawn large enough to matter."""
    torch.manual_seed(0)
    model, tok, ref = load_model(folder, **switches)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if model.is_new(name):
                p.normal_(0.0, 0.05)
    return model.eval(), tok, ref


@torch.no_grad()
def remote_logits(folder, x: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True).eval()(x).logits


@pytest.mark.parametrize("switches", [
    dict(preproj=True), dict(skip=True), dict(preproj=True, skip=True),
    dict(preproj=True, preproj_linear=True, skip=True), dict(adapter_dim=24), dict(skip=True, adapter_dim=80),
    dict(preproj=True, skip=True, lora_rank=4),
])
def test_every_switch_exports_as_remote_code_with_our_logits(tiny, tmp_path, switches):
    model, tok, ref = randomised(tiny[0], **switches)
    out = tmp_path / "hf"
    export.save_remote_code_folder(model, tok, ref, out)
    x = torch.randint(0, 50304, (2, WINDOW))
    with torch.no_grad():
        ours, plain = model(x)[0], tiny[1](x)[0]
    assert (ours - plain).abs().max().item() > 1e-2  # the switches really change the model
    diff = (remote_logits(out, x) - ours).abs().max().item()
    print(f"remote-code export {switches}: max |dlogit| = {diff:.2e}")
    assert diff <= 1e-5
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_preproj.PreprojForCausalLM"
    assert config["base"] == ref and {k: config["gpt"][k] for k in switches} == switches


def test_the_exported_code_is_this_projects_model_py(tiny, tmp_path):
    """The folder's model is model.py itself, and its wrapper tools/hf_remote.py but for the one import, so the
    export and the model cannot drift apart."""
    model, tok, ref = randomised(tiny[0], skip=True)
    export.save_remote_code_folder(model, tok, ref, tmp_path / "hf")
    assert (tmp_path / "hf" / "preproj_model.py").read_text() == (Path(ROOT) / "model.py").read_text()
    wrapper = (Path(ROOT) / "tools" / "hf_remote.py").read_text()
    exported = (tmp_path / "hf" / "modeling_preproj.py").read_text()
    assert exported == wrapper.replace(export.LOCAL_IMPORT, export.FOLDER_IMPORT) and exported != wrapper


def test_remote_code_generates_and_refuses_left_padding(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    model, tok, ref = randomised(tiny[0], preproj=True, skip=True)
    export.save_remote_code_folder(model, tok, ref, tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), trust_remote_code=True).eval()
    prompt = torch.tensor([tok.encode("The king said that").ids])
    theirs = hf.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(theirs, model.generate(prompt, 6, temperature=0))
    with pytest.raises(ValueError, match="left padding is not supported"):
        hf(prompt, attention_mask=torch.tensor([[0] + [1] * (prompt.size(1) - 1)]))


def test_lm_eval_hf_on_an_exported_probe_scores_as_we_do(probe, tmp_path, mirror):
    """lm-eval's own `--model hf` (HFLM, trust_remote_code=True) on the export of a pre-proj + skip probe gives
    our per-item log-likelihoods."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    out = tmp_path / "probe-hf"
    export.main(["--init_from", probe, "--out", str(out)])
    model, tok, _ = load_model(probe)
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(benchmarks.lambada(mirror)[:4])]
    theirs = HFLM(pretrained=str(out), device="cpu", batch_size=4, trust_remote_code=True).loglikelihood(requests)
    ours = harness.HarnessLM(model, tok).loglikelihood(requests)
    diff = max_diff([lp for lp, _ in theirs], [lp for lp, _ in ours])
    print(f"lm-eval HFLM on the exported pre-proj + skip probe vs our adapter: max |dlogprob| = {diff:.2e}")
    assert diff <= 1e-4 and [g for _, g in theirs] == [g for _, g in ours]


# --- a LoRA probe as a peft adapter beside its base ---

def test_lora_probe_exports_as_a_peft_adapter(tiny, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder = tiny[0]
    model, tok, ref = randomised(folder, lora_rank=4)
    probe = tmp_path / "lora-probe"
    save_checkpoint(probe, model, probe=True, base_ref=ref, step=1, optimizer_state=None, extra={}, tokenizer=tok)
    out = tmp_path / "adapter"
    export.main(["--init_from", str(probe), "--out", str(out), "--peft"])
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(Path(folder).resolve()) and config["r"] == 4
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), str(out)).eval()
    x = torch.randint(0, 50304, (2, WINDOW))
    with torch.no_grad():
        ours = model(x)[0]
        diff = (peft_model(x).logits - ours).abs().max().item()
        assert (ours - tiny[1](x)[0]).abs().max().item() > 1e-2  # LoRA really changes the model
    print(f"peft adapter export: max |dlogit| = {diff:.2e}")
    assert diff <= 1e-5


def test_a_hub_base_records_the_commit_it_resolved_to(tiny, tmp_path, monkeypatch):
    """A Hub name is downloaded once per load; the snapshot's commit goes into the base reference, a probe
    re-attaches to that very commit, and the probe's peft adapter names it."""
    import huggingface_hub

    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = tmp_path / "snapshots" / commit
    shutil.copytree(tiny[0], snapshot)
    calls = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo, revision=None, allow_patterns=None: calls.append((repo, revision)) or
                        str(snapshot))
    model, tok, ref = load_model("pythia-tiny", lora_rank=4)
    assert calls == [("EleutherAI/pythia-tiny", None)] and ref["revision"] == commit
    probe = tmp_path / "probe"
    save_checkpoint(probe, model, probe=True, base_ref=ref, step=1, optimizer_state=None, extra={}, tokenizer=tok)
    load_model(str(probe))
    assert calls[-1] == ("EleutherAI/pythia-tiny", commit)  # the probe's base, pinned to its commit
    export.main(["--init_from", str(probe), "--out", str(tmp_path / "adapter"), "--peft"])
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["base_model_name_or_path"], config["revision"]) == ("EleutherAI/pythia-tiny", commit)


def test_peft_export_names_a_hub_base_and_refuses_what_it_cannot_hold(probe, tmp_path):
    assert export.peft_base({"init_from": "pythia-160m@step1000"}) == ("EleutherAI/pythia-160m", "step1000")
    assert export.peft_base({"init_from": "EleutherAI/pythia-410m"}) == ("EleutherAI/pythia-410m", None)
    with pytest.raises(ValueError, match="a peft adapter needs a Hugging Face base; export the base first"):
        export.peft_base({"init_from": "nano"})
    with pytest.raises(SystemExit, match=r"^error: --peft exports a LoRA probe \(--lora_rank\) with no other switch"):
        export.main(["--init_from", probe, "--out", str(tmp_path / "adapter"), "--peft"])
    assert not (tmp_path / "adapter").exists()


def test_exported_micro_base_is_complete_and_runs_in_lm_eval(micro_base, tmp_path, mirror):
    """The embedded base's recipe (train.py from scratch, the corpus tokenizer) exported by the command line:
    transformers loads model and tokenizer, and lm-eval's own `--model hf` scores as our adapter does."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer

    out = tmp_path / "nano-hf"
    proc = subprocess.run([sys.executable, "-m", "tools.export", "--init_from", micro_base, "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith(f"wrote {out}: "), proc.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "special_tokens_map.json",
                                                    "tokenizer.json", "tokenizer_config.json"]
    model, tok, _ = load_model(micro_base)
    assert tok.to_str() == Tokenizer.from_file(f"{micro_base}/tokenizer.json").to_str()
    context, target = benchmarks.lambada(mirror)[0]
    assert AutoTokenizer.from_pretrained(str(out))(context)["input_ids"] == tok.encode(context).ids
    x = torch.tensor([tok.encode(context).ids[:model.config.block_size]])
    with torch.no_grad():
        assert (hf_logits(str(out), x) - model(x)[0]).abs().max().item() <= LOGIT_TOL
    requests = [Instance("loglikelihood", {}, pair, i)
                for i, pair in enumerate(benchmarks.lambada(mirror)[:3] + [("", "The king said")])]
    theirs = HFLM(pretrained=str(out), device="cpu", batch_size=4).loglikelihood(requests)
    ours = harness.HarnessLM(model, tok).loglikelihood(requests)
    diff = max_diff([lp for lp, _ in theirs], [lp for lp, _ in ours])
    print(f"lm-eval HFLM on the exported micro base vs our adapter: max |dlogprob| = {diff:.2e}")
    assert diff <= 1e-4
    assert [g for _, g in theirs] == [g for _, g in ours]
