#!/usr/bin/env bash
# Blockwise parallel decoding (Stern et al. 2018) on Multi30k en->de (or SRC->TGT), on top of the baseline transformer.
#
#   distill : the baseline greedy-decodes the training set (self-distillation: with exact acceptance the heads
#             must predict greedy decoding's next tokens), and, for the paper's distilled variants, beam-decodes
#             it (sequence-level knowledge distillation); both binarized with the baseline's dictionaries
#   train   : blockwise_transformer models warm-started from the baseline checkpoint:
#             self      = base frozen, heads trained on the base's own greedy outputs (the exact setting)
#             regular   = base frozen, original data      distilled = base frozen, beam-distilled data
#             finetuned = all parameters, original data    both      = all parameters, distilled data
#             self-finetuned = all parameters, the base's own greedy outputs
#             (the fine-tuned ones continue from the frozen ones of the same data, with a KL term to the
#             frozen baseline's distribution so that p_1 stays close to the model the heads learnt). Frozen variants train
#             to a plateau of the heads' mean validation accuracy (proposal_accuracy, patience 3; not trained again
#             once there)
#   evaluate: paper Table 1 through fairseq-plugins bench (BLEU, mean accepted block size), per variant and k
#   bench   : fairseq-plugins bench, blockwise generator vs stock greedy on the same base, same run
#   fast    : the same on the fast decoder step (--fast-step), float32 and int8, batch 1, k in FAST_BLOCK_SIZES
#             (2 4 6), the whole test set (FAST_LIMIT): blockwise_fast_step.json (BENCH_JSON's name + _fast_step)
#   ctranslate2: the fast int8 step's blockwise decoding (one native call a sentence) against CTranslate2 int8
#             greedy on the baseline, in the same runs (bench --reference ctranslate2, the baseline as the stock
#             side), batch 1, k in CT2_BLOCK_SIZES (2 3), the whole test set (CT2_LIMIT):
#             blockwise_ctranslate2.json (BENCH_JSON's name + _ctranslate2)
#
# Usage: examples/blockwise/run.sh [BASELINE_WORK] [WORK]
#   BASELINE_WORK is the work dir of examples/baseline/run.sh (data/ and checkpoints/checkpoint_best.pt).
#   env: SRC (en), TGT (de): the language suffixes, those of BASELINE_WORK's data,
#        STAGES ("distill train evaluate bench fast"; ctranslate2 when asked), VARIANTS ("self"), K (heads per model, 10),
#        HEAD_VOCAB (2000: heads 2..k train with --blockwise-proposal-vocab and every decode here proposes with
#        --block-proposal-vocab over that many tokens; 0: the whole vocabulary),
#        LAYOUT (separate|joint, the heads' --blockwise-head-layout: separate), FFN_DIM (hidden units per
#        head; default the base's d_ff, the paper's size), LOSS (mean|sample, --blockwise-loss),
#        EPOCHS (frozen variants' cap, 40), PATIENCE (3), MINUTES (wall-clock cap of every variant, none),
#        FINETUNE_UPDATES (200), BLOCK_SIZES ("1 2 4 6 8 10", capped at K),
#        BENCH_LIMIT (0 = whole test set), BENCH_RUNS (3), RESULTS (WORK/results; RESULTS=docs/results writes
#        the repository's figures), BENCH_JSON (RESULTS/blockwise.json: the other results beside it, named after it),
#        BEST_VARIANT (self: the speed benches' model), BEST_K (default: the fastest k >= 2 of the sweep),
#        SWEEP_LIMIT (200 sentences), SKIP_SWEEP (1: keep the existing sweep), DEVICE (cpu), THREADS (1),
#        LATENCY_LIMIT (100), LR_FROZEN (1e-3), LR_FINETUNE (1e-4), TEACHER_WEIGHT (1.0: the KL term to the
#        baseline when fine-tuning), PROPOSAL_VOCAB (2000) and THRESHOLDS
#        ("0.3 0.6"): the batch-1 call-cost settings of the bench stage (blockwise_call_cost.json),
#        FAST_BLOCK_SIZES ("2 4 6") and FAST_LIMIT (0 = the whole test set): the fast stage; CT2_BLOCK_SIZES
#        ("2 3") and CT2_LIMIT (0): the ctranslate2 stage
set -euo pipefail
# shellcheck source=examples/tools.sh
source "$(dirname "$0")/../tools.sh"  # the venv's commands on PATH (make install)
BASE=${1:-work/baseline}
WORK=${2:-work/blockwise}
STAGES=${STAGES:-distill train evaluate bench fast}
VARIANTS=${VARIANTS:-self}
K=${K:-10}
LAYOUT=${LAYOUT:-separate}
FFN_DIM=${FFN_DIM:-}
LOSS=${LOSS:-mean}
# Heads 2..k train and propose over the HEAD_VOCAB most frequent target tokens (0: all): on 2 CPU cores a
# head's full 8k output product made a frozen-head update take ~17 s at K=10
HEAD_VOCAB=${HEAD_VOCAB:-2000}
# (an `if`, not `&&`: a false last test would make the substitution fail and set -e end the script silently)
BLOCK_SIZES=$(for k in ${BLOCK_SIZES:-1 2 4 6 8 10}; do if (( k <= K )); then echo "$k"; fi; done)
RESULTS=${RESULTS:-$WORK/results}
BENCH_JSON=${BENCH_JSON:-$RESULTS/blockwise.json}
USER_DIR=$(fairseq-plugins user-dir)
BASE_CKPT=$BASE/checkpoints/checkpoint_best.pt
COMMANDS=$WORK/commands.txt
mkdir -p "$WORK"
[[ -f $BASE_CKPT ]] || { echo "no baseline checkpoint at $BASE_CKPT: run examples/baseline/run.sh first" >&2; exit 2; }

