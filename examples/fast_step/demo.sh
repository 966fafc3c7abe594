#!/usr/bin/env bash
# Fast-step steps of `make demo` (examples/demo/steps.mk): the demo baseline decoded greedily on the fast decoder
# step (--task fast_step_translation --fast-step, docs/fast-step.md) against fairseq's stock greedy search on the
# same checkpoint, in the same run: fp32 (the stock outputs, token for token) and int8 (approximate); each also
# against CTranslate2 (the same checkpoint converted by its fairseq converter, float32 and int8) in the same runs.
set -euo pipefail
# shellcheck source=examples/tools.sh
source "$(dirname "$0")/../tools.sh"  # the venv's commands on PATH (make install)
source examples/demo/lib.sh
case $1 in
  bench-fp32)
    bench 1-fast_step-fp32 --method fast_step --path "$BASELINE_CKPT" --beam 1 --fast-step \
      --reference ctranslate2 --reference-compute-type float32 --label "fast step fp32" \
      --model-note "demo baseline, $(model_note baseline)"
    ;;
  bench-int8)
    bench 2-fast_step-int8 --method fast_step --path "$BASELINE_CKPT" --beam 1 --fast-step \
      --fast-step-precision int8 --reference ctranslate2 --reference-compute-type int8 --label "fast step int8" \
      --model-note "demo baseline, $(model_note baseline)"
    ;;
  *) echo "examples/fast_step/demo.sh: unknown step $1" >&2; exit 2 ;;
esac
