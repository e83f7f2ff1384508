#!/usr/bin/env bash
# On the GPU machine: install the newest carried megatron-core wheel (or each one given), then run the
# parts asked for, and print a short table last. Everything lands in one folder, packed as results.tgz
# into $OUT when $OUT is set (the trace part's torch.profiler traces apart, as traces.tar, if under 15 MiB).
#   usage: scripts/device_check.sh [MCORE_VERSION ...]   (default: the newest .whl/mcore-*/ carried)
#   env:   PARTS="tests probe bench side trace integration" (default: all of them)
#            tests        the whole test suite, GPU tests included (every version given)
#            probe        benchmarks/copy_order_probe.py: a read right after a step that offloads 8.4 GB
#            bench        benchmarks/offload_bandwidth.py on the 0.95B GPT (configs/gpt_0p9b.yaml), uncapped and under a cap
#            side         benchmarks/megatron_side_by_side.py: Megatron-LM's own pretrain_gpt.py
#                         ($MEGATRON_LM, default .megatron-lm) through our launcher, at --log-interval 1
#                         and 5, uncapped and under caps ($SIDE_ARGS narrows it); with upstream's rows
#                         when $UPSTREAM_MEGATRON_LM (default .megatron-lm-dev where present; empty: none),
#                         a copy of Megatron-LM's dev branch, run by its own pretrain_gpt.py and loop
#            trace        separate profiled runs (--log-interval 1, torch.profiler through Megatron's
#                         --profile) and benchmarks/trace_summary.py's verdict ($TRACE_ARGS narrows it)
#            integration  tests/drills/integration.py entries for $GPUS GPUs
#            sweep        (not in the default) the memory-speed curve under caps ($SWEEP_ARGS)
#            long         (not in the default) benchmarks/long_context.py: the SDPA spec, --chunked-loss and
#                         --offload-layer-inputs in Megatron-LM's loop; LONG_PART=fit|speed (the 4.18B GPT at
#                         65,536 tokens, H200), bitwise (16 x 2048 at 16k), longest (LONG_CONFIG, LONG_CAP),
#                         step (configs/gpt_1b.yaml at 16k, 8 micro-batches: the optimizer step in one streamed
#                         pass beside megatron-core's passes and no offload, bitwise), short (the 4.18B GPT,
#                         untied, at 4,096 tokens x 4 micro-batches under 16 GiB, backward in layer order, the
#                         whole state off the GPU at the peak, beside no offload, the link measured first, H200)
#            nightly      (not in the default) scripts/nightly_memory.sh without the CPU-offload reference row
#            stepspeed    (not in the default) benchmarks/streamed_step_speed.py: the optimizer-state offloader's
#                         streamed step, its copies alone and AdamW's own step beside the link ($STEPSPEED_ARGS)
#            weights      (not in the default) benchmarks/weight_streaming.py: configs/gpt_1b.yaml at micro-batch 8
#                         beside no offload, log intervals 1 and 5 (~7 min), and configs/gpt_4b.yaml under a
#                         20 GiB cap (~4 min): run as two calls, WEIGHTS_PART=speed or fit; or WEIGHTS_PART=16k:
#                         configs/gpt_1b.yaml at 16,384 tokens, 8 micro-batches, the SDPA spec and --chunked-loss in
#                         both rows, log intervals 1 and 5, 10 iterations (~6 min)
#          GPUS=1|2 (default: as many GPUs as there are, at most 2); BENCH_STEPS (6)
set -uo pipefail
cd "$(dirname "$0")/.."
results=${RESULTS:-device-results}
parts=${PARTS:-tests probe bench side trace integration}
upstream=${UPSTREAM_MEGATRON_LM-$( [ -d .megatron-lm-dev ] && echo .megatron-lm-dev )}
versions=("$@")
# Check first, delete later: a run that cannot start leaves the previous results where they are.
[ ${#versions[@]} -gt 0 ] || versions=($(ls -d .whl/mcore-* 2>/dev/null | sed 's|.whl/mcore-||' | sort -V | tail -n 1))
[ ${#versions[@]} -gt 0 ] || { echo "no megatron-core wheels under .whl/: run bash scripts/fetch_wheels.sh ($results/ left as it was)"; exit 2; }
for v in "${versions[@]}"; do
  compgen -G ".whl/mcore-$v/*.whl" >/dev/null \
    || { echo "no megatron-core $v wheel under .whl/mcore-$v/: run bash scripts/fetch_wheels.sh $v ($results/ left as it was)"; exit 2; }
done
rm -rf "$results" && mkdir -p "$results"
# The device machine's copy of the tree has no .git: pass the commit in, e.g. MEGATRON_OFFLOAD_COMMIT=$(git rev-parse --short HEAD)
export MEGATRON_OFFLOAD_COMMIT=${MEGATRON_OFFLOAD_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
gpus=${GPUS:-$(python3 -c 'import torch; print(min(torch.cuda.device_count(), 2))')}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$results/device.txt"
echo "commit $MEGATRON_OFFLOAD_COMMIT, torch $(python3 -c 'import torch; print(torch.__version__)')" | tee -a "$results/device.txt"
wants() { [[ " $parts " == *" $1 "* ]]; }
status=0
for v in "${versions[@]}"; do
  site=/tmp/site-$v
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/mcore-$v/*.whl || exit 2
  python3 -m compileall -q -j 0 "$site/megatron" >/dev/null 2>&1  # once here, not at every run's start
  export PYTHONPATH=$site:$PWD
  if wants tests; then
    echo "=== megatron-core $v: tests"
    python3 -m pytest tests -p no:cacheprovider -q --junitxml="$results/pytest-$v.xml" >"$results/pytest-$v.log" 2>&1 \
      || status=1
    grep -E "passed|failed|error|FAILED|Error" "$results/pytest-$v.log" | tail -n 25
  fi
done
if wants probe; then
  echo "=== copy-order probe"
  python3 -m benchmarks.copy_order_probe --json "$results/probe.json" 2>&1 | tee "$results/probe.log" | tail -n 5
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if wants bench; then
  echo "=== library benchmark, the 0.95B GPT, uncapped and capped"
  python3 -m benchmarks.offload_bandwidth --shapes pretraining-0.9b --steps "${BENCH_STEPS:-6}" \
    --variants finalize "step (streamed)" --cap --json "$results/bench-${versions[-1]}.json" >"$results/bench.log" 2>&1 \
    || { status=1; tail -n 30 "$results/bench.log"; }
fi
side() {  # side OUT_NAME ARGS...: the side-by-side harness, our client and upstream's when there is one
  local name=$1; shift
  eval "python3 -m benchmarks.megatron_side_by_side --megatron-lm \"${MEGATRON_LM:-.megatron-lm}\" --gpus 1 \
    ${upstream:+--upstream-megatron-lm \"$upstream\"} $* --out \"$results/$name\"" 2>&1 | tee "$results/$name.log" \
    | grep -vE "Warning|warn" | tail -n 24
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
}
if wants side; then
  echo "=== Megatron-LM's loop side by side${upstream:+, and upstream: $upstream}"
  side side "${SIDE_ARGS:-}"  # e.g. "--log-intervals 1 --only 'full offload (auto)'": a part of the matrix
fi
if wants trace; then
  echo "=== profiled runs, compute stream with and without copies (timings not from these)"
  side trace --log-intervals 1 --profile-only --profile "${TRACE_ARGS:-}"  # e.g. "'no offload' 'prefetch step'"
fi
if wants sweep; then  # not in the default PARTS: the memory-speed curve, ~6-8 min per call; $SWEEP_ARGS picks it
  echo "=== memory-speed curve under caps (${SWEEP_ARGS:---global-batch 8 --caps 90 75 50 25})"
  side sweep --sweep ${SWEEP_ARGS:---global-batch 8 --caps 90 75 50 25}  # curve.json, curve.png, curve.txt in sweep/
  [ -z "${OUT:-}" ] || { tar czf "$OUT/sweep.tgz" "$results"/sweep/curve.* "$results"/sweep/*.log 2>/dev/null; cp "$results"/sweep/curve.{json,png,txt} "$OUT/" 2>/dev/null; }
fi
if wants weights; then  # not in the default PARTS: ~7 min (speed) or ~4 min (fit) per call
  case ${WEIGHTS_PART:-speed} in
    speed) weights_args=(--config configs/gpt_1b.yaml --extra "--micro-batch-size 8 --global-batch-size 64" --train-iters 10 --log-intervals 1 5) ;;
    fit) weights_args=(--config configs/gpt_4b.yaml --train-iters 20 --log-intervals --fit 20) ;;
    16k) weights_args=(--config configs/gpt_1b.yaml --train-iters 10 --log-intervals 1 5 --extra "--spec \
      megatron_offload.megatron.sdpa_spec gpt_layer_spec --seq-length 16384 --max-position-embeddings 16384 \
      --position-embedding-type rope --no-rope-fusion --no-create-attention-mask-in-dataloader --micro-batch-size 1 \
      --global-batch-size 8 --chunked-loss" --link) ;;
  esac
  echo "=== weight streaming (${WEIGHTS_PART:-speed})"
  python3 -m benchmarks.weight_streaming --megatron-lm "${MEGATRON_LM:-.megatron-lm}" "${weights_args[@]}" \
    --out "$results/weights" 2>&1 | tee "$results/weights.log" | grep -vE "Warning|warn" | tail -n 12
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if wants long; then  # not in the default PARTS: long context in Megatron-LM's loop, one preset per call
  case ${LONG_PART:-fit} in  # $LONG_ARGS, when set, replaces the preset's arguments
    fit) long_args="--config configs/gpt_4b.yaml --seq 65536 --cap 24 --rows today new base --train-iters 6" ;;  # H200
    speed) long_args="--config configs/gpt_4b.yaml --seq 65536 --cap 24 --rows new base --train-iters 4 --global-batch-size 4" ;;
    bitwise) long_args="--config configs/gpt_1b.yaml --extra '--num-layers 16' --seq 16384 --cap 0 --rows new base --train-iters 6 --global-batch-size 2 --deterministic" ;;
    longest) long_args="--config ${LONG_CONFIG:-configs/gpt_1b.yaml} --cap ${LONG_CAP:-24} --rows --longest 16384 262144" ;;
    step) long_args="--config configs/gpt_1b.yaml --seq 16384 --cap 0 --rows new base --train-iters 6 --global-batch-size 8 --deterministic" ;;
    short) long_args="--config configs/gpt_4b.yaml --seq 4096 --cap 16 --rows new base --train-iters 6 --global-batch-size 4 --link --extra='--untie-embeddings-and-output-weights --offload-prefetch step'" ;;  # H200
  esac
  echo "=== long context (${LONG_PART:-fit}): ${LONG_ARGS:-$long_args}"
  eval "python3 -m benchmarks.long_context --megatron-lm \"${MEGATRON_LM:-.megatron-lm}\" ${LONG_ARGS:-$long_args} \
    --out \"$results/long-${LONG_PART:-fit}\"" 2>&1 | tee "$results/long.log" | grep -vE "Warning|warn" | tail -n 12
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if wants long && [ "${LONG_PART:-fit}" = step ]; then  # the same rows with megatron-core's own step passes
  echo "=== long context (step): megatron-core's step passes"
  python3 -m benchmarks.long_context --megatron-lm "${MEGATRON_LM:-.megatron-lm}" --config configs/gpt_1b.yaml \
    --seq 16384 --cap 0 --rows new --train-iters 6 --global-batch-size 8 --deterministic \
    --extra "--offload-weights-step megatron" --out "$results/long-step-megatron" 2>&1 | tee "$results/long-megatron.log" \
    | grep -vE "Warning|warn" | tail -n 4
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if wants nightly; then  # not in the default PARTS: five judged runs of configs/nightly_memory.yaml, the report
  echo "=== nightly memory comparison"
  SKIP_CPU_OFFLOAD=1 OUT="$results/nightly" bash scripts/nightly_memory.sh 2>&1 | tee "$results/nightly.log" \
    | grep -vE "Warning|warn" | tail -n 16
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if wants stepspeed; then  # not in the default PARTS: the streamed step beside the link, no Megatron (~2 min)
  echo "=== the streamed step beside the host link (${STEPSPEED_ARGS:---chunk-mb 64 128 --staging 3 4})"
  python3 -m benchmarks.streamed_step_speed ${STEPSPEED_ARGS:---chunk-mb 64 128 --staging 3 4} \
    --json "$results/streamed-step-speed.json" 2>&1 | tee "$results/streamed-step-speed.log" | grep -v pinning | tail -n 12
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if wants integration; then
  echo "=== megatron-core ${versions[-1]}: integration runs on $gpus GPU(s)"
  python3 -m tests.drills.integration --gpus "$gpus" --out "$results/integration" 2>&1 | tee "$results/integration.log" \
    | grep -vE "Warning|warn" | tail -n 40
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
python3 -m benchmarks.summarize "$results" | tee "$results/summary.txt"
if [ -n "${OUT:-}" ]; then  # traces (3-4 MB each for the 0.95B GPT) apart, only where they fit what comes back
  tar czf "$OUT/results.tgz" --exclude=torch_profile --exclude=tensorboard "$results" && cp "$results/summary.txt" "$OUT/"
  traces=$(find "$results" -path '*torch_profile*' -type f)
  if [ -n "$traces" ]; then
    tar cf "$OUT/traces.tar" $traces
    [ "$(stat -c %s "$OUT/traces.tar")" -le $((15 * 1024 * 1024)) ] || { rm "$OUT/traces.tar"; echo "traces over 15 MiB: not packed"; }
  fi
fi
exit $status
