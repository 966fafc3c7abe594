#!/usr/bin/env bash
# The five fixes of docs/rnn_fc.md ("Why the first models did not learn"), one at a time. fc4-tanh is trained
# on the references (as the first models were) for EPOCHS epochs per step; each step adds one fix to the step
# before, from the first models' settings to today's defaults:
#
#   first     the first models: the paper's FC layout, nn.Linear's initialisation, 400 warm-up updates, dropout
#             0.3 on every FC input, gradients clipped at 1.0
#   +init     He / Xavier initialisation with zero biases (--rnn-fc-fc-init he)
#   +layout   pre-norm residual FC blocks (LAYOUT=residual)
#   +warmup   150 warm-up updates (about one epoch)
#   +dropout  dropout 0.1 inside the FC stack (--rnn-fc-fc-dropout 0.1)
#   +noclip   no gradient clipping (CLIP_NORM=0): today's defaults
#   lstm      fairseq's own --arch lstm of a similar size (3+3 layers, 256-d, bidirectional encoder: 8.69M
#             parameters against fc4-tanh's 7.97M), the same data, optimiser and schedule, trained for the
#             training wall time the +noclip step took
#
# Each step resumes from its checkpoint_last.pt when re-run. The validation curves (loss, nll and training wall
# time per epoch) go to RESULTS/rnn_fc_ablation.{json,md} (examples/results/training_curves.py).
#
# Usage: examples/rnn_fc/ablation.sh [BASELINE_WORK] [WORK]
#   env: STEPS ("first +init +layout +warmup +dropout +noclip lstm"), EPOCHS (3), THREADS (1),
#        RESULTS (WORK/results; RESULTS=docs/results writes the repository's figures), TRAIN_FLAGS (extra
#        fairseq-train flags for every step)
set -euo pipefail
# shellcheck source=examples/tools.sh
source "$(dirname "$0")/../tools.sh"  # the venv's commands on PATH (make install)
BASE=${1:-work/baseline}
WORK=${2:-work/rnn_fc_ablation}
STEPS=${STEPS:-first +init +layout +warmup +dropout +noclip lstm}
EPOCHS=${EPOCHS:-3}
RESULTS=${RESULTS:-$WORK/results}
RECIPE=$(dirname "$0")/run.sh
ALL_STEPS=(first +init +layout +warmup +dropout +noclip lstm)
for step in $STEPS; do
  [[ " ${ALL_STEPS[*]} " == *" $step "* ]] || { echo "STEPS: unknown step '$step' (${ALL_STEPS[*]})" >&2; exit 2; }
done
# shellcheck source=examples/common.sh
source "$(dirname "$0")/../common.sh"  # SRC, TGT, use_baseline_data, record
use_baseline_data "$BASE" "$WORK"
mkdir -p "$RESULTS"

# The settings of each step, cumulative, as examples/rnn_fc/run.sh's LAYOUT, WARMUP and CLIP_NORM and two flags.
settings() {
  init=he layout=residual warmup=150 fc_dropout=0.1 clip=0
  case $1 in
    first) init=torch layout=paper warmup=400 fc_dropout=0.3 clip=1.0 ;;
    +init) layout=paper warmup=400 fc_dropout=0.3 clip=1.0 ;;
    +layout) warmup=400 fc_dropout=0.3 clip=1.0 ;;
    +warmup) fc_dropout=0.3 clip=1.0 ;;
    +dropout) clip=1.0 ;;
  esac
}
step_dir() { echo "$WORK/${1#+}"; }

for step in $STEPS; do
  [[ $step == lstm ]] && continue
  settings "$step"
  echo "== $step: layout $layout, init $init, warm-up $warmup, FC dropout $fc_dropout, clip $clip"
  LAYOUT=$layout WARMUP=$warmup CLIP_NORM=$clip \
    TRAIN_FLAGS="--rnn-fc-fc-init $init --rnn-fc-fc-dropout $fc_dropout ${TRAIN_FLAGS:-}" \
    TRAIN_ON=raw SYSTEMS=fc4-tanh EPOCHS=$EPOCHS STAGES=train THREADS=${THREADS:-1} \
    "$RECIPE" "$BASE" "$(step_dir "$step")"
done

if [[ " $STEPS " == *" lstm "* ]]; then
  noclip_log=$(step_dir +noclip)/fc4-tanh/train.log
  [[ -f $noclip_log ]] || {
    echo "the lstm step trains for +noclip's wall time: run +noclip first ($noclip_log)" >&2
    exit 2
  }
  seconds=$(python "$(dirname "$0")/../results/training_curves.py" --logs "noclip=$noclip_log" --json - |
    python -c 'import json, sys; print(json.load(sys.stdin)["runs"]["noclip"]["curve"][-1]["wall_seconds"])')
  mkdir -p "$WORK/lstm"
  echo "== lstm: $seconds s of training, as +noclip"
  OMP_NUM_THREADS=${THREADS:-1} record fairseq-train "$DATA/bin" --task translation --source-lang "$SRC" \
    --target-lang "$TGT" --arch lstm --encoder-embed-dim 256 --encoder-hidden-size 256 --encoder-layers 3 \
    --encoder-bidirectional --decoder-embed-dim 256 --decoder-hidden-size 256 --decoder-layers 3 \
    --decoder-out-embed-dim 256 --share-all-embeddings --dropout 0.3 --optimizer adam --adam-betas '(0.9, 0.98)' \
    --clip-norm 0 --lr 1e-3 --lr-scheduler inverse_sqrt --warmup-updates 150 \
    --criterion label_smoothed_cross_entropy --label-smoothing 0.1 --max-tokens 4096 --max-epoch 100 --seed 1 \
    --stop-time-hours "$(python -c "print($seconds / 3600)")" --save-dir "$WORK/lstm/checkpoints" \
    --keep-last-epochs 1 --log-format simple --log-interval 50 ${TRAIN_FLAGS:-} 2>&1 | tee -a "$WORK/lstm/train.log"
fi

logs=()
for step in "${ALL_STEPS[@]}"; do
  log=$(step_dir "$step")/fc4-tanh/train.log
  [[ $step == lstm ]] && log=$WORK/lstm/train.log
  [[ -f $log ]] && logs+=("$step=$log")
done
python "$(dirname "$0")/../results/training_curves.py" --logs "${logs[@]}" --json "$RESULTS/rnn_fc_ablation.json" \
  --markdown "$RESULTS/rnn_fc_ablation.md"
cat "$RESULTS/rnn_fc_ablation.md"
