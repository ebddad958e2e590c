"""
Sample text from any model: the embedded base, one of our run folders (a probe re-attaches to its base), a Pythia
name or a Hugging Face folder. Generation uses the K/V cache.

    python sample.py                                                     # the embedded base, unconditional
    python sample.py --init_from out/nano-preproj-skip --prompt "Mr. Speaker, " --num_samples 3
    python sample.py --init_from pythia-160m --prompt "The capital of France is" --temperature 0
"""

import argparse

import torch

from data.sources import DataError
from lab.checkpoint import CheckpointError, load_model
from lab.cli import ArgumentParser, add_model_args, nonneg_float, nonneg_int, positive_int, switches_of, utf8
from lab.evaluation import encode, eot_id
from lab.precision import for_inference, prefer_flash_attention, resolve_dtype


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--prompt", type=utf8, default="", help="text to continue ('' = start a new document)")
    p.add_argument("--max_new_tokens", type=positive_int, default=100)
    p.add_argument("--temperature", type=nonneg_float, default=0.8, help="0 = greedy")
    p.add_argument("--top_k", type=nonneg_int, default=200, help="sample among the k likeliest tokens (0 = all)")
    p.add_argument("--num_samples", type=positive_int, default=1)
    return p.parse_args(argv)


def sample(args: argparse.Namespace) -> list[str]:
    """num_samples continuations of the prompt, generated as one batch; reproducible from --seed."""
    model, tokenizer, _ = load_model(args.init_from, **switches_of(args), mirror=args.mirror)
    ctx = for_inference(model, args.device, resolve_dtype(args.dtype, args.device))
    ids = encode(tokenizer, args.prompt) or [eot_id(tokenizer)]  # an empty prompt starts after <|endoftext|>
    idx = torch.tensor([ids] * args.num_samples, device=args.device)
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    with ctx:
        out = model.generate(idx, args.max_new_tokens, args.temperature, args.top_k or None, generator=generator)
    return [tokenizer.decode(row.tolist()) for row in out]


def main(argv: list[str] | None = None) -> list[str]:
    prefer_flash_attention()
    args = get_args(argv)
    try:
        texts = sample(args)
    except (CheckpointError, DataError, ValueError) as e:  # ValueError: prompt + new tokens beyond the context
        raise SystemExit(f"error: {e}")
    for i, text in enumerate(texts):
        print(f"--- sample {i + 1} of {len(texts)} ({args.init_from}) ---\n{text}\n")
    return texts


if __name__ == "__main__":
    main()
