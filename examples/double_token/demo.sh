#!/usr/bin/env bash
# Double-token steps of `make demo` (examples/demo/steps.mk): the paper's bidirectional system (bidir-2),
# warm-started from the demo baseline (--double-token-base-checkpoint: its tensors, EOD added, the decoder's
# positions from its sinusoidal table) and fine-tuned for 200 updates (about 2 minutes on one core); then its
# DoubleTopK beam search on the fast decoder step (int8: --fast-step --fast-step-precision int8, a step's pairs
# through each layer in one call) against fairseq's beam search on the demo baseline, the model it changes, in
# the same run.
set -euo pipefail
# shellcheck source=examples/tools.sh
source "$(dirname "$0")/../tools.sh"  # the venv's commands on PATH (make install)
source examples/demo/lib.sh
case $1 in
  train)
    # shellcheck disable=SC2086  # BASELINE_ARCH is a list of words
    train double_token-bidir-2 --task double_token_translation --token-order bidir --tokens-per-step 2 \
      ${BASELINE_ARCH/baseline_transformer_tiny/double_token_transformer_tiny} \
      --double-token-base-checkpoint "$BASELINE_CKPT" \
      --criterion label_smoothed_cross_entropy --label-smoothing 0.1 \
      --lr 1e-3 --warmup-updates 50 --max-update 200
    ;;
  bench)
    # The stock side is fairseq's beam search on the demo baseline, the model bidir-2 was fine-tuned from.
    bench 5-double_token --method double_token --path "$WORK/double_token-bidir-2/checkpoint_best.pt" \
      --baseline-path "$BASELINE_CKPT" --beam 5 --token-order bidir --tokens-per-step 2 --fast-step \
      --fast-step-precision int8 --label "double-token bidir-2 on the fast step int8" \
      --model-note "bidir-2 fine-tuned from the demo baseline, $(model_note double_token-bidir-2); stock: demo baseline"
    ;;
  *) echo "examples/double_token/demo.sh: unknown step $1" >&2; exit 2 ;;
esac
