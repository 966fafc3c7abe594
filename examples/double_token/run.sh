#!/usr/bin/env bash
# Double-token bidirectional decoding (Imamura & Sumita 2020) on Multi30k en->de (or SRC->TGT): the paper's Table 2,
# Fig. 3 and Table 3 on our data.
#
#   train    : the five systems, same architecture (double_token_transformer_multi30k: the baseline's sizes,
#              learned decoder positions), each warm-started from the baseline's checkpoint
#              (--double-token-base-checkpoint) and fine-tuned to a plateau of validation loss (with TRAIN_ON=distill:
#              of greedy validation BLEU, --eval-bleu) (--patience PATIENCE, 3,
#              at most EPOCHS epochs), same seed and schedule, on the baseline's prepared data; resumes from
#              checkpoint_last.pt (one that patience stopped is not trained again). A system is ORDER-TOKENS_PER_STEP:
#                l2r-1 (single-token L2R, stock), r2l-1, l2r-2, r2l-2, bidir-2 (the paper's method)
#   average  : the mean of each system's last 5 epoch checkpoints (the paper's averaging; fewer when a system
#              stopped sooner), checkpoint_avg.pt (it records which it averaged): what every later stage decodes
#   evaluate : fairseq-generate --beam BEAM on the whole test set, detokenised, sacreBLEU (Table 2's BLEU)
#   bench    : fairseq-plugins bench of each other system against l2r-1 decoded in the same run
#              (--baseline-path): tokens/s and its ratio (Table 2's speed), one thread, one sentence at a
#              time, beam BEAM, the first BENCH_LIMIT test sentences
#   beams    : the same for bidir-2 at each of BEAMS (Fig. 3: speed ratio against beam width)
#   fast     : the bench rows again with every system on the fast decoder step (--fast-step, docs/fast-step.md)
#              at each of FAST_PRECISIONS (fp32 int8), still against stock l2r-1 (l2r-1's own row: what the fast
#              step alone gives), batch sizes BENCH_BATCHES -> RESULTS/double_token_fast_step.json
#   ctranslate2: (only when asked) issue 53's moonshot: bidir-2 on the fast int8 step at beam CT2_BEAM (5) against
#              the baseline, decoded in the same runs by the stock generator and by CTranslate2 int8 (bench
#              --reference ctranslate2), one thread, batch 1, the first CT2_LIMIT (0: all) test sentences
#              -> RESULTS/double_token_ctranslate2.json
#   ngram    : fairseq-plugins ngram-precision of every system's evaluate output (Table 3)
#   summary  : examples/double_token/summarize.py -> RESULTS/double_token_table2.{json,md}
#
# Usage: examples/double_token/run.sh [BASELINE_WORK] [WORK]
#   BASELINE_WORK is the work dir of examples/baseline/run.sh (only its prepared data/ is used).
#   env: SRC (en), TGT (de): the language suffixes, those of BASELINE_WORK's data,
#        STAGES ("train average evaluate bench beams fast ngram summary"; ctranslate2 when asked: CT2_BEAM,
#        CT2_LIMIT), SYSTEMS (all five), AVERAGE (5: epoch checkpoints averaged), EPOCHS (40: a cap; patience
#        stops earlier), PATIENCE (3 validations without a new best), LR (5e-4), WARMUP (500), THREADS (training threads per system, 1: run two
#        recipes with different SYSTEMS side by side on 2 cores), BEAM (10), BEAMS ("1 2 5 10 20"),
#        BENCH_LIMIT (200 sentences), BENCH_BATCHES ("1 32": batch sizes of the bench and fast stages), BEAMS_LIMIT (100), BENCH_RUNS (3),
#        RESULTS (WORK/results; RESULTS=docs/results writes the repository's figures),
#        FAST_PRECISIONS ("fp32 int8": the fast stage's --fast-step-precision),
#        TRAIN_FLAGS (extra fairseq-train flags: --fp16 on a GPU), TRAIN_ON (raw: the references; distill: the
#        baseline's beam-5 translations, DISTILL or distill/beam5 beside BASELINE_WORK, examples/lattice's distill
#        stage), INIT_WORK (a double-token work dir: each system starts from its checkpoint_avg.pt there,
#        --finetune-from-model, instead of the baseline), GEN_FLAGS (decoding flags of evaluate, bench and beams, "--max-len-a 1.2 --max-len-b 10": outputs of
#        briefly trained models that never end are cut alike for every system)
set -euo pipefail
# shellcheck source=examples/tools.sh
source "$(dirname "$0")/../tools.sh"  # the venv's commands on PATH (make install)
BASE=${1:-work/baseline}
WORK=${2:-work/double_token}
STAGES=${STAGES:-train average evaluate bench beams fast ngram summary}
SYSTEMS=${SYSTEMS:-l2r-1 r2l-1 l2r-2 r2l-2 bidir-2}
EPOCHS=${EPOCHS:-40}
PATIENCE=${PATIENCE:-3}
LR=${LR:-5e-4}
WARMUP=${WARMUP:-500}
AVERAGE=${AVERAGE:-5}
BEAM=${BEAM:-10}
GEN_FLAGS=${GEN_FLAGS:---max-len-a 1.2 --max-len-b 10}
BENCH_BATCHES=${BENCH_BATCHES:-1 32}
TRAIN_ON=${TRAIN_ON:-raw}
INIT_WORK=${INIT_WORK:-}
case $TRAIN_ON in raw|distill) ;; *) echo "TRAIN_ON=$TRAIN_ON: choose raw or distill" >&2; exit 2 ;; esac
[[ -z $INIT_WORK || -d $INIT_WORK ]] || { echo "INIT_WORK=$INIT_WORK: no such directory" >&2; exit 2; }
RESULTS=${RESULTS:-$WORK/results}
# shellcheck source=examples/common.sh
source "$(dirname "$0")/../common.sh"  # SRC, TGT, use_baseline_data, epochs, record (run + keep as provenance), stage
use_baseline_data "$BASE" "$WORK"
mkdir -p "$RESULTS"

