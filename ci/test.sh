#!/usr/bin/env bash
# Set up every test environment from scratch (or reuse it) and run all CPU test levels.
# Exits non-zero when any level fails. Environments go to $DASH_VENV_DIR (default: .venvs/ in the repo).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
venvs=${DASH_VENV_DIR:-$root/.venvs}
export PYTHONUNBUFFERED=1
# pip's wheel cache would hold a second copy of every engine's CUDA wheels (several GB); CI disks are small.
export PIP_NO_CACHE_DIR=${PIP_NO_CACHE_DIR:-1}
failed=()

# level NAME BUDGET_S COMMAND...: run one level, print its time against its budget.
level() {
  local name=$1 budget=$2; shift 2
  local start=$SECONDS
  echo "=== level $name (budget ${budget} s) ==="
  timeout $((budget * 2)) "$@"
  local rc=$?
  echo "=== level $name: exit $rc, $((SECONDS - start)) s of ${budget} s budget ==="
  [ $rc -eq 0 ] || failed+=("$name")
}

level core-setup 600 bash ci/setup_core.sh "$venvs/core"
# The house style ([tool.ruff] in pyproject.toml): a violation fails the run like a failing test.
level lint 120 "$venvs/core/bin/ruff" check .
# CI has no GPU: every Triton kernel runs under the interpreter (set before anything imports triton).
level core 1200 env TRITON_INTERPRET=1 "$venvs/core/bin/python" -m pytest -q -rs -m "not gpu and not engine_sglang and not engine_vllm" \
  --ignore=tests/engines --doctest-modules dash_core tests

if ls tests/engines/test_sglang_*.py >/dev/null 2>&1; then
  level sglang-setup 900 bash ci/setup_sglang.sh "$venvs/sglang"
  level sglang 900 bash ci/run_engine_tests.sh "$venvs/sglang" engine_sglang tests/engines/test_sglang_*.py
fi
if ls tests/engines/test_vllm_*.py >/dev/null 2>&1; then
  # Both engine venvs (SGLang ~11 GB, vLLM ~3.5 GB plus its downloads while installing) may not fit on one CI
  # disk: when the vLLM venv is still to be built and less than DASH_PRUNE_BELOW_GB (default 16) is free, the
  # SGLang venv (already used above) is removed; the next run rebuilds it.
  prune_gb=${DASH_PRUNE_BELOW_GB:-16}
  if [ ! -x "$venvs/vllm/bin/python" ] && [ -d "$venvs/sglang" ] &&
     [ "$(df -Pk "$venvs" | awk 'NR == 2 {print int($4 / 1048576)}')" -lt "$prune_gb" ]; then
    echo "disk: less than $prune_gb GB free before building the vLLM venv; removing $venvs/sglang ($(du -sh "$venvs/sglang" | cut -f1))"
    rm -rf "$venvs/sglang"
  fi
  level vllm-setup 600 bash ci/setup_vllm.sh "$venvs/vllm"
  level vllm 900 bash ci/run_engine_tests.sh "$venvs/vllm" engine_vllm tests/engines/test_vllm_*.py
fi

if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED levels: ${failed[*]}"
  exit 1
fi
echo "all levels passed"
