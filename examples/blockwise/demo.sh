#!/usr/bin/env bash
# Blockwise step of `make demo` (run by examples/demo/run.sh with WORK, USER_DIR, BASELINE_CKPT, BASELINE_ARCH,
# the `bench` and `say` functions): train 4 proposal heads on the frozen demo baseline for about two minutes,
# then bench exact blockwise decoding against stock greedy on the same model.
set -euo pipefail
say "blockwise: train proposal heads on the frozen baseline (about 2 minutes)"
# shellcheck disable=SC2086  # BASELINE_ARCH is a list of words
fairseq-train "$WORK/data/bin" --user-dir "$USER_DIR" --task blockwise_translation \
  ${BASELINE_ARCH/baseline_transformer_tiny/blockwise_transformer_tiny} --blockwise-heads 4 \
  --blockwise-base-checkpoint "$BASELINE_CKPT" --blockwise-freeze-base \
  --criterion blockwise_label_smoothed_cross_entropy --label-smoothing 0.1 \
  --optimizer adam --adam-betas '(0.9, 0.98)' --lr 3e-3 --lr-scheduler inverse_sqrt --warmup-updates 50 \
  --max-tokens 4096 --seed 1 --max-update 400 --stop-time-hours 0.035 \
  --save-dir "$WORK/blockwise" --no-epoch-checkpoints --log-format simple --log-interval 50 --no-progress-bar \
  > "$WORK/blockwise-train.log" 2>&1 \
  || { tail -30 "$WORK/blockwise-train.log" >&2; echo "blockwise training failed" >&2; exit 1; }
grep -E "valid on" "$WORK/blockwise-train.log" | tail -1 | grep -oE "head[0-9]+_accuracy [0-9.]+" | tr '\n' ' '; echo
say "bench: blockwise (exact acceptance, k=4) against stock greedy"
bench --method blockwise --path "$WORK/blockwise/checkpoint_best.pt" --beam 1 --block-size 4
