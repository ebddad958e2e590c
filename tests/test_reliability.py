"""Nothing lost, nothing silently wrong (docs/reliability.md): every script answers bad input with exactly one
`error: ...` line and a non-zero exit, and a run folder survives NaN, Ctrl-C, kills, full disks and a second run.

Each case asserts the exit status, the one error line (naming the problem), no traceback, and that the run folder
is unchanged or still resumable. The integrity cases are numbered as in issue 12."""

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import analyze_layers
import eval_lambada
import sample
import train
from conftest import MICRO, ROOT, run
from data.prepare import load_nano_split
from data.sources import DataError
from lab import checkpoint
from lab.checkpoint import load_model, read_checkpoint
from lab.evaluation import val_loss
from tools import bench, export, harness

# --- helpers ---


def error_line(code, stderr: str, strict: bool = True) -> str:
    """The one `error:` line of a failed command. strict: stderr holds nothing else (no progress bar yet).
    code is the exit code, or in-process the SystemExit's message (which the interpreter would print)."""
    assert code not in (0, None), "the command did not fail"
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.strip()] + ([code] if isinstance(code, str) else [])
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, lines[-10:]
    if strict:
        assert lines == errors, lines
    return errors[0]


def main_error(monkeypatch, capsys, module, argv: list[str], strict: bool = True) -> str:
    """Run a script's main() in-process with this command line; return its one error line."""
    monkeypatch.setattr(sys, "argv", [f"{module.__name__}.py", *map(str, argv)])
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        module.main()
    return error_line(e.value.code, capsys.readouterr().err, strict)


