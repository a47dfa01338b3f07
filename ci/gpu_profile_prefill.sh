#!/usr/bin/env bash
# Nsight Compute profile of one wave of the prefill kernels (the route launch, the Triton attention launch, which
# only builds the unions where the Gluon one runs, and the Gluon attention launch) on a GPU machine whose runtime lets
# ncu read the hardware counters (see the device notes). Everything lands in $OUT:
#   profile_summary.txt    speed of light, memory, occupancy, launch and warp-state sections of each kernel
#   profile_route.csv, profile_attn.csv, profile_attn_ws.csv   per source line and SASS instruction: stall samples
#                          by reason, instructions executed (ncu --page source), to find where a kernel waits
#
#   bash ci/gpu_profile_prefill.sh [SKIP] [ARGS...]   # ARGS go to benchmarks/prefill_profile.py
#
# SKIP (default 90): launches of these kernels skipped before the three profiled ones, i.e. 3 x the wave index
# where the Gluon launch runs (128k, topk 64 runs 42 waves of 198 tiles: 90 is a late one; a SKIP past the last
# launch profiles nothing, and ncu then lists the other kernels only). Clocks are left alone (--clock-control none).
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"  # root (the working directory from here on), out, py
skip=${1:-90}
[ $# -gt 0 ] && shift
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
[ -n "$ncu" ] || { echo "ncu not found"; exit 2; }
kernels='regex:^(_prefill_(route|attn)_kernel|prefill_attn_ws)'
timeout "${PROFILE_TIMEOUT:-250}" "$ncu" --clock-control none --profile-from-start off -k "$kernels" \
  --launch-skip "$skip" --launch-count 3 --section SpeedOfLight --section MemoryWorkloadAnalysis \
  --section Occupancy --section LaunchStats --section WarpStateStats --section SourceCounters \
  --section ComputeWorkloadAnalysis --import-source yes \
  --metrics dram__bytes_read.sum,lts__t_bytes.sum,lts__t_sector_hit_rate.pct \
  -o "$out/profile" "$py" benchmarks/prefill_profile.py "$@" > "$out/profile_collect.log" 2>&1
rc=$?
tail -3 "$out/profile_collect.log"
[ $rc -eq 0 ] || { echo "ncu exit status $rc"; exit $rc; }
"$ncu" -i "$out/profile.ncu-rep" --print-details all > "$out/profile_summary.txt" 2>&1
for k in _prefill_route_kernel:route _prefill_attn_kernel:attn prefill_attn_ws:attn_ws; do
  "$ncu" -i "$out/profile.ncu-rep" -k "regex:^${k%%:*}\$" --page source --print-source cuda,sass --csv \
    > "$out/profile_${k##*:}.csv" 2>&1
done
rm -f "$out/profile.ncu-rep"
grep -E "^  (_prefill|prefill_attn_ws)|Duration|L2 Hit Rate  |Achieved Occupancy|Registers Per Thread" "$out/profile_summary.txt"
