#!/usr/bin/env bash
# The baseline every method is compared with: fairseq's stock transformer (3+3 layers, 256-d, shared
# embeddings; preset baseline_transformer_multi30k) on Multi30k en->de (or SRC->TGT) with a joint 8k SentencePiece.
# ~4 min an epoch on 2 CPU cores, 20 epochs. Re-running skips finished stages (fairseq-train resumes from
# checkpoint_last.pt and stops at once when --max-epoch is reached).
#
# Usage: examples/baseline/run.sh [MULTI30K_DIR] [WORK_DIR]
#   MULTI30K_DIR holds train, valid and test text as <split>.$SRC and <split>.$TGT (Multi30k's names train, val,
#   test_2016_flickr, or train, valid|dev, test: see fairseq-plugins prepare).
#   env: SRC (en), TGT (de): the language suffixes, VOCAB (8000: pieces of the joint SentencePiece model),
#        ARCH (baseline_transformer_multi30k; baseline_transformer_base_multi30k: fairseq's transformer-base
#        shape, 6+6 layers, 512-d, 2048 FFN, about 10x the baseline's training time; LR=5e-4 there),
#        LR (1e-3), WARMUP (1000 updates), EPOCHS (20), STAGES ("prepare train evaluate bench"),
#        RESULTS (WORK_DIR/results; RESULTS=docs/results
#        writes the repository's figures), BENCH_JSON (RESULTS/baseline.json),
#        BENCH_LIMIT (200 sentences; 0 = whole test set), BENCH_RUNS (3),
#        TRAIN_FLAGS (extra fairseq-train flags, e.g. --fp16 on a GPU; none by default),
#        RANKS (1): train with this many CPU processes of one thread each (fairseq DDP over gloo), each on
#        4096/RANKS tokens a batch, so an update still sees 4096 tokens; PORT (29511) for their rendezvous
set -euo pipefail
# shellcheck source=examples/tools.sh
source "$(dirname "$0")/../tools.sh"  # the venv's commands on PATH (make install)
RAW=${1:-../shared/data/multi30k}
WORK=${2:-work/baseline}
EPOCHS=${EPOCHS:-20}
STAGES=${STAGES:-prepare train evaluate bench}
RESULTS=${RESULTS:-$WORK/results}
BENCH_JSON=${BENCH_JSON:-$RESULTS/baseline.json}
USER_DIR=$(fairseq-plugins user-dir)
CKPT=$WORK/checkpoints/checkpoint_best.pt
COMMANDS=$WORK/commands.txt
mkdir -p "$WORK"

# shellcheck source=examples/common.sh
source "$(dirname "$0")/../common.sh"  # SRC, TGT, check_langs, record (run + keep as provenance), stage

if stage prepare && [[ ! -f $WORK/data/prepare.json ]]; then
  record fairseq-plugins prepare "$RAW" "$WORK/data" -s "$SRC" -t "$TGT" --vocab-size "${VOCAB:-8000}" --workers 2
fi
if [[ -f $WORK/data/prepare.json ]]; then check_langs "$WORK/data"; fi

RANKS=${RANKS:-1}
train() {  # fairseq-train with the given flags, on RANKS one-thread processes (DDP) when RANKS > 1
  # shellcheck disable=SC2086  # TRAIN_FLAGS is a list of flags
  if (( RANKS == 1 )); then record fairseq-train "$@" --max-tokens 4096 ${TRAIN_FLAGS:-}; return; fi
  local pids=() rank
  for (( rank = 0; rank < RANKS; rank++ )); do
    # Only rank 0 logs to the console (fairseq's own rule); every rank gets one thread.
    OMP_NUM_THREADS=1 record fairseq-train "$@" --max-tokens $(( 4096 / RANKS )) --cpu \
      --distributed-world-size "$RANKS" --distributed-rank "$rank" --distributed-no-spawn \
      --distributed-backend gloo --ddp-backend legacy_ddp \
      --distributed-init-method "tcp://127.0.0.1:${PORT:-29511}" &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
}

if stage train; then
  train "$WORK/data/bin" --user-dir "$USER_DIR" \
    --task translation --source-lang "$SRC" --target-lang "$TGT" \
    --arch "${ARCH:-baseline_transformer_multi30k}" \
    --optimizer adam --adam-betas '(0.9, 0.98)' --clip-norm 0.0 \
    --lr "${LR:-1e-3}" --lr-scheduler inverse_sqrt --warmup-updates "${WARMUP:-1000}" \
    --criterion label_smoothed_cross_entropy --label-smoothing 0.1 \
    --max-epoch "$EPOCHS" --seed 1 \
    --save-dir "$WORK/checkpoints" --no-epoch-checkpoints \
    --log-format simple --log-interval 100
fi

if stage evaluate; then
  # Plain fairseq-generate + sacrebleu, the way a user would score it.
  # Decoded again only when the checkpoint is newer than the hypotheses (a re-run of a finished recipe scores them).
  for beam in 5 1; do
    if [[ ! $WORK/hyp.beam$beam.$TGT -nt $CKPT ]]; then
      record fairseq-generate "$WORK/data/bin" --user-dir "$USER_DIR" --path "$CKPT" \
        --source-lang "$SRC" --target-lang "$TGT" --gen-subset test --beam "$beam" --batch-size 64 \
        > "$WORK/generate.beam$beam.out"
      fairseq-plugins detok "$WORK/data" --from-generate --input "$WORK/generate.beam$beam.out" \
        > "$WORK/hyp.beam$beam.$TGT.tmp"
      mv "$WORK/hyp.beam$beam.$TGT.tmp" "$WORK/hyp.beam$beam.$TGT"
    fi
    echo "beam $beam: $(sacrebleu "$WORK/data/raw/test.$TGT" -i "$WORK/hyp.beam$beam.$TGT" -b)"
  done
fi

if stage bench; then
  # The figures of docs/results (RESULTS=docs/results): one thread, one sentence at a time, beam 5 and greedy,
  # with CTranslate2 float32 on the same checkpoint in the same runs (what users convert to for speed).
  mkdir -p "$(dirname "$BENCH_JSON")"
  rm -f "$BENCH_JSON.tmp"
  for beam in 5 1; do
    fairseq-plugins bench --method baseline --path "$CKPT" --data "$WORK/data" --split test \
      --device cpu --threads 1 --batch-size 1 --beam "$beam" \
      --runs "${BENCH_RUNS:-3}" --limit "${BENCH_LIMIT:-200}" \
      --reference ctranslate2 --provenance "$COMMANDS" --json "$BENCH_JSON.tmp" --append \
      --markdown "${BENCH_JSON%.json}.md" --append-markdown --plot "${BENCH_JSON%.json}.png"
  done
  mv "$BENCH_JSON.tmp" "$BENCH_JSON"
fi