# shellcheck source=examples/common.sh
source "$(dirname "$0")/../common.sh"  # SRC, TGT, check_langs, record (run + keep as provenance), stage
if [[ -f $BASE/data/prepare.json ]]; then check_langs "$BASE/data"; fi
[[ -z ${MINUTES:-} ]] || minutes_as_hours "$MINUTES" MINUTES > /dev/null  # a bad MINUTES stops before any work

# ---- self-distillation (greedy) and sequence-level distillation (beam 5) ---------------------------------
SELF_DISTILL=$WORK/self_distill
DISTILL=$(shared_distill "$BASE")
if stage distill; then
  [[ " $VARIANTS " == *" self "* ]] && distill_greedy "$BASE" "$SELF_DISTILL"
  [[ " $VARIANTS " == *" distilled "* || " $VARIANTS " == *" both "* ]] && distill_beam5 "$BASE"
fi

# ---- blockwise models, warm-started from the baseline ----------------------------------------------------
# Frozen variants: a plateau of the heads' mean validation accuracy, within EPOCHS (and MINUTES if given);
# fine-tuned ones: FINETUNE_UPDATES (and MINUTES).
variant_stop() {
  case $1 in
    self|regular|distilled)
      echo "--max-epoch ${EPOCHS:-40} --patience ${PATIENCE:-3} --best-checkpoint-metric proposal_accuracy"
      echo "--maximize-best-checkpoint-metric ${MINUTES:+--stop-time-hours $(minutes_as_hours "$MINUTES" MINUTES)}" ;;
    # Fine-tuned: the checkpoint whose p_1 (exact blockwise = its greedy decoding) has the best validation
    # BLEU, since the base itself changes.
    *) echo "--max-update ${FINETUNE_UPDATES:-200} ${MINUTES:+--stop-time-hours $(minutes_as_hours "$MINUTES" MINUTES)}"
       echo "--eval-bleu --eval-bleu-args {\"beam\":1} --eval-bleu-remove-bpe sentencepiece"
       echo "--best-checkpoint-metric bleu --maximize-best-checkpoint-metric" ;;
  esac
}
# Fine-tuning starts from the frozen variant's heads: unfreezing a base under freshly initialised heads lets
# their large early gradients pull the base away from its own predictions (measured: head-1 validation
# accuracy fell from 67% to 42% in 350 updates). A frozen base runs without dropout (the model keeps it in
# evaluation mode), so --dropout only acts in the heads.
variant_flags() {  # data dir, warm-start checkpoint, then extra fairseq-train flags, of one variant
  local frozen="--blockwise-base-checkpoint $BASE_CKPT --blockwise-freeze-base --lr ${LR_FROZEN:-1e-3} --dropout 0.1"
  local tuned="--lr ${LR_FINETUNE:-1e-4} --blockwise-teacher-checkpoint $BASE_CKPT --blockwise-teacher-weight ${TEACHER_WEIGHT:-1.0}"
  case $1 in
    self)      echo "$SELF_DISTILL/bin $frozen" ;;
    regular)   echo "$BASE/data/bin $frozen" ;;
    distilled) echo "$DISTILL/bin $frozen" ;;
    finetuned) echo "$BASE/data/bin --blockwise-base-checkpoint $WORK/regular/checkpoints/checkpoint_best.pt $tuned" ;;
    both)      echo "$DISTILL/bin --blockwise-base-checkpoint $WORK/distilled/checkpoints/checkpoint_best.pt $tuned" ;;
    self-finetuned) echo "$SELF_DISTILL/bin --blockwise-base-checkpoint $WORK/self/checkpoints/checkpoint_best.pt $tuned" ;;
    *) echo "unknown variant $1 (self regular distilled finetuned both self-finetuned)" >&2; exit 2 ;;
  esac
}
if stage train; then
  for variant in $VARIANTS; do
    stopped_by_patience "$WORK/$variant/train.log" "${PATIENCE:-3}" && continue  # a frozen variant at its plateau
    # shellcheck disable=SC2046  # the variant's stop flags, as words
    stopped_by_budget "$WORK/$variant/train.log" $(variant_stop "$variant") && continue  # a fine-tuning done
    mkdir -p "$WORK/$variant"
    # shellcheck disable=SC2046  # word splitting of the variant's flags is intended
    record fairseq-train $(variant_flags "$variant") --user-dir "$USER_DIR" \
      --task blockwise_translation --source-lang "$SRC" --target-lang "$TGT" \
      --arch blockwise_transformer_multi30k --blockwise-heads "$K" --blockwise-head-layout "$LAYOUT" \
      ${FFN_DIM:+--blockwise-ffn-dim "$FFN_DIM"} \
      --criterion blockwise_label_smoothed_cross_entropy --blockwise-loss "$LOSS" --label-smoothing 0.1 \
      --blockwise-proposal-vocab "$HEAD_VOCAB" \
      --optimizer adam --adam-betas '(0.9, 0.98)' --clip-norm 0.0 \
      --lr-scheduler inverse_sqrt --warmup-updates 100 --warmup-init-lr 1e-7 \
      --max-tokens 4096 $(variant_stop "$variant") --seed 1 \
      --save-dir "$WORK/$variant/checkpoints" --no-epoch-checkpoints \
      --log-format simple --log-interval 50 2>&1 | tee -a "$WORK/$variant/train.log"  # -a: a resumed run keeps the curve
  done
