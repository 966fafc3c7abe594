#!/usr/bin/env bash
# The fast decoder step (docs/fast-step.md) on the trained baseline transformer, Multi30k test_2016 (or the test
# split of BASELINE_WORK's SRC->TGT data): every figure is `fairseq-plugins bench --method fast_step`, the fast
# step against fairseq's stock generator on the same model, in the same run, one thread, alternating per batch.
#
#   lists : candidate lists of the baseline's dictionaries (fairseq-plugins align --lexical-table on the
#           training pieces, then fairseq-plugins shortlist: top TOP translations per source piece + the
#           FREQUENT most frequent target pieces); skipped when LIST exists. The sizes: int8 + lists greedy on
#           the whole test set lost 1.43 BLEU against int8 alone with 20 + 100 (143 candidates a sentence),
#           0.85 with 100 + 1000, 0.21 with 50 + 2000, 0.07 with 20 + 3000 (baseline after 17 epochs)
#   exact : fp32, batch 1, greedy and beam 5 (outputs identical to stock): RESULTS/fast_step.json
#   fast  : greedy at batch 1 with int8, candidate lists, and both (the whole test set, for BLEU):
#           RESULTS/fast_step_approximate.json
#   batch : greedy and beam 5 at batch BATCH: RESULTS/fast_step_batch.json
#   devlin: Devlin (2017)'s search on the baseline: beam 6, int8 + candidate lists + early stopping (delta 3)
#           against stock beam 6, batch 1, the whole test set: RESULTS/fast_step_devlin.json
#   ctranslate2 : the bar users pick instead, in the same runs (bench --reference ctranslate2: the baseline
#           converted by CTranslate2's fairseq converter), the whole test set, one thread, length limit
#           1.2 x source + 10 on every side: fp32 against CTranslate2 float32 and int8 against CTranslate2 int8,
#           greedy and beam 5 at batch 1, and int8 beam 5 at batch BATCH: RESULTS/fast_step_ctranslate2.json
#   hub   : the fast step as a Python user calls it: hub.translate a sentence a call against a generator built
#           once (examples/fast_step/hub_timing.py), fp32 and int8, greedy and beam 5, HUB_LIMIT (300) test
#           sentences: RESULTS/fast_step_hub.json (one entry a setting)
#   profile : where a token's time goes (examples/fast_step/profile.py), int8 greedy and beam 5, the search step
#           by step (each part timed) and in one native call, beside CTranslate2 int8's time a token:
#           RESULTS/fast_step_profile_{greedy,beam5}_{python,native}.{json,md}
#
# Usage: examples/fast_step/run.sh [BASELINE_WORK] [WORK]
#   BASELINE_WORK is the work dir of examples/baseline/run.sh (prepared data/ and checkpoints/).
#   env: SRC (en), TGT (de): the language suffixes, those of BASELINE_WORK's data,
#        STAGES ("lists exact fast batch devlin ctranslate2 hub profile"), LIMIT (sentences of the exact and batch stages, 300; 0 = all),
#        FAST_LIMIT (0: the whole test set), PROFILE_LIMIT (300), RUNS (3), BATCH (32), TOP (50), FREQUENT (2000),
#        LIST (WORK/shortlist.TOP+FREQUENT.pt), RESULTS (WORK/results; RESULTS=docs/results writes the
#        repository's figures), DEVICE (cpu), THREADS (1),
#        JOBS (1: the fast stage's settings one at a time; 2 on two idle cores)
set -euo pipefail
# shellcheck source=examples/tools.sh
source "$(dirname "$0")/../tools.sh"  # the venv's commands on PATH (make install)
BASE=${1:-work/baseline}
WORK=${2:-work/fast_step}
STAGES=${STAGES:-lists exact fast batch devlin ctranslate2 hub profile}
RESULTS=${RESULTS:-$WORK/results}
TOP=${TOP:-50}
FREQUENT=${FREQUENT:-2000}
LIST=${LIST:-$WORK/shortlist.$TOP+$FREQUENT.pt}
# shellcheck source=examples/common.sh
source "$(dirname "$0")/../common.sh"  # SRC, TGT, use_baseline_data, record (run + keep as provenance), stage
use_baseline_data "$BASE" "$WORK"
mkdir -p "$RESULTS"
CHECKPOINT=$BASE/checkpoints/checkpoint_best.pt

if stage lists && [[ ! -f $LIST ]]; then
  if [[ ! -f $WORK/lex.$SRC-$TGT.txt ]]; then  # (the alignment of the training data: any list size reuses it)
    record fairseq-plugins align --source "$DATA/tok/train.$SRC" --target "$DATA/tok/train.$TGT" \
      --output "$WORK/train.align" --lexical-table "$WORK/lex.$SRC-$TGT.txt"
  fi
  record fairseq-plugins shortlist --lexical-table "$WORK/lex.$SRC-$TGT.txt" --data-bin "$DATA/bin" \
    -s "$SRC" -t "$TGT" --top "$TOP" --frequent "$FREQUENT" --output "$LIST"
fi

# Provenance: the baseline's commands, and those that made the lists (here, or where LIST was made).
PROVENANCE=("$BASE/commands.txt")
for commands in "$COMMANDS" "$(dirname "$LIST")/commands.txt"; do
  if [[ -f $commands && " ${PROVENANCE[*]} " != *" $commands "* ]]; then PROVENANCE+=("$commands"); fi
done

