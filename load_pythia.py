"""
Hugging Face GPT-NeoX checkpoints (Pythia) <-> our GPT, and Pythia's tokenizer. The only file that knows HF names.

    model = load_pythia("pythia-160m", preproj=True)      # a Hub name or a local Hugging Face folder
    save_hf_folder(model, tokenizer, "out/run-hf")        # back to a GPT-NeoX folder (any model whose blocks
                                                          # GPT-NeoX holds; tools/export.py writes the others)

A loader, imported by the library (lab.checkpoint) and by nothing below it: it imports only model and data. The
commands that use it are `python sample.py --init_from pythia-160m --prompt "..."` (generation from any Hub name or
folder) and `python -m tools.export --init_from out/run --out out/run-hf` (the export).
"""

import json
import os
import re
import shutil
from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch.overrides import TorchFunctionMode

from data.sources import write_atomic, write_error
from model import GPT, GPTConfig, LoRALinear

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
OUR_LAYER_KEY = re.compile(r"blocks\.(\d+)\.(.+)\.(weight|bias)$")
EOT = "<|endoftext|>"


def hf_to_ours(name: str) -> str | None:
    """Our parameter name for a Hugging Face one, or None if it does not map."""
    if name in TOP_MAP:
        return TOP_MAP[name]
    m = LAYER_KEY.match(name)
    if m and m.group(2) in LAYER_MAP:
        return f"blocks.{m.group(1)}.{LAYER_MAP[m.group(2)]}.{m.group(3)}"
    return None


def ours_to_hf(name: str) -> str:
    """The Hugging Face name of one of our base parameters: hf_to_ours read backwards, from the same tables."""
    top = {ours: hf for hf, ours in TOP_MAP.items()}
    layer = {ours: hf for hf, ours in LAYER_MAP.items()}
    if name in top:
        return top[name]
    m = OUR_LAYER_KEY.match(name)
    if m and m.group(2) in layer:
        return f"gpt_neox.layers.{m.group(1)}.{layer[m.group(2)]}.{m.group(3)}"
    raise ValueError(f"{name} has no Hugging Face GPT-NeoX name")


def config_from_hf(hf: dict, **switches) -> GPTConfig:
    """Our config from a Hugging Face GPT-NeoX config.json (old `rotary_pct` or new `rope_parameters` style)."""
    if hf.get("model_type") != "gpt_neox":
        raise ValueError(f"config.json has model_type={hf.get('model_type')!r}, expected 'gpt_neox' (a Pythia model)")
    missing = [k for k in ("vocab_size", "num_hidden_layers", "num_attention_heads", "hidden_size") if k not in hf]
    if missing:
        raise ValueError(f"config.json lacks {', '.join(missing)}; it is not a complete GPT-NeoX config")
    sizes = ("vocab_size", "num_hidden_layers", "num_attention_heads", "hidden_size", "max_position_embeddings",
             "intermediate_size")
    bad = [k for k in sizes if k in hf and (type(hf[k]) is not int or hf[k] < 1)]
    if bad:
        raise ValueError(f"config.json: {bad[0]} must be a positive integer, not {hf[bad[0]]!r}")
    if hf["hidden_size"] % hf["num_attention_heads"]:
        raise ValueError(f"config.json: hidden_size {hf['hidden_size']} is not divisible by num_attention_heads "
                         f"{hf['num_attention_heads']}")
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


def hf_config(c: GPTConfig, eot: int | None) -> dict:
    """config.json of a GPT-NeoX folder: config_from_hf read backwards, in the keys of Pythia's own files
    (rotary_pct, rotary_emb_base), which every transformers version reads."""
    return {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "vocab_size": c.vocab_size,
            "max_position_embeddings": c.block_size, "num_hidden_layers": c.n_layer,
            "num_attention_heads": c.n_head, "hidden_size": c.n_embd, "intermediate_size": c.intermediate_size,
            "rotary_pct": c.rotary_pct, "rotary_emb_base": c.rotary_base, "use_parallel_residual": c.parallel_residual,
            "layer_norm_eps": c.layer_norm_eps, "attention_bias": True, "hidden_act": "gelu",
            "tie_word_embeddings": False, "bos_token_id": eot, "eos_token_id": eot, "use_cache": True}


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
    patterns = ["config.json", "tokenizer.json", "*.safetensors", "*.safetensors.index.json"]
    path = hub_download(repo_id, revision, patterns)
    if not any(f.endswith(".safetensors") for f in os.listdir(path)):  # old revisions ship only .bin files
        path = hub_download(repo_id, revision, ["*.bin", "*.bin.index.json"])
    return path


