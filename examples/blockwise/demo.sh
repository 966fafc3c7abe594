#!/usr/bin/env bash
# Blockwise steps of `make demo` (examples/demo/steps.mk): 4 proposal heads trained on the frozen demo
# baseline for about two minutes, then exact blockwise decoding against stock greedy on the same model.
set -euo pipefail
# shellcheck source=examples/tools.sh
source "$(dirname "$0")/../tools.sh"  # the venv's commands on PATH (make install)
source examples/demo/lib.sh
case $1 in
  train)
    say "blockwise: train 4 proposal heads on the frozen demo baseline (about 2 minutes)"
    # shellcheck disable=SC2086  # BASELINE_ARCH is a list of words
    train blockwise --task blockwise_translation \
      ${BASELINE_ARCH/baseline_transformer_tiny/blockwise_transformer_tiny} --blockwise-heads 4 \
      --blockwise-base-checkpoint "$BASELINE_CKPT" --blockwise-freeze-base \
      --criterion blockwise_label_smoothed_cross_entropy --label-smoothing 0.1 \
      --lr 3e-3 --warmup-updates 50 --max-update 400 --stop-time-hours 0.03
    ;;
  bench)
    bench 2-blockwise --method blockwise --path "$WORK/blockwise/checkpoint_best.pt" --beam 1 --block-size 4 \
      --label "blockwise k=4, exact" \
      --model-note "heads on the frozen demo baseline, $(model_note blockwise)"
    ;;
  *) echo "examples/blockwise/demo.sh: unknown step $1" >&2; exit 2 ;;
esac
