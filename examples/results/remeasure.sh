#!/usr/bin/env bash
# `make results`: re-measure every README row from the pinned model set (docs/results/models.json) on an idle
# machine, rewriting the bench JSONs of docs/results, then regenerate the README's and the method pages' blocks.
#
# Refuses to start while a pinned model is missing here, its hash is not recorded, or its file differs from its
# pin (`fairseq-plugins report --check-models --require-all-models`): a new machine first re-trains the set with
# make retrain (models.json's plan of the recipes), pins the hashes, then runs this. Refuses a loaded machine
# too (1-minute load average above MAX_LOAD, 0.5): rows measured beside a training are not comparable with idle
# ones. Each row comes from its recipe's bench stage with RESULTS=docs/results and the whole test set timed
# (BENCH_LIMIT=0: every BLEU on the whole split); rows measured by a bench command of their own (no recipe stage)
# are re-run from the command their JSON recorded. The GPU rows need a device: `examples/gpu/run.sh bench`
# (docs/gpu.md), not run here.
#
# Rows by group (ROWS): baseline, fast_step, blockwise, double_token, rnn_fc, bytenet, lattice; each group needs
# its own pinned models only (ROWS_MODELS below), so a machine that is still training the set (make retrain)
# re-measures the groups whose models are here, one after another.
#
# Usage: make results [DATA=../shared/data/multi30k] [SHAKESPEARE=../shared/data/tinyshakespeare] [ROWS="..."]
#   env: DATA, SHAKESPEARE, MAX_LOAD (0.5), ROWS (every group), DRY_RUN (1: print the commands, run none)
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=examples/tools.sh
source examples/tools.sh
DATA=${DATA:-../shared/data/multi30k}
SHAKESPEARE=${SHAKESPEARE:-../shared/data/tinyshakespeare}
MAX_LOAD=${MAX_LOAD:-0.5}
GROUPS_ALL="baseline fast_step blockwise double_token rnn_fc bytenet lattice"
ROWS=${ROWS:-$GROUPS_ALL}
# The pinned models (docs/results/models.json) each group's rows are measured on.
declare -A ROWS_MODELS=(
  [baseline]=baseline [fast_step]=baseline [blockwise]=baseline,blockwise-self
  [double_token]=baseline,double-token-bidir-2 [rnn_fc]=baseline,rnn_fc-fc4-tanh-tenc-ft
  [bytenet]=bytenet-mt-anneal,transformer-mt-anneal [lattice]=baseline,lattice-ffn512
)
needed=()
for group in $ROWS; do
  [[ -n ${ROWS_MODELS[$group]:-} ]] || { echo "make results: ROWS names $group; the groups: $GROUPS_ALL" >&2; exit 2; }
  needed+=("${ROWS_MODELS[$group]}")
done
required=$(IFS=,; echo "${needed[*]}")
if [[ " $ROWS " == *" fast_step "* && ! -f work/rnn_fc/shortlist.pt ]]; then
  echo "make results: the fast_step rows read work/rnn_fc/shortlist.pt: make retrain's rnn_fc-lists job makes it" >&2
  exit 2
fi
if ! fairseq-plugins report --check-models --require-models "$required"; then
  echo "make results: the pinned models of ROWS=\"$ROWS\" are not all here and pinned (above); train the missing" \
       "ones with make retrain (docs/results/models.json's plan), pin them (fairseq-plugins report --pin NAME)," \
       "then run it again" >&2
  exit 2
fi
row() { [[ " $ROWS " == *" $1 "* ]]; }
load=$(cut -d' ' -f1 /proc/loadavg)
if awk -v load="$load" -v max="$MAX_LOAD" 'BEGIN { exit !(load > max) }'; then
  echo "make results: load average $load > MAX_LOAD=$MAX_LOAD: the figures are measured on an idle machine" >&2
  exit 2
fi

run() {
  echo "+ $*"
  [[ ${DRY_RUN:-} == 1 ]] || env "$@"
}

