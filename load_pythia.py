"""
Hugging Face GPT-NeoX checkpoints (Pythia) -> our GPT, and Pythia's tokenizer. The only file that knows HF names.

    python load_pythia.py pythia-160m --prompt "The capital of France is"
    python load_pythia.py path/to/hf_folder --prompt "..." --tokenizer path/to/tokenizer.json
"""

import json
import os
import re

import torch
from tokenizers import Tokenizer

from cli import ArgumentParser, positive_int, utf8
from model import GPT, GPTConfig

# Buffers that old Pythia checkpoints carry and that we recompute: ignored on load.
IGNORED = re.compile(r"(attention\.(bias|masked_bias)|rotary_emb\.inv_freq)$")

# Hugging Face name -> our name ({i} is the layer index). A pure renaming: every tensor is copied as it is.
LAYER_MAP = {
    "input_layernorm": "ln_1",
    "post_attention_layernorm": "ln_2",
    "attention.query_key_value": "attn.qkv",
    "attention.dense": "attn.proj",
    "mlp.dense_h_to_4h": "mlp.fc",
    "mlp.dense_4h_to_h": "mlp.proj",
}
TOP_MAP = {
    "gpt_neox.embed_in.weight": "wte.weight",
    "gpt_neox.final_layer_norm.weight": "ln_f.weight",
    "gpt_neox.final_layer_norm.bias": "ln_f.bias",
    "embed_out.weight": "lm_head.weight",
}
LAYER_KEY = re.compile(r"gpt_neox\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def hf_to_ours(name: str) -> str | None:
    """Our parameter name for a Hugging Face one, or None if it does not map."""
    if name in TOP_MAP:
        return TOP_MAP[name]
    m = LAYER_KEY.match(name)
    if m and m.group(2) in LAYER_MAP:
        return f"blocks.{m.group(1)}.{LAYER_MAP[m.group(2)]}.{m.group(3)}"
    return None


def config_from_hf(hf: dict, **switches) -> GPTConfig:
    """Our config from a Hugging Face GPT-NeoX config.json (old `rotary_pct` or new `rope_parameters` style)."""
    if hf.get("model_type") != "gpt_neox":
        raise ValueError(f"config.json has model_type={hf.get('model_type')!r}, expected 'gpt_neox' (a Pythia model)")
    missing = [k for k in ("vocab_size", "num_hidden_layers", "num_attention_heads", "hidden_size") if k not in hf]
    if missing:
        raise ValueError(f"config.json lacks {', '.join(missing)}; it is not a complete GPT-NeoX config")
    if hf.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"hidden_act={hf['hidden_act']!r} is not supported (Pythia uses exact 'gelu')")
    if hf.get("tie_word_embeddings", False):
        raise ValueError("tie_word_embeddings=True is not supported: GPT-NeoX has an untied output layer")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope_type={rope['rope_type']!r} is not supported (Pythia uses plain RoPE)")
    return GPTConfig(
        vocab_size=hf["vocab_size"],
        block_size=hf.get("max_position_embeddings", 2048),
        n_layer=hf["num_hidden_layers"],
        n_head=hf["num_attention_heads"],
        n_embd=hf["hidden_size"],
        intermediate_size=hf.get("intermediate_size", 4 * hf["hidden_size"]),
        rotary_pct=rope.get("partial_rotary_factor", hf.get("rotary_pct", 0.25)),
        rotary_base=rope.get("rope_theta", hf.get("rotary_emb_base", 10000.0)),
        parallel_residual=hf.get("use_parallel_residual", True),
        layer_norm_eps=hf.get("layer_norm_eps", 1e-5),
        bias=hf.get("attention_bias", True),
        **switches,
    )


def hf_folder(name_or_dir: str, revision: str | None = None) -> str:
    """A local folder holding config.json and the weights: the folder itself, or a Hub download.

    Accepts 'pythia-160m', 'EleutherAI/pythia-160m' and 'EleutherAI/pythia-160m@step143000' (a revision).
    """
    if os.path.isdir(name_or_dir):
        return name_or_dir
    if "@" in name_or_dir:
        name_or_dir, revision = name_or_dir.split("@", 1)
    repo_id = name_or_dir if "/" in name_or_dir else f"EleutherAI/{name_or_dir}"
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo_id):
        raise ValueError(f"{name_or_dir!r} is neither a folder nor a Hugging Face model id like 'pythia-160m'")
    from huggingface_hub import snapshot_download

    patterns = ["config.json", "tokenizer.json", "*.safetensors", "*.safetensors.index.json"]
    path = snapshot_download(repo_id, revision=revision, allow_patterns=patterns)
    if not any(f.endswith(".safetensors") for f in os.listdir(path)):  # old revisions ship only .bin files
        path = snapshot_download(repo_id, revision=revision, allow_patterns=["*.bin", "*.bin.index.json"])
    return path


