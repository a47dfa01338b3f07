"""``benchmarks/sass_loops.py``: the loops it finds in a disassembly are the kernel's loops.

The parser on a hand-written disassembly (a loop, an inner loop, and a barrier wait's retry placed after the end
of the code, which branches back into it and is not a loop), then the script on the Gluon prefill attention compiled
for sm_90 (in a subprocess without ``TRITON_INTERPRET``): each of its three warpgroups has a loop over union blocks
that issues the block's 8 QK and 4 PV warpgroup MMAs and its K and V refills once.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests._benchmarks import import_benchmark
from tests.kernels._kernel_env import KERNEL_DEVICE

ROOT = Path(__file__).resolve().parents[2]

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   FADD R2, R2, R3 ;
.L_x_2:
        /*0020*/                   FMUL R4, R4, R5 ;
        /*0030*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R0+URZ+0x10], R6 ;
        /*0040*/              @!P1 BRA `(.L_x_9) ;
.L_x_3:
        /*0050*/               @P0 BRA `(.L_x_2) ;
        /*0060*/                   IADD3 R7, R7, 0x1, RZ ;
        /*0070*/               @P2 BRA `(.L_x_1) ;
        /*0080*/                   EXIT ;
.L_x_9:
        /*0090*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R0+URZ+0x10], R6 ;
        /*00a0*/              @!P1 BRA `(.L_x_9) ;
        /*00b0*/                   BRA `(.L_x_3) ;
"""


def test_loops_of_a_disassembly():
    sl = import_benchmark("sass_loops")
    found = {(a, b): ops for a, b, ops in sl.loops(SASS)}
    assert sorted(len(ops) for ops in found.values()) == [4, 7]  # inner: FMUL SYNCS BRA BRA; outer adds 3
    outer = max(found.values(), key=len)
    assert outer[0] == "FADD" and outer[-1] == "BRA" and "EXIT" not in outer


@pytest.mark.skipif(KERNEL_DEVICE != "cpu", reason="CPU check (compiles for sm_90 without a GPU)")
def test_union_loop_of_the_gluon_attention():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "benchmarks/sass_loops.py", "--kernel", "prefill_attn_ws", "--where", "QT=16",
                        "--top", "40"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if r.returncode and "No such file" in r.stderr:
        pytest.skip("triton's bundled nvdisasm or ptxas is missing")
    assert r.returncode == 0, r.stderr[-4000:]
    loops = [(int(m.group(1)), dict(re.findall(r"([A-Z][A-Z0-9_]*) (\d+)", m.group(2))))
             for m in re.finditer(r": (\d+) instructions \(([^)]*)\)", r.stdout)]
    # each warpgroup's union loop: a block's 12 MMAs and its K and V refills by TMA (the local window's loop also
    # issues 12 MMAs, but loads by pointers)
    union = [n for n, ops in loops if ops.get("HGMMA") == "12" and ops.get("UTMALDG") == "2"]
    assert len(union) == 3, r.stdout
    assert all(200 < n < 1000 for n in union), r.stdout
