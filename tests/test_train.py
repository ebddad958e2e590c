"""The training loop: pre-training, the frozen probe, checkpoints, resume, DDP, the Pythia path, bad inputs."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from conftest import MICRO, ROOT, losses, make_hf_model, run, spawn_two_ranks
from data.sources import DataError, fetch
from lab.checkpoint import CheckpointError, load_model, read_checkpoint


def test_pretraining_lowers_the_loss(micro_base):
    trace = losses(micro_base)
    assert len(trace) == 30
    assert sum(trace[-5:]) / 5 < trace[0] - 1.0  # from ~9.0 (uniform over 8192) well down


def test_probe_trains_only_new_parameters(micro_base, tmp_path):
    base, _, _ = load_model(micro_base)
    out = tmp_path / "probe"
    model, results = run(f"--init_from {micro_base} --preproj --skip {MICRO} --max_iters 8 --out_dir {out}")
    # every base tensor bit-identical after the probe
    for name, t in base.base_state_dict().items():
        assert torch.equal(t, model.base_state_dict()[name]), name
    # the probe's parameters did move
    assert any(not torch.equal(p, q) for p, q in zip(model.new_state_dict().values(),
                                                    load_model(micro_base, preproj=True, skip=True)[0]
                                                    .new_state_dict().values()))
    # the checkpoint holds only new parameters and re-attaches to its base with identical logits
    ckpt = read_checkpoint(out)
    assert ckpt["kind"] == "probe" and set(ckpt["model"]) == set(model.new_state_dict())
    assert all(k.split(".")[2] in ("w_up", "w_down", "w_skip") for k in ckpt["model"])
    reloaded, _, _ = load_model(str(out))
    x = torch.randint(0, 8192, (2, 16))
    model.eval()
    with torch.no_grad():
        assert torch.equal(reloaded(x)[0], model(x)[0])
    assert set(results["val_loss"]["base"]) == {"val", "val_books"}


def test_the_last_step_is_evaluated_once(micro_base, tmp_path, monkeypatch):
    """The final report takes the trained model's validation losses from the loop's evaluation of the last step
    instead of measuring them a second time."""
    import train
    calls, real = [], train.val_loss
    monkeypatch.setattr(train, "val_loss", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = tmp_path / "p"
    _, results = run(f"--init_from {micro_base} --preproj --skip {MICRO} --max_iters 4 --eval_interval 2 "
                     f"--out_dir {out}")
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert results["val_loss"]["trained"] == {n: last[f"{n}_loss"] for n in ("val", "val_books")}
    assert len(calls) == 2 * 3  # two streams, each measured for the base, at step 2 and at step 4


def test_validation_on_named_splits(micro_base, tmp_path, capsys):
    """--val_splits replaces the data's held-out splits in the loop's record (the study's learning curves); an
    unknown name stops at parse time in one line."""
    out = tmp_path / "p"
    run(f"--init_from {micro_base} --skip {MICRO} --max_iters 4 --eval_interval 2 --val_splits sotu_search "
        f"--out_dir {out}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "sotu_search_loss" in r] == [2, 4]
    assert not any("val_loss" in r for r in records)
    with pytest.raises(SystemExit):
        run(f"--init_from {micro_base} --skip {MICRO} --val_splits sotu_search,nope --out_dir {tmp_path / 'q'}")
    assert "--val_splits: 'nope' is no held-out split; choose from val, val_books, sotu_search" in \
        capsys.readouterr().err
    assert not (tmp_path / "q").exists()


def test_resume_matches_uninterrupted_run(micro_base, tmp_path):
    common = f"--init_from {micro_base} --skip {MICRO} --max_iters 8 --ckpt_interval 2"
    run(f"{common} --out_dir {tmp_path / 'a'}")
    run(f"{common} --out_dir {tmp_path / 'b'} --stop_at 5")
    assert read_checkpoint(tmp_path / "b")["step"] == 5
    run(f"--out_dir {tmp_path / 'b'} --resume")  # the settings come from the checkpoint
    a, b = read_checkpoint(tmp_path / "a"), read_checkpoint(tmp_path / "b")
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k])


def test_ddp_two_processes_match_one(micro_base, tmp_path):
    """Two processes train as one does, with and without --compile (DDP around the objective's compiled blocks)."""
    common = f"train.py --init_from {micro_base} --preproj --skip {MICRO} --max_iters 4 --grad_accum 2"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    two_processes = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    for launcher, flags, out in (([], [], "one"), (two_processes, [], "two"), (two_processes, ["--compile"], "two_c")):
        proc = subprocess.run([sys.executable, *launcher, *common.split(), *flags, "--out_dir", str(tmp_path / out)],
                              cwd=ROOT, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
    one, two, compiled = (losses(tmp_path / out) for out in ("one", "two", "two_c"))
    assert len(one) == len(two) == len(compiled) == 4
    for other in (two, compiled):  # same batch, only the order of sums differs
        assert max(abs(a - b) for a, b in zip(one, other)) < 1e-5


def collectives_of_a_rank(rank: int, port: int, base: str, out: str, logs: str) -> None:
    """One process of a two-process train.py run, as torchrun starts it; writes the names of the collectives that
    train.py and lab/ call, in order, to logs/rank<rank>.json."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    torch.set_num_threads(1)
    calls = []
    for name in ("all_reduce", "barrier"):
        real = getattr(dist, name)
        setattr(dist, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    from train import get_args, train
    train(get_args(f"--init_from {base} --preproj --skip {MICRO} --max_iters 2 --out_dir {out}".split()))
    dist.destroy_process_group()
    with open(os.path.join(logs, f"rank{rank}.json"), "w") as f:
        json.dump(calls, f)


def test_every_process_leaves_the_loop_at_a_barrier(micro_base, tmp_path):
    """The last collective of every process is a barrier, which holds no tensor: a process that exits just after an
    all-reduce can abort while gloo's worker thread still releases that all-reduce's tensor (docs/reliability.md,
    "Several processes")."""
    spawn_two_ranks(collectives_of_a_rank, 30500 + os.getpid() % 1000, micro_base, str(tmp_path / "run"),
                    str(tmp_path))
    for rank in (0, 1):
        calls = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert calls.count("all_reduce") >= 4 and calls[-1] == "barrier", (rank, calls)


@pytest.mark.parametrize("body, status, stderr", [
    ("pass", 0, ""),
    ("raise SystemExit(3)", 3, ""),
    ("raise SystemExit('error: a one-line message')", 1, "error: a one-line message\n"),
    ("raise ValueError('not caught')", 1, "ValueError: not caught"),
])
def test_a_torchrun_process_exits_with_its_status_and_without_the_interpreter_shutdown(body, status, stderr):
    """cli.exit_without_interpreter_shutdown: main()'s exit status and what the shutdown would print, while the
    shutdown itself (here an atexit handler that would print) never runs. main() prints without flushing, into a
    pipe that buffers it: only the exit's own flush gets it out."""
    script = ("import atexit, sys\nfrom lab import cli\n"
              "atexit.register(lambda: print('the interpreter shut down', file=sys.stderr))\n"
              f"def main():\n    print('ran', flush=False)\n    {body}\n"
              "cli.exit_without_interpreter_shutdown(main)\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == status and proc.stdout == "ran\n"
    assert stderr in proc.stderr and "shut down" not in proc.stderr and (stderr or proc.stderr == "")


def test_pythia_path_end_to_end(tmp_path, mirror):
    """A tiny random Pythia-shaped HF checkpoint with the real Pythia tokenizer: load, probe, save, reload."""
    hf_dir = tmp_path / "hf"
    make_hf_model(vocab=50304, d=64, max_pos=64).save_pretrained(hf_dir)
    out = tmp_path / "probe"
    model, _ = run(f"--init_from {hf_dir} --preproj --skip --data corpus --seq_len 64 --batch_size 4 "
                   f"--max_iters 3 --eval_tasks none --eval_tokens 1024 --dtype float32 --out_dir {out}")
    reloaded, tok, ref = load_model(str(out))
    assert tok.encode("Hello world").ids == [12092, 1533]  # the real Pythia tokenizer came along
    assert ref["init_from"] == str(hf_dir)
    x = torch.randint(0, 50304, (2, 20))
    model.eval()
    with torch.no_grad():
        assert torch.equal(reloaded(x)[0], model(x)[0])


# --- bad inputs: a clear one-line error and no partial output ---

def cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "train.py", *argv], cwd=ROOT, capture_output=True, text=True)


def assert_one_line_error(proc, *words):
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), proc.stderr[-2000:]
    for w in words:
        assert w in last, last


def test_unknown_init_from(tmp_path):
    proc = cli("--init_from", "gpt-17", "--skip", "--out_dir", str(tmp_path / "x"))
    assert_one_line_error(proc, "unknown --init_from 'gpt-17'")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("argv, what", [(["--init_from", "pythia-160m", "--skip"], "a Hub model"),
                                        (["--paper", "--skip"], "a --paper run")])
def test_no_silent_fallback_to_the_cpu(tmp_path, monkeypatch, capsys, argv, what):
    """Where torch sees no GPU (a CPU wheel, an old driver), a Hub model or --paper stops unless --device cpu is
    given: a 500-step 410m run does not start on the CPU with one word of warning."""
    import train
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the --device default becomes the CPU
    with pytest.raises(SystemExit):
        train.get_args([*argv, "--out_dir", str(tmp_path / "x")])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no CUDA GPU is visible") and what in err[0], err
    assert train.get_args([*argv, "--device", "cpu"]).device == "cpu"  # on purpose: allowed


def test_linear_preproj_needs_preproj(tmp_path):
    proc = cli("--init_from", "scratch", "--preproj_linear", "--out_dir", str(tmp_path / "x"))
    assert_one_line_error(proc, "--preproj_linear changes the pre-projection; add --preproj")
    assert not (tmp_path / "x").exists()


def test_missing_truncated_and_foreign_checkpoints(micro_base, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(micro_base, broken)
    os.remove(broken / "ckpt.pt")
    with pytest.raises(CheckpointError, match="no ckpt.pt"):
        load_model(str(broken))
    data = open(os.path.join(micro_base, "ckpt.pt"), "rb").read()
    (broken / "ckpt.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        load_model(str(broken))
    torch.save({"state_dict": {}}, broken / "ckpt.pt")
    with pytest.raises(CheckpointError, match="not a checkpoint of this project"):
        load_model(str(broken))
    proc = cli("--init_from", str(broken), "--skip", "--out_dir", str(tmp_path / "y"))
    assert_one_line_error(proc, "not a checkpoint of this project")
    assert not (tmp_path / "y").exists()


def test_probe_on_a_changed_base_is_refused(micro_base, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(micro_base, base)
    probe = tmp_path / "probe"
    run(f"--init_from {base} --skip {MICRO} --max_iters 1 --out_dir {probe}")
    ckpt = torch.load(base / "ckpt.pt", weights_only=True)
    ckpt["model"]["ln_f.bias"] += 1e-3
    torch.save(ckpt, base / "ckpt.pt")
    with pytest.raises(CheckpointError, match="sha256 differs"):
        load_model(str(probe))


def test_mirror_missing_a_file_and_sha_mismatch(mirror, tmp_path):
    fake = tmp_path / "mirror"
    (fake / "lambada").mkdir(parents=True)
    with pytest.raises(DataError, match=r"lambada/lambada_test.jsonl is missing .* get it from https://"):
        fetch("lambada/lambada_test.jsonl", str(fake))
    (fake / "lambada" / "lambada_test.jsonl").write_text('{"text": "tampered"}\n')
    with pytest.raises(DataError, match="wrong sha256"):
        fetch("lambada/lambada_test.jsonl", str(fake))
    proc = subprocess.run([sys.executable, "-m", "data.prepare", "--mirror", str(fake), "--force"], cwd=ROOT,
                          capture_output=True, text=True)
    assert_one_line_error(proc, "corpus/gutenberg/", "nltk")


def test_seq_len_beyond_positions(micro_base, tmp_path):
    proc = cli("--init_from", micro_base, "--skip", "--seq_len", "64", "--out_dir", str(tmp_path / "z"))
    assert_one_line_error(proc, "--seq_len 64", "32 positions")
    assert not (tmp_path / "z").exists()


def test_paper_recipe_and_explicit_flags():
    from train import get_args
    args = get_args(["--paper", "--preproj", "--skip", "--max_iters", "20", "--device", "cpu"])
    assert (args.lr, args.batch_size, args.seq_len, args.warmup_iters, args.seed, args.beta2, args.data) == \
        (1e-5, 16, 512, 50, 42, 0.999, "wikitext103")
    assert args.max_iters == 20  # a flag given explicitly wins over the recipe
    assert args.pure_bf16  # the paper's precision comes with its recipe ...
    assert not get_args(["--paper", "--no-pure_bf16", "--device", "cpu"]).pure_bf16  # ... our fp32 masters one
    # switch away
    for form in (["--lr=3e-5"], ["--lr", "3e-5"]):  # every spelling argparse accepts wins too
        assert get_args(["--paper", "--device", "cpu", *form]).lr == 3e-5, form
    assert get_args(["--paper", "--device", "cpu", "--max_it", "7"]).max_iters == 7


def test_pure_bf16_probe(micro_base, tmp_path):
    model, _ = run(f"--init_from {micro_base} --skip {MICRO} --max_iters 2 --pure_bf16 --out_dir {tmp_path / 'p'}")
    assert model.blocks[0].w_skip.weight.dtype == torch.bfloat16
    assert read_checkpoint(tmp_path / "p")["model"]["blocks.0.w_skip.weight"].dtype == torch.bfloat16


def test_the_paper_precision_measures_base_and_trained_alike(micro_base, tmp_path):
    """Under --pure_bf16 the frozen base is held in the paper's precision too (norms and embeddings in bf16), so
    a LoRA probe that has not moved (B = 0, lr 1e-30) reports the base's own validation loss, not one 1e-3 away."""
    _, results = run(f"--init_from {micro_base} --lora_rank 2 {MICRO} --pure_bf16 --max_iters 1 --lr 1e-30 "
                     f"--min_lr 0 --out_dir {tmp_path / 'p'}")
    base, trained = results["val_loss"]["base"], results["val_loss"]["trained"]
    assert all(abs(base[n] - trained[n]) < 1e-5 for n in base), (base, trained)


def test_run_ends_with_benchmarks_for_base_and_trained(micro_base, tmp_path):
    from lab.evaluation import evaluate
    out = tmp_path / "bench"
    model, results = run(f"--init_from {micro_base} --skip {MICRO} --max_iters 2 --eval_tasks lambada "
                         f"--out_dir {out}")
    saved = json.loads((out / "eval.json").read_text())["benchmarks"]
    assert set(saved) == {"settings", "base", "trained"}
    base, tok, _ = load_model(micro_base)
    expected = evaluate(base, tok, ["lambada"])["lambada"]["metrics"]["ppl"]["value"]
    assert saved["base"]["lambada"]["metrics"]["ppl"]["value"] == pytest.approx(expected, rel=1e-9)
    assert saved["trained"]["lambada"]["n"] == 5153
    assert saved["trained"]["lambada"]["metrics"]["ppl"]["value"] != pytest.approx(expected, rel=1e-6)


def test_the_papers_whole_recipe_runs_on_a_tiny_pythia(tmp_path, mirror, monkeypatch, wikitext103_archive):
    """docs/reproduce.md's commands for Table 2, in miniature: every method in the paper's precision and ours,
    on the paper's probe text (WikiText-103 train, here served from a local archive in place of the download),
    then both evaluation protocols. Only the sizes differ from the real run."""
    import eval_lambada
    hf_dir = tmp_path / "pythia-tiny"
    make_hf_model(vocab=50304, d=64, max_pos=64).save_pretrained(hf_dir)
    small = "--max_iters 2 --batch_size 2 --seq_len 64 --eval_tasks none --eval_tokens 256 --device cpu"
    import data.prepare
    monkeypatch.setattr(data.prepare, "corpus_splits", lambda *a: pytest.fail("a WikiText probe reads no corpus"))
    methods = {"preproj": "--preproj", "lora": "--lora_rank 8", "preproj-lora": "--preproj --lora_rank 2",
               "preproj-skip": "--preproj --skip"}
    for name, flags in methods.items():  # our precision (--no-pure_bf16) on the paper's method only, for time
        for precision_flag in ("", "--no-pure_bf16") if name == "preproj-skip" else ("",):
            out = tmp_path / f"{name}{precision_flag.replace('--no-pure_bf16', '-fp32')}"
            model, _ = run(f"--init_from {hf_dir} --paper {flags} {small} {precision_flag} --out_dir {out}")
            args = read_checkpoint(out)["train_args"]
            assert args["data"] == "wikitext103" and args["lr"] == 1e-5 and args["pure_bf16"] == (not precision_flag)
            last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
            assert "wikitext_loss" in last and "val_loss" not in last  # validated on held-out WikiText
            held = {p.dtype for n, p in model.named_parameters() if p.requires_grad and "lora" not in n}
            assert held <= ({torch.bfloat16} if not precision_flag else {torch.float32})
    for protocol, dtype in (("paper", "bfloat16"), ("lm-eval", "float32")):
        report = eval_lambada.main(["--init_from", str(tmp_path / "preproj-skip"), "--protocol", protocol,
                                    "--dtype", dtype, "--limit", "8", "--mirror", mirror,
                                    "--out", str(tmp_path / f"eval-{protocol}.json")])
        assert set(report["results"]) == {"lambada", "wikitext", "hellaswag", "arc_easy"}
        assert report["config"]["dtype"] == dtype
    with pytest.raises(SystemExit, match="wikitext: no item .* raise --limit"):  # the first raw line is empty
        eval_lambada.main(["--init_from", str(hf_dir), "--protocol", "paper", "--tasks", "wikitext", "--limit", "1",
                           "--mirror", mirror, "--out", str(tmp_path / "none.json")])


def test_the_documented_commands_run_in_miniature(tmp_path, mirror):
    """tools/reproduce.sh, the commands docs/reproduce.md gives, run as they are on a tiny random Pythia-shaped
    folder on the CPU: the paper's probe text comes from a mirror slot (WikiText-2's validation lines standing in
    for WikiText-103 train), sizes from TRAIN_EXTRA and EVAL_EXTRA. Every file the docs promise must appear."""
    local = tmp_path / "mirror"
    local.mkdir()
    for entry in os.listdir(mirror):
        os.symlink(os.path.join(mirror, entry), local / entry)
    (local / "wikitext103").mkdir()
    shutil.copy(os.path.join(mirror, "wikitext", "wiki.valid.raw"), local / "wikitext103" / "wiki.train.raw")
    base = tmp_path / "pythia-tiny"
    make_hf_model(vocab=50304, d=64, max_pos=64).save_pretrained(base)
    shutil.copy(os.path.join(mirror, "tokenizers", "20B_tokenizer.json"), base / "tokenizer.json")
    env = {**os.environ, "PREPROJ_MIRROR": str(local), "OUT": str(tmp_path / "out"), "DEVICE": "cpu",
           "TRAIN_EXTRA": "--max_iters 2 --batch_size 2 --seq_len 64 --eval_tokens 256", "EVAL_EXTRA": "--limit 4"}
    proc = subprocess.run(["bash", "tools/reproduce.sh", str(base), "8"], cwd=ROOT, env=env, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "out"
    runs = ["pythia-tiny-preproj", "pythia-tiny-lora8", "pythia-tiny-preproj-lora64", "pythia-tiny-preproj-skip",
            "pythia-tiny-preproj-skip-fp32"]
    for folder in ["pythia-tiny-base", *runs]:
        for name in ("eval-paper.json", "eval-lmeval.json"):
            assert (out / folder / name).is_file(), (folder, name)
    assert read_checkpoint(out / runs[3])["train_args"]["data"] == "wikitext103"
    assert json.loads((out / "pythia-tiny-compare.json").read_text())["rows"]
    assert (out / "pythia-tiny-layers" / "layers.png").is_file()


def test_settings_are_resolved_once_and_recorded(micro_base, tmp_path):
    """The command line is never changed by a run: its settings are resolved once (the window for --seq_len 0, the
    dtype for --dtype auto) into a read-only object, which the checkpoint records as train_args."""
    from train import get_args, resolve_settings, train

    args = get_args(f"--init_from {micro_base} --preproj {MICRO} --max_iters 1 --dtype auto "
                    f"--out_dir {tmp_path / 'p'}".split())
    given = dict(vars(args))
    train(args)
    assert vars(args) == given and given["seq_len"] == 0 and given["dtype"] == "auto"
    saved = read_checkpoint(tmp_path / "p")["train_args"]
    assert saved["seq_len"] == 32 and saved["dtype"] in ("float32", "bfloat16")
    assert {k: v for k, v in saved.items() if k not in ("seq_len", "dtype")} == \
        {k: v for k, v in given.items() if k not in ("seq_len", "dtype")}
    settings = resolve_settings(args, 32, "cpu")
    with pytest.raises(AttributeError, match="read-only"):
        settings.lr = 1.0
