#!/usr/bin/env bash
# Set up a virtual environment (once) and run lint and the test suite. On a machine without a GPU the
# GPU tests skip and say why; on a GPU machine with megatron-core importable they run too.
#   usage: bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VENV:-.venv}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  # Pin torch first: a bare "torch" requirement would pull a CUDA build of several GB onto a CPU machine.
  "$venv/bin/pip" install -q "torch==${TORCH_VERSION:-2.13.0}"
  "$venv/bin/pip" install -q -e ".[test]"
fi
"$venv/bin/ruff" check .
"$venv/bin/python" -m pytest "$@"
