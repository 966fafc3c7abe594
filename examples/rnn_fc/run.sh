#!/usr/bin/env bash
# Fast CPU decoding (Devlin 2017) on Multi30k en->de: rnn_fc models, the decoder switches, candidate lists.
#
#   train     : rnn_fc_multi30k variants (SYSTEMS), fairseq-train on the baseline's prepared data:
#                 fc4-tanh  the preset: AttGRU, 4 FC-ReLU layers (skip every second), FC-tanh top
#                 fc0-tanh  no FC-ReLU layers (AttGRU, FC-tanh, softmax)
#                 fc4-gru   a GRU top layer instead of FC-tanh
#                 fc8-tanh  8 FC-ReLU layers
#   align     : fairseq-plugins align --lexical-table of the training pieces (systran-align)
#   shortlist : fairseq-plugins shortlist: top 20 translations per source piece + the most frequent pieces
#   evaluate  : BLEU of every Table 1 row (fairseq-generate --task rnn_fc_translation, whole test set)
#   bench     : fairseq-plugins bench, beam 6, one thread, one sentence at a time (the paper's setting)
#   summary   : examples/rnn_fc/summarize.py -> RESULTS/rnn_fc_*.json
#
# Usage: examples/rnn_fc/run.sh [BASELINE_WORK] [WORK]
#   BASELINE_WORK is the work dir of examples/baseline/run.sh (prepared data/ and checkpoints/).
#   env: STAGES, SYSTEMS, EPOCHS (12; per system EPOCHS_fc0_tanh ...: the variants default to VARIANT_EPOCHS, 3),
#        THREADS (training threads, 1), WARMUP (400), BENCH_LIMIT (200), BENCH_RUNS (2), RESULTS (docs/results)
set -euo pipefail
BASE=${1:-work/baseline}
WORK=${2:-work/rnn_fc}
STAGES=${STAGES:-train align shortlist evaluate bench summary}
SYSTEMS=${SYSTEMS:-fc4-tanh fc0-tanh fc4-gru fc8-tanh}
EPOCHS=${EPOCHS:-12}
VARIANT_EPOCHS=${VARIANT_EPOCHS:-3}
: "${EPOCHS_fc0_tanh:=$VARIANT_EPOCHS}" "${EPOCHS_fc4_gru:=$VARIANT_EPOCHS}" "${EPOCHS_fc8_tanh:=$VARIANT_EPOCHS}"
WARMUP=${WARMUP:-400}
RESULTS=${RESULTS:-docs/results}
USER_DIR=$(fairseq-plugins user-dir)
DATA=$BASE/data
COMMANDS=$WORK/commands.txt
mkdir -p "$WORK"
[[ -f $DATA/prepare.json ]] || { echo "no prepared data in $DATA: run examples/baseline/run.sh first" >&2; exit 2; }

# shellcheck source=examples/common.sh
source "$(dirname "$0")/../common.sh"  # record (run + keep as provenance), stage

epochs() { local var="EPOCHS_${1//-/_}"; echo "${!var:-$EPOCHS}"; }
fc_layers() { local name=${1#fc}; echo "${name%-*}"; }    # fc4-tanh -> 4
top_layer() { echo "${1#*-}"; }                          # fc4-tanh -> tanh
checkpoint() { echo "$WORK/$1/checkpoints/checkpoint_best.pt"; }

if stage train; then
  for system in $SYSTEMS; do
    OMP_NUM_THREADS=${THREADS:-1} record fairseq-train "$DATA/bin" --user-dir "$USER_DIR" --task translation \
      --source-lang en --target-lang de --arch rnn_fc_multi30k --rnn-fc-fc-layers "$(fc_layers "$system")" \
      --rnn-fc-top "$(top_layer "$system")" --optimizer adam --adam-betas '(0.9, 0.98)' --clip-norm 1.0 \
      --lr 1e-3 --lr-scheduler inverse_sqrt --warmup-updates "$WARMUP" --criterion label_smoothed_cross_entropy \
      --label-smoothing 0.1 --max-tokens 4096 --max-epoch "$(epochs "$system")" --seed 1 \
      --save-dir "$WORK/$system/checkpoints" --log-format simple --log-interval 50
  done
fi
