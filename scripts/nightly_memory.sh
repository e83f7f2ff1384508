#!/usr/bin/env bash
# The nightly CI job: baseline, --offload-optimizer-states and --optimizer-cpu-offload runs of the nightly
# config, a report (report.md/json, two plots) and a verdict; exits with benchmarks/compare_memory.py's status
# (0 pass, 1 a threshold failed, 2 usage error or the baseline/offload run failed). Re-runnable: each run
# rewrites OUT/report.json, report.md, peak_memory.png, memory_timeline.png and thresholds_reached.yaml.
# Thresholds: THRESHOLDS names the file (configs/nightly_thresholds.yaml by default); after a first run on
# the nightly's machine, OUT/thresholds_reached.yaml holds them set from what that run reached (the room
# each gets: REACHED_* in benchmarks/compare_memory.py): copy it over configs/nightly_thresholds.yaml.
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
