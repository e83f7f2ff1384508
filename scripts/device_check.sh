#!/usr/bin/env bash
# On the GPU machine: install each carried megatron-core wheel, run the whole test suite (GPU tests
# included) and the side-by-side benchmark against it, and print a short table last.
# Full logs and JSON go to $OUT (default ./device-results).
#   usage: scripts/device_check.sh [MCORE_VERSION ...]     (default: every .whl/mcore-*/ carried)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-device-results}
mkdir -p "$out"
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=($(ls -d .whl/mcore-* 2>/dev/null | sed 's|.whl/mcore-||'))
[ ${#versions[@]} -gt 0 ] || { echo "no megatron-core wheels under .whl/: run ../shared/device/fetch-wheels.sh"; exit 2; }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
status=0
for v in "${versions[@]}"; do
  site=/tmp/site-$v
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/mcore-$v/*.whl || exit 2
  echo "=== megatron-core $v: tests"
  PYTHONPATH=$site:$PWD python3 -m pytest tests -p no:cacheprovider -q --junitxml="$out/pytest-$v.xml" \
    >"$out/pytest-$v.log" 2>&1 || status=1
  tail -n 25 "$out/pytest-$v.log"
  echo "=== megatron-core $v: benchmark"
  PYTHONPATH=$site:$PWD python3 benchmarks/offload_bandwidth.py --json "$out/bench-$v.json" \
    >"$out/bench-$v.log" 2>&1 || { status=1; tail -n 30 "$out/bench-$v.log"; }
done
python3 benchmarks/summarize.py "$out"
exit $status
