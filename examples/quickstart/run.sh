#!/usr/bin/env bash
# Quickstart: every method end to end on your own parallel text, with tiny models, in minutes on one CPU thread.
#   fairseq-plugins prepare -> fairseq-train --user-dir -> fairseq-generate (the method's task flags)
#   -> fairseq-plugins detok -> sacrebleu
# The models are the *_tiny presets trained for at most UPDATES updates: the BLEU lines say that each pipeline
# runs on your data, not what a method can do (the recipes examples/<method>/run.sh train the real models).
# docs/quickstart.md shows each step as the command this script runs.
#
#   baseline     fairseq's transformer (baseline_transformer_tiny), trained; beam 5
#   fast_step    the fast decoder step on the baseline (--task fast_step_translation --fast-step); beam 5
#   rnn_fc       Devlin's fast CPU decoding: an rnn_fc_tiny model trained and decoded with its exact speedups
#                (beam 6); then the same search on the baseline with int8 matrices and candidate lists
#                (fairseq-plugins align + shortlist), row rnn_fc-on-baseline
#   blockwise    4 proposal heads trained on the frozen baseline; exact blockwise decoding (= greedy), k = 4
#   double_token bidir-2 fine-tuned from the baseline; DoubleTopK beam search, beam 5
#   lattice      candidate tables (fairseq-plugins align + lattice-table) and a lattice scorer on the baseline's
#                encoder; lattice decoding, K = 32
#   bytenet      character data (prepare --char) and a ByteNet (bytenet_tiny) trained from scratch; beam 4
# A method built on the baseline trains it first if it is not there. Re-running skips every finished training
# and the prepared data, and decodes and scores again.
#
# Usage: examples/quickstart/run.sh RAW_DIR [WORK]
#   RAW_DIR holds train, valid and test text as <split>.$SRC and <split>.$TGT: one sentence a line, the two sides
#   line by line translations of each other (valid may be named val or dev; Multi30k's names work too).
#   WORK (work/quickstart) receives data/ (prepared), one directory per model or row (checkpoint_best.pt,
#   train.log, generate.out, hyp.$TGT) and bleu.txt: one line per row, "NAME: BLEU b (n sentences)".
#   env: SRC (en), TGT (de): the language suffixes of the files,
#        METHODS ("baseline fast_step rnn_fc blockwise double_token lattice bytenet"),
#        UPDATES (300: every training's --max-update), MAX_TOKENS (2048 a batch),
#        VOCAB (1000 joint SentencePiece pieces; where the training text supports fewer, the most it supports),
#        THREADS (1: OMP_NUM_THREADS of every command)
set -euo pipefail
# shellcheck source=examples/tools.sh
source "$(dirname "$0")/../tools.sh"  # the venv's commands on PATH (make install)
RAW=${1:?usage: examples/quickstart/run.sh RAW_DIR [WORK]   (env SRC, TGT, METHODS; see docs/quickstart.md)}
WORK=${2:-work/quickstart}
SRC=${SRC:-en}
TGT=${TGT:-de}
METHODS=${METHODS:-baseline fast_step rnn_fc blockwise double_token lattice bytenet}
UPDATES=${UPDATES:-300}
MAX_TOKENS=${MAX_TOKENS:-2048}
VOCAB=${VOCAB:-1000}
export OMP_NUM_THREADS=${THREADS:-1} MKL_NUM_THREADS=${THREADS:-1}
START=$(date +%s)
for method in $METHODS; do
  case $method in
    baseline|fast_step|rnn_fc|blockwise|double_token|lattice|bytenet) ;;
    *) echo "METHODS: unknown method $method (baseline fast_step rnn_fc blockwise double_token lattice bytenet)" >&2
       exit 2 ;;
  esac
done
[[ -d $RAW ]] || { echo "$RAW: no such directory (RAW_DIR: train, valid and test files .$SRC and .$TGT)" >&2; exit 2; }
USER_DIR=$(fairseq-plugins user-dir)
DATA=$WORK/data
BASELINE=$WORK/baseline/checkpoint_best.pt
mkdir -p "$WORK"

say() {
  local seconds=$(( $(date +%s) - START ))
  printf '==> [%d:%02d] %s\n' $((seconds / 60)) $((seconds % 60)) "$*"
}
fail() { echo "quickstart: $*" >&2; exit 1; }

