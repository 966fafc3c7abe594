#!/usr/bin/env bash
# Double-token bidirectional decoding (Imamura & Sumita 2020) on Multi30k en->de: the paper's Table 2,
# Fig. 3 and Table 3 on our data.
#
#   train    : the five systems, same architecture (double_token_transformer_multi30k: the baseline's sizes,
#              learned decoder positions) and same budget (EPOCHS epochs, same seed and schedule), on the
#              baseline's prepared data. A system is ORDER-TOKENS_PER_STEP:
#                l2r-1 (single-token L2R, stock), r2l-1, l2r-2, r2l-2, bidir-2 (the paper's method)
#   evaluate : fairseq-generate --beam BEAM on the whole test set, detokenised, sacreBLEU (Table 2's BLEU)
#   bench    : fairseq-plugins bench per system against l2r-1 decoded in the same run (--baseline-path):
#              tokens/s and its ratio (Table 2's speed), one thread, one sentence at a time, beam BEAM
#   beams    : the same for bidir-2 at each of BEAMS (Fig. 3: speed ratio against beam width)
#   ngram    : fairseq-plugins ngram-precision of l2r-1, r2l-1 and bidir-2 (Table 3)
#
# Usage: examples/double_token/run.sh [BASELINE_WORK] [WORK]
#   BASELINE_WORK is the work dir of examples/baseline/run.sh (only its prepared data/ is used).
#   env: STAGES ("train evaluate bench beams ngram"), SYSTEMS (all five), EPOCHS (4), WARMUP (250),
#        THREADS (training threads per system, 2), BEAM (10), BEAMS ("1 2 5 10 20"),
#        BENCH_LIMIT (300 sentences), BEAMS_LIMIT (150), BENCH_RUNS (2), RESULTS (docs/results)
set -euo pipefail
BASE=${1:-work/baseline}
WORK=${2:-work/double_token}
STAGES=${STAGES:-train evaluate bench beams ngram}
SYSTEMS=${SYSTEMS:-l2r-1 r2l-1 l2r-2 r2l-2 bidir-2}
EPOCHS=${EPOCHS:-4}
WARMUP=${WARMUP:-250}
BEAM=${BEAM:-10}
RESULTS=${RESULTS:-docs/results}
USER_DIR=$(fairseq-plugins user-dir)
DATA=$BASE/data
COMMANDS=$WORK/commands.txt
mkdir -p "$WORK"
[[ -f $DATA/prepare.json ]] || { echo "no prepared data in $DATA: run examples/baseline/run.sh first" >&2; exit 2; }

# shellcheck source=examples/common.sh
source "$(dirname "$0")/../common.sh"  # record (run + keep as provenance), stage

system_flags() {  # the task flags of system ORDER-N
  local order=${1%-*} per_step=${1#*-}
  case $order-$per_step in
    l2r-1|r2l-1|l2r-2|r2l-2|bidir-2) echo "--task double_token_translation --token-order $order --tokens-per-step $per_step" ;;
    *) echo "unknown system $1 (l2r-1 r2l-1 l2r-2 r2l-2 bidir-2)" >&2; exit 2 ;;
  esac
}
checkpoint() { echo "$WORK/$1/checkpoints/checkpoint_best.pt"; }

if stage train; then
  for system in $SYSTEMS; do
    # shellcheck disable=SC2046  # word splitting of the system's flags is intended
    OMP_NUM_THREADS=${THREADS:-2} record fairseq-train "$DATA/bin" --user-dir "$USER_DIR" $(system_flags "$system") \
      --source-lang en --target-lang de --arch double_token_transformer_multi30k \
      --optimizer adam --adam-betas '(0.9, 0.98)' --clip-norm 0.0 \
      --lr 1e-3 --lr-scheduler inverse_sqrt --warmup-updates "$WARMUP" \
      --criterion label_smoothed_cross_entropy --label-smoothing 0.1 \
      --max-tokens 4096 --max-epoch "$EPOCHS" --seed 1 \
      --save-dir "$WORK/$system/checkpoints" --no-epoch-checkpoints \
      --log-format simple --log-interval 50
  done
fi
