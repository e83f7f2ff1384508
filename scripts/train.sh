#!/usr/bin/env bash
# The main job, from a fresh GPU machine: make a virtual environment, install this package with
# megatron-core >= 0.17 (which ships Megatron-LM's training loop and requires Python >= 3.12), check
# the command line, and train a GPT on mock data with optimizer-state offloading, through torchrun.
#   usage: bash scripts/train.sh [MEGATRON/OFFLOAD ARGS...]
#   env:   CONFIG=configs/tiny.yaml  GPUS=1  VENV=.venv-gpu  PYTHON=python3 (3.12 or later)
# The install is marked done only once it succeeded: after a failed or interrupted one, the next run
# installs again. Every refusal is one line, before anything big starts, the one no install can fix
# (no GPU) first.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VENV:-.venv-gpu}
python=${PYTHON:-python3}
config=${CONFIG:-configs/tiny.yaml}
pins=("megatron-core>=0.17,<0.20")
say() { echo "megatron-offload: $*" >&2; }

# 1. A GPU driver first: what cannot be installed is said before what can (a newer Python, about 5 GB
#    of packages); torch checks CUDA itself after the install.
if [ -z "${SKIP_GPU_CHECK:-}" ] && ! command -v nvidia-smi >/dev/null && [ ! -e /proc/driver/nvidia/version ]; then
  say "no CUDA GPU found: Megatron-LM's training loop needs one; the tests run without: bash scripts/test.sh"
  exit 2
fi

# 2. Python >= 3.12, before pip runs (it would only say "No matching distribution found").
py=$python
[ -x "$venv/bin/python" ] && py=$venv/bin/python
version=$("$py" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null) \
  || { say "no Python found at '$py': set PYTHON to a Python 3.12 or later (PYTHON=python3.12 bash scripts/train.sh)"; exit 2; }
if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
  if [ "$py" = "$python" ]; then fix="run PYTHON=python3.12 bash scripts/train.sh"
  else fix="rm -rf $venv and run PYTHON=python3.12 bash scripts/train.sh"; fi
  say "the main job needs Python >= 3.12 (megatron-core >= 0.17, which ships Megatron-LM's training loop, requires it); $py is Python $version: $fix"
  exit 2
fi

# 3. The install, marked done by a file named after what was asked for (setup.py and the pins).
stamp="$venv/.installed-$( (printf '%s\n' "${pins[@]}"; cat setup.py) | sha256sum | cut -c1-16)"
if [ ! -e "$stamp" ]; then
  if [ ! -x "$venv/bin/python" ]; then
    say "[1/3] making $venv with $python (Python $version)"
    "$python" -m venv "$venv"
  fi
  say "[2/3] installing this package, torch with CUDA (about 5 GB with its nvidia packages) and ${pins[*]}: several minutes; pip lists each download"
  "$venv/bin/python" -m pip install -e . "${pins[@]}" \
    || { say "the install into $venv failed (pip's message is above); run the same command again to retry"; exit 1; }
  rm -f "$venv"/.installed-*
  touch "$stamp"
  say "[3/3] installed into $venv; later runs start here"
fi

# 4. The command line (config file, megatron.training, CUDA): one line if it cannot run.
"$venv/bin/python" -m megatron_offload.config.files --config "$config" "$@" || exit 2

export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
# megatron-core requires one hardware queue with tensor or context parallelism; plain data parallelism
# keeps the default, which lets copies and compute overlap more freely.
if "$venv/bin/python" -c 'import sys; from megatron_offload.config.files import needs_one_connection as n
sys.exit(0 if n(sys.argv[1:]) else 1)' --config "$config" "$@"; then
  export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
fi
exec "$venv/bin/python" -m torch.distributed.run --standalone --nproc-per-node "${GPUS:-1}" \
  scripts/pretrain_gpt.py --config "$config" --offload-optimizer-states "$@"
