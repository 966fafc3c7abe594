#!/usr/bin/env bash
# ByteNet (Kalchbrenner et al. 2016) on real data, against stock fairseq transformers of the same size
# trained for the same wall-clock time (the two run side by side, one thread each).
#
#   prepare  : character-level Multi30k en->de (SRC->TGT; fairseq-plugins prepare --char) and Tiny Shakespeare
#              (fairseq-plugins prepare-lm)
#   train-mt : bytenet_multi30k_char and a character transformer with as many parameters, MT_MINUTES each; then
#              their "-anneal" cool-downs from their best checkpoints (MT_ANNEAL_UPDATES, 1228)
#   train-lm : bytenet_lm_shakespeare, a transformer_lm with as many parameters and a nanoGPT-sized one (the
#              reference character model: 6 layers, 384-d, dropout 0.2), LM_MINUTES each; then the "-anneal"
#              cool-downs of the deep ByteNets from their best checkpoints (ANNEAL_UPDATES, 372)
#   average  : each trained system's AVERAGE (5) epoch checkpoints centred on its best validation loss averaged
#              into checkpoint_avg.pt, which every later stage uses (patience stops a training PATIENCE epochs
#              past its best: the checkpoints kept are the last AVERAGE + PATIENCE)
#   evaluate-mt: BLEU on the test split (Multi30k's test_2016_flickr), beam 12 and greedy, no length
#              normalisation (--lenpen 0, the paper's setting) for both systems; beam 12 also at each length penalty
#              of BEAM_LENPENS (WORK/<system>/test.beam12.lenpen1.txt)
#   evaluate-lm: bits per character on Tiny Shakespeare valid (fairseq-eval-lm)
#   bench    : decoding time against output length, cached (stock generator) vs recomputed
#              (--bytenet-decoding recompute), RESULTS/bytenet_length.json; ByteNet against the character
#              transformer (--baseline-path) on the test split, both with the stock generator, and CTranslate2
#              float32 on the transformer, in one run: RESULTS/bytenet_speed.json (each system's cool-down where
#              MT_SYSTEMS names it)
#   saliency : the paper's Fig. 6 for the first test pair, RESULTS/bytenet_saliency.{png,json}
#   summary  : RESULTS/bytenet.json (BLEU, bits per character, parameters, updates, length scaling)
#
# Usage: examples/bytenet/run.sh [MULTI30K_DIR] [SHAKESPEARE_DIR] [WORK]
#   MULTI30K_DIR holds train, valid and test text as <split>.$SRC and <split>.$TGT (see fairseq-plugins prepare).
#   env: SRC (en), TGT (de): the language suffixes,
#        STAGES ("prepare train-mt train-lm average evaluate-mt evaluate-lm bench saliency summary"),
#        MT_MINUTES (600), LM_MINUTES (600): wall-clock caps; every training stops earlier at a plateau of
#        validation loss (PATIENCE epochs without a new best, 5) and resumes from checkpoint_last.pt when re-run,
#        BEAM (12), BEAM_LENPENS (1; empty: none), DEVICE (cpu), THREADS (1), BENCH_LIMIT (200), RESULTS (WORK/results; RESULTS=docs/results/bytenet-cpu
#        writes the repository's CPU figures, which the README overview reads),
#        MT_SYSTEMS ("bytenet-mt transformer-mt bytenet-mt-anneal transformer-mt-anneal"), LM_SYSTEMS ("bytenet-lm bytenet-lm-d25 bytenet-lm-deep bytenet-lm-deep-reg
#        bytenet-lm-deep-layerdrop bytenet-lm-deep-512 bytenet-lm-wide bytenet-lm-deep-wide bytenet-lm-deep-wide-d50
#        transformer-lm nanogpt-lm bytenet-lm-deep-anneal
#        bytenet-lm-deep-reg-anneal"; empty: none of that kind; one system alone where only one core is free: a
#        later run of the other gives it the same budget), TOGETHER (2): how many trainings run side by side
#        (THREADS each; 0: all at once, as the GPU kit runs them; a cool-down starts at the first free place once its
#        source has ended, TRAIN_POLL_SECONDS (5) apart at most); a training that patience stopped is not re-run,
#        SAVE_LAST_UPDATES (200 on the CPU, else 0): checkpoint_last.pt every so many updates within an epoch too,
#        EVAL_THREADS (2), LENGTHS ("100 200 400 800"), RECOMPUTE_MAX (400), LENGTH_LIMIT (10 sentences), LENGTH_RUNS (3),
#        TRAIN_FLAGS (none): added to every training, MT_TRAIN_FLAGS (none): added to the MT trainings before
#        TRAIN_FLAGS (a flag in both: TRAIN_FLAGS' value wins; the GPU kit's bytenet stage sets larger MT batches)
set -euo pipefail
# shellcheck source=examples/tools.sh
source "$(dirname "$0")/../tools.sh"  # the venv's commands on PATH (make install)
MULTI30K=${1:-../shared/data/multi30k}
SHAKESPEARE=${2:-../shared/data/tinyshakespeare}
WORK=${3:-work/bytenet}
STAGES=${STAGES:-prepare train-mt train-lm average evaluate-mt evaluate-lm bench saliency summary}
MT_MINUTES=${MT_MINUTES:-600}
LM_MINUTES=${LM_MINUTES:-600}
PATIENCE=${PATIENCE:-5}
AVERAGE=${AVERAGE:-5}
BEAM=${BEAM:-12}
BEAM_LENPENS=${BEAM_LENPENS-1}
DEVICE=${DEVICE:-cpu}
THREADS=${THREADS:-1}
TOGETHER=${TOGETHER:-2}
EVAL_THREADS=${EVAL_THREADS:-2}
BENCH_LIMIT=${BENCH_LIMIT:-200}
RESULTS=${RESULTS:-$WORK/results}
USER_DIR=$(fairseq-plugins user-dir)
COMMANDS=$WORK/commands.txt
mkdir -p "$WORK" "$RESULTS"
# shellcheck source=examples/common.sh
source "$(dirname "$0")/../common.sh"  # SRC, TGT, check_langs, record (run + keep as provenance), stage
CPU_FLAG=$([[ $DEVICE == cpu ]] && echo --cpu || true)
# checkpoint_last.pt also every SAVE_LAST_UPDATES updates inside an epoch, without a validation
# (FAIRSEQ_PLUGINS_SAVE_LAST_UPDATES; README, "A training cut mid-epoch"): a training cut off mid-epoch resumes from
# there, not from the epoch's start. 200 MT updates are about 8 minutes on one CPU thread; none on a GPU.
export FAIRSEQ_PLUGINS_SAVE_LAST_UPDATES=${SAVE_LAST_UPDATES:-$([[ $DEVICE == cpu ]] && echo 200 || echo 0)}

