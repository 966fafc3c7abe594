# shellcheck shell=bash
# Shell helpers of `make demo`'s steps (sourced by examples/demo/run.sh and every examples/<method>/demo.sh).
#   say TEXT...          a progress line with the time since the demo started
#   train NAME FLAGS...  fairseq-train with the demo's common flags (seed 1, one thread) on $TRAIN_DATA (default:
#                        the prepared demo data) into $WORK/NAME (log $WORK/NAME-train.log); FLAGS bound it by
#                        --max-update, never by time, so every machine trains the same model; says when it
#                        starts, its updates so far once a minute, and at the end the seconds it took and the
#                        last validation loss; a failure shows the log's tail
#   model_note NAME      "N updates, M min on 1 core", as train recorded it (for the table's model column)
#   bench NAME FLAGS...  fairseq-plugins bench, 1 thread, batch 1, 3 runs alternating per batch, the first
#                        $BENCH_LIMIT test sentences (BLEU on those, both sides), outputs capped at
#                        1.2 x source + 10 tokens, into $WORK/bench/NAME.json (the table's rows, in NAME order)
# Environment (from run.sh): WORK, USER_DIR, DEMO_START, BENCH_LIMIT, SYNTHETIC, SRC and TGT (the languages of
# RAW, en and de unless set), and for methods built on the demo baseline BASELINE_CKPT and BASELINE_ARCH (its
# sizes, which a warm-started method must repeat).
SRC=${SRC:-en}
TGT=${TGT:-de}

say() {
  local seconds=$(( $(date +%s) - ${DEMO_START:-$(date +%s)} ))
  printf '==> [%d:%02d] %s\n' $((seconds / 60)) $((seconds % 60)) "$*"
}

train() {
  local name=$1 log=$WORK/$1-train.log start updates_wanted watcher status=0
  shift
  start=$(date +%s)
  updates_wanted=$(printf '%s\n' "$@" | grep -A1 -x -e --max-update | tail -1)
  say "$name: training starts ($updates_wanted updates)"
  training_progress "$name" "$log" "$updates_wanted" "$start" &
  watcher=$!
  fairseq-train "${TRAIN_DATA:-$WORK/data/bin}" --user-dir "$USER_DIR" --seed 1 --max-tokens 4096 \
    --optimizer adam --adam-betas '(0.9, 0.98)' --lr-scheduler inverse_sqrt \
    --save-dir "$WORK/$name" --no-epoch-checkpoints --log-format simple --log-interval 50 --no-progress-bar \
    "$@" > "$log" 2>&1 || status=$?
  kill "$watcher" 2>/dev/null || true
  wait "$watcher" 2>/dev/null || true
  if (( status )); then tail -30 "$log" >&2; echo "demo: training $name failed (log: $log)" >&2; return 1; fi
  [[ -f $WORK/$name/checkpoint_best.pt ]] || { echo "demo: training $name wrote no checkpoint ($log)" >&2; return 1; }
  local updates seconds
  updates=$(grep -E "valid on" "$log" | tail -1 | grep -oE "num_updates [0-9]+" | cut -d' ' -f2)
  seconds=$(grep -oE "done training in [0-9.]+ seconds" "$log" | grep -oE "[0-9.]+" | tail -1)
  awk -v u="${updates:-?}" -v s="${seconds:-0}" 'BEGIN { printf "%s updates, %.1f min on 1 core\n", u, s / 60 }' \
    > "$WORK/$name/trained.txt"
  say "$name trained in $(( $(date +%s) - start )) s: $(grep -E "valid on" "$log" | tail -1 | grep -oE "(epoch [0-9]+| nll_loss [0-9.]+|num_updates [0-9]+)" | tr -s ' \n' ' ')"
}

# While a training runs: a line a minute with its updates so far (fairseq logs every 50) and its seconds.
training_progress() {  # NAME LOG UPDATES_WANTED START_EPOCH_SECONDS
  local updates
  while sleep 60; do
    updates=$(grep -oE "num_updates[= ][0-9]+" "$2" 2>/dev/null | tail -1 | grep -oE "[0-9]+$" || true)
    say "$1: ${updates:-0} of $3 updates after $(( $(date +%s) - $4 )) s"
  done
}

model_note() {  # what training made model NAME: "N updates, M min on 1 core"
  cat "$WORK/$1/trained.txt" 2>/dev/null || echo "training record missing"
}

bench() {
  local name=$1 log=$WORK/bench/$1.log start=$SECONDS
  shift
  mkdir -p "$WORK/bench"
  say "bench $name: starts"
  # Outputs capped at 1.2 x source + 10 tokens (a step's flags may set their own after these): a briefly trained
  # model may not stop on its own, and an uncapped output runs to fairseq's 200 tokens on both sides. BLEU is
  # scored on the sentences timed only: decoding the rest of the test set would take longer than the timing.
  fairseq-plugins bench --data "$WORK/data" --split test --threads 1 --batch-size 1 --runs 3 \
    --limit "$BENCH_LIMIT" --no-whole-split-bleu --max-len-a 1.2 --max-len-b 10 \
    --json "$WORK/bench/$name.json.tmp" "$@" > /dev/null 2> "$log" \
    || { tail -20 "$log" >&2; echo "demo: bench $name failed (log: $log)" >&2; return 1; }
  mv "$WORK/bench/$name.json.tmp" "$WORK/bench/$name.json"
  say "bench $name done in $((SECONDS - start)) s: $(fairseq-plugins report "$WORK/bench/$name.json" 2>/dev/null | sed -n 2p | tr -s ' ')"
}

# The demo baseline every warm-started method builds on, and its sizes (a warm-started method repeats them).
# shellcheck disable=SC2034  # both are read by the scripts that source this file
BASELINE_CKPT=$WORK/baseline/checkpoint_best.pt
if (( ${SYNTHETIC:-0} )); then
  BASELINE_ARCH="--arch baseline_transformer_tiny"
else
  # shellcheck disable=SC2034
  BASELINE_ARCH="--arch baseline_transformer_tiny --encoder-embed-dim 128 --decoder-embed-dim 128
                 --encoder-ffn-embed-dim 512 --decoder-ffn-embed-dim 512"
fi
# The source and target language of the prepared data.
data_langs() {
  python -c "import json, sys; d = json.load(open(sys.argv[1])); print(d['source_lang'], d['target_lang'])" \
    "$WORK/data/prepare.json"
}
