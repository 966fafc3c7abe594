#!/usr/bin/env bash
# Blockwise steps of `make demo` (examples/demo/steps.mk): proposal heads trained on the frozen demo baseline
# for 150 updates (about 2 minutes on one core),
# then exact blockwise decoding on the fast decoder step (--task blockwise_translation --fast-step: a block's
# positions through each decoder layer in one call) against stock greedy on the same model. Exact acceptance
# in fp32 gives stock greedy's outputs; the fast step's own greedy decoding is the fast_step fp32 row (the same
# weights: the base is frozen), so the table's two rows show what the blocks add on top of the fast step.
set -euo pipefail
# shellcheck source=examples/tools.sh
source "$(dirname "$0")/../tools.sh"  # the venv's commands on PATH (make install)
source examples/demo/lib.sh
# k = 2: at the demo's sizes a call of the fast step costs about 3 of its greedy steps at k = 2 and 4 at k = 4,
# while heads trained for 150 updates accept 1.35 and 1.50 tokens a call: the smallest block loses least
# (measured 2.31x, 2.09x, 2.03x stock greedy at k = 2, 3, 4, where the fast step's own greedy made 4.8x).
HEADS=2
# Heads 2..k propose among the 1,000 most frequent target pieces only, in training and in decoding: their output
# products cost a quarter of the whole vocabulary's, most of a frozen-base update's work (0: the whole
# vocabulary, the synthetic data's 104 entries).
if (( ${SYNTHETIC:-0} )); then PROPOSAL_VOCAB=0; else PROPOSAL_VOCAB=1000; fi
case $1 in
  train)
    # shellcheck disable=SC2086  # BASELINE_ARCH is a list of words
    train blockwise --task blockwise_translation \
      ${BASELINE_ARCH/baseline_transformer_tiny/blockwise_transformer_tiny} --blockwise-heads "$HEADS" \
      --blockwise-base-checkpoint "$BASELINE_CKPT" --blockwise-freeze-base \
      --criterion blockwise_label_smoothed_cross_entropy --label-smoothing 0.1 \
      --blockwise-proposal-vocab "$PROPOSAL_VOCAB" --lr 3e-3 --warmup-updates 50 --max-update 150
    ;;
  bench)
    bench 4-blockwise --method blockwise --path "$WORK/blockwise/checkpoint_best.pt" --beam 1 --block-size "$HEADS" \
      --block-proposal-vocab "$PROPOSAL_VOCAB" --fast-step --label "blockwise k=$HEADS exact on the fast step" \
      --model-note "heads on the frozen demo baseline, $(model_note blockwise)"
    ;;
  *) echo "examples/blockwise/demo.sh: unknown step $1" >&2; exit 2 ;;
esac
