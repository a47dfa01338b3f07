#!/usr/bin/env bash
# GPU run of the model benchmark (benchmarks/model.py: TTFT and TPOT of a Llama-3-8B-shaped model, DASH against
# the dense peers) on a machine with a CUDA GPU and no package registry. Everything lands in $OUT (default ./out):
#   model_env.txt      versions, imports of the optional peers, nvidia-smi
#   model_bench.log    the benchmark's log and tables
#   model.json         docs/perf/model.json merged with this run's records (written after every point)
#   model.svg          the chart, where matplotlib imports (else: python benchmarks/model.py --render-only --out ...)
#
#   bash ci/gpu_model.sh                      # every point, every peer that imports
#   bash ci/gpu_model.sh --points ttft        # ARGS go to benchmarks/model.py
#
# Optional peers as in ci/gpu.sh: FlashInfer from a carried wheel under .whl/flashinfer/ (its kernels JIT-build on
# first use, about a minute per module), FlashAttention 4 staged and carried under .whl/fa4/. Time limit (seconds):
# BENCH_TIMEOUT (default 560). DASH_COMMIT names the commit in the records where the copy has no git metadata.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"  # root (the working directory from here on), out, py, wheels
gpu_env model_env.txt
[ -f docs/perf/model.json ] && cp docs/perf/model.json "$out/model.json"
args=("$@")
[ -n "${DASH_COMMIT:-}" ] && args+=(--commit "$DASH_COMMIT")
limit=${BENCH_TIMEOUT:-560}
echo "== model benchmark ${args[*]}, limit ${limit}s"
timeout "$limit" "$py" benchmarks/model.py "${args[@]}" --out "$out/model.json" --svg "$out/model.svg" \
  > "$out/model_bench.log" 2>&1
b=$?
tail -60 "$out/model_bench.log"
echo "benchmark exit status $b"
exit $b
