"""Every prefill kernel launch compiles for the H200 (sm_90) on a CPU machine, within its shared memory.

As ``test_kernel_compile.py`` for decode: the interpreter cannot see compiler-only errors (non-constexpr
globals, loop-carried type changes, constexpr-specialised arguments) or GPU resources, so this compiles
(in a subprocess without ``TRITON_INTERPRET``) the launches ``paged_dash_prefill_triton`` makes for six
supported configurations with triton's bundled ptxas. Spills are printed, not failed on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernels._kernel_env import KERNEL_DEVICE

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(KERNEL_DEVICE != "cpu", reason="CPU check; on a GPU the compiled tests cover this")
def test_prefill_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-m", "tests.kernels._prefill_compile_check"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    if r.returncode and "ptxas" in r.stderr and "No such file" in r.stderr:
        pytest.skip("triton's bundled ptxas is missing")
    assert r.returncode == 0, r.stderr[-4000:]
    recs = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    kernels = {x["kernel"] for x in recs}
    assert kernels == {"_prefill_route_kernel", "_prefill_attn_kernel", "_zero_tail_kernel"}, r.stdout[-2000:]
    assert len(recs) >= 12, r.stdout[-2000:]
    errors = [f"{x['kernel']} {x['constexprs']}: {x['error']}" for x in recs if "error" in x]
    assert not errors, "\n".join(errors)
    big = [x for x in recs if x["shared"] > 227 * 1024]
    assert not big, f"shared memory over the H200 limit: {big}"
    spills = [f"{x['kernel']} {x['constexprs']}: {x['spill_bytes']} B" for x in recs if x.get("spill_bytes")]
    if spills:
        print("register spills:\n" + "\n".join(spills))
