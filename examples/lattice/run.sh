#!/usr/bin/env bash
# Sequence-to-lattice translation on Multi30k en->de (or SRC->TGT): tables, training, and the paper's comparisons.
#
#   distill  : the baseline transformer (examples/baseline) translates the training source, beam 5; its
#              outputs become a distilled training set (same dictionaries), binarised in DISTILL/bin (shared with the
#              rnn_fc and blockwise recipes; default work/distill/beam5 beside BASELINE_WORK)
#   align    : fairseq-plugins align (systran-align, or ALIGN_BACKEND=fast_align) of each training set
#   table    : fairseq-plugins lattice-table of each, and lattice-recall on test (paper Fig. 1)
#   train    : lattice_transformer_multi30k (the baseline's encoder, a Markov scorer) for each SYSTEM (resumes
#              from checkpoint_last.pt; one that patience stopped is not trained again):
#                raw-1      original targets, 1 scorer layer
#                distill-1  distilled targets, 1 scorer layer (the paper's setting)
#                distill-2, distill-3   distilled targets, 2 and 3 scorer layers (paper Table 3)
#   average  : the mean of each system's last AVERAGE (5) epoch checkpoints (fewer when patience stopped it
#              sooner), checkpoint_avg.pt (it records which it averaged): what every later stage decodes
#   evaluate : fairseq-generate --task lattice_translation on the whole test set, sacreBLEU
#   bench    : fairseq-plugins bench of each system against the baseline transformer at beam 5 decoded in
#              the same run (--baseline-path), one thread, one sentence at a time (latency), K=64
#   ks       : the same for distill-1 at each K of KS (paper Table 2)
#   layers   : distill-1, -2, -3 after LAYERS_EPOCH (3) epochs each: BLEU and a bench row (paper Table 3)
#   fast     : distill-1 at each K of FAST_KS (24 32 64) x precision of FAST_PRECISIONS (fp32 int8: the scorer's
#              feed-forward matrices and the encoder's, --lattice-scorer-precision and --lattice-encoder-precision)
#              x FAST_NO_REPEAT (0 3: Viterbi, or --no-repeat-ngram-size 3): whole-test BLEU and a bench row each,
#              and FAST_BATCH_SETTING ("32 int8 3": K, precision, no-repeat) at batch 32 on the whole test set
#              -> RESULTS/lattice_fast.json
#   ctranslate2: (only when asked) issue 53's moonshot: distill-1 at CT2_SETTINGS ("24 int8 3": K, precision,
#              no-repeat; several settings separated by commas) against the baseline decoded in the same runs at
#              beam 5 by the stock generator and by CTranslate2 int8 (bench --reference ctranslate2), batch 1, one
#              thread, the whole test set (CT2_LIMIT, 0) -> RESULTS/lattice_ctranslate2.json
#   summary  : examples/lattice/summarize.py -> RESULTS/lattice_summary.{json,md} and the frontier plot
#              RESULTS/lattice_frontier.png (BLEU gap against speed ratio, every setting, the paper's point)
#
# Usage: examples/lattice/run.sh [BASELINE_WORK] [WORK]
#   BASELINE_WORK is the work dir of examples/baseline/run.sh (prepared data/ and checkpoints/).
#   env: SRC (en), TGT (de): the language suffixes, those of BASELINE_WORK's data,
#        STAGES, SYSTEMS ("raw-1 distill-1 distill-2 distill-3"), EPOCHS (6; per system EPOCHS_raw_1 ...,
#        distill-2 and distill-3 default to LAYERS_EPOCH), WARMUP (400), THREADS (training threads per
#        system, 2), KS ("1 32 64 128"), K (64),
#        BENCH_LIMIT (200 sentences), BENCH_RUNS (3), LAYERS_EPOCH (3), DEVICE (cpu),
#        RESULTS (WORK/results; RESULTS=docs/results writes the repository's figures),
#        LR (1e-3), AVERAGE (5), ALIGN_BACKEND (systran), WARM_START (1: encoder and embeddings from the baseline's checkpoint,
#        --lattice-base-checkpoint; 0: from scratch), VARIANT_RESULTS (summary: bench JSONs of other systems to
#        plot on the frontier, their rows with a whole-test BLEU), PATIENCE (3 validations without improvement stop a system;
#        EPOCHS is a cap; the distilled systems' plateau is of validation BLEU, lattice decoding at K, when their
#        table exists, the others' of validation loss), TRAIN_FLAGS (extra fairseq-train flags: --fp16 on a GPU)
set -euo pipefail
# shellcheck source=examples/tools.sh
source "$(dirname "$0")/../tools.sh"  # the venv's commands on PATH (make install)
BASE=${1:-work/baseline}
WORK=${2:-work/lattice}
STAGES=${STAGES:-distill align table train average evaluate bench ks layers fast summary}
SYSTEMS=${SYSTEMS:-raw-1 distill-1 distill-2 distill-3}
EPOCHS=${EPOCHS:-6}
LAYERS_EPOCH=${LAYERS_EPOCH:-3}
: "${EPOCHS_distill_2:=$LAYERS_EPOCH}" "${EPOCHS_distill_3:=$LAYERS_EPOCH}"
WARMUP=${WARMUP:-400}
LR=${LR:-1e-3}
AVERAGE=${AVERAGE:-5}
K=${K:-64}
RESULTS=${RESULTS:-$WORK/results}
# shellcheck source=examples/common.sh
source "$(dirname "$0")/../common.sh"  # SRC, TGT, use_baseline_data, epochs, record (run + keep as provenance), stage
use_baseline_data "$BASE" "$WORK"
mkdir -p "$RESULTS"
DISTILL=$(shared_distill "$BASE")

