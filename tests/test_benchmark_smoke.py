"""The GPU benchmarks' code paths at tiny shapes on the CPU (``--smoke``, kernels under the Triton interpreter), so
that the scripts cannot rot between GPU runs: every row they should write is there, with the fields the report reads.
Each runs in a fresh process (the interpreter must be set before triton is imported; ``host_time.py`` runs without
it, its launches stubbed)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest

from dash_core.kernels.decode.config import DecodeConfig
from dash_core.kernels.prefill.config import GluonConfig
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
    """``--preset serving``: the step of several layers sharing a workspace and the mixed step (DASH also as a decode
    call and a prefill call), DASH with its write and the dense peers on the same step."""
    recs = _smoke("prefill.py", tmp_path, "--preset", "serving")
    by = {(r["method"], r["variant"]): r for r in recs}
    assert set(by) == {(m, v) for m in ("dash-triton", "dense-cudnn", "dense-sdpa")
                       for v in ("serving", "mixed")} | {("dash-triton", "mixed-split")}
    serving, mixed = by[("dash-triton", "serving")], by[("dash-triton", "mixed")]
    assert (serving["batch"], serving["context"], serving["layers"], serving["includes_write"]) == (2, 96, 2, True)
    assert (mixed["batch"], mixed["context"], mixed["decode_tokens"], mixed["prompt_tokens"]) == (3, 300, 2, 96)
    assert serving["topk"] == mixed["topk"] == 4 and serving["tile_reuse"] > 0
    assert all(r["ms"] > 0 and r["host_us"] == recs[0]["host_us"] > 0 for r in recs)


def _host_time(*args) -> dict:
    """``host_time.py ARGS`` (compiled path: no interpreter): ``{"B x N, L layers, LAYOUT[ TUNING]": launches a
    step by kernel}``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(BENCHMARKS / "host_time.py"), "--steps", "2", *args],
                       cwd=BENCHMARKS.parent, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = {}
    for line in r.stdout.splitlines():
        assert float(line.split(": ")[1].split(" us")[0]) > 0
        out[line.split(": ")[0]] = ast.literal_eval(line.split("launches a step: ")[1])
    return out


def test_host_time_launches_every_kernel_of_a_layer():
    """``host_time.py`` times the op on the Hopper kernel path: each layer of a step launches its write and attention
    kernels (the attention routing these short tables itself; a route launch before it with ``fuse_route`` off, or
    before a wave's Gluon attention), the step its one plan kernel, and every launch after the warm-up is a kept one.
    A path taken elsewhere (the PyTorch path, a stand-in that no longer reaches the launch, a launch through Triton's
    JIT: ``name (jit)``) changes these counts."""
    per_layer = {"_kv_rows_kernel": 3, "_prefill_attn_kernel": 3, "_tile_tables_kernel": 1}
    routed = {**per_layer, "_prefill_route_kernel": 3}
    assert _host_time("--cases", "1x256,2x640", "--layers", "3", "--tune", "fuse_route=0") == {
        "1 x 256, 3 layers, sglang": per_layer, "2 x 640, 3 layers, sglang": per_layer,
        "1 x 256, 3 layers, sglang fuse_route=0": routed, "2 x 640, 3 layers, sglang fuse_route=0": routed}
    with_gluon = {"_kv_rows_kernel": 1, "_prefill_route_kernel": 1, "_prefill_attn_kernel": 1,
                  "_tile_tables_kernel": 1, "prefill_attn_ws": 1}
    assert _host_time("--cases", "16x1024", "--layers", "1", "--layout", "vllm") == {
        "16 x 1024, 1 layers, vllm": with_gluon}
    without = {"_kv_rows_kernel": 1, "_prefill_attn_kernel": 1, "_tile_tables_kernel": 1}
    assert _host_time("--cases", "1x256", "--layers", "1", "--tune", "gluon_min_tiles=0") == {  # a setting beside
        "1 x 256, 1 layers, sglang": without, "1 x 256, 1 layers, sglang gluon_min_tiles=0": with_gluon}


def test_kernel_resources_compiles_every_kernel_of_a_step(tmp_path):
    """``kernel_resources.py`` compiles, for sm_90 and without a GPU, each kernel the 16 x 1k prefill step launches
    (the kernels ``host_time.py`` counts above, the Gluon attention among them) and each of a B 1 decode step's, and
    reports ptxas's registers: the Gluon program's warpgroups at their register budget, its shared memory within an
    sm_90 program's 227 KiB, the decode split attention at its register cap without spilling; ``--sass`` writes each
    kernel's SASS (the Gluon one with Hopper's warpgroup MMAs and TMA loads)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(BENCHMARKS / "kernel_resources.py"), "--cases", "16x1024", "--layout",
                        "vllm", "--decode-cases", "1x4096", "--sass", str(tmp_path)], cwd=BENCHMARKS.parent, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    sections: dict = {}  # "prefill 16x1024" -> {"kernel (n)": resources}
    kernels: dict = {}
    for line in r.stdout.splitlines():
        if line.startswith("  "):
            name, resources = line.strip().split(": ", 1)
            kernels[name] = resources
        else:
            kernels = sections.setdefault(line.split(",")[0], {})
    assert {title: {name.split(" (")[0] for name in names} for title, names in sections.items()} == {
        "prefill 16x1024": {"_kv_rows_kernel", "_prefill_route_kernel", "_prefill_attn_kernel", "_tile_tables_kernel",
                            "prefill_attn_ws"},
        "decode 1x4096": {"_decode_scores_kernel", "_decode_select_kernel", "_decode_attn_split_kernel",
                          "_merge_kernel"}}
    ws = sections["prefill 16x1024"]["prefill_attn_ws (1)"]
    assert ws.startswith(f"{GluonConfig().regs} registers, ")
    assert 0 < int(ws.split(", ")[-1].split(" bytes")[0]) <= 227 * 1024
    split = sections["decode 1x4096"]["_decode_attn_split_kernel (1)"]
    assert split.startswith(f"{DecodeConfig().attn_maxnreg} registers, 0 / 0 bytes spilled")
    names = [name for compiled in sections.values() for name in compiled]
    assert {p.name for p in tmp_path.iterdir()} == {f"{n.split(' (')[0]}_{n.split('(')[1][:-1]}.sass" for n in names}
    sass = (tmp_path / "prefill_attn_ws_1.sass").read_text()
    assert "HGMMA.64x64x16.F32.BF16" in sass and "UTMALDG.2D" in sass