def hub_download(repo_id: str, revision: str | None, patterns: list[str]) -> str:
    """The files of a Hub model that match patterns, from the local cache or downloaded; its folder. The Hub's
    errors run over several lines: each becomes one OSError line that says what to do."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=patterns)
    except LocalEntryNotFoundError as e:
        raise OSError(f"{repo_id} cannot be downloaded (no network, or HF_HUB_OFFLINE is set) and is not in the "
                      f"Hugging Face cache; download it where there is network (`hf download {repo_id}`) or pass "
                      f"a local folder") from e
    except GatedRepoError as e:
        raise OSError(f"{repo_id} is gated on the Hugging Face Hub; accept its terms on its page and log in "
                      f"(`hf auth login`)") from e
    except RepositoryNotFoundError as e:
        raise OSError(f"the Hugging Face Hub has no model {repo_id!r} (or it is private); check the name, e.g. "
                      f"pythia-160m") from e
    except RevisionNotFoundError as e:
        raise OSError(f"{repo_id} has no revision {revision!r} on the Hugging Face Hub; Pythia's checkpoints are "
                      f"named like step143000") from e
    except HfHubHTTPError as e:
        raise OSError(f"the Hugging Face Hub refused {repo_id}: {str(e).splitlines()[0]}") from e


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


def load_pythia(name_or_dir: str, *, revision: str | None = None, dtype: torch.dtype = torch.float32,
                device: str = "cpu", **switches) -> GPT:
    """A Pythia / GPT-NeoX model from a Hub name or a local Hugging Face folder, with the research switches.

    The base weights are copied exactly; the switches (model.SWITCHES, e.g. preproj=True) add new parameters with
    the paper's initialisation.
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
        config = config_from_hf(hf_config, **switches)
    except ValueError as e:
        raise ValueError(f"{cfg_path}: {e}") from e
    model = skeleton(config)  # nothing drawn for the base, whose weights the checkpoint gives
    state = map_state_dict(read_hf_weights(folder), model.base_state_dict())
    model.load_state_dict(state, strict=False, assign=True)  # strict on the base by map_state_dict
    materialise_new_params(model)
    return model.to(device=device, dtype=dtype).eval()


def skeleton(config: GPTConfig) -> GPT:
    """A GPT on the meta device: every parameter's shape and dtype, no storage, so no draw fills anything. Its
    normal draws are skipped, not run: the first on a meta tensor imports torch._dynamo, seconds of a process that
    never trains (docs/performance.md, "The test suite")."""
    with torch.device("meta"), _NoDraws():
        return GPT(config)


class _NoDraws(TorchFunctionMode):
    """nn.init.normal_ returns its tensor untouched: of the draws model.py makes, the one whose meta-device kernel
    is Python (the uniform draws and the fills have kernels of their own)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.init.normal_:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def materialise_new_params(model: GPT) -> None:
    """The switches' parameters, still on the meta device after the base was assigned, made real and drawn with
    the paper's initialisation (GPT.init_new_params)."""
    for name, p in list(model.named_parameters()):
        if p.is_meta:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype),
                                                                        requires_grad=p.requires_grad))
    model.init_new_params()


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


# --- export: our GPT -> a Hugging Face GPT-NeoX folder ---

def hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """Our base weights under Hugging Face's names, each LoRA update merged into its weight: W + (alpha / r) B A.

    ValueError for what a GPT-NeoX cannot hold: pre-projection, the skip and the adapter change the block itself.
    """
    c = model.config
    if c.preproj or c.skip or c.adapter_dim:
        raise ValueError("pre-projection and the content skip (and the capacity adapter) change the block, so no "
                         "GPT-NeoX folder can hold this model; python -m tools.export writes it with its own "
                         "modelling code (docs/harness.md)")
    if not c.bias:  # GPT-NeoX's MLP always has biases
        raise ValueError("a model without biases has no GPT-NeoX form")
    merged = {f"{name}.weight": m.merged_weight() for name, m in model.named_modules()
              if isinstance(m, LoRALinear) and m.rank}
    return {ours_to_hf(k): merged.get(k, v).detach().cpu().contiguous() for k, v in model.base_state_dict().items()}


def free_folder(folder: str) -> Path:
    """The export target, which must not exist yet or be empty: an export never mixes with older files."""
    path = Path(folder)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ValueError(f"{folder} already exists and is not empty; choose a new folder")
    return path


def save_hf_folder(model: GPT, tokenizer: Tokenizer, folder: str) -> None:
    """A folder that transformers' AutoModelForCausalLM and AutoTokenizer load (and lm-eval's `--model hf`):
    config.json, model.safetensors, tokenizer.json, tokenizer_config.json, special_tokens_map.json."""
    from safetensors.torch import save_file

    target = free_folder(folder)
    state = hf_state_dict(model)
    dtype = str(model.wte.weight.dtype).removeprefix("torch.")
    config = {**hf_config(model.config, tokenizer.token_to_id(EOT)), "dtype": dtype}
    write_folder(target, {"config.json": json.dumps(config, indent=2),
                          "model.safetensors": lambda path: save_file(state, str(path), metadata={"format": "pt"}),
                          **tokenizer_files(tokenizer, model.config.block_size)})


def tokenizer_files(tokenizer: Tokenizer, block_size: int) -> dict[str, str]:
    """The tokenizer files of a Hugging Face folder, which AutoTokenizer reads as the generic fast tokenizer (Pythia's
    own folders name GPTNeoXTokenizer)."""
    special = {"bos_token": EOT, "eos_token": EOT, "unk_token": EOT} if tokenizer.token_to_id(EOT) is not None else {}
    return {"tokenizer.json": tokenizer.to_str(),
            "tokenizer_config.json": json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **special,
                                                 "model_max_length": block_size}, indent=2),
            "special_tokens_map.json": json.dumps(special, indent=2)}


def write_folder(target: Path, files: dict) -> None:
    """Files (text, or a function that writes to a path) into a new folder, whole or not at all: written into a
    hidden folder beside the target, then renamed to it, so a failure leaves nothing behind."""
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # the remains of an export that was killed
    try:
        tmp.mkdir(parents=True)
    except OSError as e:  # a read-only file system, say
        raise write_error(target, e) from e
    try:
        for name, content in files.items():
            write_atomic(tmp / name, content)
        os.replace(tmp, target)  # a rename: the folder appears whole (an empty target is replaced)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