system_flags() {  # the task flags of system ORDER-N
  local order=${1%-*} per_step=${1#*-}
  case $order-$per_step in
    l2r-1|r2l-1|l2r-2|r2l-2|bidir-2) echo "--task double_token_translation --token-order $order --tokens-per-step $per_step" ;;
    *) echo "unknown system $1 (l2r-1 r2l-1 l2r-2 r2l-2 bidir-2)" >&2; exit 2 ;;
  esac
}
checkpoint() { echo "$WORK/$1/checkpoints/checkpoint_avg.pt"; }
train_bin() { if [[ $TRAIN_ON == distill ]]; then echo "$(shared_distill "$BASE")/bin"; else echo "$DATA/bin"; fi; }
# The plateau: of validation loss on the references' own training set; of validation BLEU (greedy, natural order)
# on the distilled one, where the loss on the references' valid set rises from the first epoch while BLEU still
# improves (measured: bidir-2 38.6 after one distilled epoch, 39.1 averaged over four, its valid loss rising).
plateau_flags() {
  if [[ $TRAIN_ON == distill ]]; then
    echo "--eval-bleu --eval-bleu-args {\"beam\":1} --eval-bleu-remove-bpe sentencepiece"
    echo "--best-checkpoint-metric bleu --maximize-best-checkpoint-metric"
  fi
}
init_flags() {  # SYSTEM: where its weights start (fairseq applies either only when no checkpoint_last.pt exists)
  if [[ -n $INIT_WORK ]]; then echo "--finetune-from-model $INIT_WORK/$1/checkpoints/checkpoint_avg.pt"
  else echo "--double-token-base-checkpoint $BASE/checkpoints/checkpoint_best.pt"; fi
}