def read_hf_weights(folder: str) -> dict[str, torch.Tensor]:
    """All tensors of a Hugging Face checkpoint folder: single or sharded, safetensors or pytorch_model.bin."""
    for index, single, is_st in (("model.safetensors.index.json", "model.safetensors", True),
                                 ("pytorch_model.bin.index.json", "pytorch_model.bin", False)):
        if os.path.exists(os.path.join(folder, index)):
            with open(os.path.join(folder, index)) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        elif os.path.exists(os.path.join(folder, single)):
            files = [single]
        else:
            continue
        state = {}
        for fname in files:
            path = os.path.join(folder, fname)
            try:
                if is_st:
                    from safetensors.torch import load_file
                    state.update(load_file(path))
                else:
                    state.update(torch.load(path, map_location="cpu", weights_only=True))
            except Exception as e:  # safetensors and torch raise their own types for a damaged file
                raise ValueError(f"{path} is not a readable weights file ({str(e).splitlines()[0][:120]}); "
                                 f"it may be truncated: download it again") from e
        return state
    raise FileNotFoundError(f"no model.safetensors or pytorch_model.bin (or their sharded index) in {folder}")


def map_state_dict(hf_state: dict[str, torch.Tensor],
                   expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a Hugging Face state dict to ours (expected: our model's base tensors); refuse keys that do not map,
    tensors of the wrong shape, and report missing ones."""
    ours, unexpected = {}, []
    for k, v in hf_state.items():
        if IGNORED.search(k):
            continue
        name = hf_to_ours(k)
        if name is None or name not in expected:
            unexpected.append(k)
        elif v.shape != expected[name].shape:
            raise ValueError(f"tensor {k} has shape {tuple(v.shape)}, but config.json implies "
                             f"{tuple(expected[name].shape)}; the weights and config.json do not belong together")
        else:
            ours[name] = v
    missing = sorted(expected.keys() - ours.keys())
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the GPT-NeoX layout: missing {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''} ({len(missing)} in all), unexpected "
                         f"{sorted(unexpected)[:8]} ({len(unexpected)} in all)")
    return ours


def load_pythia(name_or_dir: str, *, preproj: bool = False, skip: bool = False, lora_rank: int = 0,
                lora_alpha: float = 0.0, revision: str | None = None, dtype: torch.dtype = torch.float32,
                device: str = "cpu") -> GPT:
    """A Pythia / GPT-NeoX model from a Hub name or a local Hugging Face folder, with the research switches.

    The base weights are copied exactly; the new parameters get the paper's initialisation.
    """
    folder = hf_folder(name_or_dir, revision)
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"no config.json in {folder}")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            hf_config = json.load(f)
    except ValueError as e:  # not UTF-8, or not JSON
        raise ValueError(f"{cfg_path} is not a readable JSON file ({e})") from e
    try:
        config = config_from_hf(hf_config, preproj=preproj, skip=skip, lora_rank=lora_rank, lora_alpha=lora_alpha)
    except ValueError as e:
        raise ValueError(f"{cfg_path}: {e}") from e
    model = GPT(config)
    state = map_state_dict(read_hf_weights(folder), model.base_state_dict())
    model.load_state_dict(state, strict=False)  # strict on the base by map_state_dict; new params keep their init
    return model.to(device=device, dtype=dtype).eval()


def load_tokenizer(name_or_path: str) -> Tokenizer:
    """Pythia's tokenizer (tokenizers library): a tokenizer.json file, a folder holding one, or a Hub name."""
    if os.path.isfile(name_or_path):
        return read_tokenizer(name_or_path)
    if os.path.isdir(name_or_path):
        path = os.path.join(name_or_path, "tokenizer.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"no tokenizer.json in {name_or_path}; pass the tokenizer file explicitly")
        return read_tokenizer(path)
    return read_tokenizer(os.path.join(hf_folder(name_or_path), "tokenizer.json"))


def read_tokenizer(path: str) -> Tokenizer:
    """A tokenizer.json file; a missing or unreadable one is an error naming the file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist; a model folder needs its tokenizer.json")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises a bare Exception for a damaged file
        raise ValueError(f"{path} is not a readable tokenizer.json ({e}); replace it") from e


def main() -> None:
    p = ArgumentParser(description="Load a Pythia checkpoint, print its size and a greedy continuation.")
    p.add_argument("name_or_dir", help="pythia-160m, EleutherAI/pythia-410m[@revision], or a Hugging Face folder")
    p.add_argument("--prompt", type=utf8, default="The meaning of life is")
    p.add_argument("--max_new_tokens", type=positive_int, default=32)
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the one beside the weights)")
    p.add_argument("--preproj", action="store_true")
    p.add_argument("--skip", action="store_true")
    args = p.parse_args()
    try:
        model = load_pythia(args.name_or_dir, preproj=args.preproj, skip=args.skip)
        tok = load_tokenizer(args.tokenizer or hf_folder(args.name_or_dir))
        idx = torch.tensor([tok.encode(args.prompt).ids])
        out = model.generate(idx, args.max_new_tokens, temperature=0)
    except (ValueError, FileNotFoundError, OSError) as e:
        raise SystemExit(f"error: {e}")
    print(f"parameters: {model.num_params('base'):,} base + {model.num_params('new'):,} new")
    print(tok.decode(out[0].tolist()))


if __name__ == "__main__":
    main()
