#!/usr/bin/env bash
# Sequence-to-lattice step of `make demo` (run by examples/demo/run.sh with WORK, USER_DIR, BASELINE_ARCH,
# BASELINE_CKPT, the `bench` and `say` functions): align the demo's training text, count the candidate
# tables, train a lattice_transformer of the demo baseline's sizes for about two minutes, then bench lattice
# decoding against the demo baseline at beam 5 in the same run.
set -euo pipefail
read -r SRC TGT < <(python -c "import json, sys; d = json.load(open(sys.argv[1])); print(d['source_lang'], d['target_lang'])" \
  "$WORK/data/prepare.json")
say "lattice: align the training text (systran-align) and count the candidate tables"
fairseq-plugins align --source "$WORK/data/tok/train.$SRC" --target "$WORK/data/tok/train.$TGT" \
  --output "$WORK/lattice-train.align" 2>> "$WORK/lattice.log"
fairseq-plugins lattice-table --data-bin "$WORK/data/bin" -s "$SRC" -t "$TGT" --alignment "$WORK/lattice-train.align" \
  --output "$WORK/lattice-table.pt" 2>> "$WORK/lattice.log"
fairseq-plugins lattice-recall --table "$WORK/lattice-table.pt" --data-bin "$WORK/data/bin" -s "$SRC" -t "$TGT" \
  --split test --k 1 8 64 2>> "$WORK/lattice.log"
say "lattice: train lattice_transformer (about 2 minutes)"
# shellcheck disable=SC2086  # BASELINE_ARCH is a list of words
fairseq-train "$WORK/data/bin" --user-dir "$USER_DIR" --task lattice_translation \
  ${BASELINE_ARCH/baseline_transformer_tiny/lattice_transformer_tiny} \
  --criterion label_smoothed_cross_entropy --label-smoothing 0.1 \
  --optimizer adam --adam-betas '(0.9, 0.98)' --lr 2e-3 --lr-scheduler inverse_sqrt --warmup-updates 100 \
  --max-tokens 4096 --seed 1 --max-epoch 12 --stop-time-hours 0.035 \
  --save-dir "$WORK/lattice" --no-epoch-checkpoints --log-format simple --log-interval 50 \
  --no-progress-bar > "$WORK/lattice-train.log" 2>&1 \
  || { tail -30 "$WORK/lattice-train.log" >&2; echo "lattice training failed" >&2; exit 1; }
grep -E "valid on" "$WORK/lattice-train.log" | tail -1 | grep -oE "nll_loss [0-9.]+"
say "bench: lattice decoding (K=64, L+-3) against the demo baseline (stock beam 5)"
bench --method lattice --path "$WORK/lattice/checkpoint_best.pt" --baseline-path "$BASELINE_CKPT" --beam 5 \
  --lattice-table "$WORK/lattice-table.pt" --label "lattice (K=64) vs baseline beam 5"
