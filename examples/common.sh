# Shell helpers shared by the recipes in examples/ (sourced; defines functions, and the two parameters below).
#   SRC, TGT       the source and target language suffixes of the corpus (environment; default en and de,
#                  Multi30k's en->de): the raw files RAW/<split>.$SRC and .$TGT, and every -s/-t,
#                  --source-lang/--target-lang and file name (tok/train.$SRC, raw/test.$TGT, ...) of the recipes
#   check_langs DATA
#                  stops (exit 2) unless the prepared data in DATA (its prepare.json) is $SRC -> $TGT
#   use_baseline_data BASE WORK
#                  for recipes built on examples/baseline's work dir BASE: sets USER_DIR, DATA (BASE/data) and
#                  COMMANDS (WORK/commands.txt), creates WORK, stops unless DATA holds prepared $SRC -> $TGT data
#   epochs SYSTEM  $EPOCHS_<system> (dashes as underscores) if set, else $EPOCHS
#   record CMD...  run CMD and append it (once) to $COMMANDS, the provenance bench reads with --provenance
#   stage NAME     true when NAME is one of the words of $STAGES
#   minutes_as_hours MINUTES NAME
#                  MINUTES as fairseq-train's --stop-time-hours value (the recipes take their budgets in minutes);
#                  stops (exit 2, naming the setting NAME) unless MINUTES is a number >= 0
#   distill_training_set BASE OUT [fairseq-generate flags...]
#                  sequence-level distillation from examples/baseline's model (work dir BASE): it translates
#                  its training source at beam 5; OUT/tok/train.{$SRC,$TGT} is the distilled pair (pieces),
#                  OUT/bin its binaries with BASE's dictionaries, valid and test copied from BASE. Skipped
#                  when OUT/bin is there; uses $USER_DIR and record. Two recipes building the same OUT at once
#                  take turns (flock on OUT/.lock): the second finds it made.
#   stopped_by_patience LOG PATIENCE
#                  true, with a note on stderr, when the fairseq-train log LOG ends in a stop by --patience of at
#                  least PATIENCE: the recipes do not train that system again
#   last_flag_value FLAG FLAGS...
#                  the value of the last FLAG among FLAGS (`FLAG VALUE` or `FLAG=VALUE`; argparse keeps the last),
#                  empty where FLAGS have none
#   stopped_by_budget LOG FLAGS...
#                  true, with a note on stderr, when LOG ends in a stop by the time or update budget
#                  (--stop-time-hours, --max-update) that FLAGS, the flags the training would run with, still set:
#                  the recipes do not train that system again (a larger budget trains it on)
#   average_last_epochs DIR N OUT
#                  fairseq-plugins average-checkpoints of DIR's last N epoch checkpoints (fewer when a training
#                  stopped sooner, e.g. by patience) into OUT; the checkpoint records which it averaged
#   average_epochs_around_best DIR LOG N OUT
#                  the same for the N epochs centred on the lowest validation loss in LOG (fairseq-train's log)
#   shared_distill BASE
#                  the beam-5 distilled training set the recipes share (rnn_fc, lattice, blockwise): $DISTILL if
#                  set, else distill/beam5 beside BASE
#   distill_beam5 BASE
#                  builds it (distill_training_set with the shared flags) unless it is there

SRC=${SRC:-en}
TGT=${TGT:-de}

check_langs() {
  local langs
  langs=$(python3 -c 'import json, sys; m = json.load(open(sys.argv[1])); print(m["source_lang"], m["target_lang"])' \
    "$1/prepare.json") || { echo "$1/prepare.json: unreadable" >&2; exit 2; }
  [[ $langs == "$SRC $TGT" ]] || {
    echo "$1 holds ${langs/ /->} data, not $SRC->$TGT: set SRC=${langs% *} TGT=${langs#* } (or prepare it anew)" >&2
    exit 2; }
}

use_baseline_data() {
  USER_DIR=$(fairseq-plugins user-dir)
  DATA=$1/data
  COMMANDS=$2/commands.txt
  mkdir -p "$2"
  [[ -f $DATA/prepare.json ]] || { echo "no prepared data in $DATA: run examples/baseline/run.sh first" >&2; exit 2; }
  check_langs "$DATA"
}
epochs() { local var="EPOCHS_${1//-/_}"; echo "${!var:-$EPOCHS}"; }