# ---- the data: a joint SentencePiece model, tokenised text and fairseq binaries in WORK/data ------------------
prepare() {  # RAW OUT [--char]: fairseq-plugins prepare: a joint SentencePiece model of VOCAB pieces, or characters
  local raw=$1 out=$2 log=$2.log max tokens=(--vocab-size "$VOCAB")
  shift 2
  (( $# == 0 )) || tokens=("$@")
  if ! fairseq-plugins prepare "$raw" "$out" -s "$SRC" -t "$TGT" "${tokens[@]}" > "$log" 2>&1; then
    # SentencePiece: "Vocabulary size too high (1000). Please set it to a value <= 612."
    max=$(grep -oE "value <= [0-9]+" "$log" | grep -oE "[0-9]+$" | tail -1 || true)
    [[ -n $max && $# == 0 ]] || { cat "$log" >&2; fail "fairseq-plugins prepare failed"; }
    say "VOCAB=$VOCAB is more pieces than the training text supports: $max instead"
    VOCAB=$max
    fairseq-plugins prepare "$raw" "$out" -s "$SRC" -t "$TGT" --vocab-size "$VOCAB" >> "$log" 2>&1 \
      || { cat "$log" >&2; fail "fairseq-plugins prepare failed"; }
  fi
}
if [[ ! -f $DATA/prepare.json ]]; then
  say "prepare $RAW ($SRC -> $TGT, a joint SentencePiece model of $VOCAB pieces)"
  prepare "$RAW" "$DATA"
fi
langs=$(python3 -c 'import json, sys; m = json.load(open(sys.argv[1])); print(m["source_lang"], m["target_lang"])' \
  "$DATA/prepare.json")
[[ $langs == "$SRC $TGT" ]] || {
  echo "quickstart: $DATA holds ${langs/ /->} data, not $SRC->$TGT: remove it or use another WORK" >&2; exit 2; }

# ---- training and scoring -------------------------------------------------------------------------------------
train() {  # NAME DATA_BIN FLAGS...: fairseq-train into WORK/NAME, unless its checkpoint_best.pt is there
  local name=$1 bin=$2 log=$WORK/$1/train.log
  shift 2
  [[ -f $WORK/$name/checkpoint_best.pt ]] && return 0
  mkdir -p "$WORK/$name"
  say "$name: train (at most $UPDATES updates)"
  fairseq-train "$bin" --user-dir "$USER_DIR" --source-lang "$SRC" --target-lang "$TGT" "$@" \
    --optimizer adam --adam-betas '(0.9, 0.98)' --lr-scheduler inverse_sqrt --warmup-updates 50 \
    --max-tokens "$MAX_TOKENS" --max-update "$UPDATES" --seed 1 --num-workers 0 \
    --save-dir "$WORK/$name" --no-epoch-checkpoints --log-format simple --log-interval 50 --no-progress-bar \
    > "$log" 2>&1 || { tail -30 "$log" >&2; fail "training $name failed (log: $log)"; }
  [[ -f $WORK/$name/checkpoint_best.pt ]] || fail "training $name wrote no checkpoint (log: $log)"
}

evaluate() {  # NAME DATA CHECKPOINT FLAGS...: fairseq-generate on the test split, detok, sacreBLEU -> WORK/bleu.txt
  local name=$1 data=$2 path=$3 dir=$WORK/$1 bleu sentences references
  shift 3
  mkdir -p "$dir"
  fairseq-generate "$data/bin" --user-dir "$USER_DIR" --path "$path" --source-lang "$SRC" --target-lang "$TGT" \
    --gen-subset test --batch-size 64 "$@" > "$dir/generate.out" 2> "$dir/generate.log" \
    || { tail -30 "$dir/generate.log" >&2; fail "decoding $name failed (log: $dir/generate.log)"; }
  fairseq-plugins detok "$data" --from-generate --input "$dir/generate.out" > "$dir/hyp.$TGT"
  sentences=$(wc -l < "$dir/hyp.$TGT")
  references=$(wc -l < "$data/raw/test.$TGT")
  (( sentences == references )) || fail "$name: $sentences translations of $references test sentences"
  bleu=$(sacrebleu "$data/raw/test.$TGT" -i "$dir/hyp.$TGT" -b -w 2 2> /dev/null)
  touch "$WORK/bleu.txt"
  grep -v "^$name: " "$WORK/bleu.txt" > "$WORK/bleu.txt.tmp" || true
  echo "$name: BLEU $bleu ($sentences sentences)" >> "$WORK/bleu.txt.tmp"
  mv "$WORK/bleu.txt.tmp" "$WORK/bleu.txt"
  say "$name: BLEU $bleu ($sentences test sentences, $dir/hyp.$TGT)"
}

baseline() {  # the stock transformer every warm-started method builds on
  train baseline "$DATA/bin" --task translation --arch baseline_transformer_tiny --lr 5e-3 \
    --criterion label_smoothed_cross_entropy --label-smoothing 0.1
}

aligned() {  # one alignment of the training pieces and its lexical table (lattice tables, candidate lists)
  [[ -f $WORK/align/lex.txt ]] && return 0
  mkdir -p "$WORK/align"
  say "align the training text (fairseq-plugins align)"
  fairseq-plugins align --source "$DATA/tok/train.$SRC" --target "$DATA/tok/train.$TGT" \
    --output "$WORK/align/train.align" --lexical-table "$WORK/align/lex.txt.tmp" > "$WORK/align/align.log" 2>&1 \
    || { tail -5 "$WORK/align/align.log" >&2; fail "fairseq-plugins align failed"; }
  mv "$WORK/align/lex.txt.tmp" "$WORK/align/lex.txt"
}

for method in $METHODS; do
  case $method in
    baseline)
      baseline
      evaluate baseline "$DATA" "$BASELINE" --task translation --beam 5 ;;
    fast_step)
      baseline
      evaluate fast_step "$DATA" "$BASELINE" --task fast_step_translation --fast-step --beam 5 ;;
    rnn_fc)
      train rnn_fc "$DATA/bin" --task translation --arch rnn_fc_tiny --lr 3e-3 \
        --criterion label_smoothed_cross_entropy --label-smoothing 0.1
      evaluate rnn_fc "$DATA" "$WORK/rnn_fc/checkpoint_best.pt" --task rnn_fc_translation --beam 6 \
        --rnn-fc-speedups all
      baseline
      aligned
      if [[ ! -f $WORK/rnn_fc-on-baseline/shortlist.pt ]]; then
        mkdir -p "$WORK/rnn_fc-on-baseline"
        fairseq-plugins shortlist --lexical-table "$WORK/align/lex.txt" --data-bin "$DATA/bin" -s "$SRC" -t "$TGT" \
          --output "$WORK/rnn_fc-on-baseline/shortlist.pt" > "$WORK/rnn_fc-on-baseline/shortlist.log" 2>&1 \
          || { cat "$WORK/rnn_fc-on-baseline/shortlist.log" >&2; fail "fairseq-plugins shortlist failed"; }
      fi
      evaluate rnn_fc-on-baseline "$DATA" "$BASELINE" --task rnn_fc_translation --beam 6 --rnn-fc-precision int8 \
        --rnn-fc-shortlist "$WORK/rnn_fc-on-baseline/shortlist.pt" ;;
    blockwise)
      baseline
      train blockwise "$DATA/bin" --task blockwise_translation --arch blockwise_transformer_tiny \
        --blockwise-heads 4 --blockwise-base-checkpoint "$BASELINE" --blockwise-freeze-base --lr 3e-3 \
        --criterion blockwise_label_smoothed_cross_entropy --label-smoothing 0.1
      evaluate blockwise "$DATA" "$WORK/blockwise/checkpoint_best.pt" --task blockwise_translation --beam 1 \
        --block-size 4 ;;
    double_token)
      baseline
      train double_token "$DATA/bin" --task double_token_translation --token-order bidir --tokens-per-step 2 \
        --arch double_token_transformer_tiny --double-token-base-checkpoint "$BASELINE" --lr 1e-3 \
        --criterion label_smoothed_cross_entropy --label-smoothing 0.1
      # Briefly trained models may not end their outputs: cut at 1.2 x the source length + 10 tokens.
      evaluate double_token "$DATA" "$WORK/double_token/checkpoint_best.pt" --task double_token_translation \
        --token-order bidir --tokens-per-step 2 --beam 5 --max-len-a 1.2 --max-len-b 10 ;;
    lattice)
      baseline
      aligned
      if [[ ! -f $WORK/lattice/table.pt ]]; then
        mkdir -p "$WORK/lattice"
        fairseq-plugins lattice-table --data-bin "$DATA/bin" -s "$SRC" -t "$TGT" --split train \
          --alignment "$WORK/align/train.align" --output "$WORK/lattice/table.pt" > "$WORK/lattice/table.log" 2>&1 \
          || { cat "$WORK/lattice/table.log" >&2; fail "fairseq-plugins lattice-table failed"; }
      fi
      train lattice "$DATA/bin" --task lattice_translation --arch lattice_transformer_tiny \
        --lattice-base-checkpoint "$BASELINE" --lr 2e-3 --criterion label_smoothed_cross_entropy --label-smoothing 0.1
      evaluate lattice "$DATA" "$WORK/lattice/checkpoint_best.pt" --task lattice_translation \
        --lattice-table "$WORK/lattice/table.pt" --lattice-k 32 ;;
    bytenet)
      if [[ ! -f $WORK/bytenet-data/prepare.json ]]; then
        say "bytenet: character data (prepare --char)"
        prepare "$RAW" "$WORK/bytenet-data" --char
      fi
      train bytenet "$WORK/bytenet-data/bin" --task translation --arch bytenet_tiny --lr 3e-3 --clip-norm 1.0 \
        --criterion label_smoothed_cross_entropy --label-smoothing 0.1
      evaluate bytenet "$WORK/bytenet-data" "$WORK/bytenet/checkpoint_best.pt" --task translation --beam 4 \
        --max-len-a 1.5 --max-len-b 10 ;;
  esac
done
say "done: $WORK/bleu.txt"
cat "$WORK/bleu.txt"
