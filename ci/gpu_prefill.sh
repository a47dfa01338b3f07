#!/usr/bin/env bash
# GPU run of the prefill kernels (issue 5) on a machine with a CUDA GPU and no package registry:
# the prefill GPU tests (the CPU prefill tests compiled, 128k prompts on sampled rows, golden cases on
# scattered pages, recorded engine batches, no-sync, scratch bound), then the prefill benchmark.
# Everything lands in $OUT (default ./out):
#   prefill_env.txt                          versions, nvidia-smi
#   prefill_tests.log, prefill_tests.xml     pytest -m gpu tests/kernels/test_kernel_prefill*.py
#   prefill_bench.log, prefill.json, PERFORMANCE.md, prefill.svg   benchmarks/prefill.py (merged with the repo's docs)
#
#   bash ci/gpu_prefill.sh              # tests, then the required benchmark rows (at most 8 min with the default limits)
#   bash ci/gpu_prefill.sh tests        # tests only
#   bash ci/gpu_prefill.sh bench [ARGS] # benchmark only; ARGS go to benchmarks/prefill.py (default: --preset required)
#
# The golden cases through paged_dash_prefill on scattered pages need a copy of the golden files: put it at
# shared/golden in the checkout (git-ignored; a shared/ folder travels with the working tree to the GPU machine),
# or point DASH_GOLDEN_DIR at it; without one those tests skip.
# Optional peers as in ci/gpu.sh: FlashInfer from a carried wheel under .whl/flashinfer/, the published
# DashAttention kernels from $DASH_PUBLISHED_DIR or an ignored copy at third_party/dash-attention.
# Time limits (seconds): TEST_TIMEOUT (default 240), BENCH_TIMEOUT (default 240). DASH_PREFILL_EXAMPLES
# (default 4) sets the hypothesis examples of the compiled CPU tests (each new shape compiles kernels).
# If one call may not run that long, run `tests` and `bench` as two calls.
set -uo pipefail
mode=${1:-all}
[ $# -gt 0 ] && shift
. "$(dirname "$0")/gpu_env.sh"  # root (the working directory from here on), out, py, wheels
export DASH_PREFILL_EXAMPLES=${DASH_PREFILL_EXAMPLES:-4}
gpu_env prefill_env.txt

rc=0
if [ "$mode" = all ] || [ "$mode" = tests ]; then
  gpu_tests prefill_tests "${TEST_TIMEOUT:-240}" tests/kernels/test_kernel_prefill.py \
    tests/kernels/test_kernel_prefill_gpu.py || rc=$?
fi
if [ "$mode" = all ] || [ "$mode" = bench ]; then
  gpu_bench prefill_bench prefill "${BENCH_TIMEOUT:-240}" "$@" || rc=$?
fi
exit $rc
