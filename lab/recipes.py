"""
Recipes: named sets of train.py settings, each written once, here, as a dict of flag names and values.

    NANO_BASE    the embedded base: a small GPT-NeoX that train.py pre-trains on the public-domain corpus the first
                 time a run needs it (--init_from nano); its shape is train.py's default shape for --init_from scratch
    STUDY_BASE   the 12-layer base of the study (study/): the embedded base's data and schedule at twice the depth and
                 two thirds of the width, head size 64 as Pythia's, so that a step costs no more (docs/screen.md)
    PAPER_PROBE  the paper's probe (PAPER.md): lr 1e-5, 500 steps, effective batch 16 of 512 tokens, 50 warm-up
                 steps, seed 42, WikiText-103 lines, bf16 weights with no fp32 master copy (train.py --paper)

`flags(recipe)` writes a recipe as the command line that runs it, so what a script prints is what it runs.
"""

NANO_SHAPE = dict(n_layer=6, n_head=3, n_embd=192, block_size=256)
PRETRAINING = dict(init_from="scratch", max_iters=600, batch_size=16, lr=2e-3, min_lr=2e-4, warmup_iters=30,
                   weight_decay=0.1, beta2=0.95)

NANO_BASE = {**PRETRAINING, **NANO_SHAPE}
STUDY_BASE = {**PRETRAINING, **NANO_SHAPE, "n_layer": 12, "n_head": 2, "n_embd": 128, "eval_tasks": "none", "seed": 42}
PAPER_PROBE = dict(lr=1e-5, min_lr=0.0, max_iters=500, batch_size=16, grad_accum=1, seq_len=512, warmup_iters=50,
                   seed=42, weight_decay=0.0, beta2=0.999, data="wikitext103", pure_bf16=True)


def flags(recipe: dict) -> list[str]:
    """A recipe as train.py's command line: ["--n_layer", "6", ...]; a True switch is its bare flag."""
    argv = []
    for name, value in recipe.items():
        if value is False:  # an off switch has no flag of its own: it is left out
            raise ValueError(f"recipe setting {name}=False: leave switches that are off out of a recipe")
        argv += [f"--{name}"] if value is True else [f"--{name}", str(value)]
    return argv