def script(*argv, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *map(str, argv)], cwd=ROOT, capture_output=True, text=True, **kwargs)


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file of a folder with its bytes: 'unchanged' means equal snapshots."""
    return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir()) if p.is_file() and p.name != ".lock"}


def steps(folder: Path) -> list[int]:
    return [json.loads(line)["step"] for line in open(Path(folder) / "metrics.jsonl")]


def wait_for_records(folder: Path, n: int, proc: subprocess.Popen) -> None:
    """Until metrics.jsonl holds n records (the run is inside its loop): signals then arrive at a known point."""
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if (folder / "metrics.jsonl").is_file() and len(steps(folder)) >= n:
            return
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"no {n} metrics records: {proc.communicate()[1][-2000:]}")


PROBE = f"--skip {MICRO} --max_iters 6 --ckpt_interval 2 --eval_tokens 64"


@pytest.fixture(scope="module")
def stopped_probe(micro_base, tmp_path_factory):
    """A probe of the micro base stopped at step 2 of 6 (--stop_at): tests copy it and resume it."""
    out = tmp_path_factory.mktemp("stopped") / "probe"
    run(f"--init_from {micro_base} {PROBE} --stop_at 2 --out_dir {out}")
    return out


@pytest.fixture
def probe_copy(stopped_probe, tmp_path):
    out = tmp_path / "probe"
    shutil.copytree(stopped_probe, out)
    return out


# --- every numeric flag, every script: one line at parse time, naming the flag and its range ---

NO_CUDA = not torch.cuda.is_available()
BAD_FLAGS = [
    (train, "--lr nan", "--lr: expected a finite number > 0"),
    (train, "--lr inf", "--lr"),
    (train, "--lr 0", "--lr"),
    (train, "--lr -1e-3", "--lr"),
    (train, "--min_lr -1", "--min_lr: expected a finite number >= 0"),
    (train, "--batch_size 0", "--batch_size: expected an integer >= 1"),
    (train, "--grad_accum 0", "--grad_accum"),
    (train, "--max_iters -3", "--max_iters"),
    (train, "--seq_len -1", "--seq_len: expected an integer >= 0"),
    (train, "--eval_tokens 0", "--eval_tokens"),
    (train, "--eval_interval 0", "--eval_interval"),
    (train, "--ckpt_interval 0", "--ckpt_interval"),
    (train, "--warmup_iters 1.5", "--warmup_iters"),
    (train, "--beta2 1", "--beta2: expected a number in [0, 1)"),
    (train, "--grad_clip nan", "--grad_clip"),
    (train, "--weight_decay -0.1", "--weight_decay"),
    (train, "--hellaswag_limit -1", "--hellaswag_limit"),
    (train, "--stop_at -1", "--stop_at"),
    (train, "--lora_rank -1", "--lora_rank"),
    (train, "--seed -1", "--seed"),
    (train, "--n_layer 0", "--n_layer"),
    (train, "--n_embd 100 --n_head 3", "--n_embd 100 is not divisible by --n_head 3"),
    (train, "--eval_tasks ,", "--eval_tasks: expected at least one name"),
    (train, "--device tpu9", "--device: unknown device 'tpu9'"),
    (train, "--device cuda:99", "no usable CUDA GPU" if NO_CUDA else "CUDA GPU(s)"),
    (train, "--out_dir {file}", "is a file; pass a folder"),
    (train, "--out_dir {file}/run", "is a file, not a folder"),
    (eval_lambada, "--limit 0", "--limit"),
    (eval_lambada, "--batch_size 0", "--batch_size"),
    (eval_lambada, "--tasks {empty}", "--tasks: expected at least one name"),
    (eval_lambada, "--out {dir}", "is a folder; pass a file name"),
    (eval_lambada, "--out {file}/eval.json", "is a file, not a folder"),
    (sample, "--temperature nan", "--temperature: expected a finite number >= 0"),
    (sample, "--temperature -1", "--temperature"),
    (sample, "--top_k -1", "--top_k"),
    (sample, "--max_new_tokens 0", "--max_new_tokens"),
    (sample, "--num_samples 0", "--num_samples"),
    (sample, "--prompt caf\udce9", "--prompt: not valid UTF-8 (byte 3)"),
    (analyze_layers, "--tokens 0", "--tokens"),
    (analyze_layers, "--seq_len 0", "--seq_len"),
    (analyze_layers, "--out {file}", "is a file; pass a folder"),
    (analyze_layers, "--device cuda:99", "--device"),
    (bench, "--batch 0", "--batch"),
    (bench, "--reps 0", "--reps"),
    (bench, "--shapes pythia-7b", "unknown shape 'pythia-7b'"),
    (bench, "--smoke --batch 8 --eval_from nano", "--smoke sets its own --batch, --eval_from"),
    (export, "--init_from nano --out {file}", "is a file; pass a folder"),
    (export, "--init_from nano --out {file}/hf", "is a file, not a folder"),
    (harness, "--tasks {empty}", "--tasks: expected at least one name"),
    (harness, "--tasks piqa --limit 0", "--limit"),
    (harness, "--tasks piqa --out {dir}", "is a folder; pass a file name"),
]


@pytest.mark.parametrize("module,flags,message", BAD_FLAGS,
                         ids=[f"{m.__name__} {f}" for m, f, _ in BAD_FLAGS])
def test_bad_flag_values_stop_at_parse_time(module, flags, message, tmp_path, monkeypatch, capsys):
    (tmp_path / "a_file").write_text("not a folder")
    argv = flags.format(file=tmp_path / "a_file", dir=tmp_path, empty="").split(" ")
    line = main_error(monkeypatch, capsys, module, argv)
    assert message in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # nothing written


def test_bad_flags_from_a_shell(tmp_path):
    """The same through the real entry points: exactly one line on stderr, exit status 2, nothing on stdout."""
    for argv, start in ((["train.py", "--lr", "nan", "--out_dir", tmp_path / "run"], "error: argument --lr: "),
                        (["eval_lambada.py", "--tasks", ""], "error: argument --tasks: "),
                        (["-m", "tools.bench", "--smoke", "--seq", "64"], "error: --smoke sets its own --seq"),
                        (["-m", "tools.bench", "--sections", "1,7"], "error: argument --sections: expected a comma"),
                        (["-m", "tools.export", "--init_from", "nano"], "error: the following arguments are required: "
                                                                         "--out"),
                        (["-m", "tools.harness", "--init_from", "nano"], "error: the following arguments are "
                                                                          "required: --tasks")):
        proc = script(*argv)
        assert proc.returncode == 2 and proc.stdout == ""
        assert error_line(proc.returncode, proc.stderr).startswith(start)
    assert not (tmp_path / "run").exists()


# --- files a user hands over: one line naming the file and the problem ---

def damage(folder: Path, how: str) -> None:
    from safetensors.torch import load_file, save_file
    weights = folder / "model.safetensors"
    if how == "misshapen tensor":
        state = load_file(weights)
        state["gpt_neox.final_layer_norm.weight"] = state["gpt_neox.final_layer_norm.weight"][:-1].clone()
        save_file(state, weights)
    elif how == "truncated tensor file":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif how == "config without a field":
        config = json.loads((folder / "config.json").read_text())
        del config["hidden_size"]
        (folder / "config.json").write_text(json.dumps(config))
    elif how == "config not UTF-8":
        (folder / "config.json").write_bytes(b'{"model_type": "gpt_neox\xff\xfe"}')
    elif how == "garbage tokenizer":
        (folder / "tokenizer.json").write_text("<html>not found</html>")
    elif how in ("zero heads", "a number as a string"):
        config = json.loads((folder / "config.json").read_text())
        config.update({"num_attention_heads": 0} if how == "zero heads" else {"num_hidden_layers": "2"})
        (folder / "config.json").write_text(json.dumps(config))
    elif how == "no tokenizer":  # Pythia's 50k tokenizer would be taken, and index past a 512-token embedding
        (folder / "tokenizer.json").unlink(missing_ok=True)


@pytest.mark.parametrize("how,message", [
    ("misshapen tensor", "tensor gpt_neox.final_layer_norm.weight has shape (63,), but config.json implies (64,)"),
    ("truncated tensor file", "model.safetensors is not a readable weights file"),
    ("config without a field", "config.json lacks hidden_size"),
    ("config not UTF-8", "config.json is not a readable JSON file"),
    ("garbage tokenizer", "tokenizer.json is not a readable tokenizer.json"),
    ("zero heads", "config.json: num_attention_heads must be a positive integer, not 0"),
    ("a number as a string", "config.json: num_hidden_layers must be a positive integer, not '2'"),
    ("no tokenizer", "Pythia's tokenizer (the folder has no tokenizer.json) has 50,277 tokens, more than the model's "
                     "vocab_size 512"),
])
def test_damaged_hugging_face_folder(tiny_hf_dir, tmp_path, monkeypatch, capsys, how, message):
    folder = tmp_path / "hf"
    shutil.copytree(tiny_hf_dir, folder)
    damage(folder, how)
    line = main_error(monkeypatch, capsys, sample, ["--init_from", folder, "--max_new_tokens", "2"])
    assert message in line and str(folder) in line, line


def test_a_hub_model_that_cannot_be_downloaded_is_one_line(tmp_path, monkeypatch, capsys):
    """Offline with an empty Hugging Face cache (the Hub's own offline mode: nothing is downloaded even online)."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    line = main_error(monkeypatch, capsys, sample, ["--init_from", "pythia-160m", "--max_new_tokens", "2"])
    assert "EleutherAI/pythia-160m cannot be downloaded" in line and "hf download EleutherAI/pythia-160m" in line


@pytest.mark.parametrize("error, message", [
    ("RepositoryNotFoundError", "the Hugging Face Hub has no model 'EleutherAI/pythia-16m'"),
    ("GatedRepoError", "EleutherAI/pythia-16m is gated on the Hugging Face Hub"),
    ("RevisionNotFoundError", "EleutherAI/pythia-16m has no revision 'step1'"),
    ("HfHubHTTPError", "the Hugging Face Hub refused EleutherAI/pythia-16m: 503 Service Unavailable"),
])
def test_the_hubs_refusals_are_one_line(error, message, monkeypatch, capsys):
    import huggingface_hub
    import huggingface_hub.errors

    def refuse(*args, **kwargs):
        cls = getattr(huggingface_hub.errors, error)
        e = cls.__new__(cls)  # the Hub's errors want an HTTP response to be built; the message is what matters
        Exception.__init__(e, "503 Service Unavailable\n\nthe Hub's explanation, over several lines")
        raise e

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    line = main_error(monkeypatch, capsys, sample, ["--init_from", "pythia-16m@step1", "--max_new_tokens", "2"])
    assert message in line, line


def test_run_folder_without_tokenizer(micro_base, tmp_path, monkeypatch, capsys):
    folder = tmp_path / "run"
    shutil.copytree(micro_base, folder)
    os.remove(folder / "tokenizer.json")
    line = main_error(monkeypatch, capsys, sample, ["--init_from", folder, "--max_new_tokens", "2"])
    assert f"{folder}/tokenizer.json does not exist" in line


@pytest.mark.parametrize("content,message", [(b"", "holds no items"),
                                             (b'{"ctx_a": "caf\xe9"}\n', "is not UTF-8 text (byte 14)")])
def test_bad_benchmark_file(micro_base, tmp_path, monkeypatch, capsys, content, message):
    bad = tmp_path / "mirror" / "hellaswag" / "hellaswag_val.jsonl"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(content)
    argv = ["--init_from", micro_base, "--tasks", "hellaswag", "--mirror", tmp_path / "mirror",
            "--out", tmp_path / "e.json"]
    line = main_error(monkeypatch, capsys, eval_lambada, argv)
    assert f"{bad} {message}" in line
    assert not (tmp_path / "e.json").exists()


def test_full_disk_says_so(micro_base, mirror, tmp_path, monkeypatch, capsys):
    """A real ENOSPC: the temporary file the results go to first (named by the process id) is /dev/full."""
    out = tmp_path / "eval.json"
    out.write_text("previous results")
    monkeypatch.setattr(os, "getpid", lambda: 4242)
    (tmp_path / ".eval.items.jsonl.4242.tmp").symlink_to("/dev/full")
    line = main_error(monkeypatch, capsys, eval_lambada, ["--init_from", micro_base, "--tasks", "lambada", "--limit",
                                                         "2", "--mirror", mirror, "--out", out], strict=False)
    assert f"the disk is full: could not write {tmp_path / 'eval.items.jsonl'}" in line
    assert out.read_text() == "previous results" and not os.path.lexists(tmp_path / ".eval.items.jsonl.4242.tmp")


def test_full_disk_during_training_keeps_the_checkpoint(probe_copy, monkeypatch, capsys):
    before = read_checkpoint(probe_copy)
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        if isinstance(obj, dict) and obj.get("step") == 4:
            f.write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    line = main_error(monkeypatch, capsys, train, ["--out_dir", probe_copy, "--resume"], strict=False)
    assert f"the disk is full: could not write {probe_copy}/ckpt.pt" in line
    assert read_checkpoint(probe_copy)["step"] == before["step"] == 2
    assert not list(probe_copy.glob(".*.tmp"))
    monkeypatch.setattr(torch, "save", real_save)
    run(f"--out_dir {probe_copy} --resume")  # space again: it continues
    assert read_checkpoint(probe_copy)["step"] == 6 and steps(probe_copy) == [1, 2, 3, 4, 5, 6]


# --- --resume with other flags: honoured (stop_at, device, compile, mirror) or refused, never ignored ---

def test_resume_refuses_flags_it_would_ignore(probe_copy, monkeypatch, capsys):
    before = snapshot(probe_copy)
    line = main_error(monkeypatch, capsys, train, ["--out_dir", probe_copy, "--resume", "--lr", "0.5",
                                                   "--max_iters", "6", "--batch_size", "4"])
    assert "would ignore --batch_size 4 (saved: 8), --lr 0.5 (saved: 0.001)" in line  # --max_iters 6 agrees
    assert snapshot(probe_copy) == before
    line = main_error(monkeypatch, capsys, train, ["--out_dir", probe_copy, "--resume", "--stop_at", "1"])
    assert "--stop_at 1 is not after the checkpoint's step 2" in line
    assert snapshot(probe_copy) == before
    run(f"--out_dir {probe_copy} --resume --stop_at 3 --device cpu --max_iters 6")  # honoured, or as saved
    assert read_checkpoint(probe_copy)["step"] == 3


def test_resume_without_a_run(tmp_path, monkeypatch, capsys):
    line = main_error(monkeypatch, capsys, train, ["--out_dir", tmp_path / "none", "--resume"])
    assert "holds no checkpoint to continue" in line and not (tmp_path / "none").exists()


# --- the integrity cases of issue 12 ---

def test_1_resume_refuses_a_changed_base(micro_base, tmp_path, monkeypatch, capsys):
    base, probe = tmp_path / "base", tmp_path / "probe"
    shutil.copytree(micro_base, base)
    run(f"--init_from {base} {PROBE} --stop_at 2 --out_dir {probe}")
    before = snapshot(probe)
    original = (base / "ckpt.pt").read_bytes()
    ckpt = torch.load(base / "ckpt.pt", weights_only=True)
    ckpt["model"]["blocks.0.ln_1.weight"][0] += 1e-3
    torch.save(ckpt, base / "ckpt.pt")
    line = main_error(monkeypatch, capsys, train, ["--out_dir", probe, "--resume"])
    assert f"the base {base} has changed since {probe} was trained on it (sha256 differs)" in line
    assert snapshot(probe) == before
    (base / "ckpt.pt").write_bytes(original)  # the base restored: the probe resumes
    run(f"--out_dir {probe} --resume")
    assert read_checkpoint(probe)["step"] == 6


def test_2_nan_keeps_only_a_checkpoint_that_works(micro_base, tmp_path, monkeypatch, capsys):
    out = tmp_path / "nan"
    # a learning rate that grows through warm-up: good for two steps, then the weights overflow
    line = main_error(monkeypatch, capsys, train, ["--init_from", micro_base, *PROBE.split(), "--max_iters", "40",
                                                   "--lr", "1e19", "--warmup_iters", "10", "--grad_clip", "0",
                                                   "--ckpt_interval", "1", "--out_dir", out], strict=False)
    kept = read_checkpoint(out)["step"]
    assert kept >= 1 and f"the last good checkpoint, step {kept}, is kept in {out}" in line, line
    model, _, _ = load_model(str(out))
    assert torch.isfinite(torch.tensor(val_loss(model, load_nano_split("val"), 32, 1024)))
    # with no checkpoint due yet, the message names none
    out = tmp_path / "nan2"
    line = main_error(monkeypatch, capsys, train, ["--init_from", micro_base, *PROBE.split(), "--lr", "1e30",
                                                   "--out_dir", out], strict=False)
    assert "there is no earlier checkpoint" in line and not (out / "ckpt.pt").exists()


def test_3_ctrl_c_saves_and_says_how_to_resume(micro_base, tmp_path, monkeypatch):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "train.py", "--init_from", micro_base, *PROBE.split(), "--max_iters",
                             "5000", "--ckpt_interval", "1000", "--out_dir", out], cwd=ROOT, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_for_records(out, 1, proc)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT
    line = error_line(proc.returncode, stderr, strict=False)
    stopped = read_checkpoint(out)["step"]
    assert f"stopped by SIGINT after step {stopped}" in line and f"--out_dir {out} --resume" in line
    assert steps(out)[-1] == stopped
    run(f"--out_dir {out} --resume --stop_at {stopped + 2}")
    assert steps(out) == list(range(1, stopped + 3))