if stage prepare; then
  [[ -f $WORK/mt-data/prepare.json ]] || record fairseq-plugins prepare --char "$MULTI30K" "$WORK/mt-data" -s "$SRC" -t "$TGT"
  [[ -f $WORK/lm-data/prepare.json ]] || record fairseq-plugins prepare-lm \
    "$SHAKESPEARE/train.txt" "$SHAKESPEARE/valid.txt" "$WORK/lm-data"
fi
if [[ -f $WORK/mt-data/prepare.json ]]; then check_langs "$WORK/mt-data"; fi

# Every system gets the same optimiser, schedule, dropout (but nanoGPT's own 0.2), wall-clock cap and plateau
# rule (validation loss, checked once an epoch); the epoch checkpoints are kept for averaging.
COMMON_TRAIN=(--user-dir "$USER_DIR" $CPU_FLAG --optimizer adam --adam-betas "(0.9,0.98)" --clip-norm 1.0
  --lr 1e-3 --lr-scheduler inverse_sqrt --dropout 0.1 --seed 1 --num-workers 0
  --log-format simple --log-interval 50 --keep-last-epochs "$((AVERAGE + PATIENCE))" --patience "$PATIENCE")
MT_TRAIN=("$WORK/mt-data/bin" --task translation --source-lang "$SRC" --target-lang "$TGT"
  --criterion label_smoothed_cross_entropy --label-smoothing 0.1 --max-tokens 4096 --warmup-updates 1000
  --stop-time-hours "$(minutes_as_hours "$MT_MINUTES" MT_MINUTES)" --max-epoch 100)
