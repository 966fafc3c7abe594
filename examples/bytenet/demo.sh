#!/usr/bin/env bash
# ByteNet steps of `make demo` (examples/demo/steps.mk): character data of its own (the first 10,000 training
# pairs) and a small ByteNet, 500 updates (about 3 minutes on one core); then its cached decoder (fairseq's generator with the model's incremental state)
# against fairseq's path for a decoder without a cache (the whole prefix at every step), same model, greedy,
# on the first 50 test sentences (the uncached side recomputes every prefix: 100 would take 1.5 minutes).
set -euo pipefail
# shellcheck source=examples/tools.sh
source "$(dirname "$0")/../tools.sh"  # the venv's commands on PATH (make install)
source examples/demo/lib.sh
case $1 in
  train)
    say "bytenet: character data"
    rm -rf "$WORK/bytenet-data"
    fairseq-plugins prepare --char "$RAW" "$WORK/bytenet-data" -s "$SRC" -t "$TGT" --train-limit 10000 --workers 1 \
      2> "$WORK/bytenet-prepare.log" || { tail -5 "$WORK/bytenet-prepare.log" >&2; exit 1; }
    TRAIN_DATA=$WORK/bytenet-data/bin train bytenet --task translation --arch bytenet_multi30k_char \
      --decoder-blocks 5 --encoder-blocks 5 --encoder-embed-dim 128 --decoder-embed-dim 128 \
      --encoder-hidden-dim 64 --decoder-hidden-dim 128 --output-hidden-dim 128 \
      --criterion label_smoothed_cross_entropy --label-smoothing 0.1 --lr 2e-3 \
      --warmup-updates 100 --clip-norm 1.0 --max-update 500
    ;;
  bench)
    bench 8-bytenet --method bytenet --data "$WORK/bytenet-data" --path "$WORK/bytenet/checkpoint_best.pt" \
      --beam 1 --limit 50 --baseline-no-cache --label "bytenet cached vs no cache" \
      --model-note "characters, $(model_note bytenet)"
    ;;
  *) echo "examples/bytenet/demo.sh: unknown step $1" >&2; exit 2 ;;
esac
