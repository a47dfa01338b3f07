# Shared set-up of the GPU runs (sourced by ci/gpu.sh, not run).
# Sets root (cd there), out ($OUT, default ./out), py ($PYTHON, default python3: the GPU image's python3 holds torch)
# and the environment every script needs. The GPU machine has no package registry: optional packages travel as wheels under
# .whl/ (ignored by git; docs/segments.md says how they are built), at most 64 MiB per call. What does not fit
# one call is staged by earlier calls on the same warm machine (`gpu_stage`) under $DASH_WHEEL_STAGE.
#
#   .whl/flashinfer/*.whl          FlashInfer (trimmed) + tvm-ffi
#   .whl/fa4/part1/*.part1         first half of the cutlass-dsl cu13 wheel (stage it: it does not fit with part2)
#   .whl/fa4/part2/*               the rest of FlashAttention 4 and its dependencies, *.part2 and SHA256SUMS
#
# gpu_env REPORT installs whatever is carried or staged into $TMPDIR/site (offline, no dependency resolution),
# sets the environment each library needs, points DASH_PUBLISHED_DIR at an ignored copy of the published
# kernels when present, and writes versions, imports and nvidia-smi to "$out/REPORT".
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root" || exit 2
out=${OUT:-$root/out}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
tmp=${TMPDIR:-/tmp}  # caches and staged wheels of the GPU machine (lost when it is given back)
wheels=${DASH_WHEEL_STAGE:-$tmp/dash_wheels}
site=$tmp/site

_pip_target() {
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$@" \
    >> "$out/wheel_install.log" 2>&1
}

# The directory (carried first, then staged) that holds files matching GLOB under .whl/SUB, or nothing.
_wheel_dir() {
  local sub=$1 glob=$2 d
  for d in ".whl/$sub" "$wheels/$sub"; do
    if ls "$d"/$glob >/dev/null 2>&1; then echo "$d"; return; fi
  done
}

