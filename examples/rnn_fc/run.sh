#!/usr/bin/env bash
# Fast CPU decoding (Devlin 2017) on Multi30k en->de (or SRC->TGT): rnn_fc models, the decoder switches, candidate
# lists.
#
#   distill   : the baseline transformer's beam-5 translations of the training set (sequence-level distillation,
#               shared with the lattice recipe: DISTILL, default work/distill/beam5 beside BASELINE_WORK)
#   train     : rnn_fc_multi30k variants (SYSTEMS), fairseq-train on the distilled set (TRAIN_ON=raw: the
#               references) to a plateau of validation loss (--patience PATIENCE, 3; EPOCHS a cap), keeping the last
#               AVERAGE epoch checkpoints; resumes from checkpoint_last.pt, one that patience stopped is not
#               trained again:
#                 fc4-tanh  the preset: AttGRU, 4 FC-ReLU layers, FC-tanh top
#                 fc0-tanh  no FC-ReLU layers (AttGRU, FC-tanh, softmax)
#                 fc4-gru   a GRU top layer instead of FC-tanh
#                 fc8-tanh  8 FC-ReLU layers
#               LAYOUT (residual) is the FC stack's layout: residual (pre-norm blocks, our fix) or paper.
#               Suffixes, in any order after fcN-top: "-tenc" (fc4-tanh-tenc): the same decoder on the baseline
#               transformer's encoder, warm-started from BASELINE_WORK's checkpoint and frozen
#               (rnn_fc_multi30k_transformer_encoder; our deviation from the paper's BiGRU encoder); "-d512": the
#               paper's decoder widths (AttGRU and attention 512, FC layers 1024; embeddings stay 256); "-ft" (last;
#               fc4-tanh-tenc-ft): the system named without it, trained first, fine-tuned whole (its encoder no longer
#               frozen) from its best checkpoint at FINETUNE_LR (3e-4)
#   average   : each system's last AVERAGE epoch checkpoints (fewer if it stopped sooner) averaged ->
#               checkpoint_avg.pt, the one every
#               later stage decodes
#   align     : fairseq-plugins align --lexical-table of the training pieces (systran-align)
#   shortlist : fairseq-plugins shortlist: top LIST_TOP (20) translations per source piece + the LIST_FREQUENT (100)
#               most frequent pieces
#   table1    : paper Table 1 on MAIN_SYSTEM (fc4-tanh): each decoding switch added in turn; per row the BLEU of
#               fairseq-generate on the whole test set and a bench row (vs fairseq's stock generator on the
#               same model, same run) -> RESULTS/rnn_fc_table1.json
#   table2    : paper Table 2: every SYSTEM trained to its plateau (averaged), exact switches on
#               -> RESULTS/rnn_fc_table2.json
#   baseline  : the candidate-list, int8 and early-stopping switches on the baseline transformer (any fairseq
#               model decodes with --task rnn_fc_translation) -> RESULTS/rnn_fc_baseline.json
#   lists     : candidate-list size on the baseline transformer: --frequent in FREQUENTS (100 500 2000), top 20
#               -> RESULTS/rnn_fc_lists.json
#   versus    : MAIN_SYSTEM (exact switches; all switches) against the baseline transformer at beam 6 in the same
#               run -> RESULTS/rnn_fc_vs_baseline.json (another MAIN_SYSTEM than fc4-tanh:
#               RESULTS/rnn_fc_vs_baseline_MAIN_SYSTEM.json)
#   ctranslate2 : MAIN_SYSTEM with every switch against the baseline transformer at beam 6, the stock generator and
#               CTranslate2 int8 on that baseline in the same runs (bench --reference ctranslate2, length limit 1.2 x
#               source + 10 on every side) -> RESULTS/rnn_fc_ctranslate2.json (_MAIN_SYSTEM as for versus)
#   summary   : examples/rnn_fc/summarize.py -> RESULTS/rnn_fc_summary.{json,md}
# Every bench: beam 6, one thread, one sentence at a time (the paper's setting), BENCH_LIMIT sentences.
#
# Usage: examples/rnn_fc/run.sh [BASELINE_WORK] [WORK]
#   BASELINE_WORK is the work dir of examples/baseline/run.sh (prepared data/ and checkpoints/).
#   env: SRC (en), TGT (de): the language suffixes, those of BASELINE_WORK's data,
#        STAGES, SYSTEMS, MAIN_SYSTEM (fc4-tanh: the system of table1 and versus), TRAIN_ON (distill | raw),
#        DISTILL, LAYOUT (residual | paper), FINETUNE_LR (3e-4), LIST_TOP, LIST_FREQUENT, EPOCHS (60: a cap; per
#        system EPOCHS_fc0_tanh ...), PATIENCE (3 validations without a new best), AVERAGE (5), THREADS
#        (training threads, 1), WARMUP (150, about one epoch),
#        CLIP_NORM (0: the transformer recipe clips nothing), BENCH_LIMIT (200), BENCH_RUNS (3),
#        RESULTS (WORK/results; RESULTS=docs/results writes the repository's figures), TRAIN_FLAGS (extra
#        fairseq-train flags: --fp16 on a GPU)
set -euo pipefail
# shellcheck source=examples/tools.sh
source "$(dirname "$0")/../tools.sh"  # the venv's commands on PATH (make install)
BASE=${1:-work/baseline}
WORK=${2:-work/rnn_fc}
STAGES=${STAGES:-distill train average align shortlist table1 table2 baseline lists versus ctranslate2 summary}
SYSTEMS=${SYSTEMS:-fc4-tanh fc0-tanh fc4-gru fc8-tanh}
TRAIN_ON=${TRAIN_ON:-distill}
LAYOUT=${LAYOUT:-residual}
EPOCHS=${EPOCHS:-60}
PATIENCE=${PATIENCE:-3}
AVERAGE=${AVERAGE:-5}
WARMUP=${WARMUP:-150}
CLIP_NORM=${CLIP_NORM:-0}
RESULTS=${RESULTS:-$WORK/results}
case $TRAIN_ON in distill|raw) ;; *) echo "TRAIN_ON=$TRAIN_ON: choose distill or raw" >&2; exit 2 ;; esac
case $LAYOUT in residual|paper) ;; *) echo "LAYOUT=$LAYOUT: choose residual or paper" >&2; exit 2 ;; esac
# shellcheck source=examples/common.sh
source "$(dirname "$0")/../common.sh"  # SRC, TGT, use_baseline_data, epochs, record (run + keep as provenance), stage
use_baseline_data "$BASE" "$WORK"
mkdir -p "$RESULTS"
DISTILL=$(shared_distill "$BASE")

