#!/usr/bin/env bash
# On the GPU machine: install each carried megatron-core wheel, run the whole test suite (GPU tests
# included) and the side-by-side benchmark against it, then the Megatron-LM integration runs (with
# the newest version, which ships megatron.training), and print a short table last.
# Everything lands in one folder, packed as results.tgz into $OUT when $OUT is set.
#   usage: scripts/device_check.sh [MCORE_VERSION ...]   (default: every .whl/mcore-*/ carried)
#   env:   GPUS=1|2 (integration entries to run; default: as many GPUs as there are, at most 2)
#          SKIP_TESTS=1, SKIP_BENCH=1, SKIP_INTEGRATION=1 to leave a part out
#          BENCH_ALL_VERSIONS=1 to benchmark every version (default: the newest only); BENCH_STEPS (8)
set -uo pipefail
cd "$(dirname "$0")/.."
results=${RESULTS:-device-results}
rm -rf "$results" && mkdir -p "$results"
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=($(ls -d .whl/mcore-* 2>/dev/null | sed 's|.whl/mcore-||' | sort -V))
[ ${#versions[@]} -gt 0 ] || { echo "no megatron-core wheels under .whl/: run ../shared/device/fetch-wheels.sh"; exit 2; }
# The device machine's copy of the tree has no .git: pass the commit in, e.g. MEGATRON_OFFLOAD_COMMIT=$(git rev-parse --short HEAD)
export MEGATRON_OFFLOAD_COMMIT=${MEGATRON_OFFLOAD_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
gpus=${GPUS:-$(python3 -c 'import torch; print(min(torch.cuda.device_count(), 2))')}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$results/device.txt"
status=0
for v in "${versions[@]}"; do
  site=/tmp/site-$v
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/mcore-$v/*.whl || exit 2
  export PYTHONPATH=$site:$PWD
  if [ -z "${SKIP_TESTS:-}" ]; then
    echo "=== megatron-core $v: tests"
    python3 -m pytest tests -p no:cacheprovider -q --junitxml="$results/pytest-$v.xml" >"$results/pytest-$v.log" 2>&1 \
      || status=1
    grep -E "passed|failed|error" "$results/pytest-$v.log" | tail -n 15
  fi
  if [ -z "${SKIP_BENCH:-}" ] && { [ -n "${BENCH_ALL_VERSIONS:-}" ] || [ "$v" = "${versions[-1]}" ]; }; then
    echo "=== megatron-core $v: benchmark"
    python3 benchmarks/offload_bandwidth.py --steps "${BENCH_STEPS:-8}" --json "$results/bench-$v.json" \
      >"$results/bench-$v.log" 2>&1 \
      || { status=1; tail -n 30 "$results/bench-$v.log"; }
  fi
done
if [ -z "${SKIP_INTEGRATION:-}" ]; then
  echo "=== megatron-core ${versions[-1]}: integration runs on $gpus GPU(s)"
  python3 scripts/integration.py --gpus "$gpus" --out "$results/integration" 2>&1 | tee "$results/integration.log" \
    | grep -vE "Warning|warn" | tail -n 40
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
python3 benchmarks/summarize.py "$results" | tee "$results/summary.txt"
[ -n "${OUT:-}" ] && tar czf "$OUT/results.tgz" "$results" && cp "$results/summary.txt" "$OUT/"
exit $status
