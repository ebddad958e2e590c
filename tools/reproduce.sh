#!/usr/bin/env bash
# The paper's Table 2 for one model (docs/reproduce.md): the baseline, the four trained rows in the paper's
# precision and pre-proj + skip in ours, each evaluated under the paper's protocol and lm-eval's, a paired
# comparison and the layer figure. The test suite runs this very script in miniature on a tiny random
# Pythia-shaped folder on the CPU, so that the documented commands cannot rot.
#
#   bash tools/reproduce.sh pythia-160m 480       # MODEL and the LoRA rank of its row (410M: pythia-410m 640)
#
# Environment: OUT (default out), DEVICE (default cuda), TRAIN_EXTRA and EVAL_EXTRA (flags added to every
# training / evaluation; empty for the real run), PREPROJ_MIRROR (the data mirror, if any).
set -euo pipefail
M=${1:?usage: bash tools/reproduce.sh MODEL LORA_RANK}
R=${2:?usage: bash tools/reproduce.sh MODEL LORA_RANK}
OUT=${OUT:-out}
NAME=$(basename "$M")
G="--device ${DEVICE:-cuda}"
T="$G --eval_tasks none ${TRAIN_EXTRA:-}"  # training skips the end-of-run benchmarks: Table 2 is eval_lambada.py's
E="$G ${EVAL_EXTRA:-}"
RUNS=("$OUT/$NAME-preproj" "$OUT/$NAME-lora$R" "$OUT/$NAME-preproj-lora64" "$OUT/$NAME-preproj-skip"
      "$OUT/$NAME-preproj-skip-fp32")

# Baseline: the untouched model, under the paper's protocol (bf16, as the author) and lm-eval's (fp32)
python eval_lambada.py --init_from "$M" $E --protocol paper --dtype bfloat16 --out "$OUT/$NAME-base/eval-paper.json"
python eval_lambada.py --init_from "$M" $E --dtype float32 --out "$OUT/$NAME-base/eval-lmeval.json"
# The four trained rows in the paper's precision, and pre-proj + skip in ours (fp32 master weights)
python train.py --init_from "$M" --paper $T --preproj --out_dir "${RUNS[0]}"
python train.py --init_from "$M" --paper $T --lora_rank "$R" --out_dir "${RUNS[1]}"
python train.py --init_from "$M" --paper $T --preproj --lora_rank 64 --out_dir "${RUNS[2]}"
python train.py --init_from "$M" --paper $T --preproj --skip --out_dir "${RUNS[3]}"
python train.py --init_from "$M" --paper $T --no-pure_bf16 --preproj --skip --out_dir "${RUNS[4]}"
# Every trained run, named (no other folder of $OUT is taken for one), under both protocols
for run in "${RUNS[@]}"; do
  python eval_lambada.py --init_from "$run" $E --protocol paper --dtype bfloat16 --out "$run/eval-paper.json"
  python eval_lambada.py --init_from "$run" $E --dtype float32 --out "$run/eval-lmeval.json"
done
python -m tools.compare "$OUT/$NAME-base/eval-paper.json" "${RUNS[3]}/eval-paper.json" \
  --out "$OUT/$NAME-compare.json"                                          # pre-proj + skip against the baseline
python analyze_layers.py --ckpt "${RUNS[3]}" --paper $G --out "$OUT/$NAME-layers"   # Figure 2