fc_layers() { local name=${1#fc}; echo "${name%%-*}"; }   # fc4-tanh(-...) -> 4
top_layer() { local top=${1#*-}; echo "${top%%-*}"; }    # fc4-tanh(-...) -> tanh
has_suffix() { [[ $1- == *"-$2-"* ]]; }                  # has_suffix fc4-tanh-tenc-d512 tenc
# fairseq-train's task, model and size flags of a system name (see train above).
system_flags() {
  local suffix parent=${1%-ft}
  for suffix in $(cut -d- -f3- <<< "$1" | tr - ' '); do
    case $suffix in tenc|d512|ft) ;; *) echo "SYSTEMS: $1: unknown suffix -$suffix (-tenc, -d512, -ft)" >&2; exit 2 ;; esac
  done
  if [[ $parent != "$1" ]]; then
    [[ -f $WORK/$parent/checkpoints/checkpoint_best.pt ]] || {
      echo "SYSTEMS: $1 fine-tunes $parent: train $parent first ($WORK/$parent/checkpoints/checkpoint_best.pt)" >&2
      exit 2; }
    echo "--finetune-from-model $WORK/$parent/checkpoints/checkpoint_best.pt --lr ${FINETUNE_LR:-3e-4}"
  fi
  if has_suffix "$1" tenc && [[ $parent != "$1" ]]; then
    echo "--task rnn_fc_translation --arch rnn_fc_multi30k_transformer_encoder"
  elif has_suffix "$1" tenc; then
    echo "--task rnn_fc_translation --arch rnn_fc_multi30k_transformer_encoder --rnn-fc-freeze-encoder"
    echo "--rnn-fc-base-checkpoint $BASE/checkpoints/checkpoint_best.pt"
  else
    echo "--task translation --arch rnn_fc_multi30k"
  fi
  if has_suffix "$1" d512; then
    echo "--decoder-hidden-size 512 --rnn-fc-attention-dim 512 --rnn-fc-fc-dim 1024"
  fi
}
checkpoint() { echo "$WORK/$1/checkpoints/checkpoint_avg.pt"; }
train_bin() { if [[ $TRAIN_ON == raw ]]; then echo "$DATA/bin"; else echo "$DISTILL/bin"; fi; }

if stage distill && [[ $TRAIN_ON == distill ]]; then
  OMP_NUM_THREADS=${THREADS:-1} distill_beam5 "$BASE"
fi

if stage train; then
  for system in $SYSTEMS; do
    stopped_by_patience "$WORK/$system/train.log" "$PATIENCE" && continue
    mkdir -p "$WORK/$system"
    # Validation is on the references (the distilled set copies the baseline's valid split).
    flags=$(system_flags "$system")
    # shellcheck disable=SC2086  # system_flags: words, last so that they override the defaults before them
    OMP_NUM_THREADS=${THREADS:-1} record fairseq-train "$(train_bin)" --user-dir "$USER_DIR" \
      --source-lang "$SRC" --target-lang "$TGT" --rnn-fc-fc-layers "$(fc_layers "$system")" \
      --rnn-fc-top "$(top_layer "$system")" --rnn-fc-fc-layout "$LAYOUT" --optimizer adam \
      --adam-betas '(0.9, 0.98)' --clip-norm "$CLIP_NORM" --lr 1e-3 --lr-scheduler inverse_sqrt \
      --warmup-updates "$WARMUP" --criterion label_smoothed_cross_entropy --label-smoothing 0.1 \
      --max-tokens 4096 --max-epoch "$(epochs "$system")" --patience "$PATIENCE" --seed 1 \
      --save-dir "$WORK/$system/checkpoints" --keep-last-epochs "$AVERAGE" \
      --log-format simple --log-interval 50 $flags ${TRAIN_FLAGS:-} 2>&1 | tee -a "$WORK/$system/train.log"
  done
fi

if stage average; then
  for system in $SYSTEMS; do
    average_last_epochs "$WORK/$system/checkpoints" "$AVERAGE" "$(checkpoint "$system")"
  done
fi

LIST_TOP=${LIST_TOP:-20}
LIST_FREQUENT=${LIST_FREQUENT:-100}
LIST=$WORK/shortlist.pt
[[ $LIST_TOP == 20 && $LIST_FREQUENT == 100 ]] || LIST=$WORK/shortlist-t$LIST_TOP-f$LIST_FREQUENT.pt
BASELINE=$BASE/checkpoints/checkpoint_best.pt

# The lexical table and the shortlist are made once (pinned task files: a re-run must not rewrite them).
if stage align && [[ ! -f $WORK/lex.$SRC-$TGT.txt ]]; then
  record fairseq-plugins align --source "$DATA/tok/train.$SRC" --target "$DATA/tok/train.$TGT" \
    --output "$WORK/train.align" --lexical-table "$WORK/lex.$SRC-$TGT.txt"
fi

if stage shortlist && [[ ! -f $LIST ]]; then
  record fairseq-plugins shortlist --lexical-table "$WORK/lex.$SRC-$TGT.txt" --data-bin "$DATA/bin" \
    -s "$SRC" -t "$TGT" --top "$LIST_TOP" --frequent "$LIST_FREQUENT" --output "$LIST"
fi

evaluate() {  # NAME CHECKPOINT [decoding flags...]: fairseq-generate of the whole test set at beam 6, sacreBLEU
  # (env EVAL_TASK: the task that decodes, rnn_fc_translation unless given)
  local name=$1 path=$2 out=$WORK/eval/$1
  shift 2
  mkdir -p "$(dirname "$out")"
  OMP_NUM_THREADS=1 record fairseq-generate "$DATA/bin" --user-dir "$USER_DIR" --task "${EVAL_TASK:-rnn_fc_translation}" \
    --path "$path" --source-lang "$SRC" --target-lang "$TGT" --gen-subset test --beam 6 --batch-size 64 "$@" > "$out.out.tmp"
  mv "$out.out.tmp" "$out.out"
  fairseq-plugins detok "$DATA" --from-generate --input "$out.out" > "$out.$TGT"
  sacrebleu "$DATA/raw/test.$TGT" -i "$out.$TGT" -m bleu > "$out.bleu.json"
  echo "$name: $(sacrebleu "$DATA/raw/test.$TGT" -i "$out.$TGT" -m bleu -b)"
}

bench_row() {  # JSON LABEL CHECKPOINT [bench and decoding flags...]: beam 6, one thread, batch 1
  local json=$1 label=$2 path=$3
  shift 3
  fairseq-plugins bench --method rnn_fc --label "$label" --path "$path" --beam 6 --data "$DATA" --split test \
    --threads 1 --batch-size 1 --limit "${BENCH_LIMIT:-200}" --runs "${BENCH_RUNS:-3}" \
    --provenance "$COMMANDS" "$BASE/commands.txt" --json "$json" --append "$@"
}

evaluate_and_bench_rows() {  # PREFIX CHECKPOINT JSON ROW...: each "label|flags" row evaluated as PREFIX-<i>
  local prefix=$1 path=$2 json=$3 i label
  shift 3
  local rows=("$@") flags
  rm -f "$json.tmp"
  for i in "${!rows[@]}"; do
    label=${rows[$i]%%|*}
    read -r -a flags <<< "${rows[$i]#*|}"
    evaluate "$prefix-$i" "$path" "${flags[@]}"
    bench_row "$json.tmp" "$label" "$path" "${flags[@]}"
  done
  mv "$json.tmp" "$json"
}

# Paper Table 1: label|flags, each row adding one switch to the one before.
TABLE1=(
  "plain decoder|--rnn-fc-speedups none"
  "+ beam-batched matmuls|--rnn-fc-speedups batched"
  "+ pre-computed embeddings|--rnn-fc-speedups batched,embeddings"
  "+ pre-computed attention|--rnn-fc-speedups batched,embeddings,attention"
  "+ merged states|--rnn-fc-speedups all"
  "+ early stopping|--rnn-fc-speedups all --rnn-fc-early-stop"
  "+ int8|--rnn-fc-speedups all --rnn-fc-early-stop --rnn-fc-precision int8"
  "+ candidate lists|--rnn-fc-speedups all --rnn-fc-early-stop --rnn-fc-precision int8 --rnn-fc-shortlist $LIST"
)
MAIN_SYSTEM=${MAIN_SYSTEM:-fc4-tanh}
MAIN=$(checkpoint "$MAIN_SYSTEM")

if stage table1; then
  evaluate_and_bench_rows table1 "$MAIN" "$RESULTS/rnn_fc_table1.json" "${TABLE1[@]}"
fi

if stage table2; then
  json=$RESULTS/rnn_fc_table2.json
  rm -f "$json.tmp"
  for system in $SYSTEMS; do
    evaluate "table2-$system" "$(checkpoint "$system")"
    bench_row "$json.tmp" "$system (averaged at its plateau)" "$(checkpoint "$system")"
  done
  mv "$json.tmp" "$json"
fi

# The switches that apply to any fairseq model, on the baseline transformer.
BASELINE_ROWS=(
  "transformer, this search|"
  "+ candidate lists|--rnn-fc-shortlist $LIST"
  "+ int8|--rnn-fc-precision int8"
  "+ int8 + candidate lists|--rnn-fc-precision int8 --rnn-fc-shortlist $LIST"
  "+ int8 + candidate lists + early stopping|--rnn-fc-precision int8 --rnn-fc-shortlist $LIST --rnn-fc-early-stop"
)

if stage baseline; then
  EVAL_TASK=translation evaluate baseline-stock "$BASELINE"  # stock fairseq, beam 6
  evaluate_and_bench_rows baseline "$BASELINE" "$RESULTS/rnn_fc_baseline.json" "${BASELINE_ROWS[@]}"
fi

if stage lists; then
  json=$RESULTS/rnn_fc_lists.json
  rm -f "$json.tmp"
  for frequent in ${FREQUENTS:-100 500 2000}; do
    record fairseq-plugins shortlist --lexical-table "$WORK/lex.$SRC-$TGT.txt" --data-bin "$DATA/bin" \
      -s "$SRC" -t "$TGT" --top 20 --frequent "$frequent" --output "$WORK/shortlist-f$frequent.pt"
    evaluate "lists-f$frequent" "$BASELINE" --rnn-fc-shortlist "$WORK/shortlist-f$frequent.pt"
    bench_row "$json.tmp" "transformer + candidate lists (top 20, $frequent frequent)" "$BASELINE" \
      --rnn-fc-shortlist "$WORK/shortlist-f$frequent.pt"
  done
  mv "$json.tmp" "$json"
fi

if stage versus; then
  # The target: rnn_fc against the baseline transformer (stock fairseq, beam 6) decoded in the same run.
  json=$RESULTS/rnn_fc_vs_baseline.json
  [[ $MAIN_SYSTEM == fc4-tanh ]] || json=$RESULTS/rnn_fc_vs_baseline_$MAIN_SYSTEM.json
  rm -f "$json.tmp"
  bench_row "$json.tmp" "$MAIN_SYSTEM exact switches" "$MAIN" --baseline-path "$BASELINE"
  read -r -a flags <<< "${TABLE1[-1]#*|}"
  bench_row "$json.tmp" "$MAIN_SYSTEM all switches" "$MAIN" --baseline-path "$BASELINE" "${flags[@]}"
  mv "$json.tmp" "$json"
fi

if stage ctranslate2; then
  # What users pick instead: MAIN_SYSTEM with every switch against the baseline transformer at beam 6, decoded in
  # the same runs by the stock generator and by CTranslate2 int8 (bench --reference ctranslate2, its own fairseq
  # converter; the same length limit on every side).
  json=$RESULTS/rnn_fc_ctranslate2.json
  [[ $MAIN_SYSTEM == fc4-tanh ]] || json=$RESULTS/rnn_fc_ctranslate2_$MAIN_SYSTEM.json
  rm -f "$json.tmp"
  read -r -a flags <<< "${TABLE1[-1]#*|}"
  bench_row "$json.tmp" "$MAIN_SYSTEM all switches vs CTranslate2 int8" "$MAIN" --baseline-path "$BASELINE" \
    "${flags[@]}" --max-len-a 1.2 --max-len-b 10 --reference ctranslate2 --reference-compute-type int8
  mv "$json.tmp" "$json"
fi

if stage summary; then
  python "$(dirname "$0")/summarize.py" --work "$WORK" --results "$RESULTS" --out "$RESULTS/rnn_fc_summary"
fi