corpus() { echo "${1%-*}"; }                       # raw-1 -> raw, distill-2 -> distill
layers() { echo "${1#*-}"; }                       # raw-1 -> 1
data_bin() { if [[ $1 == raw ]]; then echo "$DATA/bin"; else echo "$DISTILL/bin"; fi; }
tok_dir() { if [[ $1 == raw ]]; then echo "$DATA/tok"; else echo "$DISTILL/tok"; fi; }
table() { echo "$WORK/$1/table.pt"; }
checkpoint() { echo "$WORK/$1/checkpoints/checkpoint_avg.pt"; }
warm_start_flags() {
  [[ ${WARM_START:-1} == 1 ]] && echo "--lattice-base-checkpoint $BASE/checkpoints/checkpoint_best.pt"
  echo "--patience ${PATIENCE:-3}"
}
# The plateau of a system trained on distilled targets is of validation BLEU (lattice decoding at K): the
# validation loss is on the references, which the distilled targets are not, and it rises while BLEU improves
# (as for double_token's distilled systems). Without a table (e.g. on a device that lacks it), of validation loss.
plateau_flags() {
  if [[ $(corpus "$1") == distill && -f $(table distill) ]]; then
    echo "--lattice-table $(table distill) --lattice-k $K --eval-bleu --eval-bleu-remove-bpe sentencepiece"
    echo "--best-checkpoint-metric bleu --maximize-best-checkpoint-metric"
  fi
}
corpora() { for system in $SYSTEMS; do corpus "$system"; done | sort -u; }

if stage distill; then
  OMP_NUM_THREADS=${THREADS:-2} distill_beam5 "$BASE"
fi

# The alignment and the table are made once (the table is a pinned task file: a re-run must not rewrite it).
if stage align; then
  for c in $(corpora); do
    mkdir -p "$WORK/$c"
    [[ -f $WORK/$c/train.align ]] && continue
    record fairseq-plugins align --backend "${ALIGN_BACKEND:-systran}" --source "$(tok_dir "$c")/train.$SRC" \
      --target "$(tok_dir "$c")/train.$TGT" --output "$WORK/$c/train.align"
  done
fi

if stage table; then
  for c in $(corpora); do
    [[ -f $(table "$c") ]] || record fairseq-plugins lattice-table --data-bin "$(data_bin "$c")" -s "$SRC" \
      -t "$TGT" --split train --alignment "$WORK/$c/train.align" --output "$(table "$c")"
    [[ -f $RESULTS/lattice_recall_$c.json ]] || record fairseq-plugins lattice-recall --table "$(table "$c")" --data-bin "$(data_bin "$c")" \
      -s "$SRC" -t "$TGT" --split test --json "$RESULTS/lattice_recall_$c.json"
  done
fi

if stage train; then
  for system in $SYSTEMS; do
    stopped_by_patience "$WORK/$system/train.log" "${PATIENCE:-3}" && continue
    c=$(corpus "$system")
    mkdir -p "$WORK/$system"
    # shellcheck disable=SC2046,SC2086  # word splitting of the warm-start flags and TRAIN_FLAGS is intended
    OMP_NUM_THREADS=${THREADS:-2} record fairseq-train "$(data_bin "$c")" --user-dir "$USER_DIR" \
      --task lattice_translation --source-lang "$SRC" --target-lang "$TGT" \
      --arch lattice_transformer_multi30k --lattice-scorer-layers "$(layers "$system")" \
      --optimizer adam --adam-betas '(0.9, 0.98)' --clip-norm 0.0 \
      --lr "$LR" --lr-scheduler inverse_sqrt --warmup-updates "$WARMUP" \
      --criterion label_smoothed_cross_entropy --label-smoothing 0.1 \
      --max-tokens 4096 --max-epoch "$(epochs "$system")" --seed 1 \
      --save-dir "$WORK/$system/checkpoints" --keep-last-epochs "$AVERAGE" $(warm_start_flags) $(plateau_flags "$system") \
      --log-format simple --log-interval 50 ${TRAIN_FLAGS:-} 2>&1 | tee -a "$WORK/$system/train.log"
  done
