#!/usr/bin/env bash
# Fast CPU decoding step of `make demo` (run by examples/demo/run.sh with WORK, USER_DIR, BASELINE_ARCH,
# BASELINE_CKPT, the `bench` and `say` functions): candidate lists from the aligner's lexical table, an rnn_fc
# trained for about two minutes, then bench rows at beam 6: the plain decoder, the exact speedups, all switches
# (each against fairseq's stock generator on the same model), and the switches on the demo baseline.
set -euo pipefail
read -r SRC TGT < <(python -c "import json, sys; d = json.load(open(sys.argv[1])); print(d['source_lang'], d['target_lang'])" \
  "$WORK/data/prepare.json")
say "rnn_fc: lexical table (systran-align) and candidate lists"
fairseq-plugins align --source "$WORK/data/tok/train.$SRC" --target "$WORK/data/tok/train.$TGT" \
  --output "$WORK/rnn_fc-train.align" --lexical-table "$WORK/rnn_fc-lex.txt" 2>> "$WORK/rnn_fc.log"
fairseq-plugins shortlist --lexical-table "$WORK/rnn_fc-lex.txt" --data-bin "$WORK/data/bin" -s "$SRC" -t "$TGT" \
  --output "$WORK/rnn_fc-list.pt" 2>> "$WORK/rnn_fc.log"
say "rnn_fc: train rnn_fc_tiny (about 2 minutes)"
fairseq-train "$WORK/data/bin" --user-dir "$USER_DIR" --task translation --arch rnn_fc_tiny \
  --criterion label_smoothed_cross_entropy --label-smoothing 0.1 --clip-norm 1.0 \
  --optimizer adam --adam-betas '(0.9, 0.98)' --lr 5e-3 --lr-scheduler inverse_sqrt --warmup-updates 50 \
  --max-tokens 4096 --seed 1 --max-epoch 12 --stop-time-hours 0.035 \
  --save-dir "$WORK/rnn_fc" --no-epoch-checkpoints --log-format simple --log-interval 50 \
  --no-progress-bar > "$WORK/rnn_fc-train.log" 2>&1 \
  || { tail -30 "$WORK/rnn_fc-train.log" >&2; echo "rnn_fc training failed" >&2; exit 1; }
grep -E "valid on" "$WORK/rnn_fc-train.log" | tail -1 | grep -oE "nll_loss [0-9.]+"
say "bench: rnn_fc decoders at beam 6 against the stock generator on the same model"
RNN_FC=$WORK/rnn_fc/checkpoint_best.pt
bench --method rnn_fc --path "$RNN_FC" --beam 6 --rnn-fc-speedups none --label "rnn_fc plain decoder"
bench --method rnn_fc --path "$RNN_FC" --beam 6 --label "rnn_fc exact speedups"
bench --method rnn_fc --path "$RNN_FC" --beam 6 --rnn-fc-precision int8 --rnn-fc-shortlist "$WORK/rnn_fc-list.pt" \
  --rnn-fc-early-stop --label "rnn_fc all switches"
bench --method rnn_fc --path "$BASELINE_CKPT" --beam 6 --rnn-fc-precision int8 \
  --rnn-fc-shortlist "$WORK/rnn_fc-list.pt" --label "baseline + int8 + candidate lists"