if stage train; then
  for system in $SYSTEMS; do
    stopped_by_patience "$WORK/$system/train.log" "$PATIENCE" && continue
    mkdir -p "$WORK/$system"
    # shellcheck disable=SC2046,SC2086  # word splitting of the system's flags and TRAIN_FLAGS is intended
    OMP_NUM_THREADS=${THREADS:-1} record fairseq-train "$(train_bin)" --user-dir "$USER_DIR" $(system_flags "$system") \
      --source-lang "$SRC" --target-lang "$TGT" --arch double_token_transformer_multi30k $(init_flags "$system") \
      --optimizer adam --adam-betas '(0.9, 0.98)' --clip-norm 0.0 \
      --lr "$LR" --lr-scheduler inverse_sqrt --warmup-updates "$WARMUP" \
      --criterion label_smoothed_cross_entropy --label-smoothing 0.1 \
      --max-tokens 4096 --max-epoch "$EPOCHS" --patience "$PATIENCE" $(plateau_flags) --seed 1 \
      --save-dir "$WORK/$system/checkpoints" --keep-last-epochs "$AVERAGE" \
      --log-format simple --log-interval 50 ${TRAIN_FLAGS:-} 2>&1 | tee -a "$WORK/$system/train.log"
  done
fi

if stage average; then
  for system in $SYSTEMS; do
    average_last_epochs "$WORK/$system/checkpoints" "$AVERAGE" "$(checkpoint "$system")"
  done
fi

if stage evaluate; then
  # Plain fairseq-generate + sacreBLEU on the whole test set, the way a user would score it; the stock baseline
  # transformer (the warm start) decoded alike is the l2r-1 target's reference.
  mkdir -p "$WORK/baseline"
  # shellcheck disable=SC2086
  record fairseq-generate "$DATA/bin" --user-dir "$USER_DIR" --path "$BASE/checkpoints/checkpoint_best.pt" \
    --source-lang "$SRC" --target-lang "$TGT" --gen-subset test --beam "$BEAM" --batch-size 64 $GEN_FLAGS \
    > "$WORK/baseline/generate.beam$BEAM.out"
  fairseq-plugins detok "$DATA" --from-generate --input "$WORK/baseline/generate.beam$BEAM.out" \
    > "$WORK/baseline/hyp.beam$BEAM.$TGT"
  sacrebleu "$DATA/raw/test.$TGT" -i "$WORK/baseline/hyp.beam$BEAM.$TGT" -m bleu > "$WORK/baseline/bleu.beam$BEAM.json"
  echo "stock baseline beam $BEAM: $(sacrebleu "$DATA/raw/test.$TGT" -i "$WORK/baseline/hyp.beam$BEAM.$TGT" -m bleu -b)"
  for system in $SYSTEMS; do
    out=$WORK/$system/generate.beam$BEAM.out
    # shellcheck disable=SC2046,SC2086
    record fairseq-generate "$DATA/bin" --user-dir "$USER_DIR" $(system_flags "$system") --path "$(checkpoint "$system")" \
      --source-lang "$SRC" --target-lang "$TGT" --gen-subset test --beam "$BEAM" --batch-size 64 $GEN_FLAGS > "$out.tmp"
    mv "$out.tmp" "$out"
    fairseq-plugins detok "$DATA" --from-generate --input "$out" > "$WORK/$system/hyp.beam$BEAM.$TGT"
    sacrebleu "$DATA/raw/test.$TGT" -i "$WORK/$system/hyp.beam$BEAM.$TGT" -m bleu > "$WORK/$system/bleu.beam$BEAM.json"
    echo "$system beam $BEAM: $(sacrebleu "$DATA/raw/test.$TGT" -i "$WORK/$system/hyp.beam$BEAM.$TGT" -m bleu -b)"
  done
fi

