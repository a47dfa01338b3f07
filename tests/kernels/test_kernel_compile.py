"""Every decode and prefill kernel compiles for the H200 (sm_90) as the launchers call it, on a CPU machine.

The interpreter cannot see compiler-only errors (non-constexpr globals, loop-carried type changes,
constexpr-specialised arguments) or GPU resource use, so this compiles (in a subprocess without
``TRITON_INTERPRET``) each launch the host code makes for six supported configurations, with
triton's bundled ptxas, and checks shared memory against the H200's limit. Register spills are
reported, not failed on (a few spilled bytes cost little in these kernels).
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


CHECKS = {  # checker module -> (fewest launches, the kernels it must cover)
    "tests.kernels._kernel_compile_check": (20, {"_decode_scores_kernel", "_decode_select_kernel",
                                                 "_decode_attn_split_kernel", "_merge_kernel", "_kv_write_kernel",
                                                 "_kv_rows_kernel"}),
    "tests.kernels._prefill_compile_check": (18, {"_prefill_route_kernel", "_prefill_attn_kernel",
                                                  "_tile_tables_kernel", "_kv_rows_kernel",
                                                  "_gather_summaries_kernel", "prefill_attn_ws"}),
}


@pytest.mark.skipif(KERNEL_DEVICE != "cpu", reason="CPU check; on a GPU the compiled tests cover this")
@pytest.mark.parametrize("checker", sorted(CHECKS), ids=["decode", "prefill"])
def test_kernels_compile_for_sm90(checker):
    fewest, kernels = CHECKS[checker]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-m", checker], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    if r.returncode and "ptxas" in r.stderr and "No such file" in r.stderr:
        pytest.skip("triton's bundled ptxas is missing")
    assert r.returncode == 0, r.stderr[-4000:]
    recs = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(recs) >= fewest, r.stdout[-2000:]
    assert {x["kernel"] for x in recs} == kernels, r.stdout[-2000:]
    errors = [f"{x['kernel']} {x['constexprs']}: {x['error']}" for x in recs if "error" in x]
    assert not errors, "\n".join(errors)
    big = [x for x in recs if x["shared"] > 227 * 1024]
    assert not big, f"shared memory over the H200 limit: {big}"
    spills = [f"{x['kernel']} {x['constexprs']}: {x['spill_bytes']} B" for x in recs if x.get("spill_bytes")]
    if spills:
        print("register spills:\n" + "\n".join(spills))