fi

if stage average; then
  for system in $SYSTEMS; do
    average_last_epochs "$WORK/$system/checkpoints" "$AVERAGE" "$(checkpoint "$system")"
  done
fi

decode_flags() {  # SYSTEM: the task flags that decode it
  echo "--task lattice_translation --lattice-table $(table "$(corpus "$1")") --lattice-k $K"
}

if stage evaluate; then
  # Plain fairseq-generate + sacreBLEU on the whole test set, the way a user would score it; the baseline
  # transformer at beam 5 scored the same way.
  mkdir -p "$WORK/baseline"
  record fairseq-generate "$DATA/bin" --user-dir "$USER_DIR" --path "$BASE/checkpoints/checkpoint_best.pt" \
    --source-lang "$SRC" --target-lang "$TGT" --gen-subset test --beam 5 --batch-size 64 > "$WORK/baseline/generate.out"
  for system in baseline $SYSTEMS; do
    if [[ $system != baseline ]]; then
      mkdir -p "$WORK/$system"
      # shellcheck disable=SC2046
      record fairseq-generate "$DATA/bin" --user-dir "$USER_DIR" $(decode_flags "$system") \
        --path "$(checkpoint "$system")" --source-lang "$SRC" --target-lang "$TGT" --gen-subset test --batch-size 64 \
        > "$WORK/$system/generate.out.tmp"
      mv "$WORK/$system/generate.out.tmp" "$WORK/$system/generate.out"
    fi
    fairseq-plugins detok "$DATA" --from-generate --input "$WORK/$system/generate.out" > "$WORK/$system/hyp.$TGT"
    sacrebleu "$DATA/raw/test.$TGT" -i "$WORK/$system/hyp.$TGT" -m bleu > "$WORK/$system/bleu.json"
    echo "$system: $(sacrebleu "$DATA/raw/test.$TGT" -i "$WORK/$system/hyp.$TGT" -m bleu -b)"
  done
fi

bench_against_baseline() {  # SYSTEM CHECKPOINT LABEL JSON [decoding flags...]: one bench row, baseline beam 5 in the same run
  # (plain: the lattice's --no-repeat-ngram-size is not the baseline's)
  local system=$1 path=$2 label=$3 json=$4
  shift 4
  # shellcheck disable=SC2046
  fairseq-plugins bench --method lattice --label "$label" --path "$path" \
    --baseline-path "$BASE/checkpoints/checkpoint_best.pt" --baseline-beam 5 --baseline-no-repeat-ngram-size 0 --beam 5 \
    --data "$DATA" --split test --device "${DEVICE:-cpu}" --threads "${BENCH_THREADS:-1}" --batch-size "${BENCH_BATCH:-1}" \
    --limit "${BENCH_LIMIT:-200}" --runs "${BENCH_RUNS:-3}" --provenance "$COMMANDS" --json "$json" --append \
    $(decode_flags "$system") "$@"
}

if stage bench; then
  json=$RESULTS/lattice.json
  rm -f "$json.tmp"
  for system in $SYSTEMS; do
    bench_against_baseline "$system" "$(checkpoint "$system")" "$system" "$json.tmp"
  done
  # The edge softmax over the whole vocabulary (as in training) instead of over the lattice.
  bench_against_baseline distill-1 "$(checkpoint distill-1)" "distill-1 vocab-softmax" "$json.tmp" --lattice-normalize vocab
  mv "$json.tmp" "$json"
fi

if stage ks; then
  json=$RESULTS/lattice_k.json
  rm -f "$json.tmp"
  for k in ${KS:-1 32 64 128}; do
    bench_against_baseline distill-1 "$(checkpoint distill-1)" "distill-1 K=$k" "$json.tmp" --lattice-k "$k"
  done
  mv "$json.tmp" "$json"
fi

if stage layers; then
  # Paper Table 3: 1, 2, 3 scorer layers after the same number of epochs (LAYERS_EPOCH; distill-1 trains
  # longer, its epoch checkpoint is used), whole-test BLEU and a bench row each.
  json=$RESULTS/lattice_layers.json
  rm -f "$json.tmp"
  for system in distill-1 distill-2 distill-3; do
    path=$WORK/$system/checkpoints/checkpoint$LAYERS_EPOCH.pt
    out=$WORK/$system/generate.epoch$LAYERS_EPOCH.out
    # shellcheck disable=SC2046
    record fairseq-generate "$DATA/bin" --user-dir "$USER_DIR" $(decode_flags "$system") --path "$path" \
      --source-lang "$SRC" --target-lang "$TGT" --gen-subset test --batch-size 64 > "$out.tmp"
    mv "$out.tmp" "$out"
    fairseq-plugins detok "$DATA" --from-generate --input "$out" > "$out.$TGT"
    sacrebleu "$DATA/raw/test.$TGT" -i "$out.$TGT" -m bleu > "$out.bleu.json"
    bench_against_baseline "$system" "$path" "$system epoch $LAYERS_EPOCH" "$json.tmp"
  done
  mv "$json.tmp" "$json"