# Re-run the bench command a results file recorded for one row (its last `commands` entry), writing the row
# back into that file in place of the old one (the same label).
replay() {
  local file=$1 label=$2
  python - "$file" "$label" <<'PY'
import json, shlex, subprocess, sys, tempfile
path, label = sys.argv[1:]
data = json.load(open(path))
rows = data if isinstance(data, list) else [data]
(row,) = [r for r in rows if r.get("label") == label]
argv = shlex.split(row["commands"][-1])
out = tempfile.mktemp(suffix=".json")
argv[argv.index("--json") + 1] = out
if "--append" in argv:
    argv.remove("--append")
print("+", shlex.join(argv), flush=True)
subprocess.run(argv, check=True)
new = json.load(open(out))
rows = [new if r is row else r for r in rows]
with open(path, "w", encoding="utf-8") as f:
    json.dump(rows if len(rows) > 1 else rows[0], f, indent=2, ensure_ascii=False)
    f.write("\n")
PY
}

# A row that came from a bench command of its own, not a recipe stage: FILE|LABEL.
replay_row() {
  echo "+ replay ${1%%|*}: ${1#*|}"
  [[ ${DRY_RUN:-} == 1 ]] || replay "${1%%|*}" "${1#*|}"
}

export RESULTS=docs/results THREADS=1 BENCH_LIMIT=0
if row baseline; then run STAGES=bench examples/baseline/run.sh "$DATA" work/baseline; fi
if row fast_step; then
  # (the ctranslate2 stage: the README's row, against CTranslate2 in the same runs; hub: issue 53's hub targets;
  # profile: where a token's time goes, docs/fast-step.md)
  run STAGES="exact fast devlin ctranslate2 hub profile" LIMIT=0 LIST=work/rnn_fc/shortlist.pt \
    examples/fast_step/run.sh work/baseline work/fast_step
fi
if row blockwise; then
  run STAGES="fast ctranslate2" BEST_VARIANT=self FAST_LIMIT=0 examples/blockwise/run.sh work/baseline work/blockwise
  replay_row "docs/results/blockwise_self_batched.json|self k=2 fast int8 batch 32"
fi
# double-token bidir-2 on the fast int8 step against the pinned baseline at beam 5, stock and CTranslate2 int8 in
# the same runs (the paper's comparison with a single-token system of its own, docs/double_token.md, needs the
# l2r-1 system trained too: SYSTEMS="l2r-1 bidir-2" STAGES="train average fast" of the same recipe)
if row double_token; then
  run TRAIN_ON=distill STAGES=ctranslate2 SYSTEMS=bidir-2 \
    examples/double_token/run.sh work/baseline work/double_token_cpu
fi
if row rnn_fc; then
  run MAIN_SYSTEM=fc4-tanh-tenc-ft LIST_TOP=50 LIST_FREQUENT=2000 STAGES="shortlist versus ctranslate2" \
    examples/rnn_fc/run.sh work/baseline work/rnn_fc
fi
if row bytenet; then
  run RESULTS=docs/results/bytenet-cpu MT_SYSTEMS="bytenet-mt-anneal transformer-mt-anneal" LM_SYSTEMS= \
    STAGES="bench summary" examples/bytenet/run.sh "$DATA" "$SHAKESPEARE" work/bytenet
fi
if row lattice; then
  # the README's row: K=16 and K=24 int8 against stock fairseq and CTranslate2 int8 at beam 5 in the same runs
  run TRAIN_FLAGS="--lattice-scorer-ffn-dim 512" THREADS=1 SYSTEMS=distill-1 CT2_SETTINGS="24 int8 3,16 int8 3" \
    STAGES=ctranslate2 examples/lattice/run.sh work/baseline work/lattice-ffn512
  replay_row "docs/results/lattice_ffn512.json|ffn512 (epochs 19-23) K=16 int8 nr3, native encoder layers"
fi
run fairseq-plugins report --readme README.md --overview-plot docs/results/overview.png
echo "make results: done on the CPU; the GPU rows: examples/gpu/run.sh bench on a lent device (docs/gpu.md)"
