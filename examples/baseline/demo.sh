#!/usr/bin/env bash
# Baseline steps of `make demo` (examples/demo/steps.mk): prepare the data, train the small demo baseline every
# warm-started method builds on (a fixed number of updates, so every machine trains the same model), and decode
# the whole test set with fairseq-generate (beam 5) + sacrebleu: the baseline's own BLEU, printed above the table.
set -euo pipefail
# shellcheck source=examples/tools.sh
source "$(dirname "$0")/../tools.sh"  # the venv's commands on PATH (make install)
source examples/demo/lib.sh
case $1 in
  prepare)
    if (( SYNTHETIC )); then VOCAB=100; else VOCAB=4000; fi
    start=$SECONDS
    say "prepare $RAW (joint SentencePiece, $VOCAB pieces)"
    rm -rf "$WORK/data"
    fairseq-plugins prepare "$RAW" "$WORK/data" -s "$SRC" -t "$TGT" --vocab-size "$VOCAB" --workers 1 \
      2> "$WORK/prepare.log" || { tail -5 "$WORK/prepare.log" >&2; exit 1; }
    say "prepared in $((SECONDS - start)) s"
    ;;
  train)
    # Multi30k: 500 updates (3.3 epochs of 153) at about 0.65 s each on one core: 5-6 minutes, the demo's
    # longest step; 22.9 BLEU at 453 updates, 28.5 at 700 (whole test set, beam 5).
    # Synthetic: 400 updates, the 12 epochs (of 33) the tiny model was given to learn the reordering.
    if (( SYNTHETIC )); then SCHEDULE=(--max-update 400 --lr 5e-3 --warmup-updates 50)
    else SCHEDULE=(--max-update 500 --lr 2e-3 --warmup-updates 200); fi
    # shellcheck disable=SC2086  # BASELINE_ARCH is a list of words
    train baseline --task translation $BASELINE_ARCH "${SCHEDULE[@]}" \
      --criterion label_smoothed_cross_entropy --label-smoothing 0.1
    ;;
  generate)
    start=$SECONDS
    say "baseline: fairseq-generate (beam 5) on the whole test set + sacrebleu"
    fairseq-generate "$WORK/data/bin" --user-dir "$USER_DIR" --path "$BASELINE_CKPT" --gen-subset test \
      --beam 5 --batch-size 64 --max-len-a 1.2 --max-len-b 10 \
      > "$WORK/baseline/generate.out.tmp" 2> "$WORK/baseline/generate.log"
    fairseq-plugins detok "$WORK/data" --from-generate --input "$WORK/baseline/generate.out.tmp" \
      > "$WORK/baseline/hyp.$TGT"
    sentences=$(wc -l < "$WORK/baseline/hyp.$TGT")
    # shellcheck disable=SC2046  # --force (synthetic: tokenised-looking text) or nothing
    bleu=$(sacrebleu "$WORK/data/raw/test.$TGT" -i "$WORK/baseline/hyp.$TGT" -b $( (( SYNTHETIC )) && echo --force))
    echo "demo baseline: sacreBLEU $bleu on the whole test set ($sentences sentences, beam 5), $(model_note baseline)" \
      > "$WORK/baseline/bleu.txt"
    mv "$WORK/baseline/generate.out.tmp" "$WORK/baseline/generate.out"
    say "baseline decoded and scored in $((SECONDS - start)) s: $(cat "$WORK/baseline/bleu.txt")"
    ;;
  *) echo "examples/baseline/demo.sh: unknown step $1" >&2; exit 2 ;;
esac