def test_4_values_checked_before_training(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    line = main_error(monkeypatch, capsys, train, ["--init_from", "scratch", "--n_layer", "1", "--n_head", "2",
                                                   "--n_embd", "32", "--block_size", "128", "--max_iters", "3",
                                                   "--eval_tokens", "100", "--batch_size", "4", "--eval_tasks",
                                                   "none", "--out_dir", out])
    assert "--eval_tokens 100 holds no window of --seq_len 128" in line
    assert not out.exists()


def test_5_6_second_run_is_locked_out_and_a_killed_run_resumes(micro_base, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "train.py", "--init_from", micro_base, *PROBE.split(), "--max_iters",
                              "5000", "--ckpt_interval", "5", "--out_dir", out], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_records(out, 7, first)  # a checkpoint at step 5, records beyond it
        line = main_error(monkeypatch, capsys, train, ["--out_dir", out, "--resume"])
        assert f"{out} is in use by process {first.pid} on " in line
    finally:
        first.kill()  # SIGKILL: the lock file stays behind, the lock itself goes with the process
        first.wait()
    saved = read_checkpoint(out)["step"]
    assert saved % 5 == 0  # the kill may have come between that checkpoint and its metrics line
    run(f"--out_dir {out} --resume --stop_at {saved + 3}")  # the stale .lock blocks nothing
    assert steps(out) == list(range(1, saved + 4))  # cut back to the checkpoint, none missing, none twice


def test_5_resume_cuts_metrics_back_to_the_checkpoint(probe_copy):
    with open(probe_copy / "metrics.jsonl", "a") as f:  # what a run killed after step 4 leaves: ckpt.pt at step 2
        f.write('{"step": 3, "loss": 9.0}\n{"step": 4, "loss": 9.0}\n{"step": 5, "lo')
    run(f"--out_dir {probe_copy} --resume --stop_at 4")
    assert steps(probe_copy) == [1, 2, 3, 4]


def test_5_a_kill_between_checkpoint_and_its_record_loses_no_record(probe_copy):
    """What a kill right after the checkpoint of step 2 leaves: its metrics line never written. The resume logs
    it from the checkpoint's copy, so the log holds every step up to the checkpoint."""
    lines = (probe_copy / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[1])["step"] == 2 and read_checkpoint(probe_copy)["step"] == 2
    (probe_copy / "metrics.jsonl").write_text(lines[0] + "\n")
    run(f"--out_dir {probe_copy} --resume --stop_at 3")
    records = [json.loads(line) for line in (probe_copy / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[1]["loss"] == json.loads(lines[1])["loss"]


def test_5_new_run_starts_its_metrics_afresh(micro_base, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 1.0}\n{"step": 3, "lo')
    run(f"--init_from {micro_base} {PROBE} --stop_at 1 --out_dir {out}")
    assert steps(out) == [1]


# A stand-in for a kill in the middle of writing a checkpoint: torch.save writes half, then the process dies.
DIE_WHILE_SAVING = """
import io, os, sys, torch
real_save = torch.save
def dying_save(obj, f, *args, **kwargs):
    if isinstance(obj, dict) and obj.get("step") == 4:
        buf = io.BytesIO()
        real_save(obj, buf)
        half = buf.getvalue()[: len(buf.getvalue()) // 2]
        if isinstance(f, (str, os.PathLike)):
            f = open(f, "wb")
        f.write(half)
        f.flush()
        os._exit(137)
    return real_save(obj, f, *args, **kwargs)
torch.save = dying_save
sys.argv[0] = "train.py"
import train
train.main()
"""


def test_7_kill_during_a_checkpoint_write(probe_copy):
    proc = script("-c", DIE_WHILE_SAVING, "--out_dir", probe_copy, "--resume")
    assert proc.returncode == 137, proc.stderr[-2000:]
    ckpt, card = read_checkpoint(probe_copy), json.loads((probe_copy / "config.json").read_text())
    assert ckpt["step"] == 2 and card.get("step", 2) == 2  # config.json never runs ahead of ckpt.pt
    assert (card["kind"], card["config"], card["base"]) == (ckpt["kind"], ckpt["config"], ckpt["base"])
    assert list(probe_copy.glob(".ckpt.pt.*.tmp"))  # what the kill left
    run(f"--out_dir {probe_copy} --resume --stop_at 4")
    assert not list(probe_copy.glob(".*.tmp")) and read_checkpoint(probe_copy)["step"] == 4


def test_8_probe_records_its_base_as_named(micro_base, tmp_path, monkeypatch, capsys):
    project = tmp_path / "project"
    shutil.copytree(micro_base, project / "bases" / "b")
    monkeypatch.setattr(checkpoint, "ROOT", project)
    run(f"--init_from {project / 'bases' / 'b'} {PROBE} --max_iters 1 --out_dir {project / 'probe'}")
    assert read_checkpoint(project / "probe")["base"]["init_from"] == "bases/b"
    assert json.loads((project / "probe" / "config.json").read_text())["base"]["init_from"] == "bases/b"
    moved = project.rename(tmp_path / "moved")  # the project moves: its probe finds its own base
    monkeypatch.setattr(checkpoint, "ROOT", moved)
    model, _, ref = load_model(str(moved / "probe"))
    assert ref["init_from"] == "bases/b" and model.config.skip
    shutil.rmtree(moved / "bases")
    line = main_error(monkeypatch, capsys, sample, ["--init_from", moved / "probe", "--max_new_tokens", "2"])
    assert f"the probe {moved / 'probe'} cannot load its base 'bases/b'" in line
    monkeypatch.setattr(checkpoint, "NANO_DIR", Path(micro_base))  # the embedded base is recorded as nano
    assert load_model("nano", skip=True)[2]["init_from"] == "nano"


def test_stopped_embedded_base_is_finished_not_used(stopped_probe, monkeypatch):
    """A first run stopped while pre-training the embedded base: the next run finishes it; nothing loads it half
    trained."""
    monkeypatch.setattr(checkpoint, "NANO_DIR", stopped_probe)
    base_args = train.nano_base_args(train.get_args(["--skip", "--device", "cpu"]))
    assert base_args.resume and base_args.out_dir == str(stopped_probe) and base_args.max_iters == 6
    with pytest.raises(checkpoint.CheckpointError, match="the embedded base is not finished"):
        load_model("nano")


@pytest.mark.parametrize("file,content,message", [
    ("lambada/lambada_test.jsonl", '{"text": "tampered"}\n', "has the wrong sha256"),
    ("hellaswag/hellaswag_val.jsonl", '{"ctx_a": "cut', "hellaswag_val.jsonl:1: malformed JSON line"),
])
def test_9_bad_benchmark_data_stops_before_training(micro_base, tmp_path, monkeypatch, capsys, file, content,
                                                    message):
    bad = tmp_path / "mirror" / file
    bad.parent.mkdir(parents=True)
    bad.write_text(content)
    out = tmp_path / "run"
    line = main_error(monkeypatch, capsys, train, ["--init_from", micro_base, *PROBE.split(), "--eval_tasks",
                                                   file.split("/")[0], "--mirror", bad.parent.parent,
                                                   "--out_dir", out])
    assert message in line and not out.exists()


def test_atomic_writer_leaves_nothing_behind_on_failure(tmp_path):
    """A failed write through the one atomic writer keeps the previous file and removes its temporary."""
    from data.sources import DataError, write_atomic
    write_atomic(tmp_path / "x.bin", lambda tmp: tmp.write_bytes(b"abc"))
    assert (tmp_path / "x.bin").read_bytes() == b"abc"

    def fail(tmp):
        tmp.write_bytes(b"half")
        raise OSError(errno.EACCES, "Permission denied")

    with pytest.raises(DataError, match="could not write .*x.bin: Permission denied"):
        write_atomic(tmp_path / "x.bin", fail)
    assert (tmp_path / "x.bin").read_bytes() == b"abc" and sorted(os.listdir(tmp_path)) == ["x.bin"]


# --- inputs are never outputs; evaluations whose two files are a pair; no item counted twice ---

def test_a_run_never_writes_into_the_folder_it_reads(tiny_hf_dir, tmp_path, monkeypatch, capsys):
    base = tmp_path / "hf"
    shutil.copytree(tiny_hf_dir, base)
    before = snapshot(base)
    line = main_error(monkeypatch, capsys, train, ["--init_from", base, "--skip", "--out_dir", base])
    assert line == f"error: --out_dir {base} is the --init_from folder, which this run reads; write the run to " \
                   f"another folder"
    assert snapshot(base) == before  # config.json and the weights untouched


def test_a_probe_that_names_itself_as_its_base_is_one_line(stopped_probe, tmp_path):
    probe = tmp_path / "probe"
    shutil.copytree(stopped_probe, probe)
    ckpt = torch.load(probe / "ckpt.pt", weights_only=True)
    ckpt["base"]["init_from"] = str(probe)  # what a run written into its base's folder left
    torch.save(ckpt, probe / "ckpt.pt")
    with pytest.raises(checkpoint.CheckpointError, match="names its own folder as its base"):
        load_model(str(probe))


def test_an_evaluation_summary_refuses_records_it_was_not_written_with(micro_base, tmp_path, monkeypatch,
                                                                        capsys, mirror):
    """A disk that fills between the two writes leaves new per-item records beside an old summary: compare
    refuses the pair instead of comparing the wrong model's items."""
    from lab.evaluation import items_path
    from tools import compare
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for out in (a, b):
        script("eval_lambada.py", "--init_from", micro_base, "--tasks", "lambada", "--limit", "4", "--dtype",
               "float32", "--out", out, check=True)
    assert json.loads(a.read_text())["items"]["lines"] == 4
    compare.main([str(a), str(b), "--out", str(tmp_path / "c.json")])  # a true pair: fine
    records = items_path(a).read_text().splitlines()
    items_path(a).write_text("\n".join(records[:3]) + "\n")  # other records beside the summary
    line = main_error(monkeypatch, capsys, compare, [a, b, "--out", tmp_path / "c.json"], strict=False)
    assert "a.items.jsonl is not the set of records that a.json was written with" in line


def test_a_task_named_twice_is_refused_and_compare_refuses_items_seen_twice(micro_base, tmp_path):
    proc = script("eval_lambada.py", "--init_from", micro_base, "--tasks", "lambada,lambada", "--out",
                  tmp_path / "e.json")
    assert error_line(proc.returncode, proc.stderr) == "error: the task list names lambada twice; name each task once"
    assert not (tmp_path / "e.json").exists()
    from lab.evaluation import item_record
    from lab.stats import compare_items
    once = [item_record("lambada", "lm-eval", i, -1.0, 1, True, None) for i in range(3)]
    with pytest.raises(ValueError, match="holds item 0 of lambada more than once"):
        compare_items(once + once[:1], once)


# --- full disks: one line, the temporary removed, what was there before intact ---

def test_a_checkpoint_on_a_full_disk_is_one_line_and_leaves_no_temporary(tmp_path, monkeypatch):
    """torch's zip writer reports a disk that fills at the end of the file as a RuntimeError about positions
    (seen on a 2 MB tmpfs): it becomes the full-disk DataError, and the temporary goes."""
    folder = tmp_path / "run"
    checkpoint.save_run_file(folder, "ckpt.pt", {"step": 1})
    def filling_save(obj, f):
        f.write(b"x" * 1000)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1741312 vs 1741200")
    monkeypatch.setattr(checkpoint.torch, "save", filling_save)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1 << 30, 1 << 30, 0))
    with pytest.raises(DataError, match=r"^the disk is full: could not write .*ckpt.pt \(what was written "
                                                   r"before is intact\)"):
        checkpoint.save_run_file(folder, "ckpt.pt", {"step": 2})
    assert sorted(p.name for p in folder.iterdir()) == ["ckpt.pt"]
    monkeypatch.undo()
    assert torch.load(folder / "ckpt.pt", weights_only=True) == {"step": 1}


def test_figures_are_written_whole_or_not_at_all(tmp_path):
    import matplotlib.pyplot as plt
    path = tmp_path / "layers.png"
    fig = plt.figure()
    analyze_layers.save_figure(fig, path, dpi=50)
    before = path.read_bytes()
    real = fig.savefig
    def full_disk(f, **kwargs):
        real(f, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")
    fig.savefig = full_disk
    with pytest.raises(analyze_layers.DataError, match="the disk is full"):
        analyze_layers.save_figure(fig, path, dpi=80)
    plt.close(fig)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["layers.png"]


def test_two_processes_writing_one_file_at_once_both_succeed(tmp_path):
    """Every writer has a temporary of its own (two ranks fetching one file used to share one, and one failed)."""
    code = ("import sys; from pathlib import Path; from data.sources import write_atomic\n"
            "for i in range(200): write_atomic(Path(sys.argv[1]), sys.argv[2] * 100_000)\n")
    target = tmp_path / "shared.txt"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(target), c], cwd=ROOT, stderr=subprocess.PIPE)
             for c in "ab"]
    errors = [p.communicate()[1].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    assert target.read_text() in ("a" * 100_000, "b" * 100_000)


def test_a_benchmark_file_cut_at_a_line_boundary_is_refused(mirror, tmp_path):
    """HellaSwag's file is not pinned by digest (the mirror's is rebuilt), so its count is checked: 300 whole
    lines of 10,042 are an incomplete file, not a smaller benchmark (--limit is the way to score fewer)."""
    from data import benchmarks
    cut = tmp_path / "mirror" / "hellaswag" / "hellaswag_val.jsonl"
    cut.parent.mkdir(parents=True)
    cut.write_text("".join(open(f"{mirror}/hellaswag/hellaswag_val.jsonl").readlines()[:300]))
    with pytest.raises(DataError, match=r"holds 300 items, HellaSwag's validation set 10,042: the file is incomplete"):
        benchmarks.hellaswag(str(tmp_path / "mirror"))
    assert len(benchmarks.hellaswag(mirror)) == 10_042
    odd = cut.read_text().splitlines()
    row = json.loads(odd[0])
    row["endings"][1] = 7
    cut.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match=r"hellaswag_val.jsonl:1: endings is not a list of strings"):
        benchmarks.hellaswag(str(tmp_path / "mirror"))


