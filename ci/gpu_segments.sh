#!/usr/bin/env bash
# GPU tests of the segment backends (dash_core.segments, and decode steps with backend=) for one backend, on
# a machine without a package registry. Wheels are carried or staged as ci/gpu_env.sh describes.
# Logs go to $OUT (default ./out).
#
#   bash ci/gpu_segments.sh TRITON          # no wheels needed
#   bash ci/gpu_segments.sh FLASHINFER      # carry (or have staged) .whl/flashinfer
#   bash ci/gpu_segments.sh FLASH_ATTN      # carry .whl/fa4/part2, with part1 staged by an earlier call on the
#                                           #   same warm machine: bash ci/gpu.sh stage fa4/part1
#   SEGMENTS_K="not graph" bash ci/gpu_segments.sh ...   # a subset (pytest -k), e.g. when JIT time is tight
set -uo pipefail
backend=${1:?usage: ci/gpu_segments.sh TRITON|FLASHINFER|FLASH_ATTN}
. "$(dirname "$0")/gpu_env.sh"  # root (the working directory from here on), out, py, wheels
log="$out/segments_${backend}.log"

case "$backend" in
  TRITON) select="TRITON or TORCH"; extra_tests=(tests/test_segments.py) ;;
  FLASHINFER) select="FLASHINFER or flashinfer"; extra_tests=() ;;
  FLASH_ATTN) select="FLASH_ATTN"; extra_tests=() ;;
  *) echo "error: backend must be TRITON, FLASHINFER or FLASH_ATTN; got '$backend'" >&2; exit 2 ;;
esac

gpu_env "env_${backend}.txt"

# SEGMENTS_K narrows the selection (e.g. SEGMENTS_K="not graph" to split a long first run).
[ -z "${SEGMENTS_K:-}" ] || select="($select) and ($SEGMENTS_K)"
start=$SECONDS
"$py" -m pytest -v -rs -p no:cacheprovider tests/gpu/test_segments_gpu.py tests/kernels/test_kernel_decode_backends.py \
  -k "$select" --junitxml="$out/segments_${backend}.xml" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
if [ ${#extra_tests[@]} -gt 0 ]; then  # the CPU segment tests, with the Triton kernel compiled
  "$py" -m pytest -v -rs -p no:cacheprovider "${extra_tests[@]}" --junitxml="$out/segments_${backend}_cpu.xml" \
    2>&1 | tee -a "$log"
  rc2=${PIPESTATUS[0]}
  [ "$rc" -ne 0 ] || rc=$rc2
fi
echo "== pytest exit $rc after $((SECONDS - start)) s" | tee -a "$log"
exit "$rc"