fi

if stage fast; then
  # The latency settings on distill-1: K x precision (of the scorer's feed-forward matrices and the encoder's)
  # x --no-repeat-ngram-size (0: Viterbi; n: the beam search over the scored lattice that forbids repeated
  # n-grams), hoisting on (the default); each with its whole-test BLEU (fairseq-generate) and a bench row against
  # the baseline at beam 5. Labels "distill-1 K=32 int8 [nr3]", outputs generate.k32.int8[.nr3].out.
  json=$RESULTS/lattice_fast.json
  rm -f "$json.tmp"
  for k in ${FAST_KS:-24 32 64}; do
    for precision in ${FAST_PRECISIONS:-fp32 int8}; do
      for no_repeat in ${FAST_NO_REPEAT:-0 3}; do
        flags=(--lattice-k "$k" --lattice-scorer-precision "$precision" --lattice-encoder-precision "$precision")
        setting="K=$k $precision" slug="k$k.$precision"
        if [[ $no_repeat != 0 ]]; then
          flags+=(--no-repeat-ngram-size "$no_repeat")
          setting+=" nr$no_repeat" slug+=".nr$no_repeat"
        fi
        out=$WORK/distill-1/generate.$slug.out
        # shellcheck disable=SC2046
        record fairseq-generate "$DATA/bin" --user-dir "$USER_DIR" $(decode_flags distill-1) "${flags[@]}" \
          --path "$(checkpoint distill-1)" --source-lang "$SRC" --target-lang "$TGT" --gen-subset test --batch-size 64 \
          > "$out.tmp"
        mv "$out.tmp" "$out"
        fairseq-plugins detok "$DATA" --from-generate --input "$out" > "$out.$TGT"
        sacrebleu "$DATA/raw/test.$TGT" -i "$out.$TGT" -m bleu > "$out.bleu.json"
        echo "distill-1 $setting: $(sacrebleu "$DATA/raw/test.$TGT" -i "$out.$TGT" -m bleu -b)"
        bench_against_baseline distill-1 "$(checkpoint distill-1)" "distill-1 $setting" "$json.tmp" "${flags[@]}"
      done
    done
  done
  # Throughput at batch 32 (all test sentences), the setting of FAST_BATCH_SETTING, against beam 5 at batch 32.
  read -r k precision no_repeat <<< "${FAST_BATCH_SETTING:-32 int8 3}"
  BENCH_LIMIT=0 BENCH_BATCH=32 bench_against_baseline distill-1 "$(checkpoint distill-1)" \
    "distill-1 K=$k $precision$([[ $no_repeat != 0 ]] && echo " nr$no_repeat")" "$json.tmp" --lattice-k "$k" \
    --lattice-scorer-precision "$precision" --lattice-encoder-precision "$precision" --no-repeat-ngram-size "$no_repeat"
  mv "$json.tmp" "$json"
fi

if stage ctranslate2; then
  json=$RESULTS/lattice_ctranslate2.json
  rm -f "$json.tmp"
  IFS=, read -ra settings <<< "${CT2_SETTINGS:-24 int8 3}"
  for setting in "${settings[@]}"; do
    read -r k precision no_repeat <<< "$setting"
    BENCH_LIMIT=${CT2_LIMIT:-0} bench_against_baseline distill-1 "$(checkpoint distill-1)" \
      "distill-1 K=$k $precision$([[ $no_repeat != 0 ]] && echo " nr$no_repeat") vs CTranslate2 int8" "$json.tmp" \
      --lattice-k "$k" --lattice-scorer-precision "$precision" --lattice-encoder-precision "$precision" \
      --no-repeat-ngram-size "$no_repeat" --reference ctranslate2 --reference-compute-type int8
  done
  mv "$json.tmp" "$json"
fi

if stage summary; then
  python "$(dirname "$0")/summarize.py" --work "$WORK" --systems $SYSTEMS --bench "$RESULTS/lattice.json" \
    --ks "$RESULTS/lattice_k.json" --fast "$RESULTS/lattice_fast.json" --layers "$RESULTS/lattice_layers.json" --layers-epoch "$LAYERS_EPOCH" --recall "$RESULTS"/lattice_recall_*.json --commands "$COMMANDS" \
    --out "$RESULTS/lattice_summary" --plot "$RESULTS/lattice_frontier.png" ${VARIANT_RESULTS:+--variants $VARIANT_RESULTS}
fi
