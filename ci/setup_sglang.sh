#!/usr/bin/env bash
# Create the SGLang test environment from scratch: ci/setup_sglang.sh VENV_DIR
#
# Installs sglang==0.5.23 (CUDA wheels; they import and run on a CPU-only machine), pytest and hypothesis,
# and this project with --no-deps -e. SGLang's generic CPU path imports `vllm._custom_ops.rotary_embedding`;
# the script writes a test-only pure-torch replacement into VENV_DIR/dash_test_shims and puts that directory on
# the venv's import path with a .pth file, so every Python process of this venv (including the engine's spawned
# scheduler and the HTTP server) finds it. Never use this venv next to a real vLLM install: the shim shadows it.
#
# Idempotent: when VENV_DIR already imports sglang 0.5.23, the shim and this project, it exits at once.
# Needs ~12 GB of free disk (the venv is ~11 GB) and PyPI access. Python: $PYTHON (default python3), >= 3.10.
set -euo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: $0 VENV_DIR" >&2
    exit 2
fi
# Absolute: the .pth file written below must name the shim directory from any working directory.
mkdir -p "$(dirname "$1")"
VENV_DIR=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
REPO_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
SGLANG_VERSION=0.5.23
NEED_GB=${DASH_SGLANG_NEED_GB:-12}
START=$(date +%s)

elapsed() { echo "setup_sglang: $1 after $(( $(date +%s) - START )) s"; }

check_venv() {
    [[ -x "$VENV_DIR/bin/python" ]] || return 1
    "$VENV_DIR/bin/python" - "$SGLANG_VERSION" "$REPO_DIR" <<'EOF' >/dev/null 2>&1
import importlib.metadata as md, os, sys
assert md.version("sglang") == sys.argv[1]
import vllm._custom_ops  # the rope shim
assert "dash_test_shims" in vllm._custom_ops.__file__
import adapters.sglang.plugin, dash_core, pytest, hypothesis, safetensors  # noqa: F401
assert os.path.realpath(os.path.dirname(dash_core.__file__)).startswith(os.path.realpath(sys.argv[2]))
eps = md.entry_points(group="sglang.srt.plugins")
assert any(e.name == "dash" for e in eps)
EOF
}

if check_venv; then
    elapsed "$VENV_DIR already works (sglang $SGLANG_VERSION, rope shim, dash-serve), nothing to do"
    exit 0
fi

# Free disk where the venv goes (ci/lib.sh's need_disk fails with a clear message when it is short).
. "$REPO_DIR/ci/lib.sh"
need_disk "$NEED_GB" "$(dirname "$VENV_DIR")"
echo "setup_sglang: enough free disk for the SGLang venv (about ${NEED_GB} GB); creating $VENV_DIR"

"$PYTHON" -m venv "$VENV_DIR"
# pip, with the noise of local find-links directories that lack a package filtered out.
pip_install() {
    { "$VENV_DIR/bin/python" -m pip install --quiet "$@" 2>&1; } | { grep -v "is neither a file nor a directory" || true; }
}
pip_install --upgrade pip
pip_install "sglang==$SGLANG_VERSION" "pytest>=8" "hypothesis>=6.100" "safetensors>=0.4" numpy requests
elapsed "sglang $SGLANG_VERSION installed"
# --no-deps: this project must not change SGLang's pinned torch or triton. Its build noise goes to a log.
if ! "$VENV_DIR/bin/python" -m pip install --quiet --no-deps -e "$REPO_DIR" > "$VENV_DIR/dash-editable-install.log" 2>&1; then
    cat "$VENV_DIR/dash-editable-install.log" >&2
    exit 1
fi

# Test-only rope shim: SGLang's RotaryEmbedding on a non-CUDA device without the CPU engine imports
# vllm._custom_ops.rotary_embedding. This pure-torch version works in place like the original op.
SHIM_DIR="$VENV_DIR/dash_test_shims"
mkdir -p "$SHIM_DIR/vllm"
cat > "$SHIM_DIR/vllm/__init__.py" <<'EOF'
"""Test-only stand-in for vLLM (written by ci/setup_sglang.sh): provides _custom_ops.rotary_embedding only."""
EOF
cat > "$SHIM_DIR/vllm/_custom_ops.py" <<'EOF'
"""Pure-torch rotary embedding with the signature of vLLM's custom op (test-only, CPU)."""
import torch


def _rotate(x, cos, sin, head_size, is_neox):
    # x [T, heads * head_size] updated in place; cos/sin [T, rot_dim // 2]
    t = x.shape[0]
    xv = x.view(t, -1, head_size)
    rot_dim = cos.shape[-1] * 2
    xr = xv[..., :rot_dim]
    c, s = cos[:, None, :], sin[:, None, :]
    if is_neox:
        x1, x2 = xr[..., : rot_dim // 2], xr[..., rot_dim // 2:]
        o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
        xr.copy_(torch.cat((o1, o2), dim=-1))
    else:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
        xr.copy_(torch.stack((o1, o2), dim=-1).flatten(-2))


def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox):
    """positions [T]; query/key [T, heads * head_size] (key may be None); cos_sin_cache [max_pos, rot_dim]."""
    pos = positions.flatten().long()
    cs = cos_sin_cache[pos].to(query.dtype)
    cos, sin = cs.chunk(2, dim=-1)
    _rotate(query.view(pos.shape[0], -1), cos, sin, head_size, is_neox)
    if key is not None:
        _rotate(key.view(pos.shape[0], -1), cos, sin, head_size, is_neox)
EOF
SITE=$("$VENV_DIR/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$SHIM_DIR" > "$SITE/dash_test_shims.pth"

if ! check_venv; then
    echo "setup_sglang: ERROR: $VENV_DIR was built but does not pass the import check" >&2
    "$VENV_DIR/bin/python" -c 'import sglang, vllm._custom_ops, adapters.sglang.plugin' >&2 || true
    exit 1
fi
echo "setup_sglang: the rope shim is $SHIM_DIR/vllm; $SITE/dash_test_shims.pth puts it on the import path of"
echo "setup_sglang: every process of this venv (spawned schedulers and servers too). Run the tests with:"
echo "setup_sglang:   $VENV_DIR/bin/python -m pytest -m engine_sglang tests/engines"
elapsed "done"