def test_wikitext103_from_the_mirror_or_a_damaged_download(mirror, tmp_path, monkeypatch, wikitext103_archive):
    """The paper's probe text has a mirror slot (an offline machine reads it there, the same lines as the
    download's), and a cached archive that is not a zip (a captive portal's page) is set aside in one line."""
    import data.sources
    from data import prepare
    from load_pythia import load_tokenizer
    tok = load_tokenizer(f"{mirror}/tokenizers/20B_tokenizer.json")
    raw = wikitext103_archive
    downloaded = prepare.wikitext103_probe_lines(tok, n_lines=50)
    local = tmp_path / "mirror" / prepare.WIKITEXT103_TRAIN
    local.parent.mkdir(parents=True)
    local.write_text(raw, encoding="utf-8")
    monkeypatch.setattr(data.sources, "download", lambda url: pytest.fail("the mirror's copy is read, not fetched"))
    from_mirror = prepare.wikitext103_probe_lines(tok, n_lines=50, mirror=str(tmp_path / "mirror"))
    assert len(from_mirror) == 50 and all(np.array_equal(a, b) for a, b in zip(downloaded, from_mirror))
    assert prepare.wikitext103_files(str(tmp_path / "mirror")) == {  # what a dry run prints for it
        prepare.WIKITEXT103_TRAIN: hashlib.sha256(raw.encode("utf-8")).hexdigest()}
    cached = tmp_path / "cache" / "downloads" / "archives" / "wikitext-103-raw-v1.zip"
    cached.write_text("<html>Please log in to the network</html>")
    with pytest.raises(DataError, match=r"was not a zip archive .* set aside as wikitext-103-raw-v1.zip.bad: run "
                                        r"again to download it anew"):
        prepare.wikitext103_probe_lines(tok, n_lines=5)
    assert not cached.exists() and cached.with_name(cached.name + ".bad").is_file()