bench_against_l2r() {  # SYSTEM BEAM LIMIT JSON [BATCH [LABEL FLAGS...]]: one bench row, stock single-token L2R decoded in the same run
  local system=$1 beam=$2 limit=$3 json=$4 batch=${5:-1} label=${6:-}
  shift $(( $# < 6 ? $# : 6 ))
  # shellcheck disable=SC2046,SC2086
  fairseq-plugins bench --method double_token --label "$system$label$( ((batch > 1)) && echo " batch $batch")" \
    --path "$(checkpoint "$system")" $GEN_FLAGS --baseline-path "$(checkpoint l2r-1)" --data "$DATA" --split test \
    --device "${DEVICE:-cpu}" --threads "${BENCH_THREADS:-1}" --batch-size "$batch" --beam "$beam" --limit "$limit" \
    --runs "${BENCH_RUNS:-3}" --provenance "$COMMANDS" --json "$json" --append $(system_flags "$system") "$@"
}

if stage bench; then
  json=$RESULTS/double_token.json
  rm -f "$json.tmp"
  for batch in $BENCH_BATCHES; do
    for system in $SYSTEMS; do
      [[ $system == l2r-1 ]] && continue  # it is every row's baseline
      bench_against_l2r "$system" "$BEAM" "${BENCH_LIMIT:-200}" "$json.tmp" "$batch"
    done
  done
  mv "$json.tmp" "$json"
fi

if stage beams; then
  json=$RESULTS/double_token_beams.json
  rm -f "$json.tmp"
  for beam in ${BEAMS:-1 2 5 10 20}; do
    bench_against_l2r bidir-2 "$beam" "${BEAMS_LIMIT:-100}" "$json.tmp"
  done
  mv "$json.tmp" "$json"
fi

if stage fast; then
  json=$RESULTS/double_token_fast_step.json
  rm -f "$json.tmp"
  for batch in $BENCH_BATCHES; do
    for precision in ${FAST_PRECISIONS:-fp32 int8}; do
      for system in $SYSTEMS; do
        bench_against_l2r "$system" "$BEAM" "${BENCH_LIMIT:-200}" "$json.tmp" "$batch" " fast step $precision" \
          --fast-step --fast-step-precision "$precision"
      done
    done
  done
  mv "$json.tmp" "$json"
fi

if stage ctranslate2; then
  json=$RESULTS/double_token_ctranslate2.json
  rm -f "$json.tmp"
  # shellcheck disable=SC2046,SC2086
  fairseq-plugins bench --method double_token --label "bidir-2 fast step int8 vs CTranslate2 int8" \
    --path "$(checkpoint bidir-2)" $GEN_FLAGS --baseline-path "$BASE/checkpoints/checkpoint_best.pt" --data "$DATA" \
    --split test --device cpu --threads 1 --batch-size 1 --beam "${CT2_BEAM:-5}" --limit "${CT2_LIMIT:-0}" \
    --runs "${BENCH_RUNS:-3}" --provenance "$COMMANDS" --json "$json.tmp" --append $(system_flags bidir-2) \
    --fast-step --fast-step-precision int8 --reference ctranslate2 --reference-compute-type int8
  mv "$json.tmp" "$json"
fi

if stage ngram; then
  hyps=() labels=()
  for system in $SYSTEMS; do hyps+=("$WORK/$system/hyp.beam$BEAM.$TGT"); labels+=("$system"); done
  fairseq-plugins ngram-precision --reference "$DATA/raw/test.$TGT" --hypotheses "${hyps[@]}" --labels "${labels[@]}" \
    --span 5 --orders 1 4 --json "$RESULTS/double_token_ngram.json"
fi

if stage summary; then
  python "$(dirname "$0")/summarize.py" --work "$WORK" --beam "$BEAM" --systems $SYSTEMS \
    --bench "$RESULTS/double_token.json" --beams "$RESULTS/double_token_beams.json" \
    --stock-bleu "$WORK/baseline/bleu.beam$BEAM.json" --batch-sizes $BENCH_BATCHES \
    --commands "$COMMANDS" --out "$RESULTS/double_token_table2"
fi
