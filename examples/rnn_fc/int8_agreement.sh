#!/usr/bin/env bash
# int8 (per-row activation scales) against fp32 on one checkpoint: fairseq-generate through rnn_fc_translation,
# beam 5, batch 64, the whole test split; sacreBLEU of both, and how many translations are identical.
#
# Usage: examples/rnn_fc/int8_agreement.sh [BASELINE_WORK (work/baseline)] [OUT_JSON (RESULTS/rnn_fc_int8_agreement.json)]
#   env: SRC (en), TGT (de): the language suffixes of BASELINE_WORK's data;
#        RESULTS (BASELINE_WORK/int8_agreement/results; RESULTS=docs/results writes the repository's figure)
set -euo pipefail
# shellcheck source=examples/tools.sh
source "$(dirname "$0")/../tools.sh"  # the venv's commands on PATH (make install)
BASE=${1:-work/baseline}
WORK=$BASE/int8_agreement
RESULTS=${RESULTS:-$WORK/results}
JSON=${2:-$RESULTS/rnn_fc_int8_agreement.json}
mkdir -p "$WORK" "$(dirname "$JSON")"
# shellcheck source=examples/common.sh
source "$(dirname "$0")/../common.sh"  # SRC, TGT, check_langs
check_langs "$BASE/data"
for precision in fp32 int8; do
  OMP_NUM_THREADS=1 fairseq-generate "$BASE/data/bin" --user-dir "$(fairseq-plugins user-dir)" \
    --task rnn_fc_translation --path "$BASE/checkpoints/checkpoint_best.pt" --source-lang "$SRC" --target-lang "$TGT" \
    --gen-subset test --beam 5 --batch-size 64 --cpu --rnn-fc-precision "$precision" > "$WORK/generate.$precision.out"
  fairseq-plugins detok "$BASE/data" --from-generate --input "$WORK/generate.$precision.out" > "$WORK/hyp.$precision.$TGT"
  sacrebleu "$BASE/data/raw/test.$TGT" -i "$WORK/hyp.$precision.$TGT" > "$WORK/bleu.$precision.json"
done
TGT=$TGT python - "$BASE" "$JSON" <<'PY'
import json, os, sys
base, out = sys.argv[1:]
work = os.path.join(base, "int8_agreement")
hyp = {p: open(os.path.join(work, f"hyp.{p}.{os.environ['TGT']}"), encoding="utf-8").read().splitlines()
       for p in ("fp32", "int8")}
result = {
    "what": "int8 (per-row activation scales) against fp32, fairseq-generate --task rnn_fc_translation --beam 5 "
            "--batch-size 64 --cpu, whole test split",
    "command": "examples/rnn_fc/int8_agreement.sh " + " ".join(sys.argv[1:]),
    "sentences": len(hyp["fp32"]),
    "identical_translations": sum(a == b for a, b in zip(hyp["fp32"], hyp["int8"])),
    "sacrebleu": {p: json.load(open(os.path.join(work, f"bleu.{p}.json"))) for p in ("fp32", "int8")},
}
with open(out + ".tmp", "w") as f:
    json.dump(result, f, indent=1)
os.replace(out + ".tmp", out)
print(f"identical: {result['identical_translations']}/{result['sentences']}")
PY
