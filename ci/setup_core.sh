#!/usr/bin/env bash
# Create (or reuse) the core virtualenv: torch (CPU) + triton 3.6.0 + this package with its test extra.
# Usage: ci/setup_core.sh VENV_DIR
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:?usage: setup_core.sh VENV_DIR}
. "$root/ci/lib.sh"
key=$(cat "$root/ci/constraints-core.txt" "$root/pyproject.toml" | sha1sum | cut -c1-16)
if stamp_ok "$venv" "$key"; then echo "core env: reusing $venv"; exit 0; fi
need_disk 4 "$(dirname "$venv")"
start=$SECONDS
python3 -m venv --clear "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q -c "$root/ci/constraints-core.txt" torch triton
"$venv/bin/pip" install -q -c "$root/ci/constraints-core.txt" -e "$root[test]"
echo "$key" > "$venv/.dash-stamp"
echo "core env: ready in $((SECONDS - start)) s ($("$venv/bin/python" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'))"
