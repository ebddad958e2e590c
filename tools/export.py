"""
Write any model of ours as a Hugging Face folder, which transformers, lm-eval's `--model hf` and the Hub take.

    python -m tools.export --init_from out/run --out out/run-hf       # any run: a probe, a full fine-tune, a base
    python -m tools.export --init_from nano --out out/nano-hf        # the embedded base, with its own tokenizer
    python -m tools.export --init_from out/lora-run --out out/adapter --peft   # a LoRA probe as a peft adapter

Three kinds of folder, by what the model holds:
  GPT-NeoX      a model without pre-projection, skip or capacity adapter (a LoRA update merged into its weights):
                config.json names GPTNeoXForCausalLM, loadable by transformers with no code of ours
  remote code   a model with any of those: config.json's auto_map names modeling_preproj.py, written beside it
                with this project's model.py (tools/hf_remote.py), so that
                AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True) runs our model exactly
  peft adapter  --peft, a LoRA probe of a Hugging Face base (a folder or a Hub name): adapter_config.json and
                adapter_model.safetensors, for PeftModel.from_pretrained(base, folder)

The model is loaded as every script loads it (lab.checkpoint.load_model). A model whose weights are not all finite
is refused. Every folder is written whole or not at all, and only into a new or empty folder.
"""

import argparse
import json
from pathlib import Path

import torch

import model as model_module
from data.sources import DataError
from lab.checkpoint import CheckpointError, base_location, load_model
from lab.cli import ArgumentParser, out_folder
from load_pythia import EOT, free_folder, save_hf_folder, tokenizer_files, write_folder
from model import GPT

REMOTE_CODE = Path(__file__).with_name("hf_remote.py")
LOCAL_IMPORT = "from model import GPT, GPTConfig  # the exported copy: from .preproj_model import GPT, GPTConfig"
FOLDER_IMPORT = "from .preproj_model import GPT, GPTConfig"
LORA_TARGETS = {"qkv": "query_key_value", "proj": "dense"}  # our LoRA layers -> the GPT-NeoX modules peft wraps


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(prog="python -m tools.export", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--init_from", required=True,
                   help="the model: anything the other scripts' --init_from accepts (nano, a run folder, ...)")
    p.add_argument("--out", type=out_folder, required=True, help="the folder to write; it must be new or empty")
    p.add_argument("--peft", action="store_true",
                   help="a LoRA probe as a peft adapter beside its base, instead of merged into a whole model")
    p.add_argument("--mirror", default=None,
                   help="offline data mirror folder (default: $PREPROJ_MIRROR), for the tokenizer of a Hugging Face "
                        "folder that has none")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = get_args(argv)
    try:
        target = free_folder(args.out)  # before loading a model that may be large
        model, tokenizer, base_ref = load_model(args.init_from, mirror=args.mirror)
        if not all(torch.isfinite(p).all() for p in model.parameters()):
            raise ValueError(f"{args.init_from} holds weights that are not finite (a diverged run); nothing to export")
        if args.peft:
            kind = save_peft_adapter(model, base_ref, target)
        elif needs_remote_code(model):
            kind = save_remote_code_folder(model, tokenizer, base_ref, target)
        else:
            save_hf_folder(model, tokenizer, str(target))
            kind = "GPT-NeoX" + (", LoRA merged into the weights" if model.config.lora_rank else "")
    except (CheckpointError, DataError, ValueError, OSError) as e:
        raise SystemExit(f"error: {e}")
    print(f"wrote {args.out}: {kind}, {model.num_params('all'):,} parameters")


def needs_remote_code(model: GPT) -> bool:
    """Pre-projection, the skip and the capacity adapter change the block itself: no GPT-NeoX folder holds them."""
    c = model.config
    return bool(c.preproj or c.skip or c.adapter_dim)


# --- remote code: our model.py travels with the weights ---

