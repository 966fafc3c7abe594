#!/usr/bin/env bash
# Double-token steps of `make demo` (examples/demo/steps.mk): the paper's bidirectional system (bidir-2),
# warm-started from the demo baseline (--double-token-base-checkpoint: its tensors, EOD added, the decoder's
# positions from its sinusoidal table) and fine-tuned for about two minutes; then DoubleTopK beam search on
# bidir-2 against fairseq's beam search on the demo baseline, the model it changes, in the same run.
set -euo pipefail
# shellcheck source=examples/tools.sh
source "$(dirname "$0")/../tools.sh"  # the venv's commands on PATH (make install)
source examples/demo/lib.sh
case $1 in
  train)
    say "double_token: fine-tune bidir-2 from the demo baseline (about 2 minutes)"
    # shellcheck disable=SC2086  # BASELINE_ARCH is a list of words
    train double_token-bidir-2 --task double_token_translation --token-order bidir --tokens-per-step 2 \
      ${BASELINE_ARCH/baseline_transformer_tiny/double_token_transformer_tiny} \
      --double-token-base-checkpoint "$BASELINE_CKPT" \
      --criterion label_smoothed_cross_entropy --label-smoothing 0.1 \
      --lr 1e-3 --warmup-updates 50 --max-epoch 12 --stop-time-hours 0.035
    ;;
  bench)
    # Briefly trained models may not stop on their own: outputs are cut at 1.2 x source length + 10 for both.
    bench 3-double_token --method double_token --path "$WORK/double_token-bidir-2/checkpoint_best.pt" \
      --baseline-path "$BASELINE_CKPT" --beam 5 --max-len-a 1.2 --max-len-b 10 \
      --token-order bidir --tokens-per-step 2 --label "double-token bidir-2 vs baseline" \
      --model-note "bidir-2 fine-tuned from the demo baseline, $(model_note double_token-bidir-2); stock: demo baseline"
    ;;
  *) echo "examples/double_token/demo.sh: unknown step $1" >&2; exit 2 ;;
esac
