#!/usr/bin/env bash
# Sequence-to-lattice steps of `make demo` (examples/demo/steps.mk): candidate tables counted from the demo's
# alignment, a lattice_transformer whose encoder and embeddings start from the demo baseline's
# (--lattice-base-checkpoint) trained for 250 updates (about 2 minutes on one core), then lattice decoding in its
# fastest measured setting (K = 16 candidates a position, int8 scorer and encoder, no repeated 3-grams) against
# the demo baseline at beam 5 with the same no-repeat rule, in the same run.
set -euo pipefail
# shellcheck source=examples/tools.sh
source "$(dirname "$0")/../tools.sh"  # the venv's commands on PATH (make install)
source examples/demo/lib.sh
read -r SRC TGT < <(data_langs)
case $1 in
  table)
    say "lattice: candidate tables from the alignment"
    fairseq-plugins lattice-table --data-bin "$WORK/data/bin" -s "$SRC" -t "$TGT" \
      --alignment "$WORK/align/train.align" --output "$WORK/lattice-table.pt" 2>> "$WORK/lattice.log"
    fairseq-plugins lattice-recall --table "$WORK/lattice-table.pt" --data-bin "$WORK/data/bin" -s "$SRC" -t "$TGT" \
      --split test --k 1 8 64 2>> "$WORK/lattice.log" > "$WORK/lattice-recall.json"
    ;;
  train)
    # shellcheck disable=SC2086  # BASELINE_ARCH is a list of words
    train lattice --task lattice_translation ${BASELINE_ARCH/baseline_transformer_tiny/lattice_transformer_tiny} \
      --lattice-base-checkpoint "$BASELINE_CKPT" \
      --criterion label_smoothed_cross_entropy --label-smoothing 0.1 \
      --lr 2e-3 --warmup-updates 100 --max-update 250
    ;;
  bench)
    bench 6-lattice --method lattice --path "$WORK/lattice/checkpoint_best.pt" --baseline-path "$BASELINE_CKPT" \
      --beam 5 --lattice-table "$WORK/lattice-table.pt" --lattice-k 16 --lattice-scorer-precision int8 \
      --lattice-encoder-precision int8 --no-repeat-ngram-size 3 --label "lattice K=16 int8" \
      --model-note "encoder from the demo baseline, $(model_note lattice); stock: demo baseline"
    ;;
  *) echo "examples/lattice/demo.sh: unknown step $1" >&2; exit 2 ;;
esac
