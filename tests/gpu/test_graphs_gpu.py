"""graphs/ on the GPU: a captured decode step replayed over changing lengths and page tables equals eager."""

import pytest
import torch

from dash_core import DashParams
from dash_core.layout import PagedKVCache, alloc_summaries
from dash_core.ops import cache_dash_prefill, paged_dash_decode
from graphs import CapturedDecode, DecodeGraphBuffers

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HQ, HKV, D, BS, PS = 8, 2, 128, 64, 128


def new_cache(pages, dtype):
    z = lambda: torch.zeros(pages * PS, HKV, D, dtype=dtype, device="cuda")
    return PagedKVCache.from_sglang(z(), z(), PS, alloc_summaries(pages * PS, BS, HKV, D, dtype, "cuda"))


@pytest.mark.parametrize("topk", [8, None])
def test_replay_over_changing_lengths_and_pages_equals_eager(topk):
    torch.manual_seed(0)
    dtype = torch.bfloat16
    p = DashParams(block_size=BS, topk=topk, scaling_factor=4.0)
    lens = [BS * 9 - 2, BS * 3 - 1, 5]  # the first two cross a block boundary within the steps below
    pages = 64
    perm = torch.randperm(pages, device="cuda").to(torch.int32)
    bt = torch.zeros(3, 12, dtype=torch.int32, device="cuda")
    at = 0
    for i in range(3):
        bt[i] = perm[at: at + 12] if at + 12 <= pages else perm[:12]
        at += 12
    caches = [new_cache(pages, dtype), new_cache(pages, dtype)]  # graph, eager
    hc = torch.randn(HKV, D, dtype=dtype, device="cuda")
    for i, n in enumerate(lens):
        pos = torch.arange(n, device="cuda")
        slots = bt[i, pos // PS].long() * PS + pos % PS
        k, v = torch.randn(n, HKV, D, dtype=dtype, device="cuda"), torch.randn(n, HKV, D, dtype=dtype, device="cuda")
        for c in caches:
            cache_dash_prefill(k, v, c, slots, p, head_cls=hc)
    bufs = DecodeGraphBuffers.allocate(4, 12, HQ, HKV, D, PS, p, dtype)
    step = CapturedDecode(bufs, caches[0], hc, batch=4)
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    for t in range(4):
        if t == 2:  # the engine moves request 1 to other pages: copy its pages, rewrite its table row
            new = perm[48:60].clone()
            for c in caches:
                c.k_pages[new.long()] = c.k_pages[bt[1].long()]
                c.v_pages[new.long()] = c.v_pages[bt[1].long()]
                for j in range(PS // BS):
                    c.summaries[new.long() * (PS // BS) + j] = c.summaries[bt[1].long() * (PS // BS) + j]
            bt[1] = new
        seq = seq + 1
        n = 3 if t != 3 else 2  # the last step drops a request (a padded row in the graph)
        pos = seq[:n].long() - 1
        slots = bt[:n].gather(1, (pos // PS)[:, None])[:, 0].long() * PS + pos % PS
        q = torch.randn(n, HQ, D, dtype=dtype, device="cuda")
        k, v = torch.randn(n, HKV, D, dtype=dtype, device="cuda"), torch.randn(n, HKV, D, dtype=dtype, device="cuda")
        got = step(q, k, v, bt[:n], seq[:n], slots).clone()
        want = paged_dash_decode(q, k, v, caches[1], bt[:n], seq[:n], slots, hc, p)
        torch.cuda.synchronize()
        assert not got.isnan().any()
        torch.testing.assert_close(got, want, atol=2e-2, rtol=0)  # split counts differ: fp32 merge order only
        assert bufs.out[n:].abs().sum().item() == 0  # padded rows are zeros
    for a, b in zip(caches[0].k_pages, caches[1].k_pages):  # the graph wrote the same K as eager
        assert torch.equal(a, b)
    assert torch.equal(caches[0].summaries, caches[1].summaries)
