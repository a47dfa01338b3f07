#!/usr/bin/env bash
# GPU run of the decode kernels (issue 4) on a machine with a CUDA GPU and no package registry:
# the GPU tests (every kernel test compiled, plus 128k contexts, CUDA graphs, sync-free decode and
# recorded engine batches), then the decode benchmark. Everything lands in $OUT (default ./out):
#   gpu_tests.log, gpu_tests.xml         pytest -m gpu tests/kernels
#   bench.log, decode.json, PERFORMANCE.md, decode.svg   benchmarks/decode.py (merged with the repo's docs)
#   env.txt                              versions, nvidia-smi
#
#   bash ci/gpu.sh              # tests, then the required benchmark rows (each under its own time limit)
#   bash ci/gpu.sh tests        # tests only             } two calls of under 10 minutes each are the
#   bash ci/gpu.sh bench [ARGS] # benchmark only         } safer way: first kernels compile, FlashInfer
#                               # JIT-builds and the published kernels autotune inside these limits
#   bash ci/gpu.sh stage SUB... # keep carried .whl/SUB (e.g. fa4/part1) for the next call on this warm machine
# ARGS go to benchmarks/decode.py (default: --preset required).
#
# Optional peers: FlashInfer and FlashAttention 4 from wheels carried or staged under .whl/ (ci/gpu_env.sh), and the
# published DashAttention kernels from $DASH_PUBLISHED_DIR or an ignored copy at third_party/dash-attention.
# Time limits (seconds): TEST_TIMEOUT (default 360), BENCH_TIMEOUT (default 220 after the tests, 540 alone).
# DASH_KERNEL_EXAMPLES (default 6 here) sets the hypothesis examples per test (each new shape compiles).
# GPU_TEST_PATHS (default tests/kernels, which includes the prefill kernels' tests); decode only:
#   GPU_TEST_PATHS="tests/kernels --ignore-glob=*prefill*" bash ci/gpu.sh tests
set -uo pipefail
mode=${1:-all}
[ $# -gt 0 ] && shift
. "$(dirname "$0")/gpu_env.sh"  # root (the working directory from here on), out, py, wheels
export DASH_KERNEL_EXAMPLES=${DASH_KERNEL_EXAMPLES:-6}
if [ "$mode" = stage ]; then
  gpu_stage "$@"
  exit $?
fi
gpu_env env.txt

rc=0
if [ "$mode" = all ] || [ "$mode" = tests ]; then
  # shellcheck disable=SC2086
  gpu_tests gpu_tests "${TEST_TIMEOUT:-360}" ${GPU_TEST_PATHS:-tests/kernels} || rc=$?
fi
if [ "$mode" = all ] || [ "$mode" = bench ]; then
  gpu_bench bench decode "${BENCH_TIMEOUT:-$([ "$mode" = bench ] && echo 540 || echo 220)}" "$@" || rc=$?
fi
exit $rc
