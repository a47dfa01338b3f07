#!/usr/bin/env bash
# The GPU runs, on a machine with a CUDA GPU and no package registry: the GPU tests and the benchmarks of one part.
#
#   bash ci/gpu.sh decode   [tests|bench] [ARGS]   # decode kernel tests; benchmarks/decode.py (default --preset required)
#   bash ci/gpu.sh prefill  [tests|bench] [ARGS]   # prefill kernel tests; benchmarks/prefill.py (default --preset required)
#   bash ci/gpu.sh prefill  profile [SKIP] [ARGS]  # Nsight Compute on one wave of a prefill call (below)
#   bash ci/gpu.sh decode   profile [ARGS]         # Nsight Compute on every launch of one decode step (below)
#   bash ci/gpu.sh segments [tests|bench] [ARGS]   # tests: ARGS = TRITON (default) | FLASHINFER | FLASH_ATTN;
#                                                  #   bench: decode.py's segment-backend rows (vLLM layout, topk 64)
#   bash ci/gpu.sh model    [tests|bench] [ARGS]   # benchmarks/model.py (tests: its GPU tests and smoke run)
#   bash ci/gpu.sh all      [tests|bench]          # every part's tests (segments: TRITON), or every benchmark
#   bash ci/gpu.sh stage SUB...                    # keep carried .whl/SUB (e.g. fa4/part1) for the next call
#
# Without tests|bench a part runs its tests, then its benchmark, each under its own time limit; two calls (tests,
# then bench) are the safer way when the first kernels compile, FlashInfer JIT-builds and the published kernels
# autotune inside a call's limit. ARGS of bench go to the benchmark, e.g.
#   bash ci/gpu.sh decode bench --preset serving
#   bash ci/gpu.sh prefill bench --preset serving --serving-cases 16x1024,8x2048
#
# Everything lands in $OUT (default ./out): env_PART.txt (versions, imports, nvidia-smi), PART_tests.log and .xml
# (pytest -m gpu), PART_bench.log and the benchmark's records PART.json (the repository's docs/perf/PART.json merged
# with this run's; copy it back and run python benchmarks/report.py), profile_* for the profile.
#
# Optional peers: FlashInfer and FlashAttention 4 from wheels carried or staged under .whl/ (ci/gpu_env.sh), the
# published DashAttention kernels from $DASH_PUBLISHED_DIR or an ignored copy at third_party/dash-attention. The
# golden cases (tests/kernels/test_kernel_golden.py, in the decode tests) read a copy of the golden files carried as
# shared/golden (git-ignored; tests/_golden.py).
# Time limits (seconds): TEST_TIMEOUT (decode 360, prefill 480, segments and model 540), BENCH_TIMEOUT (540 alone,
# 220 after the tests), PROFILE_TIMEOUT (250). DASH_KERNEL_EXAMPLES (default 6) and DASH_PREFILL_EXAMPLES (default 4)
# set the hypothesis examples per test (each new shape compiles). GPU_TEST_PATHS replaces the decode tests' paths.
# SEGMENTS_K narrows the segment tests (pytest -k), e.g. SEGMENTS_K="not graph" when JIT time is tight.
#
# The profile (prefill profile): ncu on `benchmarks/prefill.py --profile ncu --context 131072 --topk 64 ARGS`,
# the route launch, the Triton attention launch (which only builds the unions where the Gluon one runs) and the Gluon
# attention launch of one wave, after SKIP (default 90) launches of these kernels: 3 x the wave index (128k, topk 64
# runs 42 waves; a SKIP past the last launch profiles nothing). A serving step's one wave: SKIP 0 and ARGS
# `--preset serving --serving-cases 16x1024`. It needs a runtime that lets ncu read the counters.
# Outputs: profile_summary.txt (speed of light, memory, occupancy, launch, scheduler and warp-state sections of each
# kernel), profile_route.csv, profile_attn.csv, profile_attn_ws.csv (stall samples and instructions per source line
# and SASS instruction). Clocks are left alone (--clock-control none).
# The decode profile: ncu on each launch of one step of `benchmarks/decode.py --profile ncu --batch 1 --context 131072
# --topk 64 ARGS` (later ARGS override): the score, select (with the K/V write, or the write's own launch where the
# select does not take it), split attention and merge launches.
# Outputs: profile_summary.txt as above, profile_select.csv and profile_attn.csv.
set -uo pipefail
part=${1:?usage: ci/gpu.sh decode|prefill|segments|model|all [tests|bench] [ARGS], or ci/gpu.sh stage SUB...}
shift
mode=both
case "${1:-}" in tests|bench|profile) mode=$1; shift ;; esac
. "$(dirname "$0")/gpu_env.sh"  # root (the working directory from here on), out, py, wheels
export DASH_KERNEL_EXAMPLES=${DASH_KERNEL_EXAMPLES:-6}
export DASH_PREFILL_EXAMPLES=${DASH_PREFILL_EXAMPLES:-4}

