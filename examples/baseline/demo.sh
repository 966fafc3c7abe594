#!/usr/bin/env bash
# Baseline steps of `make demo` (examples/demo/steps.mk): prepare the data, train the small demo baseline
# every warm-started method builds on, decode the test set with fairseq-generate + sacrebleu, and a
# calibration bench (the stock generator against itself: the ratio shows the measurement's noise, ~1.00x).
set -euo pipefail
# shellcheck source=examples/tools.sh
source "$(dirname "$0")/../tools.sh"  # the venv's commands on PATH (make install)
source examples/demo/lib.sh
case $1 in
  prepare)
    if (( SYNTHETIC )); then VOCAB=100; else VOCAB=4000; fi
    say "prepare $RAW (joint SentencePiece, $VOCAB pieces)"
    rm -rf "$WORK/data"
    fairseq-plugins prepare "$RAW" "$WORK/data" -s "$SRC" -t "$TGT" --vocab-size "$VOCAB" --workers 1 \
      2> "$WORK/prepare.log" || { tail -5 "$WORK/prepare.log" >&2; exit 1; }
    ;;
  train)
    say "baseline: train the small transformer (about 5 minutes)"
    if (( SYNTHETIC )); then SCHEDULE=(--max-epoch 12 --lr 5e-3 --warmup-updates 50)
    else SCHEDULE=(--max-update 3000 --lr 2e-3 --warmup-updates 200); fi
    # shellcheck disable=SC2086  # BASELINE_ARCH is a list of words
    train baseline --task translation $BASELINE_ARCH "${SCHEDULE[@]}" \
      --criterion label_smoothed_cross_entropy --label-smoothing 0.1 --stop-time-hours 0.08
    ;;
  generate)
    say "baseline: fairseq-generate (beam 5) on the whole test set + sacrebleu"
    fairseq-generate "$WORK/data/bin" --user-dir "$USER_DIR" --path "$BASELINE_CKPT" --gen-subset test \
      --beam 5 --batch-size 64 > "$WORK/baseline/generate.out.tmp" 2> "$WORK/baseline/generate.log"
    mv "$WORK/baseline/generate.out.tmp" "$WORK/baseline/generate.out"
    fairseq-plugins detok "$WORK/data" --from-generate --input "$WORK/baseline/generate.out" > "$WORK/baseline/hyp.$TGT"
    say "baseline: sacreBLEU $(sacrebleu "$WORK/data/raw/test.$TGT" -i "$WORK/baseline/hyp.$TGT" -b $( (( SYNTHETIC )) && echo --force)) (whole test set, beam 5)"
    ;;
  bench)
    bench 1-baseline --method baseline --path "$BASELINE_CKPT" --beam 1 --label "stock vs stock (calibration)" \
      --model-note "demo baseline, $(model_note baseline)"
    ;;
  *) echo "examples/baseline/demo.sh: unknown step $1" >&2; exit 2 ;;
esac
