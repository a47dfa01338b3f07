"""The GPU benchmarks' code paths at tiny shapes on the CPU (``--smoke``, kernels under the Triton interpreter), so
that the scripts cannot rot between GPU runs: every row they should write is there, with the fields the report reads.
Each runs in a fresh process (the interpreter must be set before triton is imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests._benchmarks import BENCHMARKS

pytest.importorskip("triton")


def _smoke(script: str, tmp_path, *args) -> list:
    out = tmp_path / "records.json"
    env = dict(os.environ, TRITON_INTERPRET="1", TMPDIR=str(tmp_path))
    r = subprocess.run([sys.executable, str(BENCHMARKS / script), "--smoke", "--json", str(out), *args],
                       cwd=BENCHMARKS.parent, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(out.read_text())


def test_decode_smoke_writes_every_row(tmp_path):
    recs = _smoke("decode.py", tmp_path)
    got = {(r["method"], r["variant"], str(r["topk"]), r["includes_write"]) for r in recs}
    for topk in ("4", "None"):
        assert {("dash-triton", "zero-copy", topk, w) for w in (False, True)} <= got
    assert ("dash-torch", "gathered", "4", False) in got  # the segment path
    assert {("dense-cudnn", "contiguous", "None", False), ("dense-sdpa", "contiguous", "None", False)} <= got
    assert all(r["ms"] > 0 and r["run"] == recs[0]["run"] and r["command"].startswith("python benchmarks/decode.py")
               for r in recs)
    assert all(r["host_us"] == recs[0]["host_us"] > 0 for r in recs)  # one probe of the run's host, on every row


def test_prefill_serving_smoke_writes_the_step_rows(tmp_path):
    """``--preset serving``: the step of several layers sharing a workspace and the mixed step, DASH with its write
    and the dense peers on the same step."""
    recs = _smoke("prefill.py", tmp_path, "--preset", "serving")
    by = {(r["method"], r["variant"]): r for r in recs}
    assert set(by) == {(m, v) for m in ("dash-triton", "dense-cudnn", "dense-sdpa")
                       for v in ("serving", "mixed")}
    serving, mixed = by[("dash-triton", "serving")], by[("dash-triton", "mixed")]
    assert (serving["batch"], serving["context"], serving["layers"], serving["includes_write"]) == (2, 96, 2, True)
    assert (mixed["batch"], mixed["context"], mixed["decode_tokens"], mixed["prompt_tokens"]) == (3, 300, 2, 96)
    assert serving["topk"] == mixed["topk"] == 4 and serving["tile_reuse"] > 0
    assert all(r["ms"] > 0 and r["host_us"] == recs[0]["host_us"] > 0 for r in recs)