if [ "$part" = stage ]; then
  gpu_stage "$@"
  exit $?
fi
case "$part" in
  decode|prefill|segments|model|all) ;;
  *) echo "error: part must be decode, prefill, segments, model, all or stage; got '$part'" >&2; exit 2 ;;
esac
if [ "$mode" = profile ] && [ "$part" != prefill ] && [ "$part" != decode ]; then
  echo "error: profile is a mode of prefill and decode only" >&2; exit 2
fi
gpu_env "env_$part.txt"

bench_limit() { echo "${BENCH_TIMEOUT:-$([ "$mode" = bench ] && echo 540 || echo 220)}"; }

decode_tests() {
  # shellcheck disable=SC2086
  gpu_tests decode_tests "${TEST_TIMEOUT:-360}" ${GPU_TEST_PATHS:-tests/kernels --ignore-glob=*prefill* \
    tests/gpu/test_graphs_gpu.py tests/gpu/test_slot_guard_gpu.py tests/gpu/test_launcher_gpu.py}
}

prefill_tests() {
  gpu_tests prefill_tests "${TEST_TIMEOUT:-480}" tests/kernels/test_kernel_prefill.py \
    tests/kernels/test_kernel_prefill_gpu.py tests/kernels/test_prefill_ws_layout.py tests/gpu/test_launcher_gpu.py
}