bench() {  # json label beam batch limit [fast-step flags]
  local json=$1 label=$2 beam=$3 batch=$4 limit=$5
  shift 5
  fairseq-plugins bench --method fast_step --path "$CHECKPOINT" --data "$DATA" --split test \
    --device "${DEVICE:-cpu}" --threads "${THREADS:-1}" --beam "$beam" --batch-size "$batch" \
    --runs "${RUNS:-3}" --limit "$limit" --fast-step "$@" --label "$label" \
    --provenance "${PROVENANCE[@]}" --json "$json" --append
}

if stage exact; then
  rm -f "$RESULTS/fast_step.json"
  for beam in 1 5; do
    bench "$RESULTS/fast_step.json" "fast step fp32 beam $beam" "$beam" 1 "${LIMIT:-300}"
  done
fi

if stage fast; then
  # JOBS settings at a time, one thread each (JOBS=2 on 2 otherwise idle cores); one JSON part a setting.
  parts=()
  pids=()
  index=0
  for setting in "int8|--fast-step-precision int8" \
                 "int8 + candidate lists|--fast-step-precision int8 --fast-step-shortlist $LIST" \
                 "candidate lists|--fast-step-shortlist $LIST"; do
    part="$WORK/fast_step_approximate.$index.json"
    rm -f "$part"
    parts+=("$part")
    # shellcheck disable=SC2086  # the flags are words
    bench "$part" "fast step ${setting%%|*}, greedy" 1 1 "${FAST_LIMIT:-0}" ${setting#*|} &
    pids+=($!)
    index=$((index + 1))
    if (( index % ${JOBS:-1} == 0 )); then for pid in "${pids[@]}"; do wait "$pid"; done; pids=(); fi
  done
  for pid in "${pids[@]}"; do wait "$pid"; done  # (wait PID returns the job's status: set -e stops on a failure)
  # (a part holds one result: bench writes a single result as an object, more as a list)
  python -c 'import json, sys; parts = [json.load(open(p)) for p in sys.argv[2:]]
json.dump([r for p in parts for r in (p if isinstance(p, list) else [p])], open(sys.argv[1], "w"), indent=2)' \
    "$RESULTS/fast_step_approximate.json.tmp" "${parts[@]}"
  mv "$RESULTS/fast_step_approximate.json.tmp" "$RESULTS/fast_step_approximate.json"
fi

if stage batch; then
  rm -f "$RESULTS/fast_step_batch.json"
  for beam in 1 5; do
    bench "$RESULTS/fast_step_batch.json" "fast step fp32 beam $beam batch ${BATCH:-32}" "$beam" "${BATCH:-32}" \
      "${LIMIT:-300}"
  done
fi

if stage devlin; then
  rm -f "$RESULTS/fast_step_devlin.json"
  bench "$RESULTS/fast_step_devlin.json" "fast step int8 + candidate lists + early stop, beam 6" 6 1 \
    "${FAST_LIMIT:-0}" --fast-step-precision int8 --fast-step-shortlist "$LIST" --fast-step-early-stop
fi

if stage ctranslate2; then
  # The same length limit on every side: CTranslate2 has none of its own to fall back on.
  limits=(--max-len-a 1.2 --max-len-b 10)
  rm -f "$RESULTS/fast_step_ctranslate2.json"
  for precision in fp32 int8; do
    compute=$([[ $precision == int8 ]] && echo int8 || echo float32)
    for beam in 1 5; do
      bench "$RESULTS/fast_step_ctranslate2.json" "fast step $precision beam $beam vs CTranslate2 $compute" \
        "$beam" 1 "${FAST_LIMIT:-0}" --fast-step-precision "$precision" "${limits[@]}" \
        --reference ctranslate2 --reference-compute-type "$compute"
    done
  done
  bench "$RESULTS/fast_step_ctranslate2.json" "fast step int8 beam 5 batch ${BATCH:-32} vs CTranslate2 int8" 5 \
    "${BATCH:-32}" "${FAST_LIMIT:-0}" --fast-step-precision int8 "${limits[@]}" \
    --reference ctranslate2 --reference-compute-type int8
fi

if stage hub; then
  entries=()
  for precision in fp32 int8; do
    for beam in 1 5; do
      python "$(dirname "$0")/hub_timing.py" --checkpoint-dir "$(dirname "$CHECKPOINT")" --data "$DATA" \
        --precision "$precision" --beam "$beam" --limit "${HUB_LIMIT:-300}" --runs "${RUNS:-3}" \
        --json "$WORK/hub_${precision}_beam$beam.json"
      entries+=("$WORK/hub_${precision}_beam$beam.json")
    done
  done
  python - "$RESULTS/fast_step_hub.json" "${entries[@]}" <<'PY'
import json, os, sys
entries = [json.load(open(path)) for path in sys.argv[2:]]
with open(sys.argv[1] + ".tmp", "w") as f:
    json.dump(entries, f, indent=2)
    f.write("\n")
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
PY
fi

if stage profile; then
  for beam in 1 5; do
    for search in python native; do
      name=fast_step_profile_$([[ $beam == 1 ]] && echo greedy || echo beam$beam)_$search
      python "$(dirname "$0")/profile.py" --path "$CHECKPOINT" --data "$DATA" --precision int8 --beam "$beam" \
        --search "$search" --limit "${PROFILE_LIMIT:-300}" --threads "${THREADS:-1}" --json "$RESULTS/$name.json" \
        --markdown "$RESULTS/$name.md"
    done
  done
fi
