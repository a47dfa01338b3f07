"""``benchmarks/prefill.py``'s child process for the published kernels: a crash's record reaches the parent."""

from __future__ import annotations

import queue

import pytest

from tests._benchmarks import import_benchmark

pytest.importorskip("torch")


def test_a_case_whose_cleanup_raises_still_sends_its_record(monkeypatch):
    """After an illegal memory access the CUDA context is dead: ``run_published`` records the failure, then its
    cleanup raises. The record (with the crash's reason) is sent before the child ends, and the cases after it are
    not run (the parent records them as not measured)."""
    bench = import_benchmark("prefill")
    ran = []

    def crashing(a, n, hkv, sf, device, bw, recs):
        ran.append(n)
        recs.append({"context": n, "hkv": hkv, "note": "failed: illegal memory access"})
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(bench, "run_published", crashing)
    results = queue.Queue()
    with pytest.raises(RuntimeError, match="illegal memory access"):
        bench._published_child(None, [(131072, 8, 1.4), (262144, 8, 1.0)], "cpu", 1.0, results)
    assert ran == [131072]
    assert results.get_nowait() == {"context": 131072, "hkv": 8, "note": "failed: illegal memory access"}
    assert results.empty()  # no later case, and no end marker: the parent sees the process end