def test_a_wikitext103_download_with_the_wrong_digest_is_set_aside(mirror, tmp_path, monkeypatch,
                                                                   wikitext103_archive):
    """The archive is pinned by its published sha256: another file under its name (a re-packed or truncated
    copy) is set aside in one line, not read."""
    from data import prepare
    from load_pythia import load_tokenizer
    tok = load_tokenizer(f"{mirror}/tokenizers/20B_tokenizer.json")
    monkeypatch.setattr(prepare, "WIKITEXT103_SHA256",
                        "91c00ae287f0d699e18605c84afc9e45c192bc6b7797ff8837e5474655a33794")
    cached = tmp_path / "cache" / "downloads" / "archives" / "wikitext-103-raw-v1.zip"
    with pytest.raises(DataError, match=r"wikitext-103-raw-v1.zip has the wrong sha256 \(expected 91c00ae287f0\.\.\., "
                                        r"published for wikitext-103-raw-v1.zip\); it is set aside as "
                                        r"wikitext-103-raw-v1.zip.bad: run again"):
        prepare.wikitext103_probe_lines(tok, n_lines=5)
    assert not cached.exists() and cached.with_name(cached.name + ".bad").is_file()


def test_a_prepared_split_deleted_from_the_cache_is_one_line(monkeypatch, tmp_path):
    from data import prepare
    folder = tmp_path / "nano"
    shutil.copytree(prepare.NANO_DATA, folder)
    (folder / "val.bin").unlink()
    monkeypatch.setattr(prepare, "NANO_DATA", folder)
    with pytest.raises(DataError, match=r"val.bin is missing from the prepared corpus; rebuild it with `python -m "
                                        r"data.prepare --force`"):
        prepare.load_nano_split("val")


