"""The prefill benchmark's table and crossover summary on records as the GPU runs write them.

A run writes its docs after every prompt length, merged with the records already in
``docs/perf/prefill.json``; some records carry no value for a column (route-only rows have no peak
memory, records of a peer that could not run have no time, older records no KV fraction). A
writer that cannot format those stops the run after the measurements and loses its docs (it
happened on the H200), so these checks run on the CPU.
"""

from __future__ import annotations

import pytest

from tests._benchmarks import import_benchmark

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def prefill_bench():
    return import_benchmark("prefill")  # benchmarks/prefill.py


def _rec(context, method, variant, ms, *, topk=None, write=False, **extra):
    r = dict(phase="prefill", batch=1, context=context, hq=32, hkv=8, head_dim=128, bs=64, topk=topk,
             scaling_factor=1.41, method=method, variant=variant, includes_write=write, chunk=None, ms=ms,
             kv_fraction=0.06 if method == "dash-triton" else 1.0, floor_ms=1.0, floor_fraction=1.0 / ms if ms else None,
             peak_mb=100.0, device="GPU X")
    r.update(extra)
    return r


def test_rows_without_values_print_a_dash_and_speed_ups_use_the_faster_dense_peer(prefill_bench):
    recs = [
        _rec(8192, "dense-flashinfer", "one-shot", 2.0),
        _rec(8192, "dense-sdpa", "one-shot flash", 4.0),
        _rec(8192, "dash-triton", "one-shot", 4.0, topk=64, write=True),
        _rec(8192, "dash-triton", "one-shot attn_stages=3", 1.5, topk=64, write=True),  # a --tune row: not the default
        _rec(8192, "dash-triton", "one-shot workspace", 1.8, topk=64, write=True),  # a later layer's call: not either
        _rec(8192, "dash-triton", "one-shot vllm-layout", 1.7, topk=64, write=True),  # another cache layout: not either
        _rec(8192, "dash-triton", "route-only", 1.0, topk=64, peak_mb=None, kv_fraction=None, floor_ms=None,
             floor_fraction=None),
        _rec(131072, "dense-flashinfer", "one-shot", 250.0),
        _rec(131072, "dash-triton", "one-shot", 125.0, topk=64, write=True),
        _rec(131072, "published-dash", "one-shot", None, note="illegal memory access"),
    ]
    text = prefill_bench.table(recs)
    rows = {(c[1].strip(), c[8].strip(), c[2].strip()): c for c in (line.split("|") for line in text.splitlines()[2:])}
    route = rows[("8192", "dash-triton", "route-only")]
    assert [route[i].strip() for i in (11, 12, 13, 14)] == ["-", "-", "-", "-"]  # KV read, floor, of floor, peak
    assert rows[("8192", "dash-triton", "one-shot")][16].strip() == "0.50x"  # 2.0 ms (FlashInfer) / 4.0 ms
    assert rows[("131072", "dash-triton", "one-shot")][16].strip() == "2.00x"
    assert "not run: illegal memory access" in rows[("131072", "published-dash", "one-shot")][10]

    summary = prefill_bench.summary(recs)
    assert "Hkv 8, topk 64, one shot: faster than the faster dense peer from 131072 tokens on" in summary
    assert "slower at 8192 tokens" in summary  # the faster --tune, workspace and vllm-layout rows do not count
    assert rows[("8192", "dash-triton", "one-shot workspace")][16].strip() == "1.11x"  # but have their own speed-up
