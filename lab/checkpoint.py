"""
Naming, saving and loading models: one `--init_from` for every script, and our run folders.

--init_from accepts
  nano            the embedded base: a small GPT-NeoX pre-trained by train.py on the public-domain corpus
  scratch         a new model (train.py only; its shape comes from train.py's flags)
  pythia-160m     any Pythia name or Hugging Face id (EleutherAI/pythia-410m@step143000), downloaded when online
  a folder        a Hugging Face GPT-NeoX folder (config.json + weights), or one of our run folders (ckpt.pt)

A run folder holds ckpt.pt, config.json, tokenizer.json, metrics.jsonl and eval.json. A probe checkpoint stores
only the new parameters plus a reference to its base (how to load it, as the user named it, and a sha256 of its
weights), so it is small and re-attaches to exactly the base it was trained on.

ckpt.pt alone holds the step: config.json describes the model and never changes during a run. Every file is written
under a temporary name and renamed (save_run_file); what else keeps a run folder whole is in lab/run_folder.py.
"""

import errno
import hashlib
import json
import shutil
from pathlib import Path

import torch
from tokenizers import Tokenizer

from data import text
from data.sources import fetch, write_atomic
from load_pythia import hf_folder, load_pythia, load_tokenizer, read_tokenizer
from model import GPT, SWITCHES, GPTConfig

ROOT = Path(__file__).resolve().parent.parent
NANO_DIR = ROOT / "out" / "nano-base"
# The settings that define what a training run trains: runs differing only in seed repeat one experiment.
RUN_SETTINGS = ("init_from", *SWITCHES, "seed", "max_iters", "batch_size", "grad_accum", "seq_len", "lr", "min_lr",
                "warmup_iters", "weight_decay", "beta2", "grad_clip", "full_finetune", "pure_bf16", "data",
                "n_layer", "n_head", "n_embd", "block_size")


class CheckpointError(Exception):
    """A model or checkpoint cannot be loaded; the message says why and what to do."""


