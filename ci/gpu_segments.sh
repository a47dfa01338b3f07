#!/usr/bin/env bash
# GPU tests of the segment backends (dash_core.segments) for one backend, on a machine without a
# package registry: installs the wheels carried under .whl/ into /tmp/site and runs
# tests/gpu/test_segments_gpu.py for that backend. Logs go to $OUT (default ./out).
#
#   bash ci/gpu_segments.sh TRITON               # no wheels needed
#   bash ci/gpu_segments.sh FLASHINFER           # carry .whl/flashinfer (trimmed FlashInfer + tvm-ffi, ~33 MiB)
#   bash ci/gpu_segments.sh FLASH_ATTN stage     # call 1, carry .whl/fa4/part1: keeps the first half of the
#                                                #   cutlass-dsl cu13 wheel in /tmp/dash_fa4 (the machine must stay warm)
#   bash ci/gpu_segments.sh FLASH_ATTN           # call 2, carry .whl/fa4/part2: rejoins, installs FA4, runs
#   SEGMENTS_K="not graph" bash ci/gpu_segments.sh ...   # a subset (pytest -k), e.g. when JIT time is tight
#
# The wheels are built on the development machine (docs/segments.md, "Wheels for the GPU machine").
set -uo pipefail
backend=${1:?usage: ci/gpu_segments.sh TRITON|FLASHINFER|FLASH_ATTN [stage]}
mode=${2:-run}
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=${OUT:-$root/out}
mkdir -p "$out"
site=/tmp/site
stage=/tmp/dash_fa4
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}  # the GPU image's python3 holds torch
log="$out/segments_${backend}.log"

pip_install() {  # pip_install WHEEL...: into $site, offline, no dependency resolution
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$@"
}

case "$backend" in
  TRITON)
    select="TRITON or TORCH"
    extra_tests=(tests/test_segments.py)
    ;;
  FLASHINFER)
    ls .whl/flashinfer/*.whl >/dev/null 2>&1 || { echo "error: carry .whl/flashinfer" >&2; exit 2; }
    pip_install .whl/flashinfer/*.whl || exit 3
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}
    export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer_ws}
    export TVM_FFI_CACHE_DIR=${TVM_FFI_CACHE_DIR:-/tmp/tvm-ffi}
    export MAX_JOBS=${MAX_JOBS:-$(nproc)}
    if [ -z "${CUDA_HOME:-}" ] && command -v nvcc >/dev/null; then
      CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")"); export CUDA_HOME
    fi
    # The JIT links with -lcuda: without an unversioned libcuda.so (driver-only images) point the
    # linker at the driver's libcuda.so.1 through a private symlink.
    if ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so '; then
      lib1=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF; exit}')
      if [ -n "$lib1" ]; then
        mkdir -p /tmp/dash_cuda_link && ln -sf "$lib1" /tmp/dash_cuda_link/libcuda.so
        export FLASHINFER_EXTRA_LDFLAGS="-L/tmp/dash_cuda_link${FLASHINFER_EXTRA_LDFLAGS:+ $FLASHINFER_EXTRA_LDFLAGS}"
      fi
    fi
    select="FLASHINFER or flashinfer"
    extra_tests=()
    ;;
  FLASH_ATTN)
    if [ "$mode" = stage ]; then
      mkdir -p "$stage"
      cp .whl/fa4/part1/*.part1 "$stage"/ || { echo "error: carry .whl/fa4/part1" >&2; exit 2; }
      ls -l "$stage" | tee "$out/fa4_stage.txt"
      echo "staged; run 'bash ci/gpu_segments.sh FLASH_ATTN' with .whl/fa4/part2 carried while the machine is warm"
      exit 0
    fi
    ls .whl/fa4/part2/*.whl >/dev/null 2>&1 || { echo "error: carry .whl/fa4/part2" >&2; exit 2; }
    mkdir -p "$stage/join"
    cp .whl/fa4/part2/*.whl "$stage/join/"
    for p2 in .whl/fa4/part2/*.part2; do
      name=$(basename "$p2" .part2)
      p1=$(ls "$stage/$name.part1" .whl/fa4/part1/"$name.part1" 2>/dev/null | head -1)
      if [ -z "$p1" ]; then
        echo "error: $name.part1 is neither in $stage (run 'FLASH_ATTN stage' first, on the same warm machine)" \
             "nor carried in .whl/fa4/part1" >&2
        exit 2
      fi
      cat "$p1" "$p2" > "$stage/join/$name"
    done
    (cd "$stage/join" && sha256sum -c "$root/.whl/fa4/part2/SHA256SUMS") || exit 3
    pip_install "$stage"/join/*.whl || exit 3
    # nvidia-cutlass-dsl puts its packages on sys.path through a .pth file, which Python reads only
    # in site directories, not on PYTHONPATH: add that directory explicitly.
    export PYTHONPATH="$site:$site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}"
    export TVM_FFI_CACHE_DIR=${TVM_FFI_CACHE_DIR:-/tmp/tvm-ffi}
    export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
    export FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=${FLASH_ATTENTION_CUTE_DSL_CACHE_DIR:-/tmp/fa4_cache}
    select="FLASH_ATTN"
    extra_tests=()
    ;;
  *)
    echo "error: backend must be TRITON, FLASHINFER or FLASH_ATTN; got '$backend'" >&2
    exit 2
    ;;
esac

{
  echo "== $(date -u) backend=$backend"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  command -v nvcc && nvcc --version | tail -2
  "$py" - <<'EOF'
import importlib, sys
import torch, triton
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)
print("torch has __dlpack_c_exchange_api__:", hasattr(torch.Tensor, "__dlpack_c_exchange_api__"))
for mod in ("flashinfer", "flash_attn.cute", "cutlass", "quack", "tvm_ffi"):
    try:
        m = importlib.import_module(mod)
        print("import", mod, "ok", getattr(m, "__version__", ""), getattr(m, "__file__", ""))
    except Exception as e:  # report and go on: the tests skip a missing backend
        print("import", mod, "FAILED:", type(e).__name__, e)
EOF
} 2>&1 | tee "$out/env_${backend}.txt"

# SEGMENTS_K narrows the selection (e.g. SEGMENTS_K="not graph" to split a long first run).
[ -z "${SEGMENTS_K:-}" ] || select="($select) and ($SEGMENTS_K)"
start=$SECONDS
"$py" -m pytest -v -rs -p no:cacheprovider tests/gpu/test_segments_gpu.py -k "$select" \
  --junitxml="$out/segments_${backend}.xml" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
if [ ${#extra_tests[@]} -gt 0 ]; then  # the CPU segment tests, with the Triton kernel compiled
  "$py" -m pytest -v -rs -p no:cacheprovider "${extra_tests[@]}" --junitxml="$out/segments_${backend}_cpu.xml" \
    2>&1 | tee -a "$log"
  rc2=${PIPESTATUS[0]}
  [ "$rc" -ne 0 ] || rc=$rc2
fi
echo "== pytest exit $rc after $((SECONDS - start)) s" | tee -a "$log"

if [ "$backend" = FLASHINFER ] && [ -d "$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer" ]; then
  # JIT-built modules, to bring along next time under the same cache path (never commit them).
  tar -C "$FLASHINFER_WORKSPACE_BASE" -czf "$out/flashinfer_jit_cache.tgz" .cache/flashinfer 2>/dev/null
  [ "$(stat -c %s "$out/flashinfer_jit_cache.tgz")" -lt $((15 * 1024 * 1024)) ] || rm -f "$out/flashinfer_jit_cache.tgz"
fi
exit "$rc"
