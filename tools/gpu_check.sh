#!/usr/bin/env bash
# The first thing to run on a machine with a GPU (docs/reproduce.md), before any real run: about four minutes on an
# H200 without network (downloads add theirs), one report. Each step says what it checks, how long it took, and
# goes on if one fails.
#
#   bash tools/gpu_check.sh [OUT]        # default OUT: out/gpu-check; the report is OUT/report.txt
#
# With network it checks the real pythia-160m and pythia-410m; without, it writes random weights in their shapes
# (with Pythia's tokenizer from the data mirror, $PREPROJ_MIRROR) and checks those.
set -u
OUT=${1:-out/gpu-check}
mkdir -p "$OUT"
exec > >(tee "$OUT/report.txt") 2>&1
if ! python -c "import torch" >/dev/null 2>&1; then  # every step runs python: say so once, not at each step
  echo "error: 'python' cannot import torch; activate the environment that has it, or put its python first on PATH"
  exit 2
fi
status=0
step() {  # a named check, its time, and on failure its exit status; the script goes on either way
  echo; echo "=== $1"; shift; local t0=$SECONDS
  "$@" || { echo "FAILED ($?): $*"; status=1; }
  echo "($((SECONDS - t0)) s)"
}

random_pythia() {  # a Hugging Face folder of random weights in a Pythia shape: NAME LAYERS HEADS WIDTH
  [ -d "$OUT/$1" ] || python - "$OUT/$1" "$2" "$3" "$4" <<'EOF'
import sys
from load_pythia import load_tokenizer, save_hf_folder
from data.sources import fetch
from model import GPT, GPTConfig
folder, layers, heads, width = sys.argv[1], *map(int, sys.argv[2:])
save_hf_folder(GPT(GPTConfig(n_layer=layers, n_head=heads, n_embd=width)),
               load_tokenizer(str(fetch("tokenizers/20B_tokenizer.json"))), folder)
EOF
}

step "the machine" bash -c "nvidia-smi; python -c 'import torch; print(torch.__version__, torch.version.cuda, \
torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else None)'"
step "tests marked for CUDA, and the GPU path's logic" python -m pytest -q -rs tests/test_gpu_path.py tests/test_precision.py
if timeout 60 python -c "from huggingface_hub import HfApi; HfApi().model_info('EleutherAI/pythia-160m')" \
    >/dev/null 2>&1; then
  M160=pythia-160m; M410=pythia-410m; DATA=""
else
  echo "no network: random weights in Pythia's shapes, the corpus as probe text"
  random_pythia random-160m 12 12 768; random_pythia random-410m 24 16 1024
  M160=$OUT/random-160m; M410=$OUT/random-410m; DATA="--data corpus"
fi
for M in "$M160" "$M410"; do
  step "dry run of the paper's probe on $M" python train.py --init_from "$M" --paper --preproj --skip --device cuda \
    $DATA --eval_tasks lambada --out_dir "$OUT/dry-$(basename "$M")" --dry_run
done
step "100 steps of the paper's probe (16 x 512) on $M160" python train.py --init_from "$M160" --paper --preproj --skip \
  --device cuda $DATA --max_iters 100 --warmup_iters 10 --eval_tasks none --out_dir "$OUT/probe-160m-$(date +%s)"
step "the student's main job on the GPU (pre-trains the embedded base first if out/nano-base lacks it)" \
  python train.py --preproj --skip --device cuda --out_dir "$OUT/nano-preproj-skip-$(date +%s)"
step "ours against transformers on the GPU (section 6 reads the embedded base)" \
  python -m tools.bench --device cuda --shapes pythia-160m --sections 1,2,6 --reps 3
echo; echo "=== done: $( [ $status = 0 ] && echo 'every step passed' || echo 'some steps FAILED (above)' ); report: $OUT/report.txt"
exit $status
