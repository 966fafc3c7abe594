#!/usr/bin/env bash
# The GPU kit: every method trained, decoded and benchmarked on a CUDA device, one stage per device command.
# Each stage ends well inside a device command's 10 minutes; run them in this order on a lent machine:
#
#   env      : installs the carried wheels (.whl: ../shared/gpu/fetch-wheels.sh) and this package, prints
#              torch/CUDA/GPU versions, runs the test suite's CUDA-marked tests (pytest -m cuda)
#   baseline : examples/baseline/run.sh's train and evaluate stages on the GPU (same recipe, TRAIN_FLAGS
#              added), then the distilled training sets every method reuses: beam 5 (work/distill/beam5) and
#              greedy (work/blockwise/self_distill)
#   train    : each method of METHODS trained by its own recipe on the GPU (its train stage, TRAIN_FLAGS added),
#              warm-started from the baseline where the method allows; GPU_MINUTES (per method) sets the budget
#   bytenet  : ByteNet (examples/bytenet/run.sh) in BYTENET_WORK: the character MT pair and the LM systems trained
#              side by side for GPU_MINUTES each (TRAIN_FLAGS added), averaged up to their best epochs, MT decoded
#              (beam 12 and greedy) and the LMs scored (fairseq-eval-lm); needs the recipe's prepared mt-data and
#              lm-data there (carried)
#   bench    : fairseq-plugins bench of every method against the stock generator on the same model, on the GPU,
#              batch 1 and batch 64, fp32 and fp16: RESULTS/<method>.json
#   graphs   : the bench again with each method's calls captured as CUDA graphs (fast_step, blockwise and
#              double_token: --fast-step --fast-step-cuda-graphs; lattice: --lattice-cuda-graphs), against the same
#              stock sides: RESULTS/<method>_graphs.json, and blockwise and double_token on the fast step uncaptured
#              (RESULTS/<method>_fast_step.json: the bench stage runs them on their own decoders), so that what the
#              graphs add is the ratio of the two (CUDA only; a device command of its own)
#   profile  : where a token's time goes: the bench's methods and their stock sides at batch 1 (fp16 on cuda),
#              PROFILE_SENTENCES (20) decoded under torch.profiler: kernel time against the gaps between kernels
#              per output token, RESULTS/profile/<method>.json and a table each (fairseq-plugins report --profile);
#              PROFILE_METHODS (BENCH_METHODS) chooses the methods
#   pack     : the named work paths (checkpoints stripped of their optimizer state) and RESULTS as one
#              tar.gz, split in parts of 15 MiB, into $OUT (a device command's result folder), 4 at most
#   pack-rest: the next 4 parts of the last pack (the same warm machine, the next command)
#   unpack   : here, after the command: examples/gpu/run.sh unpack FILES_AT puts the parts back in place
#   stamp    : here, before the first command: writes the commit (git describe of HEAD, +dirty) into .gpu/commit,
#              which travels with the tree, so every bench JSON made there names it (the copy has no .git)
#
# Usage: examples/gpu/run.sh STAGE [ARGS]   (or make gpu-check STAGE=...; docs/gpu.md)
#   env: DEVICE (cuda; cpu = the dry run CI does, examples/gpu/dry_run.sh), WHEELS (.whl), SITE (where the wheels
#        go, /tmp/fairseq-plugins-site), WORK (work), RESULTS (WORK/results/gpu; RESULTS=docs/results/gpu writes
#        the repository's figures), SRC (en), TGT (de): the language suffixes of WORK/baseline/data,
#        train: TRAIN_FLAGS (--fp16 on cuda, none on cpu; TRAIN_FLAGS_<method> for one method), METHODS
#        ("double_token rnn_fc lattice"), DOUBLE_TOKEN_SYSTEMS (all five), RNN_FC_SYSTEMS ("fc4-tanh fc0-tanh"),
#        LATTICE_SYSTEMS (distill-1), GPU_MINUTES (4 per training, all at once), KIT_EPOCHS (100: a cap)
#        bytenet: BYTENET_WORK (WORK/bytenet-gpu), BYTENET_MT_SYSTEMS ("bytenet-mt transformer-mt"),
#        BYTENET_LM_SYSTEMS ("bytenet-lm-wide bytenet-lm-deep-wide bytenet-lm-deep-wide-d50"), GPU_MINUTES (as train),
#        BYTENET_MT_FLAGS ("--max-tokens 16384 --warmup-updates 250": both MT systems), EVAL_SECONDS (150: a cap)
#        bench: BENCH_METHODS ("baseline fast_step double_token lattice blockwise rnn_fc"), BATCHES ("1 64"),
#        PRECISIONS ("fp32 fp16"), BENCH_LIMIT (200 test sentences), BENCH_RUNS (3), BENCH_FLAGS (added to every
#        bench, after the method's own flags)
#        pack: PACK_DTYPE (float16: checkpoints' floating tensors)
# Bad input: no CUDA device (DEVICE=cuda) or a missing wheel stops every stage with a message and exit code 2.
set -euo pipefail
STAGE=${1:?usage: examples/gpu/run.sh env|baseline|train|bytenet|bench|graphs|profile|pack|pack-rest|unpack|stamp [ARGS]}
shift
DEVICE=${DEVICE:-cuda}
WHEELS=${WHEELS:-.whl}
SITE=${SITE:-/tmp/fairseq-plugins-site}
WORK=${WORK:-work}
RESULTS=${RESULTS:-$WORK/results/gpu}
export SRC=${SRC:-en} TGT=${TGT:-de}  # (every recipe the kit runs reads them too)
if [[ $DEVICE == cuda ]]; then TRAIN_FLAGS=${TRAIN_FLAGS---fp16}; else TRAIN_FLAGS=${TRAIN_FLAGS-}; fi
export TRAIN_FLAGS
KIT=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=examples/common.sh
source "$KIT/../common.sh"

