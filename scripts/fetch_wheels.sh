#!/usr/bin/env bash
# Fetch megatron-core wheels for a GPU machine without internet (CPython 3.12, x86-64 Linux) into
# .whl/mcore-VERSION/, where scripts/device_check.sh looks for them (it installs them without their
# dependencies: torch and the rest must already be on that machine).
#   usage: bash scripts/fetch_wheels.sh [VERSION ...]   (default: 0.19.2, the version checked)
set -euo pipefail
cd "$(dirname "$0")/.."
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(0.19.2)
for v in "${versions[@]}"; do
  echo "megatron-offload: fetching megatron-core $v for CPython 3.12 x86-64 into .whl/mcore-$v/" >&2
  "${PYTHON:-python3}" -m pip download --no-deps --only-binary=:all: --implementation cp --python-version 3.12 \
    --abi cp312 --platform manylinux_2_28_x86_64 --dest ".whl/mcore-$v" "megatron-core==$v" \
    || { echo "megatron-offload: could not fetch megatron-core $v (pip's message is above)" >&2; exit 1; }
done
ls .whl/mcore-*/
