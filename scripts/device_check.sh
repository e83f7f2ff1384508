#!/usr/bin/env bash
# On the GPU machine: install the newest carried megatron-core wheel (or each one given), then run the
# parts asked for, and print a short table last. Everything lands in one folder, packed as results.tgz
# into $OUT when $OUT is set.
#   usage: scripts/device_check.sh [MCORE_VERSION ...]   (default: the newest .whl/mcore-*/ carried)
#   env:   PARTS="tests probe bench side integration" (default: all of them)
#            tests        the whole test suite, GPU tests included (every version given)
#            probe        benchmarks/copy_order_probe.py: a read right after a step that offloads 8.4 GB
#            bench        benchmarks/offload_bandwidth.py on issue 9's GPT, uncapped and under a cap
#            side         benchmarks/megatron_side_by_side.py: Megatron-LM's own pretrain_gpt.py
#                         ($MEGATRON_LM, default .megatron-lm) through our launcher, at --log-interval 1
#                         and 5, uncapped and under caps ($SIDE_ARGS narrows it)
#            integration  scripts/integration.py entries for $GPUS GPUs
#          GPUS=1|2 (default: as many GPUs as there are, at most 2); BENCH_STEPS (6)
set -uo pipefail
cd "$(dirname "$0")/.."
results=${RESULTS:-device-results}
rm -rf "$results" && mkdir -p "$results"
parts=${PARTS:-tests probe bench side integration}
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=($(ls -d .whl/mcore-* 2>/dev/null | sed 's|.whl/mcore-||' | sort -V | tail -n 1))
[ ${#versions[@]} -gt 0 ] || { echo "no megatron-core wheels under .whl/: run bash scripts/fetch_wheels.sh"; exit 2; }
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
  python3 benchmarks/copy_order_probe.py --json "$results/probe.json" 2>&1 | tee "$results/probe.log" | tail -n 5
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if wants bench; then
  echo "=== library benchmark, issue 9's GPT, uncapped and capped"
  python3 benchmarks/offload_bandwidth.py --shapes pretraining-0.9b --steps "${BENCH_STEPS:-6}" \
    --variants finalize "step (streamed)" --cap --json "$results/bench-${versions[-1]}.json" >"$results/bench.log" 2>&1 \
    || { status=1; tail -n 30 "$results/bench.log"; }
fi
if wants side; then
  echo "=== Megatron-LM's loop side by side"
  # SIDE_ARGS, e.g. "--log-intervals 1 --only 'full offload (auto)'": a part of the matrix
  eval "python3 benchmarks/megatron_side_by_side.py --megatron-lm \"${MEGATRON_LM:-.megatron-lm}\" --gpus 1 \
    ${SIDE_ARGS:-} --out \"$results/side\"" 2>&1 | tee "$results/side.log" | grep -vE "Warning|warn" | tail -n 20
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if wants integration; then
  echo "=== megatron-core ${versions[-1]}: integration runs on $gpus GPU(s)"
  python3 scripts/integration.py --gpus "$gpus" --out "$results/integration" 2>&1 | tee "$results/integration.log" \
    | grep -vE "Warning|warn" | tail -n 40
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
python3 benchmarks/summarize.py "$results" | tee "$results/summary.txt"
[ -n "${OUT:-}" ] && tar czf "$OUT/results.tgz" "$results" && cp "$results/summary.txt" "$OUT/"
exit $status
