#!/usr/bin/env bash
# `make demo`: every landed method end to end on small models, then one table.
#   fairseq-plugins prepare -> fairseq-train --user-dir -> fairseq-generate -> sacrebleu -> fairseq-plugins bench
# Data: $DATA (Multi30k layout: train.en/.de, val.*, test_2016_flickr.*); else Multi30k downloaded from its
# public GitHub location; else an embedded synthetic reordering corpus (figures then mean nothing).
# Budget: at most 15 minutes on 2 CPU cores. Small models and few updates: this proves the pipeline;
# docs/results holds the real figures. Each method adds examples/<method>/demo.sh (see docs/adding-a-method.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK=${WORK:-work/demo}
MULTI30K_URL=https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw
BENCH_LIMIT=${BENCH_LIMIT:-200}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
say() { printf '\n==> %s\n' "$*"; }
rm -rf "$WORK" && mkdir -p "$WORK"
USER_DIR=$(fairseq-plugins user-dir)

synthetic_banner() {
  cat <<'BANNER'

  !!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!
  !!  SYNTHETIC DATA: no DATA=DIR was given and Multi30k could not be downloaded.    !!
  !!  The figures below come from an artificial reordering task and say nothing     !!
  !!  about translation quality. Run `make demo DATA=path/to/multi30k` for real data. !!
  !!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!
BANNER
}

# ---- data ---------------------------------------------------------------------------------------------
SYNTHETIC=0
if [[ -n "${DATA:-}" ]]; then
  for f in train val test_2016_flickr; do
    for l in en de; do [[ -s "$DATA/$f.$l" ]] || { echo "DATA=$DATA: missing $DATA/$f.$l (Multi30k layout)" >&2; exit 2; }; done
  done
  RAW=$DATA
else
  RAW=$WORK/multi30k
  mkdir -p "$RAW"
  say "DATA not set: downloading Multi30k"
  for f in train val test_2016_flickr; do
    for l in en de; do
      if ! curl -fsSL --max-time 30 "$MULTI30K_URL/$f.$l.gz" -o "$RAW/$f.$l.gz" 2>/dev/null \
         || ! gunzip -f "$RAW/$f.$l.gz"; then
        SYNTHETIC=1; break 2
      fi
    done
  done
  if (( SYNTHETIC )); then
    rm -rf "$RAW"
    RAW=$WORK/synthetic
    python -c 'import sys; from fairseq_plugins.common.synthetic import write_corpus; write_corpus(sys.argv[1], "en", "de")' "$RAW"
    synthetic_banner
  fi
fi
if (( SYNTHETIC )); then VOCAB=100; else VOCAB=4000; fi

# ---- the baseline: stock transformer, small --------------------------------------------------------------
say "prepare ($RAW)"
fairseq-plugins prepare "$RAW" "$WORK/data" -s en -t de --vocab-size "$VOCAB" --workers 2 2> "$WORK/prepare.log" \
  || { tail -5 "$WORK/prepare.log" >&2; exit 1; }

say "train the baseline (small; capped at 7 minutes)"
# BASELINE_ARCH: the baseline's sizes, which a method that warm-starts from it must repeat.
if (( SYNTHETIC )); then
  BASELINE_ARCH="--arch baseline_transformer_tiny"
  SCHEDULE=(--max-epoch 12 --lr 5e-3 --warmup-updates 50)
else
  BASELINE_ARCH="--arch baseline_transformer_tiny --encoder-embed-dim 128 --decoder-embed-dim 128
                 --encoder-ffn-embed-dim 512 --decoder-ffn-embed-dim 512"
  SCHEDULE=(--max-update 1500 --lr 2e-3 --warmup-updates 200)
fi
# shellcheck disable=SC2086  # BASELINE_ARCH is a list of words
fairseq-train "$WORK/data/bin" --user-dir "$USER_DIR" --task translation $BASELINE_ARCH "${SCHEDULE[@]}" \
  --optimizer adam --adam-betas '(0.9, 0.98)' --lr-scheduler inverse_sqrt \
  --criterion label_smoothed_cross_entropy --label-smoothing 0.1 --max-tokens 4096 --seed 1 \
  --stop-time-hours 0.12 --save-dir "$WORK/checkpoints" --no-epoch-checkpoints \
  --log-format simple --log-interval 50 --no-progress-bar > "$WORK/train.log" 2>&1 \
  || { tail -30 "$WORK/train.log" >&2; echo "fairseq-train failed (log: $WORK/train.log)" >&2; exit 1; }
grep -E "valid on" "$WORK/train.log" | tail -2 | sed 's/.*| valid |/  valid:/'
BASELINE_CKPT=$WORK/checkpoints/checkpoint_best.pt
[[ -f $BASELINE_CKPT ]] || { echo "training produced no checkpoint" >&2; exit 1; }

say "fairseq-generate (beam 5) + sacrebleu"
fairseq-generate "$WORK/data/bin" --user-dir "$USER_DIR" --path "$BASELINE_CKPT" --gen-subset test \
  --beam 5 --batch-size 64 > "$WORK/generate.out" 2> "$WORK/generate.log"
fairseq-plugins detok "$WORK/data" --from-generate --input "$WORK/generate.out" > "$WORK/hyp.de"
echo "sacreBLEU: $(sacrebleu "$WORK/data/raw/test.de" -i "$WORK/hyp.de" -b $( (( SYNTHETIC )) && echo --force))"

BENCH_JSON=$WORK/bench.json
bench() {  # one thread, one sentence at a time, against the stock generator on the same model
  fairseq-plugins bench --data "$WORK/data" --split test --threads 1 --batch-size 1 --runs 2 \
    --limit "$BENCH_LIMIT" --json "$BENCH_JSON" --append "$@" 2>> "$WORK/bench.log" > /dev/null
}
say "bench: baseline"
bench --method baseline --path "$BASELINE_CKPT" --beam 5
bench --method baseline --path "$BASELINE_CKPT" --beam 1

# ---- every landed method ----------------------------------------------------------------------------------
export WORK RAW USER_DIR BASELINE_CKPT BASELINE_ARCH BENCH_JSON BENCH_LIMIT SYNTHETIC
export -f bench say
shopt -s nullglob
for method_demo in examples/*/demo.sh; do
  say "method: $(basename "$(dirname "$method_demo")")"
  bash "$method_demo"
done

# ---- the table ------------------------------------------------------------------------------------------
say "results: $BENCH_LIMIT test sentences, 1 thread, batch 1 (details: $BENCH_JSON)"
(( SYNTHETIC )) && synthetic_banner
fairseq-plugins report "$BENCH_JSON"