fail() { echo "examples/gpu/run.sh $STAGE: $*" >&2; exit 2; }

# fairseq and its small dependencies from the carried wheels, then this package, into SITE; nothing when they
# import already (a machine of your own with `make install`).
install_carried() {
  [[ -d $SITE/fairseq ]] && export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} PATH=$SITE/bin:$PATH
  if python3 -c "import fairseq, fairseq_plugins" 2>/dev/null && command -v fairseq-plugins fairseq-train > /dev/null; then
    return 0
  fi
  local wheel missing=()
  for wheel in ve_fairseq-0.12.3 hydra_core-1.3.2 omegaconf-2.3.0 antlr4_python3_runtime-4.9.3 bitarray; do
    compgen -G "$WHEELS/$wheel*.whl" > /dev/null || missing+=("$WHEELS/$wheel*.whl")
  done
  ((${#missing[@]} == 0)) || fail "missing wheel(s): ${missing[*]}; fetch them here with" \
    "../shared/gpu/fetch-wheels.sh $WHEELS and carry $WHEELS"
  # One pip call: a second --target --upgrade would replace the first one's bin/ (fairseq's commands).
  rm -rf "$SITE"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-build-isolation --target "$SITE" \
    "$WHEELS"/*.whl .
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} PATH=$SITE/bin:$PATH
}

require_device() {
  [[ $DEVICE == cpu || $DEVICE == cuda ]] || fail "DEVICE=$DEVICE: cuda or cpu"
  if [[ $DEVICE == cuda ]]; then
    python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null \
      || fail "no CUDA device visible to torch (DEVICE=cpu runs the dry run)"
  fi
}

case $STAGE in
  stamp)  # here: the commit the device's copy of the tree is, for its bench JSONs (fairseq_plugins.bench.report)
    mkdir -p .gpu
    commit=$(git rev-parse HEAD)
    [[ -z $(git status --porcelain --untracked-files=no -- . ':(exclude)docs/results') ]] || commit+="+dirty"
    echo "$commit" > .gpu/commit.tmp && mv .gpu/commit.tmp .gpu/commit
    echo "stamped .gpu/commit: $commit"
    exit 0 ;;
  unpack)  # here: the parts one or more device commands brought back, in their places under the repo root
    (($# > 0)) || fail "usage: examples/gpu/run.sh unpack DIR... (the files_at of each device command)"
    parts=()
    for from in "$@"; do parts+=("$from"/kit.tar.gz.part*); done
    [[ -e ${parts[0]} ]] || fail "$*: no kit.tar.gz.part* files"
    mapfile -t parts < <(for part in "${parts[@]}"; do echo "$(basename "$part") $part"; done | sort | cut -d' ' -f2)
    cat "${parts[@]}" | tar -xzf - -C .
    echo "unpacked $(cat "${parts[@]}" | tar -tzf - | grep -vc /$) files from ${#parts[@]} part(s)"
    exit 0 ;;
esac

require_device
install_carried

case $STAGE in
  env)
    python3 - <<'EOF'
import fairseq, torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, fairseq {fairseq.__version__}")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs, "
          f"bf16 {torch.cuda.is_bf16_supported()}")
EOF
    [[ $DEVICE == cuda ]] && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    mkdir -p "$RESULTS"
    python3 -m pytest -q -m cuda -p no:cacheprovider --junitxml "$RESULTS/env-pytest.xml" ;;

  baseline)
    BASE=$WORK/baseline
    [[ -f $BASE/data/prepare.json ]] || fail "$BASE/data: no prepared data (run examples/baseline/run.sh with" \
      "STAGES=prepare here and carry $BASE/data)"
    mkdir -p "$BASE"
    STAGES="train evaluate" examples/baseline/run.sh "$BASE/data/raw" "$BASE" > "$BASE/train.log" 2>&1 \
      || fail "the baseline recipe failed: $(tail -1 "$BASE/train.log") (see $BASE/train.log)"
    grep -E "valid on|^beam [0-9]|done training" "$BASE/train.log" | cut -c1-160
    USER_DIR=$(fairseq-plugins user-dir)
    COMMANDS=$WORK/distill/commands.txt
    mkdir -p "$WORK/distill"
    distill_beam5 "$BASE" 2> "$WORK/distill/beam5.log"
    distill_greedy "$BASE" "$WORK/blockwise/self_distill" 2> "$WORK/distill/greedy.log"
    wc -l "$WORK/distill/beam5/tok/train.$TGT" "$WORK/blockwise/self_distill/tok/train.$TGT" ;;

  train)
    BASE=$WORK/baseline
    [[ -f $BASE/checkpoints/checkpoint_best.pt ]] || fail "$BASE/checkpoints/checkpoint_best.pt: no baseline (stage baseline)"
    [[ -f $WORK/distill/beam5/bin/train.$SRC-$TGT.$TGT.bin ]] || fail "$WORK/distill/beam5/bin: no distilled set (stage baseline)"
    minutes=${GPU_MINUTES:-4}
    stop="--stop-time-hours $(minutes_as_hours "$minutes" GPU_MINUTES)"
    jobs_started=()
    launch() {  # NAME METHOD RECIPE-ENV...: one recipe's train stage in the background, logged to WORK/gpu/NAME.log
      local name=$1 method=$2 flags_var="TRAIN_FLAGS_$2"
      shift 2
      mkdir -p "$WORK/gpu"
      env "$@" STAGES=train TRAIN_FLAGS="${!flags_var-$TRAIN_FLAGS} $stop" \
        "examples/$method/run.sh" "$BASE" "$WORK/$method" > "$WORK/gpu/$name.log" 2>&1 &
      jobs_started+=("$name:$!")
    }
    for method in ${METHODS:-double_token rnn_fc lattice}; do
      case $method in
        double_token) for system in ${DOUBLE_TOKEN_SYSTEMS:-l2r-1 r2l-1 l2r-2 r2l-2 bidir-2}; do
                        launch "double_token-$system" double_token SYSTEMS="$system" EPOCHS="${KIT_EPOCHS:-100}"; done ;;
        rnn_fc)       for system in ${RNN_FC_SYSTEMS:-fc4-tanh fc0-tanh}; do
                        launch "rnn_fc-$system" rnn_fc SYSTEMS="$system" EPOCHS="${KIT_EPOCHS:-100}"; done ;;
        lattice)      for system in ${LATTICE_SYSTEMS:-distill-1}; do
                        launch "lattice-$system" lattice SYSTEMS="$system" EPOCHS="${KIT_EPOCHS:-100}"; done ;;
        *) fail "METHODS: unknown method $method (double_token rnn_fc lattice)" ;;
      esac
    done
    failed=0
    for job in "${jobs_started[@]}"; do
      if wait "${job#*:}"; then status=ok; else status=FAILED; failed=1; fi
      echo "${job%:*}: $status; $(grep -E "valid on" "$WORK/gpu/${job%:*}.log" | tail -1 | cut -c1-160)"
    done
    # Decoding needs each system's average of its last epochs.
    if [[ " ${METHODS:-double_token rnn_fc lattice} " == *" double_token "* ]]; then
      SYSTEMS="${DOUBLE_TOKEN_SYSTEMS:-l2r-1 r2l-1 l2r-2 r2l-2 bidir-2}" STAGES="average evaluate" \
        examples/double_token/run.sh "$BASE" "$WORK/double_token" > "$WORK/gpu/double_token-evaluate.log" 2>&1 \
        || { echo "double_token average/evaluate: FAILED (see $WORK/gpu/double_token-evaluate.log)"; failed=1; }
      grep -E "beam [0-9]+:" "$WORK/gpu/double_token-evaluate.log" || true
    fi
    if [[ " ${METHODS:-double_token rnn_fc lattice} " == *" lattice "* ]]; then
      SYSTEMS="${LATTICE_SYSTEMS:-distill-1}" STAGES=average \
        examples/lattice/run.sh "$BASE" "$WORK/lattice" > "$WORK/gpu/lattice-average.log" 2>&1 \
        || { echo "lattice average: FAILED (see $WORK/gpu/lattice-average.log)"; failed=1; }
    fi
    if [[ " ${METHODS:-double_token rnn_fc lattice} " == *" rnn_fc "* ]]; then
      SYSTEMS="${RNN_FC_SYSTEMS:-fc4-tanh fc0-tanh}" STAGES=average \
        examples/rnn_fc/run.sh "$BASE" "$WORK/rnn_fc" > "$WORK/gpu/rnn_fc-average.log" 2>&1 \
        || { echo "rnn_fc average: FAILED (see $WORK/gpu/rnn_fc-average.log)"; failed=1; }
    fi
    exit $failed ;;

  bytenet)
    BYTENET=${BYTENET_WORK:-$WORK/bytenet-gpu}
    for data in mt-data lm-data; do
      [[ -f $BYTENET/$data/prepare.json ]] || fail "$BYTENET/$data: no prepared data (run examples/bytenet/run.sh" \
        "with STAGES=prepare here and carry $BYTENET/$data)"
    done
    mt_systems=${BYTENET_MT_SYSTEMS-bytenet-mt transformer-mt}
    lm_systems=${BYTENET_LM_SYSTEMS-bytenet-lm-wide bytenet-lm-deep-wide bytenet-lm-deep-wide-d50}
    minutes=${GPU_MINUTES:-4}
    # Two CPU threads per job beside a GPU (16 cores there); one on the CPU (the dry run), where the jobs share
    # two cores and more threads than cores slow every job many times over.
    threads=$([[ $DEVICE == cuda ]] && echo 2 || echo 1)
    recipe() {  # LOG SECONDS ENV...: examples/bytenet/run.sh on the GPU with ENV, logged to BYTENET/gpu-LOG.log,
                # stopped after SECONDS (0: never)
      local log=$1 seconds=$2
      shift 2
      env DEVICE="$DEVICE" THREADS="$threads" EVAL_THREADS="$threads" TOGETHER=0 MT_MINUTES="$minutes" LM_MINUTES="$minutes" \
        TRAIN_FLAGS="${TRAIN_FLAGS_bytenet-$TRAIN_FLAGS}" \
        MT_SYSTEMS="$mt_systems" LM_SYSTEMS="$lm_systems" "$@" \
        timeout "$seconds" examples/bytenet/run.sh - - "$BYTENET" > "$BYTENET/gpu-$log.log" 2>&1 \
        || { echo "bytenet $log: FAILED (see $BYTENET/gpu-$log.log): $(tail -1 "$BYTENET/gpu-$log.log")"; return 1; }
    }
    failed=0 pids=()
    # One recipe run for the MT pair and one for the LMs, at once: at batch sizes this small each training is
    # bound by kernel launches, not by the GPU, so side by side they cost little more than one. The MT batches
    # are 4 times the CPU recipe's 4,096 tokens (warm-up over as many sentences: 250 updates, not 1,000).
    if [[ -n $mt_systems ]]; then
      recipe train-mt 0 STAGES=train-mt MT_TRAIN_FLAGS="${BYTENET_MT_FLAGS---max-tokens 16384 --warmup-updates 250}" &
      pids+=($!)
    fi
    if [[ -n $lm_systems ]]; then recipe train-lm 0 STAGES=train-lm & pids+=($!); fi
    for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
    recipe average 0 STAGES=average || failed=1
    # Decoding and scoring side by side, each stopped after EVAL_SECONDS: a slow beam cannot eat the command.
    # Beam and greedy at --lenpen 0 only (BEAM_LENPENS=): the other length penalties decode on the CPU later,
    # from the averages the kit carries back.
    pids=()
    for name in $mt_systems; do
      (mt_systems=$name; recipe "evaluate-$name" "${EVAL_SECONDS:-150}" STAGES=evaluate-mt BEAM_LENPENS=) & pids+=($!)
    done
    if [[ -n $lm_systems ]]; then recipe evaluate-lm "${EVAL_SECONDS:-150}" STAGES=evaluate-lm & pids+=($!); fi
    for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
    for name in $mt_systems $lm_systems; do
      log=$BYTENET/$name/train.log
      [[ -f $log ]] || continue
      echo "$name: $(grep -c "valid on" "$log") validations, valid loss $(grep -oP "valid on 'valid' subset \| loss \K[\d.]+" "$log" \
        | tr '\n' ' ')$(grep -oP "num_updates \K\d+" "$log" | tail -1) updates"
      [[ -f $BYTENET/$name/eval-lm.log ]] && grep -o "Loss (base 2): [0-9.]*" "$BYTENET/$name/eval-lm.log" | sed "s/^/  /" || true
      for out in "$BYTENET/$name"/test.beam*.txt; do [[ -f $out ]] && echo "  $(basename "$out"): $(wc -l < "$out") lines"; done || true
    done
    exit $failed ;;

  graphs)  # the bench with the methods' calls captured as CUDA graphs: RESULTS/<method>_graphs.json
    [[ $DEVICE == cuda ]] || fail "CUDA graphs need DEVICE=cuda"
    GRAPHS=1
    BENCH_METHODS=${BENCH_METHODS:-fast_step double_token lattice blockwise}
    ;;&  # (on to the bench's own case below; profile's is skipped)
  profile)  # the bench's methods at batch 1 once more, each decode under torch.profiler: RESULTS/profile/<method>.json
    BATCHES=1 BENCH_RUNS=1 BENCH_LIMIT=${PROFILE_SENTENCES:-20} RESULTS=$RESULTS/profile
    if [[ $DEVICE == cuda ]]; then PRECISIONS=${PRECISIONS:-fp16}; else PRECISIONS=fp32; fi
    BENCH_FLAGS="${BENCH_FLAGS-} --profile $BENCH_LIMIT --no-whole-split-bleu"
    BENCH_METHODS=${PROFILE_METHODS:-${BENCH_METHODS:-}}
    ;&
  bench|graphs)
    BASE=$WORK/baseline
    DATA=$BASE/data
    mkdir -p "$RESULTS"
    bench_grid() {  # NAME MODEL ARGS...: fairseq-plugins bench over BATCHES x PRECISIONS into RESULTS/NAME.json
      local name=$1 model=$2 batch precision
      shift 2
      if [[ ! -f $model ]]; then echo "bench $name: skipped, no model at $model (stage train)"; return 0; fi
      rm -f "$RESULTS/$name.json.tmp" "$WORK/gpu/bench-$name.log"
      for batch in ${BATCHES:-1 64}; do
        for precision in ${PRECISIONS:-fp32 fp16}; do
          [[ $DEVICE == cpu && $precision == fp16 ]] && continue  # fairseq's fp16 decoding needs CUDA
          fairseq-plugins bench --path "$model" --data "$DATA" --split test --device "$DEVICE" --threads 1 \
            --batch-size "$batch" --runs "${BENCH_RUNS:-3}" --limit "${BENCH_LIMIT:-200}" \
            --label "$name batch $batch $precision" $([[ $precision == fp16 ]] && echo --fp16) \
            --provenance "$BASE/commands.txt" --json "$RESULTS/$name.json.tmp" --append "$@" ${BENCH_FLAGS-} \
            2>> "$WORK/gpu/bench-$name.log" || { echo "bench $name batch $batch $precision: FAILED" \
            "(see $WORK/gpu/bench-$name.log)"; return 1; }
        done
      done
      mv "$RESULTS/$name.json.tmp" "$RESULTS/$name.json"
      fairseq-plugins report "$RESULTS/$name.json" $([[ $STAGE == profile ]] && echo --profile)
    }
    # The graphs stage's capture flags (of a method on the fast step, of the lattice) and the JSONs' suffix
    fast_graphs=() lattice_graphs=() suffix=
    if [[ -n ${GRAPHS-} ]]; then
      fast_graphs=(--fast-step --fast-step-cuda-graphs) lattice_graphs=(--lattice-cuda-graphs) suffix=_graphs
    fi
    # The graphs stage benches double_token and blockwise on the fast step uncaptured too (the bench stage decodes
    # them on their models' own decoders): NAME_fast_step.json beside NAME_graphs.json isolates what graphs add
    uncaptured_fast_step() { [[ -z ${GRAPHS-} ]] || bench_grid "$@" --fast-step; }
    mkdir -p "$WORK/gpu"
    failed=0
    for method in ${BENCH_METHODS:-baseline fast_step double_token lattice blockwise rnn_fc}; do
      if [[ -n ${GRAPHS-} && $method =~ ^(baseline|rnn_fc)$ ]]; then echo "graphs: $method has no captured calls, skipped"; continue; fi
      case $method in
        baseline)  # the stock generator against itself: the device's absolute speed at beam 5
          bench_grid baseline "$BASE/checkpoints/checkpoint_best.pt" --method baseline --beam 5 || failed=1 ;;
        fast_step)
          bench_grid "fast_step$suffix" "$BASE/checkpoints/checkpoint_best.pt" --method fast_step --fast-step --beam 5 \
            "${fast_graphs[@]}" || failed=1 ;;
        double_token)  # bidir-2 against the single-token l2r-1 system, beam 10 (Table 2)
          double_token=("$WORK/double_token/bidir-2/checkpoints/checkpoint_avg.pt" --method double_token
            --baseline-path "$WORK/double_token/l2r-1/checkpoints/checkpoint_avg.pt" --beam 10
            --task double_token_translation --token-order bidir --tokens-per-step 2 --max-len-a 1.2 --max-len-b 10)
          uncaptured_fast_step double_token_fast_step "${double_token[@]}" || failed=1
          bench_grid "double_token$suffix" "${double_token[@]}" "${fast_graphs[@]}" || failed=1 ;;
        lattice)  # distill-1 (K = 32, no repeated trigrams) against the plain baseline at beam 5; the table is
                  # built on the CPU (lattice recipe)
          bench_grid "lattice$suffix" "$WORK/lattice/distill-1/checkpoints/checkpoint_avg.pt" --method lattice \
            --baseline-path "$BASE/checkpoints/checkpoint_best.pt" --baseline-beam 5 --beam 5 \
            --baseline-no-repeat-ngram-size 0 --task lattice_translation \
            --lattice-table "$WORK/lattice/distill/table.pt" --lattice-k 32 --no-repeat-ngram-size 3 \
            "${lattice_graphs[@]}" || failed=1 ;;
        blockwise)  # the self-distilled heads, k = 4, against stock greedy on the same base
          blockwise=("$WORK/blockwise/self/checkpoints/checkpoint_best.pt" --method blockwise --beam 1 --block-size 4
            --block-proposal-vocab "${HEAD_VOCAB:-2000}")
          uncaptured_fast_step blockwise_fast_step "${blockwise[@]}" || failed=1
          bench_grid "blockwise$suffix" "${blockwise[@]}" "${fast_graphs[@]}" || failed=1 ;;
        rnn_fc)  # fp32 (its int8 runs on the CPU only), beam 6, against the stock generator on the same model
          bench_grid rnn_fc "$WORK/rnn_fc/fc4-tanh/checkpoints/checkpoint_avg.pt" --method rnn_fc --beam 6 \
            || failed=1 ;;
        *) fail "BENCH_METHODS: unknown method $method (baseline fast_step double_token lattice blockwise rnn_fc)" ;;
      esac
    done
    exit $failed ;;

  pack)  # pack PATH... : into $OUT/kit.tar.gz.partNN (at most 4 parts a command: pack-rest sends the others)
    OUT=${OUT:?pack writes into \$OUT (set on a device command)}
    ((${#@} > 0)) || fail "name the paths to pack"
    stage=$(mktemp -d)
    rm -rf "$WORK/gpu/parts" && mkdir -p "$WORK/gpu/parts"
    for path in "$@"; do
      [[ -e $path ]] || { echo "pack: $path: not there, skipped" >&2; continue; }
      mkdir -p "$stage/$(dirname "$path")"
      if [[ -f $path && $(basename "$path") == checkpoint*.pt ]]; then  # decoding needs the model, not the optimizer
        fairseq-plugins average-checkpoints --inputs "$path" --output "$stage/$path" --dtype "${PACK_DTYPE:-float16}" \
          2> "$WORK/gpu/pack.log" || fail "$path: not a fairseq checkpoint? $(tail -1 "$WORK/gpu/pack.log")"
      else  # other files (a lattice table.pt, data) as they are
        cp -r "$path" "$stage/$path"
      fi
    done
    tar -czf - -C "$stage" . | split -b 15m -d -a 2 - "$WORK/gpu/parts/kit.tar.gz.part"
    rm -rf "$stage"
    ;&
  pack-rest)  # the next 4 parts of the last pack into $OUT
    OUT=${OUT:?pack writes into \$OUT (set on a device command)}
    parts=("$WORK"/gpu/parts/kit.tar.gz.part*)
    [[ -e ${parts[0]} ]] || fail "no parts left to send"
    mv "${parts[@]:0:4}" "$OUT/"
    left=$(( ${#parts[@]} > 4 ? ${#parts[@]} - 4 : 0 ))
    ls -l "$OUT"
    ((left == 0)) || echo "$left part(s) left: run examples/gpu/run.sh pack-rest next (on the same warm machine)" ;;

  *) fail "unknown stage (env baseline train bytenet bench graphs profile pack pack-rest unpack stamp)" ;;
esac
