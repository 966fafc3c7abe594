#!/usr/bin/env bash
# The GPU kit's dry run on the CPU (what CI runs, so that the kit cannot rot while no device is lent): every
# stage of examples/gpu/run.sh with DEVICE=cpu on a tiny synthetic corpus in Multi30k's layout (SRC -> TGT: en -> de
# unless set; bytenet's on character data from it), 3 epochs for the baseline and one for each method, a few
# sentences per bench, then pack and unpack, checking that the parts put every packed file back. Figures from it mean nothing; it checks that the stages run
# and fit together.
#
# Usage: examples/gpu/dry_run.sh [WORK]   (default work/gpu-dry; started over on every run)
set -euo pipefail
cd "$(dirname "$0")/../.."
export WORK=${1:-work/gpu-dry}
export DEVICE=cpu RESULTS=$WORK/results OMP_NUM_THREADS=1
export SRC=${SRC:-en} TGT=${TGT:-de}
# The baseline long enough to write words (detok refuses output without word boundaries): 3 epochs of 4 updates
# with the learning rate's warm-up shortened from the recipe's 1,000 updates (every training of the kit takes
# TRAIN_FLAGS); the methods 1 epoch
export EPOCHS=3 KIT_EPOCHS=1 GPU_MINUTES=5 BENCH_LIMIT=4 BENCH_RUNS=1 BATCHES="1 4" TRAIN_FLAGS="--warmup-updates 20"
export DOUBLE_TOKEN_SYSTEMS="l2r-1 bidir-2" RNN_FC_SYSTEMS=fc4-tanh LATTICE_SYSTEMS=distill-1
export BENCH_METHODS="baseline fast_step double_token rnn_fc"
# The profile stage on two of them: the fast step (its own kernels) and double-token (a stock side of its own).
export PROFILE_METHODS="fast_step double_token" PROFILE_SENTENCES=2
# Barely trained models loop to the 200-token limit: cap the outputs as the distilled sets are capped.
export BENCH_FLAGS="--max-len-a 1.2 --max-len-b 10"
rm -rf "$WORK"
mkdir -p "$WORK/raw"
python -c "import sys; from fairseq_plugins.tools.synthetic import write_corpus
write_corpus(sys.argv[1], sys.argv[2], sys.argv[3], sizes={'train': 300, 'val': 20, 'test_2016_flickr': 8})" \
  "$WORK/raw" "$SRC" "$TGT"
fairseq-plugins prepare "$WORK/raw" "$WORK/baseline/data" -s "$SRC" -t "$TGT" --vocab-size 100 2> "$WORK/prepare.log"

for stage in env baseline train bench profile; do
  echo "== dry run: $stage ($(date +%T))"
  examples/gpu/run.sh "$stage"
done
echo "== dry run: bytenet ($(date +%T))"
# The ByteNet recipe's character data from the same corpus (its English side the LM's text), then the MT pair and
# the smallest LM for a few seconds each: a first validation, the fallback to the best checkpoint where no epoch
# ended, both decodes and the LM's score.
fairseq-plugins prepare --char "$WORK/raw" "$WORK/bytenet-gpu/mt-data" -s "$SRC" -t "$TGT" 2>> "$WORK/prepare.log"
fairseq-plugins prepare-lm "$WORK/raw/train.$SRC" "$WORK/raw/val.$SRC" "$WORK/bytenet-gpu/lm-data" 2>> "$WORK/prepare.log"
# The MT pair: 30 small updates after a short warm-up (an update cap, not a time cap: a loaded CI machine takes
# long over its first ones) for outputs that hold words (detok needs them), decoded at beam 2; the LM for 20 s.
GPU_MINUTES=0.33 BYTENET_LM_SYSTEMS=bytenet-lm EVAL_SECONDS=300 BEAM=2 \
  BYTENET_MT_FLAGS="--max-tokens 1024 --warmup-updates 10 --max-update 30 --stop-time-hours 1" examples/gpu/run.sh bytenet
for path in bytenet-mt/test.beam2.txt bytenet-mt/test.beam1.txt transformer-mt/test.beam1.txt bytenet-lm/eval-lm.log; do
  [[ -s $WORK/bytenet-gpu/$path ]] || { echo "dry run: the bytenet stage wrote no $WORK/bytenet-gpu/$path" >&2; exit 1; }
done

for method in baseline fast_step double_token rnn_fc; do
  [[ -s $RESULTS/$method.json ]] || { echo "dry run: bench wrote no $RESULTS/$method.json" >&2; exit 1; }
done
for method in $PROFILE_METHODS; do
  [[ -s $RESULTS/profile/$method.json ]] || { echo "dry run: profile wrote no $RESULTS/profile/$method.json" >&2; exit 1; }
done

echo "== dry run: pack and unpack ($(date +%T))"
# A .pt that is no checkpoint (as a lattice table.pt) travels as it is: only checkpoint*.pt files are stripped.
python3 -c "import sys, torch; torch.save({'lexical_probs': torch.rand(3, 4)}, sys.argv[1])" "$WORK/table.pt"
packed=("$WORK"/double_token/*/checkpoints/checkpoint_avg.pt "$WORK/baseline/train.log" "$RESULTS" "$WORK/table.pt")
mkdir -p "$WORK/out"
OUT=$(cd "$WORK/out" && pwd)
OUT=$OUT examples/gpu/run.sh pack "${packed[@]}"
mkdir -p "$WORK/unpacked"
(cd "$WORK/unpacked" && "$OLDPWD/examples/gpu/run.sh" unpack "$OUT")
for path in "${packed[@]}"; do
  [[ -e $WORK/unpacked/$path ]] || { echo "dry run: $path did not come back from pack/unpack" >&2; exit 1; }
done
cmp "$WORK/table.pt" "$WORK/unpacked/$WORK/table.pt" || { echo "dry run: table.pt changed in pack/unpack" >&2; exit 1; }
echo "dry run: every stage ran ($(date +%T))"
