"""Out-of-range slots on CUDA (``dash_core.checks.SlotGuard``): never written; reported by a later eager call without
a host synchronisation (or at once by ``ops.check_slot_errors``); masked only inside a captured CUDA graph."""

import pytest
import torch

from dash_core import DashParams
from dash_core.kernels.decode.buffers import DecodeBuffers
from dash_core.layout import PagedKVCache, alloc_summaries
from dash_core.ops import cache_dash_prefill, check_slot_errors, paged_dash_decode

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HQ, HKV, D, BS, PS, PAGES = 8, 2, 128, 64, 64, 8


def setup():
    torch.manual_seed(0)
    dt, dev = torch.bfloat16, "cuda"
    cache = PagedKVCache.from_sglang(torch.zeros(PAGES * PS, HKV, D, dtype=dt, device=dev),
                                     torch.zeros(PAGES * PS, HKV, D, dtype=dt, device=dev), PS,
                                     alloc_summaries(PAGES * PS, BS, HKV, D, dt, dev))
    k, v = (torch.randn(3, HKV, D, dtype=dt, device=dev) for _ in range(2))
    return cache, k, v, torch.randn(HKV, D, dtype=dt, device=dev)


def test_out_of_range_slot_is_skipped_and_reported_by_a_later_eager_call():
    cache, k, v, hc = setup()
    p = DashParams(block_size=BS)
    check_slot_errors()  # nothing pending from other tests
    bad = torch.tensor([1, PAGES * PS + 3, 2], dtype=torch.int64, device="cuda")
    cache_dash_prefill(k, v, cache, bad, p, head_cls=hc)  # no synchronisation, no error yet
    torch.cuda.synchronize()
    assert cache.k_pages.view(-1, HKV, D)[[1, 2]].any(dim=-1).all()  # the good slots are written
    good = torch.tensor([4, 5, 6], dtype=torch.int64, device="cuda")
    with pytest.raises(ValueError, match=f"outside the cache's {PAGES * PS} slots"):
        cache_dash_prefill(k, v, cache, good, p, head_cls=hc)  # the next eager call reports the earlier one
    cache_dash_prefill(k, v, cache, good, p, head_cls=hc)  # reported once
    cache_dash_prefill(k, v, cache, bad.clone(), p, head_cls=hc)
    with pytest.raises(ValueError, match="outside the cache"):
        check_slot_errors(wait=True)


def test_out_of_range_slot_inside_a_captured_graph_is_masked():
    cache, k, v, hc = setup()
    p = DashParams(block_size=BS, topk=2)
    check_slot_errors()
    q = torch.randn(1, HQ, D, dtype=torch.bfloat16, device="cuda")
    bt = torch.arange(PAGES, dtype=torch.int32, device="cuda")[None]
    seq = torch.tensor([5], dtype=torch.int32, device="cuda")
    slot = torch.tensor([PAGES * PS + 7], dtype=torch.int64, device="cuda")
    bufs = DecodeBuffers.for_step(q, cache, bt, p)
    out = torch.empty_like(q)
    args = (q, k[:1], v[:1], cache, bt, seq, slot, hc, p)
    paged_dash_decode(*args, out=out, buffers=bufs)  # compile outside the capture
    eager = out.clone()
    with pytest.raises(ValueError):
        check_slot_errors(wait=True)  # the eager call's slot was reported
    before = cache.k_pages.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_dash_decode(*args, out=out, buffers=bufs)
    out.fill_(float("nan"))  # the replay writes every row again
    graph.replay()
    torch.cuda.synchronize()
    check_slot_errors(wait=True)  # nothing was watched inside the graph
    # the masked slot writes nothing, in the graph as eagerly: the same cache, so the same output, bit for bit
    assert torch.equal(cache.k_pages, before) and torch.equal(out, eager)