fi

# ---- benchmarks: every figure is fairseq-plugins bench (blockwise vs stock greedy, same model, same run) ----
PREFIX=${BENCH_JSON%.json}  # every result file is PREFIX.json or PREFIX_<what>.json
mkdir -p "$(dirname "$PREFIX")"
bench_cell() {  # json label variant block-size batch-size runs limit [extra generator flags]
  local json=$1 label=$2 variant=$3 block=$4 batch=$5 runs=$6 limit=$7
  shift 7
  fairseq-plugins bench --method blockwise --path "$WORK/$variant/checkpoints/checkpoint_best.pt" \
    --data "$BASE/data" --split test --device "${DEVICE:-cpu}" --threads "${THREADS:-1}" \
    --beam 1 --block-size "$block" --block-proposal-vocab "$HEAD_VOCAB" "$@" --batch-size "$batch" \
    --runs "$runs" --limit "$limit" \
    --latency-limit "${LATENCY_LIMIT:-100}" --label "$label" --provenance "$BASE/commands.txt" "$COMMANDS" \
    --json "$json" --append
}

if stage evaluate; then
  rm -f "${PREFIX}_table1.json"
  # Paper Table 1: BLEU and mean accepted block size per variant and block size (batched; speed is not the
  # point of this table, see the bench stage). Block sizes below K use the first heads of the K-head model.
  for variant in $VARIANTS; do
    for block in $BLOCK_SIZES; do
      bench_cell "${PREFIX}_table1.json" "$variant k=$block" "$variant" "$block" 64 1 "${BENCH_LIMIT:-0}"
    done
  done
fi