record() {
  local line
  line=$(printf '%q ' "$@")
  grep -qxF -- "$line" "$COMMANDS" 2>/dev/null || echo "$line" >> "$COMMANDS"
  "$@"
}
stage() { [[ " $STAGES " == *" $1 "* ]]; }
minutes_as_hours() {  # MINUTES NAME
  [[ $1 =~ ^([0-9]+[.]?[0-9]*|[.][0-9]+)$ ]] || { echo "$2=$1: not a number of minutes" >&2; exit 2; }
  python3 -c "import sys; print(float(sys.argv[1]) / 60)" "$1"
}

distill_training_set() {
  local base=$1 out=$2 lock
  shift 2
  [[ -f $out/bin/train.$SRC-$TGT.$TGT.bin ]] && return 0
  mkdir -p "$out/tok"
  # Recipes run side by side (make retrain) may need the same set at once: the second waits for the first to
  # finish it, then finds it made, instead of both writing the same files (where flock exists: Linux).
  if command -v flock > /dev/null; then
    exec {lock}> "$out/.lock"
    flock "$lock"
    if [[ -f $out/bin/train.$SRC-$TGT.$TGT.bin ]]; then exec {lock}>&-; return 0; fi
  fi
  if [[ ! -f $out/generate.train.out ]]; then
    record fairseq-generate "$base/data/bin" --user-dir "$USER_DIR" --path "$base/checkpoints/checkpoint_best.pt" \
      --source-lang "$SRC" --target-lang "$TGT" --gen-subset train --beam 5 --batch-size 128 "$@" \
      > "$out/generate.train.out.tmp"
    mv "$out/generate.train.out.tmp" "$out/generate.train.out"
  fi
  # H lines are SentencePiece pieces (no --bpe given); put them back in corpus order.
  fairseq-plugins detok "$base/data" --from-generate --keep-pieces --input "$out/generate.train.out" \
    > "$out/tok/train.$TGT.tmp"
  [[ $(wc -l < "$out/tok/train.$TGT.tmp") == $(wc -l < "$base/data/tok/train.$SRC") ]] || {
    echo "$out/generate.train.out: not one hypothesis per training sentence" >&2; exit 1; }
  mv "$out/tok/train.$TGT.tmp" "$out/tok/train.$TGT"
  cp "$base/data/tok/train.$SRC" "$out/tok/train.$SRC"
  record fairseq-preprocess --source-lang "$SRC" --target-lang "$TGT" --trainpref "$out/tok/train" \
    --srcdict "$base/data/bin/dict.$SRC.txt" --tgtdict "$base/data/bin/dict.$TGT.txt" \
    --destdir "$out/bin.tmp" --workers 2
  for f in "$base"/data/bin/valid.* "$base"/data/bin/test.*; do cp "$f" "$out/bin.tmp/"; done
  rm -rf "$out/bin" && mv "$out/bin.tmp" "$out/bin"
  if [[ -n ${lock:-} ]]; then exec {lock}>&-; fi  # closing the lock's only descriptor releases it
}

average_last_epochs() {
  local kept
  kept=$(find "$1" -maxdepth 1 -regex '.*/checkpoint[0-9]+\.pt' | wc -l)
  if ((kept == 0)); then  # a training stopped (by its time cap) inside its first epoch: nothing to average
    echo "average: $1 holds no epoch checkpoint yet; $3 not written" >&2
    return 0
  fi
  record fairseq-plugins average-checkpoints --inputs "$1" --num-epoch-checkpoints $(( kept < $2 ? kept : $2 )) \
    --output "$3"
}