segments_tests() {
  local backend=${1:-TRITON} select extra=() rc rc2 log
  case "$backend" in
    TRITON) select="TRITON or TORCH"; extra=(tests/test_segments.py) ;;
    FLASHINFER) select="FLASHINFER or flashinfer" ;;
    FLASH_ATTN) select="FLASH_ATTN" ;;
    *) echo "error: the segment backend must be TRITON, FLASHINFER or FLASH_ATTN; got '$backend'" >&2; return 2 ;;
  esac
  [ -z "${SEGMENTS_K:-}" ] || select="($select) and ($SEGMENTS_K)"
  gpu_tests "segments_${backend}_tests" "${TEST_TIMEOUT:-540}" tests/gpu/test_segments_gpu.py \
    tests/kernels/test_kernel_decode_backends.py -k "$select"
  rc=$?
  if [ ${#extra[@]} -gt 0 ]; then  # the CPU segment tests, with the Triton kernel compiled
    log="$out/segments_${backend}_cpu_tests.log"
    timeout "${TEST_TIMEOUT:-540}" "$py" -m pytest -q -rs -p no:cacheprovider "${extra[@]}" \
      --junitxml="$out/segments_${backend}_cpu_tests.xml" > "$log" 2>&1
    rc2=$?
    tail -5 "$log"
    [ "$rc" -ne 0 ] || rc=$rc2
  fi
  return "$rc"
}

model_tests() {
  gpu_tests model_gpu_tests "${TEST_TIMEOUT:-540}" tests/gpu/test_model_gpu.py
  local rc=$?
  echo "== model benchmark smoke run"
  timeout "${TEST_TIMEOUT:-540}" "$py" benchmarks/model.py --smoke > "$out/model_tests.log" 2>&1
  local rc2=$?
  tail -20 "$out/model_tests.log"
  [ "$rc" -ne 0 ] || rc=$rc2
  return $rc
}

find_ncu() { command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1; }

# ncu_profile KERNELS SKIP COUNT SCRIPT ARGS...: Nsight Compute on COUNT launches of KERNELS after SKIP, while
# SCRIPT ARGS runs; writes profile_summary.txt.
ncu_profile() {
  local kernels=$1 skip=$2 count=$3 ncu rc
  shift 3
  ncu=$(find_ncu)
  [ -n "$ncu" ] || { echo "ncu not found"; return 2; }
  timeout "${PROFILE_TIMEOUT:-250}" "$ncu" --clock-control none --profile-from-start off -k "$kernels" \
    --launch-skip "$skip" --launch-count "$count" --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats \
    --section SourceCounters --section ComputeWorkloadAnalysis --import-source yes \
    --metrics dram__bytes_read.sum,lts__t_bytes.sum,lts__t_sector_hit_rate.pct \
    -o "$out/profile" "$py" "$@" > "$out/profile_collect.log" 2>&1
  rc=$?
  tail -3 "$out/profile_collect.log"
  [ $rc -eq 0 ] || { echo "ncu exit status $rc"; return $rc; }
  "$ncu" -i "$out/profile.ncu-rep" --print-details all > "$out/profile_summary.txt" 2>&1
}

# profile_sources NAME:KERNEL...: each kernel's stall samples and instructions per line, as profile_NAME.csv
profile_sources() {
  local k ncu
  ncu=$(find_ncu)
  for k in "$@"; do
    "$ncu" -i "$out/profile.ncu-rep" -k "regex:^${k#*:}\$" --page source --print-source cuda,sass --csv \
      > "$out/profile_${k%%:*}.csv" 2>&1
  done
  rm -f "$out/profile.ncu-rep"
}

prefill_profile() {
  local skip=${1:-90}
  [ $# -gt 0 ] && shift
  ncu_profile 'regex:^(_prefill_(route|attn)_kernel|prefill_attn_ws)' "$skip" 3 \
    benchmarks/prefill.py --profile ncu --context 131072 --topk 64 --peers none "$@" || return $?
  profile_sources route:_prefill_route_kernel attn:_prefill_attn_kernel attn_ws:prefill_attn_ws
  grep -E "^  (_prefill|prefill_attn_ws)|Duration|L2 Hit Rate  |Achieved Occupancy|Registers Per Thread" \
    "$out/profile_summary.txt"
}

decode_profile() {
  ncu_profile 'regex:^(_decode_|_merge_kernel|_kv_write_kernel)' 0 5 \
    benchmarks/decode.py --profile ncu --batch 1 --context 131072 --topk 64 --peers none "$@" || return $?
  profile_sources select:_decode_select_kernel attn:_decode_attn_split_kernel
  grep -E "^  _(decode|merge|kv_write)|Duration|Achieved Occupancy|Registers Per Thread|Issued Warp Per Scheduler" \
    "$out/profile_summary.txt"
}

rc=0
run() { "$@" || rc=$?; }
if [ "$mode" = profile ]; then
  run "${part}_profile" "$@"
  exit $rc
fi
tests_wanted() { [ "$mode" = both ] || [ "$mode" = tests ]; }
bench_wanted() { [ "$mode" = both ] || [ "$mode" = bench ]; }
case "$part" in
  decode)
    tests_wanted && run decode_tests
    bench_wanted && run gpu_bench decode_bench decode "$(bench_limit)" "$@" ;;
  prefill)
    tests_wanted && run prefill_tests
    bench_wanted && run gpu_bench prefill_bench prefill "$(bench_limit)" "$@" ;;
  segments)
    if tests_wanted; then run segments_tests "${1:-TRITON}"; fi
    bench_wanted && run gpu_bench segments_bench decode "$(bench_limit)" --preset required --layout vllm \
      --segment-backends auto ;;
  model)
    tests_wanted && run model_tests
    bench_wanted && run gpu_bench model_bench model "$(bench_limit)" "$@" ;;
  all)
    if tests_wanted; then
      run decode_tests
      run prefill_tests
      run segments_tests TRITON
    fi
    if bench_wanted; then
      run gpu_bench decode_bench decode "$(bench_limit)"
      run gpu_bench prefill_bench prefill "$(bench_limit)"
      [ -f benchmarks/model.py ] && run gpu_bench model_bench model "$(bench_limit)"
    fi ;;
esac
exit $rc
