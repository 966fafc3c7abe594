#!/usr/bin/env bash
# Double-token step of `make demo` (run by examples/demo/run.sh with WORK, USER_DIR, BASELINE_ARCH, the
# `bench` and `say` functions): the paper's bidirectional system and single-token L2R, same sizes as the
# demo baseline, about two minutes of training each; then bench: DoubleTopK beam search on the first
# against fairseq's beam search on the second, in the same run.
set -euo pipefail
for system in l2r-1 bidir-2; do
  say "double_token: train $system (about 2 minutes)"
  # shellcheck disable=SC2086  # BASELINE_ARCH is a list of words
  fairseq-train "$WORK/data/bin" --user-dir "$USER_DIR" --task double_token_translation \
    --token-order "${system%-*}" --tokens-per-step "${system#*-}" \
    ${BASELINE_ARCH/baseline_transformer_tiny/double_token_transformer_tiny} \
    --criterion label_smoothed_cross_entropy --label-smoothing 0.1 \
    --optimizer adam --adam-betas '(0.9, 0.98)' --lr 2e-3 --lr-scheduler inverse_sqrt --warmup-updates 100 \
    --max-tokens 4096 --seed 1 --max-epoch 12 --stop-time-hours 0.035 \
    --save-dir "$WORK/double_token-$system" --no-epoch-checkpoints --log-format simple --log-interval 50 \
    --no-progress-bar > "$WORK/double_token-$system-train.log" 2>&1 \
    || { tail -30 "$WORK/double_token-$system-train.log" >&2; echo "double_token training failed" >&2; exit 1; }
  grep -E "valid on" "$WORK/double_token-$system-train.log" | tail -1 | grep -oE "nll_loss [0-9.]+"
done
say "bench: double-token bidirectional (DoubleTopK, beam 5) against single-token L2R (stock beam 5)"
# Briefly trained models may not stop on their own: outputs are cut at 1.2 x source length + 10 for both.
bench --method double_token --path "$WORK/double_token-bidir-2/checkpoint_best.pt" \
  --baseline-path "$WORK/double_token-l2r-1/checkpoint_best.pt" --beam 5 --max-len-a 1.2 --max-len-b 10 \
  --token-order bidir --tokens-per-step 2 --label "double-token bidir vs single-token L2R"