# gpu_stage SUB...: copy the carried .whl/SUB files to the stage for a later call on this warm machine.
gpu_stage() {
  local sub
  for sub in "$@"; do
    [ -d ".whl/$sub" ] || { echo "error: .whl/$sub was not carried" >&2; return 2; }
    mkdir -p "$wheels/$sub" && cp .whl/"$sub"/* "$wheels/$sub/"
  done
  ls -lR "$wheels" | tee "$out/stage.txt"
}

_install_flashinfer() {
  local dir
  dir=$(_wheel_dir flashinfer '*.whl')
  [ -n "$dir" ] || return 0
  _pip_target "$dir"/*.whl || { echo "flashinfer install failed (see wheel_install.log)"; return 0; }
  export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}
  export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$tmp/flashinfer_ws}
  export MAX_JOBS=${MAX_JOBS:-$(nproc)}
  if [ -z "${CUDA_HOME:-}" ] && command -v nvcc >/dev/null; then
    CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")"); export CUDA_HOME
  fi
  # The JIT links with -lcuda: without an unversioned libcuda.so (driver-only images) point the linker at the
  # driver's libcuda.so.1 through a private symlink.
  if ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so '; then
    local lib1
    lib1=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF; exit}')
    if [ -n "$lib1" ]; then
      mkdir -p "$tmp/dash_cuda_link" && ln -sf "$lib1" "$tmp/dash_cuda_link/libcuda.so"
      export FLASHINFER_EXTRA_LDFLAGS="-L$tmp/dash_cuda_link${FLASHINFER_EXTRA_LDFLAGS:+ $FLASHINFER_EXTRA_LDFLAGS}"
    fi
  fi
}

_install_fa4() {
  local p2dir p1dir join="$wheels/fa4/join" p2 name
  p2dir=$(_wheel_dir fa4/part2 '*.whl')
  [ -n "$p2dir" ] || return 0
  mkdir -p "$join" && cp "$p2dir"/*.whl "$join/"
  for p2 in "$p2dir"/*.part2; do
    [ -e "$p2" ] || continue
    name=$(basename "$p2" .part2)
    p1dir=$(_wheel_dir fa4/part1 "$name.part1")
    if [ -z "$p1dir" ]; then
      echo "FA4 not installed: $name.part1 is neither carried nor staged (gpu_stage fa4/part1 on this warm machine)"
      return 0
    fi
    cat "$p1dir/$name.part1" "$p2" > "$join/$name"
  done
  local sums
  sums=$(readlink -f "$p2dir/SHA256SUMS")
  (cd "$join" && sha256sum -c --quiet "$sums") || { echo "FA4 not installed: checksum mismatch"; return 0; }
  _pip_target "$join"/*.whl || { echo "FA4 install failed (see wheel_install.log)"; return 0; }
  # nvidia-cutlass-dsl puts its packages on sys.path through a .pth file, which Python reads only in site
  # directories, not on PYTHONPATH: add that directory explicitly.
  export PYTHONPATH="$site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}"
  export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
  export FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=${FLASH_ATTENTION_CUTE_DSL_CACHE_DIR:-$tmp/fa4_cache}
}

gpu_env() {
  local report=$1
  mkdir -p "$site"
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  export TVM_FFI_CACHE_DIR=${TVM_FFI_CACHE_DIR:-$tmp/tvm-ffi}
  _install_flashinfer
  _install_fa4
  if [ -z "${DASH_PUBLISHED_DIR:-}" ] && [ -d third_party/dash-attention/dash_attn ]; then
    export DASH_PUBLISHED_DIR="$root/third_party/dash-attention"
  fi
  {
    date -u
    "$py" - <<'PY'
import importlib, sys
import torch, triton
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "triton",
      triton.__version__, "|", torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA")
for mod in ("flashinfer", "flash_attn.cute"):
    try:
        m = importlib.import_module(mod)
        print("import", mod, "ok", getattr(m, "__version__", ""))
    except Exception as e:  # report and go on: the tests skip a missing library
        print("import", mod, "FAILED:", type(e).__name__, e)
PY
    echo "DASH_PUBLISHED_DIR=${DASH_PUBLISHED_DIR:-unset}"
    nvidia-smi 2>&1 | head -15
  } > "$out/$report" 2>&1
  cat "$out/$report"
}

# gpu_tests NAME LIMIT_S PYTEST_ARGS...: pytest -m gpu under a time limit, log and JUnit XML as $out/NAME.*;
# prints the log's tail and returns pytest's status.
gpu_tests() {
  local name=$1 limit=$2 t
  shift 2
  echo "== GPU tests $name (pytest -m gpu $*), limit ${limit}s"
  timeout "$limit" "$py" -m pytest -m gpu "$@" -q -rs -p no:cacheprovider --durations=25 \
    --junitxml="$out/$name.xml" > "$out/$name.log" 2>&1
  t=$?
  tail -40 "$out/$name.log"
  echo "tests exit status $t"
  return $t
}

# gpu_bench NAME SCRIPT LIMIT_S [ARGS...]: benchmarks/SCRIPT.py (default ARGS for decode and prefill: --preset
# required) writing its records to $out/SCRIPT.json, merged with the repository's docs/perf/SCRIPT.json; log
# $out/NAME.log; returns its status. The tables and charts come from the records: python benchmarks/report.py.
gpu_bench() {
  local name=$1 script=$2 limit=$3 b
  shift 3
  local args=("$@")
  if [ ${#args[@]} -eq 0 ] && [ "$script" != model ]; then args=(--preset required); fi
  [ -f "docs/perf/$script.json" ] && cp "docs/perf/$script.json" "$out/$script.json"
  echo "== $script benchmark ${args[*]}, limit ${limit}s"
  timeout "$limit" "$py" "benchmarks/$script.py" "${args[@]}" --json "$out/$script.json" > "$out/$name.log" 2>&1
  b=$?
  tail -45 "$out/$name.log"
  echo "benchmark exit status $b"
  return $b
}