if stage bench; then
  BEST=${BEST_VARIANT:-self}
  # Speedup against k (paper Fig. 4): one thread, batch 1, on a subset (SKIP_SWEEP=1 keeps an earlier sweep).
  if [[ ${SKIP_SWEEP:-0} != 1 ]]; then
    rm -f "${PREFIX}_speed_vs_k.json"
    for block in $BLOCK_SIZES; do
      bench_cell "${PREFIX}_speed_vs_k.json" "$BEST k=$block" "$BEST" "$block" 1 3 "${SWEEP_LIMIT:-200}"
    done
  fi
  # The fastest k >= 2 of that sweep (k = 1 is greedy decoding), unless BEST_K is given.
  BEST_K=${BEST_K:-$(python -c 'import sys; from fairseq_plugins.bench.report import load_results as L; r = max((r for r in L(sys.argv[1]) if r["stats"]["block_size"] > 1), key=lambda r: r["speed_ratio"]); print(r["stats"]["block_size"])' "${PREFIX}_speed_vs_k.json")}
  # Wall-clock speedup over stock greedy: one thread, batch 1 and batch 32, the best setting.
  rm -f "${PREFIX}.json"
  for batch in 1 32; do
    bench_cell "${PREFIX}.json" "$BEST k=$BEST_K batch $batch" "$BEST" "$BEST_K" "$batch" "${BENCH_RUNS:-3}" \
      "${BENCH_LIMIT:-0}"
  done
  # Approximate acceptance and minimum block size, side by side with exact (batched).
  rm -f "${PREFIX}_acceptance.json"
  settings=("--block-acceptance exact" "--block-acceptance topk --block-topk 2"
            "--block-acceptance distance --block-distance 1.0")
  for min_block in 2 3; do (( min_block <= BEST_K )) && settings+=("--min-block-size $min_block"); done
  for flags in "${settings[@]}"; do
    # shellcheck disable=SC2086  # the flags are words
    bench_cell "${PREFIX}_acceptance.json" "$BEST k=$BEST_K ${flags//--/}" "$BEST" "$BEST_K" 64 1 \
      "${BENCH_LIMIT:-0}" $flags
  done
  # Cheaper calls at batch 1: an adaptive block size (at the largest k, where it has most to cut) and
  # proposals among the most frequent tokens only, against the fixed block of the same k.
  rm -f "${PREFIX}_call_cost.json"
  settings=("--block-proposal-vocab 0" "--block-proposal-vocab ${PROPOSAL_VOCAB:-2000}")
  for threshold in ${THRESHOLDS:-0.3 0.6}; do settings+=("--block-adaptive-threshold $threshold"); done
  for block in $(printf '%s\n' "$BEST_K" "$K" | sort -un); do
    for flags in "${settings[@]}"; do
      # shellcheck disable=SC2086  # the flags are words
      bench_cell "${PREFIX}_call_cost.json" "$BEST k=$block${flags:+ ${flags//--/}}" "$BEST" "$block" 1 \
        "${BENCH_RUNS:-3}" "${SWEEP_LIMIT:-200}" $flags
    done
  done
  python "$(dirname "$0")/plots.py" "$PREFIX"
fi

# ---- the same decoding on the fast decoder step (docs/fast-step.md): one kernel pass a layer for a block ----
if stage fast; then
  # Batch 1, one thread, against stock greedy on the same base in the same run: float32 (exact: greedy's
  # outputs) and int8, proposals among the HEAD_VOCAB most frequent tokens. The moonshot of the fast-step
  # issue compares the int8 rows' speed ratio with CTranslate2's (examples/fast_step, STAGES=ctranslate2).
  rm -f "${PREFIX}_fast_step.json"
  for precision in fp32 int8; do
    for block in ${FAST_BLOCK_SIZES:-2 4 6}; do
      (( block <= K )) || continue
      bench_cell "${PREFIX}_fast_step.json" "${BEST_VARIANT:-self} k=$block fast step $precision" \
        "${BEST_VARIANT:-self}" "$block" 1 "${BENCH_RUNS:-3}" "${FAST_LIMIT:-0}" --fast-step \
        --fast-step-precision "$precision"
    done
  done
fi

# ---- against CTranslate2 (issue 53's moonshot: >= 1.5x CTranslate2 int8 greedy) ----------------------------
if stage ctranslate2; then
  rm -f "${PREFIX}_ctranslate2.json"
  for block in ${CT2_BLOCK_SIZES:-2 3}; do
    bench_cell "${PREFIX}_ctranslate2.json" "${BEST_VARIANT:-self} k=$block fast step int8 vs CTranslate2 int8" \
      "${BEST_VARIANT:-self}" "$block" 1 "${BENCH_RUNS:-3}" "${CT2_LIMIT:-0}" --fast-step --fast-step-precision int8 \
      --baseline-path "$BASE/checkpoints/checkpoint_best.pt" --reference ctranslate2 --reference-compute-type int8
  done
fi