# Whether the fairseq-train log LOG ends in a stop by --patience of at least PATIENCE validations (since its last
# start from scratch or from --finetune-from-model), said on stderr: re-run, fairseq would resume and train at least one more epoch past the
# plateau, and the recipes' averages of the last epochs would move with it. Every recipe's train stage skips such
# a training (`stopped_by_patience LOG PATIENCE && continue`).
stopped_by_patience() {  # LOG PATIENCE
  local stopped
  [[ -f $1 ]] || return 1
  stopped=$(awk '/No existing checkpoint found|loading pretrained model from/ { n = 0 }
    /early stop since valid performance hasn.t improved for last [0-9]+ runs/ { n = $(NF - 1) }
    END { print n + 0 }' "$1")
  (( stopped > 0 && stopped >= $2 )) || return 1
  echo "$(basename "$(dirname "$1")"): stopped at its plateau ($stopped validations without a new best; $1):" \
    "not trained again (a larger PATIENCE trains it on)" >&2
}

last_flag_value() {  # FLAG FLAGS...
  local flag=$1 value=
  shift
  while (( $# )); do
    case $1 in
      "$flag") value=${2-}; (( $# == 1 )) || shift ;;
      "$flag"=*) value=${1#*=} ;;
    esac
    shift
  done
  printf '%s' "$value"
}

# Whether the fairseq-train log LOG ends in a stop by its time or update budget that FLAGS (the flags the training
# would run with now; their last --stop-time-hours and --max-update count, 0 or absent: no budget) have not raised,
# said on stderr: re-run, fairseq would resume, train one more update before it checks either budget, then validate
# and save again (moving checkpoint_best.pt and the curves). Only the budget of the last stop line since the last
# start from scratch or from --finetune-from-model counts: one a larger budget has trained past does not.
stopped_by_budget() {  # LOG FLAGS...
  local log=$1 hours updates why
  shift
  [[ -f $log ]] || return 1
  hours=$(last_flag_value --stop-time-hours "$@")
  updates=$(last_flag_value --max-update "$@")
  hours=${hours:-0} updates=${updates:-0}
  # fairseq's lines: "Stopping training due to cumulative_training_time: 10.0003 > stop_time_hours: 10.0 hour(s)",
  # "Stopping training due to num_updates: 1228 >= max_update: 1228"
  why=$(awk -v hours="$hours" -v updates="$updates" '
    /No existing checkpoint found|loading pretrained model from/ { why = "" }
    /Stopping training due to (cumulative_training_time|num_updates): / {
      for (i = 1; i < NF; i++) {
        if ($i == "cumulative_training_time:")
          why = (hours > 0 && $(i + 1) + 0 > hours + 0) ? sprintf("its time budget, %.3f > %s hours", $(i + 1), hours) : ""
        if ($i == "num_updates:")
          why = (updates > 0 && $(i + 1) + 0 >= updates + 0) ? sprintf("its update budget, %d updates", $(i + 1)) : ""
      }
    }
    END { print why }' "$log")
  [[ -n $why ]] || return 1
  echo "$(basename "$(dirname "$log")"): stopped at $why ($log): not trained again (a larger budget trains it on)" >&2
}

# The N epoch checkpoints of DIR centred on the epoch of the lowest validation loss in LOG (fairseq-train's log,
# --log-format simple): from best - (N-1)/2 to best + N/2, those that exist, averaged into OUT. Either side of the
# best the weights are nearly as good and differently noisy, so their mean generalises better than the best
# alone (measured on the ByteNet LMs, docs/bytenet.md); the N epochs before it reach back to undertrained ones, the
# N after it (the last N of a training that patience stopped) are the overfitted ones. Needs --keep-last-epochs
# >= (N-1)/2 + patience + 1; without an epoch checkpoint at the best it averages the last N (average_last_epochs).
average_epochs_around_best() {  # DIR LOG N OUT
  local best epoch first last inputs=()
  best=$(sed -nE "s/.*\| epoch 0*([0-9]+) \| valid on 'valid' subset \| loss ([0-9.]+) .*/\2 \1/p" "$2" \
    | sort -g -k1,1 -k2,2n | head -n 1 | cut -d' ' -f2)
  if [[ -z $best || ! -f $1/checkpoint$best.pt ]]; then
    average_last_epochs "$1" "$3" "$4"
    return
  fi
  for ((epoch = best - ($3 - 1) / 2; epoch <= best + $3 / 2; epoch++)); do
    [[ -f $1/checkpoint$epoch.pt ]] && inputs+=("$1/checkpoint$epoch.pt") && first=${first:-$epoch} && last=$epoch
  done
  (( ${#inputs[@]} == $3 )) || echo "average: only ${#inputs[@]} of the $3 epochs around the best are there" >&2
  echo "average: epochs $first-$last of $1 (best validation loss at epoch $best)" >&2
  record fairseq-plugins average-checkpoints --inputs "${inputs[@]}" --output "$4"
}

shared_distill() { echo "${DISTILL:-$(dirname "$1")/distill/beam5}"; }
# Outputs capped at 1.2 x source + 10 tokens (Multi30k's targets stay far inside): a barely trained model's
# loops would otherwise run to 200 tokens and become training targets.
distill_beam5() { distill_training_set "$1" "$(shared_distill "$1")" --max-len-a 1.2 --max-len-b 10; }
# The base's own greedy outputs (blockwise self-distillation), BASE OUT.
distill_greedy() { distill_training_set "$1" "$2" --beam 1 --max-len-a 1.2 --max-len-b 10; }