@pytest.mark.parametrize("module, argv, words", [
    ("study.grid", ["--lrs", "abc"], "argument --lrs: expected a finite number > 0, got 'abc'"),
    ("study.grid", ["--lrs", ","], "argument --lrs: expected comma-separated numbers > 0, got ','"),
    ("study.grid", ["--steps", "0"], "argument --steps: expected an integer >= 1, got '0'"),
    ("study.grid", ["--tasks", "piqa"], "--tasks: unknown task 'piqa'"),
    ("tools.compare", ["a.json"], "the following arguments are required: b"),
    ("tools.compare", ["a.json", "b.json", "--resamples", "-1"], "argument --resamples: expected an integer >= 1"),
    ("tools.harness", ["--init_from", "nano", "--tasks", "x", "--include_path", "no/such/folder"],
     "--include_path no/such/folder: no such folder of task YAML files"),
    ("tools.bench", ["--seq", "5000"], "--seq 5000 is longer than the models' window of 2048 positions"),
    ("tools.bench", ["--new_tokens", "100000"], "ask for at most 2032"),
    ("study.layers", ["--runs", "no/such/run"], "no/such/run has no ckpt.pt; pass run folders of the experiment's"),
    ("study.records", ["--out", "no/such/grid"], "no/such/grid holds no grid (no grid.json)"),
    ("study.report", ["--out", "no/such/grid"], "no/such/grid holds no grid (no grid.json)"),
])
def test_the_study_and_the_tools_answer_bad_flags_in_one_line(module, argv, words):
    proc = script("-m", module, *argv)
    line = error_line(proc.returncode, proc.stderr)
    assert words in line, line


