#!/usr/bin/env bash
# The main job, from a fresh GPU machine: make a virtual environment (once), install this package
# with megatron-core >= 0.17 (which ships Megatron-LM's training loop), and train a GPT on mock data
# with optimizer-state offloading, through torchrun.
#   usage: bash scripts/train.sh [MEGATRON/OFFLOAD ARGS...]
#   env:   CONFIG=configs/tiny.yaml  GPUS=1  VENV=.venv-gpu
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VENV:-.venv-gpu}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q -e . "megatron-core>=0.17"
fi
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
# megatron-core requires one hardware queue with tensor or context parallelism; plain data parallelism
# keeps the default, which lets copies and compute overlap more freely.
if "$venv/bin/python" -c 'import sys; from megatron_offload.launch_config import needs_one_connection as n
sys.exit(0 if n(sys.argv[1:]) else 1)' --config "${CONFIG:-configs/tiny.yaml}" "$@"; then
  export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
fi
exec "$venv/bin/python" -m torch.distributed.run --standalone --nproc-per-node "${GPUS:-1}" \
  scripts/pretrain_gpt.py --config "${CONFIG:-configs/tiny.yaml}" --offload-optimizer-states "$@"