def weights_sha256(model: GPT) -> str:
    """A fingerprint of the base weights (fp32 bytes, sorted names): what a probe checkpoint must re-attach to."""
    h = hashlib.sha256()
    for name, t in sorted(model.base_state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def run_name(settings: dict) -> str:
    """The default run folder name, from a training run's settings: e.g. nano-preproj-skip, pythia-160m-lora64,
    nano-skip-books (a --data other than auto is named, so probes of one model on two texts never share a name)."""
    init = settings["init_from"]
    parts = ["scratch" if init == "scratch" else Path(init.rstrip("/")).name]
    parts += [s for s in ("preproj", "preproj_linear", "skip") if settings.get(s)]
    data = settings.get("data", "auto")
    parts += [text.source_name(data) if text.is_path(data) else data] if data != "auto" else []
    parts += [f"lora{settings['lora_rank']}"] if settings.get("lora_rank") else []
    parts += [f"adapter{settings['adapter_dim']}"] if settings.get("adapter_dim") else []
    parts += ["fullft"] if settings.get("full_finetune") else []
    return "-".join(parts)


def save_run_file(folder: Path, name: str, obj) -> None:
    """One file of a run folder, written atomically: a .pt name is saved with torch.save, text as it is,
    anything else as JSON."""
    if name.endswith(".pt"):
        write_atomic(Path(folder) / name, lambda tmp: _torch_save(obj, tmp))
    else:
        write_atomic(Path(folder) / name, obj if isinstance(obj, str) else json.dumps(obj, indent=2))


def _torch_save(obj, path: Path) -> None:
    """torch.save as write_atomic takes it: a failed write is an OSError, a full disk ENOSPC. (torch's zip writer
    can turn the file's own ENOSPC into a RuntimeError about positions when the disk fills at the very end.)"""
    try:
        with open(path, "wb") as f:
            torch.save(obj, f)
    except RuntimeError as e:
        full = shutil.disk_usage(Path(path).parent).free < 1 << 20
        raise OSError(errno.ENOSPC if full else errno.EIO, str(e).splitlines()[0]) from e


def save_checkpoint(folder: Path, model: GPT, *, probe: bool, base_ref: dict | None, step: int,
                    optimizer_state: dict | None, extra: dict, tokenizer: Tokenizer) -> None:
    """A probe stores the new parameters only (plus its base reference); otherwise the whole model.

    ckpt.pt is written first and config.json is derived from it without the step, so that a kill between (or
    during) the writes never leaves the two disagreeing."""
    state = model.new_state_dict() if probe else {k: v.detach().clone() for k, v in model.state_dict().items()}
    ckpt = {"kind": "probe" if probe else "full", "config": model.config.to_dict(), "model": state,
            "base": base_ref, "step": step, "optimizer": optimizer_state, **extra}
    save_run_file(folder, "tokenizer.json", tokenizer.to_str())
    save_run_file(folder, "ckpt.pt", ckpt)
    save_run_file(folder, "config.json", model_card(ckpt))


def model_card(ckpt: dict) -> dict:
    """config.json of a run folder: what the checkpoint holds and the precision it was trained in, the same at every
    step of the run."""
    return {"kind": ckpt["kind"], "config": ckpt["config"], "base": ckpt["base"],
            "dtype": ckpt.get("train_args", {}).get("dtype")}


def read_checkpoint(folder: Path, mmap: bool = False) -> dict:
    """ckpt.pt of a run folder; mmap=True reads tensors only when they are used (cheap for the settings alone)."""
    path = Path(folder) / "ckpt.pt"
    if not path.is_file():
        raise CheckpointError(f"no ckpt.pt in {folder}; train one with train.py or pass another --init_from")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # a truncated or foreign file: say so in one line
        raise CheckpointError(f"{path} is not a readable checkpoint ({type(e).__name__}); it may be truncated") from e
    if not isinstance(ckpt, dict) or "kind" not in ckpt or "config" not in ckpt:
        raise CheckpointError(f"{path} is not a checkpoint of this project (no kind/config entries)")
    return ckpt


def load_model(init_from: str, *, mirror: str | None = None, **switches) -> tuple[GPT, Tokenizer, dict]:
    """Resolve --init_from to (model in fp32 on the CPU, its tokenizer, a reference to the base weights).

    The switches (model.SWITCHES, e.g. preproj=True) apply to bases (nano, Pythia, HF folders, full checkpoints); a
    probe checkpoint brings its own.
    The reference is {"init_from": how to load the base, "sha256": its fingerprint}.
    """
    unknown = set(switches) - set(SWITCHES)
    if unknown:
        raise TypeError(f"load_model() takes the switches {', '.join(SWITCHES)}, not {', '.join(sorted(unknown))}")
    if init_from == "nano":
        if nano_status() != "ready":
            raise CheckpointError(f"the embedded base is {nano_status()}; run `python train.py` once to pre-train it")
        model, tok, ref = load_model(str(NANO_DIR), **switches, mirror=mirror)
        return model, tok, {**ref, "init_from": "nano"}
    if init_from == "scratch":
        raise CheckpointError("--init_from scratch only makes sense for train.py")
    folder = Path(init_from)
    if is_run_folder(folder):
        return _load_run(folder, switches, mirror)
    if folder.is_dir() or init_from.startswith(("pythia-", "EleutherAI/")):
        try:
            hf_dir = hf_folder(init_from)  # resolved once: a Hub name is one download, its commit known
            model = load_pythia(hf_dir, **switches)
        except (ValueError, FileNotFoundError, OSError) as e:
            raise CheckpointError(f"cannot load {init_from}: {e}") from e
        tok_path = Path(hf_dir) / "tokenizer.json"
        try:
            tok = load_tokenizer(str(tok_path if tok_path.exists() else fetch("tokenizers/20B_tokenizer.json", mirror)))
        except (ValueError, OSError) as e:
            raise CheckpointError(str(e)) from e
        if tok.get_vocab_size() > model.config.vocab_size:  # its ids would index past the embedding
            source = str(tok_path) if tok_path.exists() else "Pythia's tokenizer (the folder has no tokenizer.json)"
            raise CheckpointError(f"{init_from}: {source} has {tok.get_vocab_size():,} tokens, more than the model's "
                                  f"vocab_size {model.config.vocab_size:,}; put the model's own tokenizer.json in "
                                  f"the folder")
        ref = {"init_from": portable_name(init_from), "sha256": weights_sha256(model)}
        if not folder.is_dir():  # a Hub snapshot's folder is named by the commit it holds
            ref["revision"] = Path(hf_dir).name
        return model, tok, ref
    raise CheckpointError(f"unknown --init_from {init_from!r}: expected nano, scratch, a Pythia name like "
                          f"pythia-160m, a Hugging Face folder, or a run folder")


def is_run_folder(folder: Path) -> bool:
    """One of our run folders (its config.json names the checkpoint kind), not a Hugging Face folder."""
    try:
        return "kind" in json.loads((folder / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return False


def nano_status() -> str:
    """The embedded base: 'not built yet', 'not finished' (its first pre-training was stopped) or 'ready'."""
    if not (NANO_DIR / "ckpt.pt").is_file():
        return "not built yet"
    ckpt = read_checkpoint(NANO_DIR, mmap=True)
    return "ready" if ckpt["step"] >= ckpt["train_args"]["max_iters"] else "not finished"


def portable_name(init_from: str) -> str:
    """How a checkpoint records the model it came from: a name (nano, a Hub id) as given, a path relative to the
    project root when it lies inside the project (so that a moved or copied project finds its own), else absolute."""
    if init_from == "nano" or not Path(init_from).exists():
        return init_from
    path = Path(init_from).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def pinned_name(ref: dict) -> str:
    """A base reference as a name that loads those very weights: a Hub name with the commit it resolved to
    (name@revision), anything else as recorded."""
    name, revision = ref["init_from"], ref.get("revision")
    return f"{name.split('@')[0]}@{revision}" if revision else name


def base_location(name: str) -> str:
    """A recorded base as load_model takes it: relative paths are relative to the project root."""
    if name != "nano" and not Path(name).is_absolute() and (ROOT / name).exists():
        return str(ROOT / name)
    return name


def check_base(ref: dict, sha256: str, probe: Path) -> None:
    """A probe re-attaches only to the exact base it was trained on."""
    if sha256 != ref["sha256"]:
        raise CheckpointError(f"the base {ref['init_from']} has changed since {probe} was trained on it "
                              f"(sha256 differs); re-train the probe or restore that base")


def _load_run(folder: Path, switches: dict, mirror: str | None) -> tuple[GPT, Tokenizer, dict]:
    ckpt = read_checkpoint(folder)
    try:
        tok = read_tokenizer(str(folder / "tokenizer.json"))
    except (ValueError, OSError) as e:
        raise CheckpointError(str(e)) from e
    config = GPTConfig(**ckpt["config"])
    if ckpt["kind"] == "full":  # a whole model; the switches may add new parameters on top of it
        for k, v in switches.items():
            if v and not getattr(config, k):
                setattr(config, k, v)
        config.__post_init__()
        model = GPT(config)
        missing, unexpected = model.load_state_dict(ckpt["model"], strict=False)
        if unexpected or any(not GPT.is_new(k) for k in missing):
            raise CheckpointError(f"{folder}/ckpt.pt does not fit its own config "
                                  f"(missing {missing[:4]}, unexpected {unexpected[:4]})")
        return model, tok, {"init_from": portable_name(str(folder)), "sha256": weights_sha256(model)}
    # A probe: load its base with the probe's own switches, check the fingerprint, attach the new parameters.
    base_ref = ckpt["base"]
    probe_config = GPTConfig(**ckpt["config"])  # a switch newer than the checkpoint takes its default (off)
    probe_switches = {k: getattr(probe_config, k) for k in SWITCHES}
    base = base_location(pinned_name(base_ref))
    if Path(base).resolve() == Path(folder).resolve():
        raise CheckpointError(f"the probe {folder} names its own folder as its base (a run was written into its "
                              f"base's folder?); its base's weights are gone, so it cannot be loaded")
    try:
        model, _, _ = load_model(base, **probe_switches, mirror=mirror)
    except CheckpointError as e:
        raise CheckpointError(f"the probe {folder} cannot load its base {base_ref['init_from']!r}: {e}") from e
    check_base(base_ref, weights_sha256(model), folder)
    if set(ckpt["model"]) != set(model.new_state_dict()):
        raise CheckpointError(f"{folder}/ckpt.pt holds parameters that do not fit its config; it is damaged")
    model.load_state_dict(ckpt["model"], strict=False)
    return model, tok, base_ref