def test_exported_files_are_readable_by_others(tmp_path):
    """Every file is written with the usual permissions (0666 less the umask), not 0600 as safetensors makes its
    files, so that a shared machine's other users can load an export."""
    from safetensors.torch import save_file

    from data import sources
    plain = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(2)}, str(plain))
    ours = tmp_path / "model.safetensors"
    sources.write_atomic(ours, lambda p: save_file({"x": torch.zeros(2)}, str(p)))
    assert plain.stat().st_mode & 0o777 == 0o600  # what safetensors alone gives
    assert ours.stat().st_mode & 0o777 == 0o666 & ~sources.UMASK


UNWRITABLE = "/sys/preproj-test"  # sysfs: not even root may create files there (a real EPERM, like a read-only disk)


@pytest.mark.parametrize("argv", [
    ["train.py", "--init_from", "{micro_base}", "--skip", "--max_iters", "2", "--eval_tasks", "none", "--out_dir",
     UNWRITABLE],
    ["-m", "tools.export", "--init_from", "{micro_base}", "--out", UNWRITABLE],
    ["-m", "study.grid", "--bases", "micro={micro_base}", "--only", "baseline", "--tasks", "lambada", "--out",
     UNWRITABLE],
    ["-m", "study.report", "--results", f"{UNWRITABLE}/RESULTS.md"],
])
def test_an_output_that_cannot_be_written_is_one_line(micro_base, argv):
    proc = script(*(a.format(micro_base=micro_base) for a in argv))
    assert f"could not write {UNWRITABLE}" in error_line(proc.returncode, proc.stderr, strict=False)


