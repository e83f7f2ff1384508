#!/usr/bin/env bash
# Set up a virtual environment and run lint and the test suite. On a machine without a GPU the GPU
# tests skip and say why; on a GPU machine with megatron-core importable they run too.
#   usage: bash scripts/test.sh [pytest args...]
#   env:   VENV=.venv  PYTHON=python3 (3.10 or later)  TORCH_VERSION=2.13.0
#          TORCH_INDEX=https://download.pytorch.org/whl/cpu (where the CPU build of torch comes from;
#          empty: PyPI only, whose Linux torch is the CUDA build of several GB)
# The install is marked done only once it succeeded: after a failed or interrupted one, the next run
# installs again.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VENV:-.venv}
python=${PYTHON:-python3}
torch_version=${TORCH_VERSION:-2.13.0}
torch_index=${TORCH_INDEX-https://download.pytorch.org/whl/cpu}
say() { echo "megatron-offload: $*" >&2; }
# The install is redone when what it installs changes (torch, setup.py's requirements), not its wording.
requirements() {
  "$python" -c 'import ast, sys
call = next(n for n in ast.walk(ast.parse(open("setup.py").read())) if getattr(getattr(n, "func", None), "id", "") == "setup")
print(*[ast.unparse(k) for k in call.keywords if k.arg in ("python_requires", "install_requires", "extras_require")], sep="\n")'
}
stamp="$venv/.installed-$( (echo "torch==$torch_version"; requirements) | sha256sum | cut -c1-16)"
if [ ! -e "$stamp" ]; then
  if [ ! -x "$venv/bin/python" ]; then
    say "[1/4] making $venv with $python ($("$python" --version 2>&1))"
    "$python" -m venv "$venv"
  fi
  # torch first, pinned, from the CPU index when reachable: a bare "torch" from PyPI is the CUDA build.
  # Probed once: pip would retry an unreachable index for every package.
  if [ -n "$torch_index" ] && ! "$venv/bin/python" -c 'import sys, urllib.request as u; u.urlopen(sys.argv[1], timeout=10)'       "$torch_index/torch/" 2>/dev/null; then
    say "$torch_index is not reachable: torch comes from PyPI or the configured index (PyPI's Linux torch is the CUDA build, several GB)"
    torch_index=
  fi
  say "[2/4] installing torch $torch_version (${torch_index:+the CPU build from }${torch_index:-from PyPI or the configured index})"
  "$venv/bin/python" -m pip install "torch==$torch_version" ${torch_index:+--extra-index-url "$torch_index"} \
    || { say "installing torch failed (pip's message is above); run the same command again to retry"; exit 1; }
  say "[3/4] installing this package with megatron-core and the test tools"
  "$venv/bin/python" -m pip install -e ".[test]" \
    || { say "the install failed (pip's message is above); run the same command again to retry"; exit 1; }
  rm -f "$venv"/.installed-*
  touch "$stamp"
  say "[4/4] installed into $venv; later runs start at the tests"
fi
"$venv/bin/ruff" check .
"$venv/bin/python" -m pytest "$@"
