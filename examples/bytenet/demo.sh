#!/usr/bin/env bash
# ByteNet step of `make demo` (run by examples/demo/run.sh with WORK, RAW, USER_DIR, the `bench` and `say`
# functions): a small character-level ByteNet trained for about two minutes on the demo corpus, then
# bench: cached decoding (stock generator) against recomputing the whole prefix at every step, same model.
set -euo pipefail
say "bytenet: character data and a small ByteNet (about 2 minutes of training)"
fairseq-plugins prepare --char "$RAW" "$WORK/bytenet-data" -s en -t de --train-limit 10000 --workers 2 \
  2> "$WORK/bytenet-prepare.log" || { tail -5 "$WORK/bytenet-prepare.log" >&2; exit 1; }
fairseq-train "$WORK/bytenet-data/bin" --user-dir "$USER_DIR" --task translation --arch bytenet_multi30k_char \
  --decoder-blocks 5 --encoder-blocks 5 --encoder-embed-dim 128 --decoder-embed-dim 128 --encoder-hidden-dim 64 \
  --decoder-hidden-dim 128 --output-hidden-dim 128 \
  --criterion label_smoothed_cross_entropy --label-smoothing 0.1 --optimizer adam --lr 2e-3 \
  --lr-scheduler inverse_sqrt --warmup-updates 100 --clip-norm 1.0 --max-tokens 4096 --seed 1 \
  --stop-time-hours 0.035 --max-epoch 20 --save-dir "$WORK/bytenet" --no-epoch-checkpoints \
  --log-format simple --log-interval 50 --no-progress-bar > "$WORK/bytenet-train.log" 2>&1 \
  || { tail -30 "$WORK/bytenet-train.log" >&2; echo "bytenet training failed" >&2; exit 1; }
grep -E "valid on" "$WORK/bytenet-train.log" | tail -1 | grep -oE "nll_loss [0-9.]+"
say "bench: ByteNet greedy, cached against recomputed decoding (identical outputs expected)"
bench --method bytenet --data "$WORK/bytenet-data" --path "$WORK/bytenet/checkpoint_best.pt" --beam 1 \
  --max-len-a 1.5 --max-len-b 10 --bytenet-decoding recompute --label "bytenet recompute vs cached"
