#!/usr/bin/env bash
# The nightly CI job: the nightly config run without offload, with the smallest footprint
# (--offload-prefetch step), and under a cap (no offload's peak reserved less half the optimizer state)
# without offload and with --offload-optimizer-states alone, no offload again (the floors' no-offload time
# brackets the offload rows), plus megatron-core's --optimizer-cpu-offload as a reference; then a report
# (report.md/json, plots where matplotlib is installed) and its verdict; then,
# for the memory timeline plot, 4-iteration reruns of no offload, step and the capped default (those that ran
# through) with --record-memory-history, which the judged runs leave off (it slows their steps), and the
# report again with that plot. A job cut short in those reruns keeps its report and verdict. Exits
# with benchmarks/compare_memory.py's status (0 pass, 1 a check failed, 2 usage error or the no-offload or
# step run failed). Re-runnable: each run rewrites OUT's logs and report.
# Thresholds: THRESHOLDS names the file (configs/nightly_thresholds.yaml by default); step times are held
# to a floor measured in the same run, so the file holds no machine's figures.
#   usage: bash scripts/nightly_memory.sh [EXTRA MEGATRON ARGS...]
#   env:   OUT=nightly-memory/YYYY-MM-DD  GPUS=1  ITERS=(the config's)  CONFIG=configs/nightly_memory.yaml
#          THRESHOLDS=configs/nightly_thresholds.yaml  PYTHON=(.venv-gpu/bin/python if present, else python3)
#          SKIP_CPU_OFFLOAD=1 leaves megatron-core's --optimizer-cpu-offload reference run out
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-$([ -x .venv-gpu/bin/python ] && echo .venv-gpu/bin/python || echo python3)}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # as device_check.sh; the tool sets NCCL's
options=(--config "${CONFIG:-configs/nightly_memory.yaml}" --out "${OUT:-nightly-memory/$(date +%F)}"
  --gpus "${GPUS:-1}" --thresholds "${THRESHOLDS:-configs/nightly_thresholds.yaml}")
[ -n "${ITERS:-}" ] && options+=(--iters "$ITERS")
[ -n "${SKIP_CPU_OFFLOAD:-}" ] && options+=(--skip-cpu-offload)
exec "$python" -m benchmarks.compare_memory "${options[@]}" -- "$@"
