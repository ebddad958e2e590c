"""
Naming, saving and loading models: one `--init_from` for every script, and our run folders.

--init_from accepts
  nano            the embedded base: a small GPT-NeoX pre-trained by train.py on the public-domain corpus
  scratch         a new model (train.py only; its shape comes from train.py's flags)
  pythia-160m     any Pythia name or Hugging Face id (EleutherAI/pythia-410m@step143000), downloaded when online
  a folder        a Hugging Face GPT-NeoX folder (config.json + weights), or one of our run folders (ckpt.pt)

A run folder holds ckpt.pt, config.json, tokenizer.json, metrics.jsonl and eval.json. A probe checkpoint stores
only the new parameters plus a reference to its base (how to load it and a sha256 of its weights), so it is small
and re-attaches to exactly the base it was trained on.
"""

import argparse
import hashlib
import json
import os
from pathlib import Path

import torch
from tokenizers import Tokenizer

from data.sources import fetch
from load_pythia import load_pythia, load_tokenizer, resolve
from model import GPT, GPTConfig

ROOT = Path(__file__).resolve().parent
NANO_DIR = ROOT / "out" / "nano-base"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SWITCHES = ("preproj", "skip", "lora_rank", "lora_alpha")  # the research switches add_model_args defines


class CheckpointError(Exception):
    """A model or checkpoint cannot be loaded; the message says why and what to do."""


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The flags every script shares to name a model and where it runs."""
    p.add_argument("--init_from", default="nano",
                   help="nano (default, the embedded base), scratch, pythia-160m (or any Pythia / HF id), "
                        "a Hugging Face folder, or one of our run folders")
    p.add_argument("--preproj", action="store_true", help="add the pre-projection MLP before Q/K/V")
    p.add_argument("--skip", action="store_true", help="add the content skip W_skip around attention")
    p.add_argument("--lora_rank", type=int, default=0, help="LoRA rank on query_key_value and dense (0 = off)")
    p.add_argument("--lora_alpha", type=float, default=0.0, help="LoRA alpha (0 = 2 * rank, as the paper)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                   help="weights' dtype when evaluating or sampling (train.py uses autocast or --pure_bf16)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--mirror", default=None, help="offline data mirror folder (default: $PREPROJ_MIRROR)")


def switches_of(args: argparse.Namespace) -> dict:
    """The research switches of a parsed command line, as load_model and GPTConfig take them."""
    return {k: getattr(args, k) for k in SWITCHES}


def weights_sha256(model: GPT) -> str:
    """A fingerprint of the base weights (fp32 bytes, sorted names): what a probe checkpoint must re-attach to."""
    h = hashlib.sha256()
    for name, t in sorted(model.base_state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def save_run_file(folder: Path, name: str, obj) -> None:
    """Write one file of a run folder atomically: a temp name, then a rename, so no reader sees half a file."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{name}.tmp"
    if name.endswith(".pt"):
        torch.save(obj, tmp)
    else:
        tmp.write_text(obj if isinstance(obj, str) else json.dumps(obj, indent=2))
    os.replace(tmp, folder / name)


def save_checkpoint(folder: Path, model: GPT, *, probe: bool, base_ref: dict | None, step: int,
                    optimizer_state: dict | None, extra: dict, tokenizer: Tokenizer) -> None:
    """A probe stores the new parameters only (plus its base reference); otherwise the whole model."""
    state = model.new_state_dict() if probe else {k: v.detach().clone() for k, v in model.state_dict().items()}
    ckpt = {"kind": "probe" if probe else "full", "config": model.config.to_dict(), "model": state,
            "base": base_ref, "step": step, "optimizer": optimizer_state, **extra}
    save_run_file(folder, "tokenizer.json", tokenizer.to_str())
    save_run_file(folder, "config.json", {"kind": ckpt["kind"], "config": ckpt["config"], "base": base_ref,
                                          "step": step})
    save_run_file(folder, "ckpt.pt", ckpt)


def read_checkpoint(folder: Path) -> dict:
    path = folder / "ckpt.pt"
    if not path.is_file():
        raise CheckpointError(f"no ckpt.pt in {folder}; train one with train.py or pass another --init_from")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file: say so in one line
        raise CheckpointError(f"{path} is not a readable checkpoint ({type(e).__name__}); it may be truncated") from e
    if not isinstance(ckpt, dict) or "kind" not in ckpt or "config" not in ckpt:
        raise CheckpointError(f"{path} is not a checkpoint of this project (no kind/config entries)")
    return ckpt


def load_model(init_from: str, *, preproj: bool = False, skip: bool = False, lora_rank: int = 0,
               lora_alpha: float = 0.0, mirror: str | None = None) -> tuple[GPT, Tokenizer, dict]:
    """Resolve --init_from to (model in fp32 on the CPU, its tokenizer, a reference to the base weights).

    The switches apply to bases (nano, Pythia, HF folders, full checkpoints); a probe checkpoint brings its own.
    The reference is {"init_from": how to load the base, "sha256": its fingerprint}.
    """
    switches = dict(preproj=preproj, skip=skip, lora_rank=lora_rank, lora_alpha=lora_alpha)
    if init_from == "nano":
        if not (NANO_DIR / "ckpt.pt").is_file():
            raise CheckpointError("the embedded base is not built yet; run `python train.py` once to pre-train it")
        return load_model(str(NANO_DIR), **switches, mirror=mirror)
    if init_from == "scratch":
        raise CheckpointError("--init_from scratch only makes sense for train.py")
    folder = Path(init_from)
    if is_run_folder(folder):
        return _load_run(folder, switches, mirror)
    if folder.is_dir() or init_from.startswith(("pythia-", "EleutherAI/")):
        try:
            model = load_pythia(init_from, **switches)
            hf_dir = resolve(init_from)
        except (ValueError, FileNotFoundError, OSError) as e:
            raise CheckpointError(f"cannot load {init_from}: {e}") from e
        tok_path = Path(hf_dir) / "tokenizer.json"
        tok = load_tokenizer(str(tok_path if tok_path.exists() else fetch("tokenizers/20B_tokenizer.json", mirror)))
        return model, tok, {"init_from": str(init_from), "sha256": weights_sha256(model)}
    raise CheckpointError(f"unknown --init_from {init_from!r}: expected nano, scratch, a Pythia name like "
                          f"pythia-160m, a Hugging Face folder, or a run folder")


def is_run_folder(folder: Path) -> bool:
    """One of our run folders (its config.json names the checkpoint kind), not a Hugging Face folder."""
    try:
        return "kind" in json.loads((folder / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return False


def _load_run(folder: Path, switches: dict, mirror: str | None) -> tuple[GPT, Tokenizer, dict]:
    ckpt = read_checkpoint(folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
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
        return model, tok, {"init_from": str(folder), "sha256": weights_sha256(model)}
    # A probe: load its base with the probe's own switches, check the fingerprint, attach the new parameters.
    base_ref = ckpt["base"]
    probe_switches = {k: ckpt["config"][k] for k in SWITCHES}
    model, _, _ = load_model(base_ref["init_from"], **probe_switches, mirror=mirror)
    if weights_sha256(model) != base_ref["sha256"]:
        raise CheckpointError(f"the base {base_ref['init_from']} has changed since {folder} was trained on it "
                              f"(sha256 differs); re-train the probe or restore that base")
    if set(ckpt["model"]) != set(model.new_state_dict()):
        raise CheckpointError(f"{folder}/ckpt.pt holds parameters that do not fit its config; it is damaged")
    model.load_state_dict(ckpt["model"], strict=False)
    return model, tok, base_ref