def test_compare_writes_only_where_it_can(micro_base, tmp_path, mirror):
    script("eval_lambada.py", "--init_from", micro_base, "--tasks", "lambada", "--limit", "2", "--dtype", "float32",
           "--out", tmp_path / "a.json", check=True)
    for out, words in ((tmp_path, "is a folder; pass a file name"), (f"{UNWRITABLE}/c.json", "could not write")):
        proc = script("-m", "tools.compare", tmp_path / "a.json", tmp_path / "a.json", "--out", out)
        assert words in error_line(proc.returncode, proc.stderr), proc.stderr


def test_resume_with_a_shape_flag_names_that_flag(stopped_probe, tmp_path, monkeypatch, capsys):
    """--resume --n_embd 64 used to blame the default --n_head 3, which the user never passed."""
    probe = tmp_path / "probe"
    shutil.copytree(stopped_probe, probe)
    line = main_error(monkeypatch, capsys, train, ["--out_dir", probe, "--resume", "--n_embd", "64"])
    assert "would ignore --n_embd 64 (saved: 32)" in line and "--n_head" not in line


def test_a_corpus_file_that_is_not_utf8_is_named(tmp_path):
    from data import prepare
    bad = tmp_path / "state_union" / "1999-Clinton.txt"
    bad.parent.mkdir()
    bad.write_bytes("Mr. Speaker, caf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match=r"1999-Clinton.txt is not UTF-8 text \(byte 16\); replace the file"):
        prepare.read_docs([bad])


def test_resume_on_a_read_only_file_system_is_one_line(probe_copy, monkeypatch, capsys):
    """What a read-only mount answers when --resume takes the folder's lock (seen on a remounted tmpfs): EROFS,
    which becomes one line naming the file, the checkpoint untouched."""
    import builtins
    before = snapshot(probe_copy)
    real_open = builtins.open

    def read_only(path, mode="r", *args, **kwargs):
        if str(path).startswith(str(probe_copy)) and any(c in mode for c in "wa+x"):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", read_only)
    line = main_error(monkeypatch, capsys, train, ["--out_dir", probe_copy, "--resume"], strict=False)
    monkeypatch.undo()
    assert line.startswith("error: could not write ") and line.endswith("Read-only file system"), line
    assert snapshot(probe_copy) == before