def remote_code_files() -> dict[str, str]:
    """modeling_preproj.py (tools/hf_remote.py, its one import pointed at the copy) and preproj_model.py (model.py)."""
    wrapper = REMOTE_CODE.read_text()
    if LOCAL_IMPORT not in wrapper:
        raise RuntimeError(f"{REMOTE_CODE} lost the line `{LOCAL_IMPORT}` that the export rewrites")
    return {"modeling_preproj.py": wrapper.replace(LOCAL_IMPORT, FOLDER_IMPORT),
            "preproj_model.py": Path(model_module.__file__).read_text()}


def save_remote_code_folder(model: GPT, tokenizer, base_ref: dict | None, target: Path) -> str:
    from safetensors.torch import save_file

    c = model.config
    state = {f"gpt.{k}": v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    eot = tokenizer.token_to_id(EOT)
    config = {"architectures": ["PreprojForCausalLM"], "model_type": "preproj_gpt_neox",
              "auto_map": {"AutoConfig": "modeling_preproj.PreprojConfig",
                           "AutoModelForCausalLM": "modeling_preproj.PreprojForCausalLM"},
              "gpt": c.to_dict(), "vocab_size": c.vocab_size, "max_position_embeddings": c.block_size,
              "hidden_size": c.n_embd, "num_hidden_layers": c.n_layer, "num_attention_heads": c.n_head,
              "tie_word_embeddings": False, "bos_token_id": eot, "eos_token_id": eot,
              "dtype": str(model.wte.weight.dtype).removeprefix("torch."), "base": base_ref}
    write_folder(target, {"config.json": json.dumps(config, indent=2),
                          "model.safetensors": lambda path: save_file(state, str(path), metadata={"format": "pt"}),
                          **remote_code_files(), **tokenizer_files(tokenizer, c.block_size)})
    switches = [s for s in ("preproj", "preproj_linear", "skip", "adapter_dim", "lora_rank") if getattr(c, s)]
    return f"remote code ({', '.join(switches)}; load with trust_remote_code=True)"


# --- a peft adapter beside its base ---

def peft_base(base_ref: dict | None) -> tuple[str, str | None]:
    """(base_model_name_or_path, revision) for adapter_config.json: a Hub id as the Hub names it, a folder as a
    path; the embedded base has no Hugging Face form until it is exported."""
    name = (base_ref or {}).get("init_from", "")
    if name == "nano" or not name:
        raise ValueError("a peft adapter needs a Hugging Face base; export the base first (python -m tools.export "
                         "--init_from nano --out DIR) and probe that folder, or export this run merged (no --peft)")
    location = base_location(name)
    if Path(location).is_dir():
        return str(Path(location).resolve()), None
    repo, _, revision = name.partition("@")
    return (repo if "/" in repo else f"EleutherAI/{repo}"), revision or base_ref.get("revision")


def save_peft_adapter(model: GPT, base_ref: dict | None, target: Path) -> str:
    from safetensors.torch import save_file

    c = model.config
    if not c.lora_rank or needs_remote_code(model):
        raise ValueError("--peft exports a LoRA probe (--lora_rank) with no other switch; export this model without "
                         "--peft")
    base, revision = peft_base(base_ref)
    state = {}
    for i, block in enumerate(model.blocks):
        for ours, theirs in LORA_TARGETS.items():
            layer, prefix = getattr(block.attn, ours), f"base_model.model.gpt_neox.layers.{i}.attention.{theirs}"
            state[f"{prefix}.lora_A.weight"] = layer.lora_a.detach().cpu().contiguous()
            state[f"{prefix}.lora_B.weight"] = layer.lora_b.detach().cpu().contiguous()
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "revision": revision,
              "r": c.lora_rank, "lora_alpha": c.lora_alpha, "lora_dropout": 0.0, "bias": "none",
              "target_modules": list(LORA_TARGETS.values()), "fan_in_fan_out": False, "inference_mode": True,
              "init_lora_weights": True}
    write_folder(target, {"adapter_config.json": json.dumps(config, indent=2),
                          "adapter_model.safetensors": lambda path: save_file(state, str(path),
                                                                              metadata={"format": "pt"})})
    return f"peft LoRA adapter (r = {c.lora_rank}) for {base}" + (f"@{revision}" if revision else "")


if __name__ == "__main__":
    main()
