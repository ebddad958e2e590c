"""
Write a model as a Hugging Face GPT-NeoX folder, which transformers, lm-eval's `--model hf` and every other tool load.

    python -m tools.export --init_from out/run --out out/run-hf       # any model without pre-projection or skip
    python -m tools.export --init_from nano --out out/nano-hf        # the embedded base, with its own tokenizer

The model is loaded as every script loads it (lab.checkpoint.load_model: nano, a run folder, a probe, a Pythia name,
a Hugging Face folder); a LoRA update is merged into its weights. The folder is written by load_pythia.save_hf_folder,
the one place that knows Hugging Face's names: whole or not at all, and only into a new or empty folder.
"""

import argparse

from data.sources import DataError
from lab.checkpoint import CheckpointError, load_model
from lab.cli import ArgumentParser, out_folder
from load_pythia import free_folder, save_hf_folder


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(prog="python -m tools.export", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--init_from", required=True,
                   help="the model: anything the other scripts' --init_from accepts (nano, a run folder, ...)")
    p.add_argument("--out", type=out_folder, required=True, help="the folder to write; it must be new or empty")
    p.add_argument("--mirror", default=None,
                   help="offline data mirror folder (default: $PREPROJ_MIRROR), for the tokenizer of a Hugging Face "
                        "folder that has none")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = get_args(argv)
    try:
        free_folder(args.out)  # before loading a model that may be large
        model, tokenizer, _ = load_model(args.init_from, mirror=args.mirror)
        save_hf_folder(model, tokenizer, args.out)
    except (CheckpointError, DataError, ValueError, OSError) as e:
        raise SystemExit(f"error: {e}")
    lora = " (LoRA merged into the weights)" if model.config.lora_rank else ""
    print(f"wrote {args.out}: {model.num_params('base'):,} parameters{lora}")


if __name__ == "__main__":
    main()
