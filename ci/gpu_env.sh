# Shared set-up of the GPU scripts (sourced by ci/gpu.sh and ci/gpu_prefill.sh, not run).
# Expects: root, out, py. Installs a carried FlashInfer wheel (.whl/flashinfer/) offline into /tmp/site,
# points DASH_PUBLISHED_DIR at an ignored copy of the published kernels when present, and writes the
# versions and nvidia-smi to "$out/$1".
gpu_env() {
  local report=$1
  if ls .whl/flashinfer/*.whl >/dev/null 2>&1; then
    local site=/tmp/site
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
      .whl/flashinfer/*.whl > "$out/flashinfer_install.log" 2>&1 || echo "flashinfer install failed (see log)"
    export PYTHONPATH="$site:$PYTHONPATH"
    export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}
    export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer_ws}
    export TVM_FFI_CACHE_DIR=${TVM_FFI_CACHE_DIR:-/tmp/tvm-ffi}
    export MAX_JOBS=${MAX_JOBS:-$(nproc)}
    if [ -z "${CUDA_HOME:-}" ] && command -v nvcc >/dev/null; then
      CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")"); export CUDA_HOME
    fi
  fi
  if [ -z "${DASH_PUBLISHED_DIR:-}" ] && [ -d third_party/dash-attention/dash_attn ]; then
    export DASH_PUBLISHED_DIR="$root/third_party/dash-attention"
  fi
  {
    date -u
    "$py" -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__); print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')"
    "$py" -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1
    echo "DASH_PUBLISHED_DIR=${DASH_PUBLISHED_DIR:-unset}"
    nvidia-smi 2>&1 | head -15
  } > "$out/$report" 2>&1
  cat "$out/$report"
}
