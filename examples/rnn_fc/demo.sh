#!/usr/bin/env bash
# rnn_fc steps of `make demo` (examples/demo/steps.mk): Devlin's decoder speedups on the demo baseline itself
# (int8 matrices, candidate lists from the demo's lexical table, early stopping), against fairseq's stock beam
# search on the same model at beam 6, in the same run. (The rnn_fc model itself needs far longer than a demo's
# minutes to translate: docs/rnn_fc.md.)
set -euo pipefail
# shellcheck source=examples/tools.sh
source "$(dirname "$0")/../tools.sh"  # the venv's commands on PATH (make install)
source examples/demo/lib.sh
read -r SRC TGT < <(data_langs)
case $1 in
  lists)
    say "rnn_fc: candidate lists from the lexical table"
    fairseq-plugins shortlist --lexical-table "$WORK/align/lexical-table.txt" --data-bin "$WORK/data/bin" \
      -s "$SRC" -t "$TGT" --output "$WORK/rnn_fc-list.pt" 2>> "$WORK/rnn_fc.log"
    ;;
  bench)
    bench 7-rnn_fc --method rnn_fc --path "$BASELINE_CKPT" --beam 6 --rnn-fc-precision int8 \
      --rnn-fc-shortlist "$WORK/rnn_fc-list.pt" --rnn-fc-early-stop \
      --label "rnn_fc int8 + candidate lists + early stop" --model-note "demo baseline, $(model_note baseline)"
    ;;
  *) echo "examples/rnn_fc/demo.sh: unknown step $1" >&2; exit 2 ;;
esac
