#!/usr/bin/env bash
# The package as users install it, not the editable install the tests use: a wheel built from this
# checkout, and `pip install .` of the checkout, each into a fresh virtual environment. From a directory
# outside the checkout, every module of the checkout's megatron_offload must import from the installed
# copy, and `python -m megatron_offload.run --help` must run. A package folder left out of the install
# (one without __init__.py) fails here. CI runs it after the tests.
#   usage: bash scripts/check_install.sh
#   env:   VENV=.venv (made by scripts/test.sh: its Python and pip build and install the package, and its
#          torch and megatron-core are reused by the fresh environments, which get this package alone)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
venv=${VENV:-.venv}
python="$venv/bin/python"
say() { echo "megatron-offload: $*" >&2; }
[ -x "$python" ] || { say "no $python: run bash scripts/test.sh first (it makes $venv)"; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# A copy of the working tree's files (tracked, and new ones git does not ignore): a build in the
# checkout would leave build/ behind, and a stale build/ can put files into the wheel that the source
# no longer has.
mkdir "$tmp/src"
git ls-files -z --cached --others --exclude-standard | tar -C "$root" --null --ignore-failed-read -T - -cf - | tar -C "$tmp/src" -xf -
reused=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

fresh_env() {  # a virtual environment without pip that sees $venv's packages (torch, megatron-core) after its own
  "$python" -m venv --without-pip "$1"
  site_of "$1" >/dev/null && echo "$reused" >"$(site_of "$1")/reuse-test-env.pth"
}
site_of() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
# $venv's pip installs into the fresh environment's site-packages (--target works with every pip). The
# build uses $venv's setuptools where it can build wheels itself (>= 70.1), else an isolated one from PyPI.
isolation=()
"$python" -c 'import setuptools.command.bdist_wheel' 2>/dev/null && isolation=(--no-build-isolation)

check() {  # every module of the checkout imports from the installed copy; the launcher's --help runs
  (cd "$tmp" && "$1/bin/python" - "$root/megatron_offload" <<'EOF'
import importlib
import sys
from pathlib import Path

source = Path(sys.argv[1])
expected = sorted(
    ".".join(("megatron_offload", *p.relative_to(source).with_suffix("").parts)).removesuffix(".__init__")
    for p in source.rglob("*.py")
)
failures = []
for name in expected:
    try:
        module = importlib.import_module(name)
    except Exception as error:  # every module that does not import is named, not only the first
        failures.append(f"{name}: {type(error).__name__}: {error}")
        continue
    if not str(module.__file__).startswith(sys.prefix):
        failures.append(f"{name} imported from {module.__file__}, not from the installed copy under {sys.prefix}")
if failures:
    sys.exit("\n".join(failures))
print(f"{len(expected)} modules import from {sys.prefix}")
EOF
  ) && (cd "$tmp" && "$1/bin/python" -m megatron_offload.run --help >"$tmp/help.txt") \
    && grep -q -- "--offload-optimizer-states" "$tmp/help.txt"
}

say "[1/2] a wheel built from the checkout, installed into a fresh environment"
"$python" -m pip wheel --quiet --no-deps ${isolation[@]+"${isolation[@]}"} -w "$tmp/dist" "$tmp/src"
fresh_env "$tmp/wheel-env"
"$python" -m pip install --quiet --no-deps --target "$(site_of "$tmp/wheel-env")" "$tmp"/dist/megatron_offload-*.whl
check "$tmp/wheel-env" || { say "the installed wheel is broken (above)"; exit 1; }

say "[2/2] pip install of the checkout (not editable), into a fresh environment"
fresh_env "$tmp/checkout-env"
"$python" -m pip install --quiet --no-deps ${isolation[@]+"${isolation[@]}"} --target "$(site_of "$tmp/checkout-env")" "$tmp/src"
check "$tmp/checkout-env" || { say "the checkout, installed, is broken (above)"; exit 1; }
say "the installed package imports every module and runs python -m megatron_offload.run --help"
