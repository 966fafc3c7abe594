#!/usr/bin/env bash
# `make demo`: every landed method end to end on small models, then one table.
#   fairseq-plugins prepare -> fairseq-train --user-dir -> fairseq-generate -> sacrebleu -> fairseq-plugins bench
# Data: $DATA (Multi30k layout: train.en/.de, val.*, test_2016_flickr.*; or train, valid|dev, test); else Multi30k
# downloaded from its public GitHub location; else an embedded synthetic reordering corpus (figures then mean
# nothing). SRC and TGT (en, de) name the languages: the files' suffixes (Multi30k also has fr and cs).
# The steps and what each needs are in examples/demo/steps.mk; make runs two at a time, one thread each, so
# both cores work. Budget: 15 minutes on 2 idle CPU cores, install included. Every training is bounded by its
# number of updates and seeded, every bench output capped at 1.2 x source + 10 tokens, so every machine trains
# the same models and measures the same outputs; only the times differ. The models are small, warm-started
# from the demo baseline where the method allows: the table shows each method against its reference in the
# same run; docs/results holds the real figures. A second run reuses $WORK's data and checkpoints (trains
# nothing) and measures again; `rm -rf work/demo` starts over.
# Usage: examples/demo/run.sh [WORK]  (the work dir: WORK, else work/demo)
# Env: DATA, BENCH_LIMIT (100 test sentences a row; 0: all), SRC, TGT, STEPS (some steps alone, below), JOBS (2
# steps at once), RESULTS (also copy each row's bench JSON there: RESULTS=docs/results/demo for a figure quoted
# outside the demo).
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=examples/tools.sh
source examples/tools.sh  # the venv's commands on PATH (make install)
export WORK=${1:-${WORK:-work/demo}}
export BENCH_LIMIT=${BENCH_LIMIT:-100}
export SRC=${SRC:-en} TGT=${TGT:-de}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1  # every step is one process on one core; make runs two at a time
export DEMO_START=${DEMO_START:-$(date +%s)}
export USER_DIR
USER_DIR=$(fairseq-plugins user-dir)
MULTI30K_URL=https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw
# shellcheck source=examples/demo/lib.sh
source examples/demo/lib.sh
mkdir -p "$WORK"

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
  # Each split under one of the names fairseq-plugins prepare looks for (Multi30k's first).
  for stems in train "val valid dev" "test_2016_flickr test"; do
    for l in "$SRC" "$TGT"; do
      found=0
      for f in $stems; do if [[ -s "$DATA/$f.$l" ]]; then found=1; break; fi; done
      (( found )) || { echo "DATA=$DATA: missing $DATA/${stems// /.$l or }.$l (Multi30k layout)" >&2; exit 2; }
    done
  done
  RAW=$DATA
  SOURCE="DATA=$(cd "$DATA" && pwd)"
elif [[ -f $WORK/data-source ]] && [[ $(cat "$WORK/data-source") != DATA=* ]]; then
  RAW=$(sed -n 's/^downloaded=\|^synthetic=//p' "$WORK/data-source")  # what an earlier demo fetched or built
  SOURCE=$(cat "$WORK/data-source")
  [[ $SOURCE == synthetic=* ]] && SYNTHETIC=1
else
  RAW=$WORK/multi30k
  mkdir -p "$RAW"
  say "DATA not set: downloading Multi30k"
  for f in train val test_2016_flickr; do
    for l in "$SRC" "$TGT"; do
      if ! curl -fsSL --max-time 30 "$MULTI30K_URL/$f.$l.gz" -o "$RAW/$f.$l.gz" 2>/dev/null \
         || ! gunzip -f "$RAW/$f.$l.gz"; then
        SYNTHETIC=1; break 2
      fi
    done
  done
  if (( SYNTHETIC )); then
    rm -rf "$RAW"
    RAW=$WORK/synthetic
    python -c 'import sys; from fairseq_plugins.tools.synthetic import write_corpus; write_corpus(*sys.argv[1:])' \
      "$RAW" "$SRC" "$TGT"
    synthetic_banner
    SOURCE="synthetic=$RAW"
  else
    SOURCE="downloaded=$RAW"
  fi
fi
if [[ -f $WORK/data-source && $(cat "$WORK/data-source") != "$SOURCE" ]]; then
  echo "demo: $WORK was built from $(cat "$WORK/data-source"), not $SOURCE: remove $WORK or set WORK=another/dir" >&2
  exit 2
fi
if [[ -f $WORK/data/prepare.json && $(data_langs) != "$SRC $TGT" ]]; then
  echo "demo: $WORK holds $(data_langs | tr ' ' '-') data, not $SRC-$TGT: remove $WORK or set WORK=another/dir" >&2
  exit 2
fi
echo "$SOURCE" > "$WORK/data-source"
export RAW SYNTHETIC
say "data: $SOURCE$( (( SYNTHETIC )) && echo ' (SYNTHETIC: the figures say nothing about translation)')"

# Models trained by an earlier demo with other settings would be reused silently: refuse them.
DEMO_VERSION="2: trainings bounded by updates"
if [[ -f $WORK/prepare.log && $(cat "$WORK/demo-version" 2>/dev/null) != "$DEMO_VERSION" ]]; then
  echo "demo: $WORK holds models of an earlier version of the demo: remove $WORK or set WORK=another/dir" >&2
  exit 2
fi
echo "$DEMO_VERSION" > "$WORK/demo-version"

# ---- every step, two at a time ------------------------------------------------------------------------------
rm -rf "$WORK/bench"  # the measurements are made anew on every run; models are reused
# STEPS: some of steps.mk's files alone (relative to WORK: STEPS=bench/2-fast_step-int8.json trains the demo
# baseline and measures that row) with what they need; JOBS: steps at once (2; 1 leaves the other core idle while
# a row is timed, as a figure quoted outside the demo needs)
steps=()
for step in ${STEPS:-}; do steps+=("$WORK/$step"); done
make --no-print-directory -j"${JOBS:-2}" -f examples/demo/steps.mk WORK="$WORK" "${steps[@]}"

# ---- the table ------------------------------------------------------------------------------------------
say "results: 1 thread, batch 1, 3 runs alternating per batch (details: $WORK/bench/*.json)"
(( SYNTHETIC )) && synthetic_banner
if [[ -f $WORK/baseline/bleu.txt ]]; then cat "$WORK/baseline/bleu.txt"; echo; fi  # (STEPS may leave it out)
if compgen -G "$WORK/bench/*.json" > /dev/null; then
  fairseq-plugins report "$WORK"/bench/*.json
  python examples/demo/notes.py "$WORK/bench"
  if [[ -n ${RESULTS:-} ]]; then
    mkdir -p "$RESULTS"
    for row in "$WORK"/bench/*.json; do
      name=$(basename "$row")
      cp "$row" "$RESULTS/.$name.tmp" && mv "$RESULTS/.$name.tmp" "$RESULTS/$name"
    done
    say "rows copied to $RESULTS"
  fi
fi
say "demo finished"