read -ra EXTRA_TRAIN <<< "${TRAIN_FLAGS:-}"
read -ra EXTRA_MT_TRAIN <<< "${MT_TRAIN_FLAGS:-}"
# A transformer with the ByteNet's parameter count (5.95M vs 6.00M): 3+3 layers, d 256, FFN 1152.
MT_TRANSFORMER=(--arch transformer --encoder-layers 3 --decoder-layers 3 --encoder-embed-dim 256
  --decoder-embed-dim 256 --encoder-ffn-embed-dim 1152 --decoder-ffn-embed-dim 1152
  --encoder-attention-heads 4 --decoder-attention-heads 4 --share-all-embeddings)
LM_TRAIN=("$WORK/lm-data/bin" --task language_modeling --tokens-per-sample 256 --sample-break-mode none
  --criterion cross_entropy --max-tokens 8192 --warmup-updates 100 --stop-time-hours "$(minutes_as_hours "$LM_MINUTES" LM_MINUTES)" --max-epoch 100)
# transformer_lm with the ByteNet LM's parameter count (4.66M vs 4.68M): 5 layers, d 256, FFN 1184.
LM_TRANSFORMER=(--arch transformer_lm --decoder-layers 5 --decoder-embed-dim 256 --decoder-ffn-embed-dim 1184
  --decoder-attention-heads 4 --share-decoder-input-output-embed)
# nanoGPT's reference character model (shakespeare_char: 6 layers, 6 heads, 384-d, dropout 0.2, tied
# embeddings; 10.7M parameters) in fairseq's transformer_lm, trained by this pipeline.
LM_NANOGPT=(--arch transformer_lm --decoder-layers 6 --decoder-embed-dim 384 --decoder-ffn-embed-dim 1536
  --decoder-attention-heads 6 --share-decoder-input-output-embed --dropout 0.2)

