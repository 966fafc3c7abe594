#!/usr/bin/env bash
# `make demo` step: one alignment of the demo's training text (systran-align) with its lexical table, used by
# the lattice candidate tables and by rnn_fc's candidate lists.
set -euo pipefail
# shellcheck source=examples/tools.sh
source "$(dirname "$0")/../tools.sh"  # the venv's commands on PATH (make install)
source examples/demo/lib.sh
read -r SRC TGT < <(data_langs)
start=$SECONDS
say "align the training text (systran-align) with its lexical table"
mkdir -p "$WORK/align"
fairseq-plugins align --source "$WORK/data/tok/train.$SRC" --target "$WORK/data/tok/train.$TGT" \
  --output "$WORK/align/train.align" --lexical-table "$WORK/align/lexical-table.txt.tmp" 2> "$WORK/align/align.log" \
  || { tail -5 "$WORK/align/align.log" >&2; exit 1; }
mv "$WORK/align/lexical-table.txt.tmp" "$WORK/align/lexical-table.txt"
say "aligned in $((SECONDS - start)) s"