start_training() {  # NAME: fairseq-train for "$WORK/<name>" in the background (THREADS), its pid in STARTED;
                    # fails (starting nothing) where a cool-down's learning rate cannot be read
  local lr
  STARTED=
  stopped_by_patience "$WORK/$1/train.log" "$PATIENCE" && return 0
  eval "local flags=(\"\${${1//-/_}_FLAGS[@]}\")"
  stopped_by_budget "$WORK/$1/train.log" "${flags[@]}" "${EXTRA_TRAIN[@]}" && return 0
  mkdir -p "$WORK/$1"
  if [[ $1 == *-anneal ]]; then
    lr=$(cool_down_lr "$1") || return 1
    flags+=(--lr "$lr")
  fi
  OMP_NUM_THREADS=$THREADS record fairseq-train "${flags[@]}" "${EXTRA_TRAIN[@]}" --save-dir "$WORK/$1/checkpoints" \
    >> "$WORK/$1/train.log" 2>&1 &  # appended: a re-run resumes
  STARTED=$!
}
cool_down_source() {  # NAME: the system a "-anneal" NAME starts from (empty for the others)
  local start
  start=$(cool_down_start "$1")
  [[ -n $start ]] || return 0
  start=${start#"$WORK/"}
  echo "${start%%/*}"
}
# NAME...: at most TOGETHER trainings side by side (0: all at once), started in the order given; a cool-down
# whose source is among NAMEs starts once that training has ended, so a core freed by a training that patience
# stopped goes to its cool-down while the others train on. A failed training starts nothing more: the recipe
# waits for the running ones, then stops naming its log.
train_systems() {
  local limit=$((TOGETHER > 0 ? TOGETHER : $#)) waiting=("$@") running=() pids=() failed=() left=() i name source
  while (( ${#waiting[@]} + ${#running[@]} )); do
    left=()
    for name in "${waiting[@]}"; do
      source=$(cool_down_source "$name")
      if (( ${#failed[@]} == 0 && ${#running[@]} < limit )) \
          && [[ -z $source || " ${waiting[*]} ${running[*]} " != *" $source "* ]]; then
        if ! start_training "$name"; then
          failed+=("$name")
        elif [[ -n $STARTED ]]; then
          running+=("$name"); pids+=("$STARTED")
        fi
      elif (( ${#failed[@]} == 0 )); then
        left+=("$name")
      fi
    done
    if (( ${#running[@]} == 0 )); then
      # nothing runs: what waits can start now (its source was skipped as stopped), unless nothing started
      (( ${#left[@]} < ${#waiting[@]} )) || { echo "run.sh: cannot schedule ${left[*]}" >&2; exit 2; }
      waiting=("${left[@]}")
      continue
    fi
    waiting=("${left[@]}")
    sleep "${TRAIN_POLL_SECONDS:-5}"
    left=(); local alive=()
    for i in "${!running[@]}"; do
      if kill -0 "${pids[$i]}" 2>/dev/null; then
        left+=("${running[$i]}"); alive+=("${pids[$i]}")
      else
        wait "${pids[$i]}" || failed+=("${running[$i]}")
      fi
    done
    running=("${left[@]}"); pids=("${alive[@]}")
  done
  for name in "${failed[@]}"; do
    echo "run.sh: the training of $name failed (or could not start): see $WORK/$name/train.log and above" >&2
  done
  (( ${#failed[@]} == 0 )) || exit 1
}
bytenet_mt_FLAGS=("${MT_TRAIN[@]}" "${COMMON_TRAIN[@]}" --arch bytenet_multi30k_char "${EXTRA_MT_TRAIN[@]}")
transformer_mt_FLAGS=("${MT_TRAIN[@]}" "${COMMON_TRAIN[@]}" "${MT_TRANSFORMER[@]}" "${EXTRA_MT_TRAIN[@]}")
bytenet_lm_FLAGS=("${LM_TRAIN[@]}" "${COMMON_TRAIN[@]}" --arch bytenet_lm_shakespeare)
transformer_lm_FLAGS=("${LM_TRAIN[@]}" "${COMMON_TRAIN[@]}" "${LM_TRANSFORMER[@]}")
nanogpt_lm_FLAGS=("${LM_TRAIN[@]}" "${COMMON_TRAIN[@]}" "${LM_NANOGPT[@]}")
# The ByteNet LM with more dropout: at 0.1 it overfits Tiny Shakespeare's 1M characters after ~7 epochs.
bytenet_lm_d25_FLAGS=("${bytenet_lm_FLAGS[@]}" --dropout 0.25)
# Deeper (20 blocks: receptive field 497 characters against 249, more than the 256-character blocks: capacity,
# not context; fairseq-train warns) with more dropout, for the <= 2.05 bits target:
# the 10-block model overfits at either dropout, so capacity and context are what it lacks.
bytenet_lm_deep_FLAGS=("${bytenet_lm_FLAGS[@]}" --decoder-blocks 20 --dropout 0.2)
# The deep model overfits after epoch 7 at dropout 0.2: more dropout and decoupled weight decay (fairseq's adam is
# AdamW) to hold its best validation loss for longer.
bytenet_lm_deep_reg_FLAGS=("${bytenet_lm_FLAGS[@]}" --decoder-blocks 20 --dropout 0.3 --weight-decay 0.01)
# LayerDrop (whole residual blocks skipped in training, each with probability 0.2): the regularisation that
# dropout (0.1-0.3) and weight decay did not give the 20-block model.
bytenet_lm_deep_layerdrop_FLAGS=("${bytenet_lm_deep_FLAGS[@]}" --decoder-layerdrop 0.2)
# The 20-block model on 512-character training blocks (its receptive field is 497): every scored character of
# the evaluation has 192-255 characters before it, while a 256-character block gives half its positions fewer
# than 128 in training.
bytenet_lm_deep_512_FLAGS=("${bytenet_lm_deep_FLAGS[@]}" --tokens-per-sample 512)
# Wider instead of deeper: the 10-block model (receptive field 249) at 1.5 times the width (stream 384, blocks
# 384 -> 192 -> 384, output layers 192: 10.5M parameters, nanoGPT's size) with dropout 0.35, since every deeper
# or longer-context setting levelled off at 2.07-2.09 bits by overfitting the 1M training characters.
bytenet_lm_wide_FLAGS=("${bytenet_lm_FLAGS[@]}" --decoder-embed-dim 384 --decoder-hidden-dim 192
  --output-hidden-dim 192 --dropout 0.35)
# Both at once (20 blocks at 1.5 times the width: 20M parameters) under heavier dropout, 0.4 or 0.5: the capacity
# the wide model had early (ahead of the deep one by epoch 4) held longer. Sized for the GPU kit's bytenet stage.
bytenet_lm_deep_wide_FLAGS=("${bytenet_lm_wide_FLAGS[@]}" --decoder-blocks 20 --dropout 0.4)
bytenet_lm_deep_wide_d50_FLAGS=("${bytenet_lm_deep_wide_FLAGS[@]}" --dropout 0.5)
# Cool-down ("-anneal" systems): inverse_sqrt's learning rate falls ever more slowly, so a training stopped by
# patience or by its time cap has not settled; each cool-down restarts its source run from its best checkpoint
# (fresh Adam moments, 12 warm-up updates) with the learning rate falling linearly from the one it had there to 0
# over UPDATES: ANNEAL_UPDATES for the LMs (372: 3 epochs of 124 batches), MT_ANNEAL_UPDATES for the MT pair
# (1228: 2 epochs of 614 batches). The starting rate is read from that checkpoint when the cool-down starts
# (cool_down_lr), so a cool-down starts once its source's training has ended (train_systems). UPDATES bounds it,
# not the source's --stop-time-hours: fairseq carries the source's training time into a --finetune-from-model run,
# so a source stopped at its time cap would leave its cool-down one update.
ANNEAL_UPDATES=${ANNEAL_UPDATES:-372}
MT_ANNEAL_UPDATES=${MT_ANNEAL_UPDATES:-1228}
anneal_flags() {  # SOURCE UPDATES: the cool-down of $WORK/SOURCE from its best checkpoint over UPDATES (no --lr)
  ANNEAL_FLAGS=(--finetune-from-model "$WORK/$1/checkpoints/checkpoint_best.pt" --lr-scheduler polynomial_decay
    --power 1 --end-learning-rate 0 --warmup-updates 12 --total-num-update "$2" --max-update "$2"
    --stop-time-hours 0)
}
anneal_flags bytenet-lm-deep "$ANNEAL_UPDATES"
bytenet_lm_deep_anneal_FLAGS=("${bytenet_lm_deep_FLAGS[@]}" "${ANNEAL_FLAGS[@]}")
anneal_flags bytenet-lm-deep-reg "$ANNEAL_UPDATES"
bytenet_lm_deep_reg_anneal_FLAGS=("${bytenet_lm_deep_reg_FLAGS[@]}" "${ANNEAL_FLAGS[@]}")
anneal_flags bytenet-mt "$MT_ANNEAL_UPDATES"
bytenet_mt_anneal_FLAGS=("${bytenet_mt_FLAGS[@]}" "${ANNEAL_FLAGS[@]}")
anneal_flags transformer-mt "$MT_ANNEAL_UPDATES"
transformer_mt_anneal_FLAGS=("${transformer_mt_FLAGS[@]}" "${ANNEAL_FLAGS[@]}")
cool_down_start() {  # NAME: the checkpoint a "-anneal" system starts from (its --finetune-from-model)
  eval "local flags=(\"\${${1//-/_}_FLAGS[@]}\")"
  last_flag_value --finetune-from-model "${flags[@]}"
}
# The learning rate a cool-down NAME starts at: the one its source's optimiser had in the checkpoint it starts
# from; a resumed cool-down keeps the one it started at (its own checkpoint's --lr: the source may be gone).
cool_down_lr() {  # NAME
  python - "$WORK/$1/checkpoints/checkpoint_last.pt" "$(cool_down_start "$1")" <<'EOF'
import os, sys

import torch

resumed, start = sys.argv[1:]
if os.path.isfile(resumed):
    print(torch.load(resumed, map_location="cpu", weights_only=False)["cfg"]["optimization"]["lr"][0])
else:
    print(torch.load(start, map_location="cpu", weights_only=False)["last_optimizer_state"]["param_groups"][0]["lr"])
EOF
}
# SYSTEMS_VAR NAME...: the systems trained from scratch, then the cool-downs (each checked before anything starts:
# it needs its source's best checkpoint, or its source among those trained first here, or its own checkpoint).
train_with_cool_downs() {
  local list=$1 from_scratch=() cool_downs=() name start source_system
  shift
  for name in "$@"; do
    if [[ $name == *-anneal ]]; then cool_downs+=("$name"); else from_scratch+=("$name"); fi
    [[ $name == *-anneal ]] || declare -p "${name//-/_}_FLAGS" &> /dev/null || {
      echo "run.sh: $list names $name, which is not a system of this recipe (its systems: $(compgen -A arrayvar |
        sed -n 's/^\([a-z0-9_]*\)_FLAGS$/\1/p' | tr _ - | tr '\n' ' '))" >&2; exit 2; }
  done
  for name in "${cool_downs[@]}"; do
    start=$(cool_down_start "$name")
    [[ -n $start ]] || { echo "run.sh: $list names $name, which is not a cool-down of this recipe" >&2; exit 2; }
    source_system=$(cool_down_source "$name")
    # A cool-down that already saved a checkpoint resumes from it and no longer needs its source; one whose
    # source trains first in this same run finds it once that training ends.
    [[ -f $WORK/$name/checkpoints/checkpoint_last.pt || -f $start || " ${from_scratch[*]} " == *" $source_system "* ]] || {
      echo "run.sh: $name starts from $start, which does not exist: train $source_system first" \
        "($list=$source_system)" >&2; exit 2; }
  done
  train_systems "${from_scratch[@]}" "${cool_downs[@]}"
}
MT_SYSTEMS=${MT_SYSTEMS-bytenet-mt transformer-mt bytenet-mt-anneal transformer-mt-anneal}
LM_SYSTEMS=${LM_SYSTEMS-bytenet-lm bytenet-lm-d25 bytenet-lm-deep bytenet-lm-deep-reg bytenet-lm-deep-layerdrop
  bytenet-lm-deep-512 bytenet-lm-wide bytenet-lm-deep-wide bytenet-lm-deep-wide-d50 transformer-lm nanogpt-lm
  bytenet-lm-deep-anneal bytenet-lm-deep-reg-anneal}
# What every stage after training decodes: the average of the last epochs once the average stage made it.
final_checkpoint() {
  local dir=$WORK/$1/checkpoints
  [[ -f $dir/checkpoint_avg.pt ]] && echo "$dir/checkpoint_avg.pt" || echo "$dir/checkpoint_best.pt"
}
# shellcheck disable=SC2086  # lists of names
if stage train-mt; then train_with_cool_downs MT_SYSTEMS $MT_SYSTEMS; fi
# shellcheck disable=SC2086
if stage train-lm; then train_with_cool_downs LM_SYSTEMS $LM_SYSTEMS; fi
# The ByteNet or the transformer (KIND: bytenet-mt, transformer-mt) that the bench and saliency stages use: its
# cool-down where MT_SYSTEMS names it.
mt_system() { [[ " $MT_SYSTEMS " == *" $1-anneal "* ]] && echo "$1-anneal" || echo "$1"; }
if stage average; then
  for name in $MT_SYSTEMS $LM_SYSTEMS; do
    [[ -d $WORK/$name/checkpoints ]] && average_epochs_around_best "$WORK/$name/checkpoints" "$WORK/$name/train.log" "$AVERAGE" \
      "$WORK/$name/checkpoints/checkpoint_avg.pt"
  done
fi

if stage evaluate-mt; then
  for name in $MT_SYSTEMS; do
    # --lenpen 0: no length normalisation (the paper's setting), for both systems alike; BEAM also at each of
    # BEAM_LENPENS (fairseq's default 1: scores divided by length, since unnormalised ones make beam search favour
    # short outputs). Greedy search keeps one hypothesis, which no length penalty changes.
    runs=("$BEAM:0")
    (( BEAM == 1 )) || runs+=("1:0")
    for lenpen in $BEAM_LENPENS; do [[ $lenpen =~ ^0*\.?0*$ ]] || runs+=("$BEAM:$lenpen"); done
    for run in "${runs[@]}"; do
      beam=${run%:*} lenpen=${run#*:}
      out=$WORK/$name/test.beam$beam$([[ $lenpen == 0 ]] || echo ".lenpen$lenpen")
      OMP_NUM_THREADS=$EVAL_THREADS record fairseq-generate "$WORK/mt-data/bin" --user-dir "$USER_DIR" $CPU_FLAG \
        --path "$(final_checkpoint "$name")" --gen-subset test --beam "$beam" --lenpen "$lenpen" \
        --max-len-a 1.5 --max-len-b 10 --batch-size 32 > "$out.out"
      fairseq-plugins detok "$WORK/mt-data" --from-generate --input "$out.out" > "$out.txt"
    done
  done
fi
if stage evaluate-lm; then
  for name in $LM_SYSTEMS; do
    OMP_NUM_THREADS=$EVAL_THREADS record fairseq-eval-lm "$WORK/lm-data/bin" --user-dir "$USER_DIR" $CPU_FLAG \
      --path "$(final_checkpoint "$name")" --gen-subset valid --tokens-per-sample 256 \
      --context-window 192 --max-tokens 8192 > "$WORK/$name/eval-lm.log" 2>&1
  done
fi

if stage bench; then
  # Decoding time against output length: every output is forced to exactly L characters (--min-len L,
  # --max-len-a 0 --max-len-b L), greedy, one sentence at a time, one thread; no BLEU beyond the timed sentences
  # (forced lengths make it meaningless here, and evaluate-mt scores the whole test split). "stock" is fairseq's
  # SequenceGenerator with the layer cache; the method side recomputes the whole prefix at every step
  # (--bytenet-decoding recompute) up to RECOMPUTE_MAX characters, where it is quadratic and slow.
  LENGTH_JSON=$RESULTS/bytenet_length.json
  rm -f "$LENGTH_JSON"
  for length in ${LENGTHS:-100 200 400 800}; do
    decoding=$([[ $length -le ${RECOMPUTE_MAX:-400} ]] && echo recompute || echo cached)
    record fairseq-plugins bench --method bytenet --path "$(final_checkpoint "$(mt_system bytenet-mt)")" \
      --data "$WORK/mt-data" --device "$DEVICE" --threads "$THREADS" --batch-size 1 --beam 1 \
      --limit "${LENGTH_LIMIT:-10}" --runs "${LENGTH_RUNS:-3}" --warmup 1 --latency-limit 0 --no-whole-split-bleu \
      --min-len "$length" --max-len-a 0 --max-len-b "$length" --bytenet-decoding "$decoding" \
      --label "length $length, $decoding vs cached" --provenance "$COMMANDS" --json "$LENGTH_JSON" --append
  done
  # ByteNet against the character transformer on the same test sentences, in one process, alternating batch by
  # batch: both with the stock generator (ByteNet's cached decoding), beam BEAM, one sentence at a time; the
  # speed ratio is transformer time / ByteNet time (BLEU on the timed sentences; evaluate-mt scores the whole split).
  # CTranslate2 float32 decodes the transformer in the same runs (--reference ctranslate2: what a user converts
  # the transformer to for speed; its converter does not take ByteNet, so the transformer is its model), with the
  # same beam, --lenpen 0 (CTranslate2's length_penalty 0: no normalisation either) and length limit.
  # The JSON is written whole once the bench ends (no --append): a failed bench leaves the last one in place.
  if [[ " $MT_SYSTEMS " =~ \ transformer-mt(-anneal)?\  ]]; then
    record fairseq-plugins bench --method bytenet --path "$(final_checkpoint "$(mt_system bytenet-mt)")" \
      --baseline-path "$(final_checkpoint "$(mt_system transformer-mt)")" --data "$WORK/mt-data" --device "$DEVICE" \
      --threads "$THREADS" --batch-size 1 --beam "$BEAM" --lenpen 0 --max-len-a 1.5 --max-len-b 10 \
      --limit "$BENCH_LIMIT" --runs "${BENCH_RUNS:-3}" --label "ByteNet vs the character transformer, beam $BEAM" \
      --reference ctranslate2 --no-whole-split-bleu --provenance "$COMMANDS" --json "$RESULTS/bytenet_speed.json"
  fi
fi

if stage saliency; then
  # The first pair of the test split, from prepare's copy of it (Multi30k's test_2016_flickr).
  record fairseq-plugins saliency --path "$(final_checkpoint "$(mt_system bytenet-mt)")" --data "$WORK/mt-data" \
    --source="$(head -n 1 "$WORK/mt-data/raw/test.$SRC")" --target="$(head -n 1 "$WORK/mt-data/raw/test.$TGT")" \
    --output "$RESULTS/bytenet_saliency.png" --json "$RESULTS/bytenet_saliency.json"
fi

if stage summary; then
  record python "$(dirname "$0")/summarize.py" "$WORK" "$MULTI30K" "$RESULTS/bytenet.json"
fi
