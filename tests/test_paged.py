"""The pure-PyTorch paged path and the public ops against the oracle (docs/semantics.md section 8)."""

import dataclasses
import pytest
import torch
from hypothesis import given, settings, strategies as st

from dash_core import DashParams, dash_reference
from dash_core.layout import (PAGE_SIZE_ERROR, PagedKVCache, alloc_summaries, block_table_from_req_to_token,
                              slots_of)
from dash_core.ops import cache_dash_prefill, paged_dash_decode, paged_dash_prefill
from dash_core.reference import block_summaries, route, routing_scores
from tests.kernels._kernel_scenarios import near_decisions

HQ, HKV, D = 4, 2, 16


def heads_first(x):  # [T, H, D] -> [1, H, T, D]
    return x.permute(1, 0, 2)[None]


def make_cache(layout, num_pages, page_size, dtype, store=True, bs=16):
    summ = alloc_summaries(num_pages * page_size, bs, HKV, D, dtype) if store else None
    if layout == "sglang":
        return PagedKVCache.from_sglang(torch.zeros(num_pages * page_size, HKV, D, dtype=dtype),
                                        torch.zeros(num_pages * page_size, HKV, D, dtype=dtype), page_size, summ)
    # vLLM: an extra head slot and extra channels, to check the view ignores them
    kv = torch.zeros(num_pages, HKV + 1, page_size, 2 * D + 8, dtype=dtype)
    return PagedKVCache.from_vllm(kv, HKV, D, summ)


class Requests:
    """Random requests laid out in shuffled pages of one cache."""

    def __init__(self, lengths, page_size, seed, dtype=torch.float32, shared_prefix_pages=0):
        g = torch.Generator().manual_seed(seed)
        self.lengths = lengths
        self.ps = page_size
        pages_each = [-(-n // page_size) for n in lengths]
        self.num_pages = sum(pages_each) + 3
        perm = torch.randperm(self.num_pages, generator=g)
        self.tables, at = [], 0
        for i, np_ in enumerate(pages_each):
            own = perm[at: at + np_]
            at += np_
            if i > 0 and shared_prefix_pages:  # request i shares request 0's first pages
                own[:shared_prefix_pages] = self.tables[0][:shared_prefix_pages]
            self.tables.append(own)
        width = max(pages_each) + 1
        self.block_table = torch.zeros(len(lengths), width, dtype=torch.int32)
        for i, t in enumerate(self.tables):
            self.block_table[i, : t.numel()] = t.to(torch.int32)
        n = max(lengths)
        self.q = torch.randn(len(lengths), n, HQ, D, generator=g).to(dtype)
        self.k = torch.randn(len(lengths), n, HKV, D, generator=g).to(dtype)
        self.v = torch.randn(len(lengths), n, HKV, D, generator=g).to(dtype)
        self.hc = torch.randn(HKV, D, generator=g).to(dtype)
        if shared_prefix_pages:  # shared pages hold equal tokens
            s = shared_prefix_pages * page_size
            self.k[1:, :s], self.v[1:, :s] = self.k[0, :s], self.v[0, :s]

    def slots(self, i, lo, hi):
        return slots_of(self.block_table[i], torch.arange(lo, hi), self.ps)

    def extend(self, cache, params, starts, ends, op=paged_dash_prefill):
        """Run one batch extending request i from starts[i] to ends[i] tokens."""
        idx = [i for i in range(len(starts)) if ends[i] > starts[i]]
        cat = lambda x: torch.cat([x[i, starts[i]: ends[i]] for i in idx])
        slots = torch.cat([self.slots(i, starts[i], ends[i]) for i in idx])
        cu = torch.tensor([0] + [ends[i] - starts[i] for i in idx]).cumsum(0).to(torch.int32)
        seq = torch.tensor([ends[i] for i in idx], dtype=torch.int32)
        bt = self.block_table[idx]
        if op is paged_dash_decode:
            return op(cat(self.q), cat(self.k), cat(self.v), cache, bt, seq, slots, self.hc, params)
        return op(cat(self.q), cat(self.k), cat(self.v), cache, bt, cu, seq, slots, self.hc, params)

    def routed_apart(self, i, params, n):
        """``[n] bool``: rows of request i whose routing docs/semantics.md section 7 lets fp32 and float64 decide apart
        (``near_decisions``): an entry near a head's threshold, or two of a unit's mp near its ``topk``-th largest
        (seeds exist where two blocks tie at the cap in fp32 and not in float64)."""
        k, q = heads_first(self.k[i, :n])[0], heads_first(self.q[i, :n])[0]
        ncand = (torch.arange(n) // params.block_size - params.local_blocks + 1).clamp(min=0)
        apart = torch.zeros(n, dtype=torch.bool)
        nblk = int(ncand.max())
        if nblk == 0:
            return apart
        summ = block_summaries(k, self.hc, params.block_size)[:, :nblk]
        qs = (params.scaling_factor * q).to(q.dtype)
        rt, x = route(qs, summ, ncand, params), routing_scores(qs, summ)
        g = x.shape[0] // rt.mp.shape[0]  # query heads a unit routes for
        for r in range(n):
            c = int(ncand[r])
            for u in range(rt.mp.shape[0] if c else 0):
                near_tau, near_k = near_decisions(x[u * g: (u + 1) * g, r, :c], rt.mp[u, r, :c], params.topk)
                apart[r] |= bool(near_tau.any()) or int(near_k.sum()) > 1
        return apart

    def oracle(self, i, params, lo, hi):
        n = self.lengths[i]
        out, _ = dash_reference(heads_first(self.q[i, :n]), heads_first(self.k[i, :n]), heads_first(self.v[i, :n]),
                                self.hc, params, rows=list(range(lo, hi)))
        return out[0].permute(1, 0, 2)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), layout=st.sampled_from(["sglang", "vllm"]), ps_mult=st.sampled_from([1, 2, 4]),
       router=st.sampled_from(["kv_head", "shared"]), topk=st.sampled_from([None, 1, 3]),
       est=st.booleans(), chunks=st.integers(1, 3))
def test_chunked_prefill_then_decode_equals_oracle(seed, layout, ps_mult, router, topk, est, chunks):
    bs = 16
    lengths = [5, 70, 131, 16]  # very short and longer requests, ends on and off block boundaries
    r = Requests(lengths, bs * ps_mult, seed)
    p = DashParams(block_size=bs, topk=topk, router=router, estimate_diagonal=est, scaling_factor=4.0, local=32)
    cache = make_cache(layout, r.num_pages, r.ps, torch.float32)
    # prefill all but the last token in `chunks` extends of paged history, then one decode step
    outs = [[] for _ in lengths]
    cuts = [[n - 1 - (n - 1) * c // chunks for c in range(chunks, -1, -1)] for n in lengths]
    for c in range(chunks):
        starts, ends = [cu[c] for cu in cuts], [cu[c + 1] for cu in cuts]
        o = r.extend(cache, p, starts, ends)
        at = 0
        for i in range(len(lengths)):
            m = ends[i] - starts[i]
            outs[i].append(o[at: at + m])
            at += m
    dec = r.extend(cache, p, [n - 1 for n in lengths], lengths, op=paged_dash_decode)
    for i, n in enumerate(lengths):
        got = torch.cat(outs[i] + [dec[i: i + 1]])
        same = ~r.routed_apart(i, p, n)
        assert same.any(), f"request {i}: every row is near a routing threshold"
        assert torch.allclose(got[same], r.oracle(i, p, 0, n)[same], atol=1e-5, rtol=1e-5), f"request {i}"


def test_shared_prefix_pages_reuse_summaries():
    bs, ps = 16, 32
    r = Requests([100, 90], ps, seed=7, shared_prefix_pages=2)
    p = DashParams(block_size=bs, scaling_factor=4.0)
    cache = make_cache("sglang", r.num_pages, ps, torch.float32)
    r.extend(cache, p, [0], [100])  # request 0 writes the shared pages and their summaries
    shared = r.tables[0][:2]
    snapshot = cache.summaries.clone()
    # request 1 hits the prefix cache: only tokens from 64 on are new, summaries of 0..3 are reused
    out = r.extend(cache, p, [0, 64], [0, 90])
    assert torch.allclose(out, r.oracle(1, p, 64, 90), atol=1e-5)
    sblk = torch.cat([torch.arange(2) + t * 2 for t in shared])  # summary rows of the shared blocks
    assert torch.equal(cache.summaries[sblk], snapshot[sblk]) and snapshot[sblk].abs().sum() > 0
    # read, not recomputed: with the shared blocks' stored summaries negated, the same extend routes otherwise
    cache.summaries[sblk] = -snapshot[sblk]
    tampered = r.extend(cache, p, [0, 64], [0, 90])
    assert torch.equal(cache.summaries[sblk], -snapshot[sblk])
    assert (tampered - out).abs().max() > 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_cache_matches_oracle_on_same_inputs(dtype):
    bs = 16
    r = Requests([77, 50], bs, seed=3, dtype=dtype)
    p = DashParams(block_size=bs, scaling_factor=2.0, topk=2)
    cache = make_cache("vllm", r.num_pages, bs, dtype)
    out = r.extend(cache, p, [0, 0], [77, 50])
    assert out.dtype == dtype
    ref = torch.cat([r.oracle(0, p, 0, 77), r.oracle(1, p, 0, 50)])
    assert torch.equal(out, ref)  # same float64 math on the same stored values


def test_page_size_not_a_multiple_of_block_size():
    r = Requests([40], 24, seed=1)
    p = DashParams(block_size=16)
    with pytest.raises(ValueError, match=PAGE_SIZE_ERROR):
        r.extend(make_cache("sglang", r.num_pages, 24, torch.float32), p, [0], [40])
    # without a summary store the fallback recomputes summaries from gathered keys
    out = r.extend(make_cache("sglang", r.num_pages, 24, torch.float32, store=False), p, [0], [40])
    assert torch.allclose(out, r.oracle(0, p, 0, 40), atol=1e-5)


def test_bad_input_is_rejected_before_anything_is_written():
    r = Requests([40], 16, seed=2)
    p = DashParams(block_size=16)
    cache = make_cache("sglang", r.num_pages, 16, torch.float32)
    slots = r.slots(0, 0, 40)
    with pytest.raises(ValueError, match="head_cls"):
        cache_dash_prefill(r.k[0], r.v[0], cache, slots, p)  # summaries need head_cls
    with pytest.raises(ValueError, match="head_cls"):
        paged_dash_prefill(r.q[0], r.k[0], r.v[0], cache, r.block_table, torch.tensor([0, 40], dtype=torch.int32),
                           torch.tensor([40], dtype=torch.int32), slots, r.hc[:, :8], p)
    with pytest.raises(ValueError, match="v must be"):
        cache_dash_prefill(r.k[0], r.v[0, :, :1], cache, slots, p, head_cls=r.hc)
    with pytest.raises(ValueError, match="q must be"):
        paged_dash_prefill(r.q[0, :, :3], r.k[0], r.v[0], cache, r.block_table,
                           torch.tensor([0, 40], dtype=torch.int32), torch.tensor([40], dtype=torch.int32), slots,
                           r.hc, p)
    assert cache.k_pages.abs().sum() == 0 and cache.summaries.abs().sum() == 0


def test_padded_rows_and_padding_slots():
    r = Requests([20, 33], 16, seed=4)
    p = DashParams(block_size=16)
    cache = make_cache("sglang", r.num_pages, 16, torch.float32)
    r.extend(cache, p, [0, 0], [19, 32])
    q = torch.stack([r.q[0, 19], r.q[1, 32], r.q[1, 32]])
    k = torch.stack([r.k[0, 19], r.k[1, 32], r.k[1, 32]])
    v = torch.stack([r.v[0, 19], r.v[1, 32], r.v[1, 32]])
    slots = torch.cat([r.slots(0, 19, 20), r.slots(1, 32, 33), torch.tensor([-1])])
    bt = torch.cat([r.block_table, r.block_table[:1]])
    every = torch.arange(cache.num_slots)
    before = (cache.keys(every).clone(), cache.values(every).clone(), cache.summaries.clone())
    out = paged_dash_decode(q, k, v, cache, bt, torch.tensor([20, 33, 0], dtype=torch.int32), slots, r.hc, p)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    # the padding slot (-1) writes nothing: K/V changed at the two real slots only, and no summary (neither
    # token completes a block of 16)
    written = torch.zeros(cache.num_slots, dtype=torch.bool)
    written[slots[:2]] = True
    for now, then in zip((cache.keys(every), cache.values(every)), before[:2]):
        changed = (now != then).flatten(1).any(1)
        assert torch.equal(changed, written)
    assert torch.equal(cache.summaries, before[2])
    assert torch.allclose(out[0], r.oracle(0, p, 19, 20)[0], atol=1e-5)
    assert torch.allclose(out[1], r.oracle(1, p, 32, 33)[0], atol=1e-5)


def test_views_do_not_copy():
    kv = torch.zeros(4, 3, 16, 40)
    c = PagedKVCache.from_vllm(kv, 2, 16)
    c.k_pages[1, 5, 1, 2] = 7.0
    c.v_pages[2, 3, 0, 0] = 9.0
    assert kv[1, 1, 5, 2] == 7.0 and kv[2, 0, 3, 16] == 9.0
    kb = torch.zeros(64, 2, 16)
    c = PagedKVCache.from_sglang(kb, kb.clone(), 16)
    c.k_pages[2, 3, 1, 4] = 5.0
    assert kb[35, 1, 4] == 5.0


def test_block_table_from_req_to_token():
    req_to_token = torch.tensor([[64, 65, 66, 67, 32, 33, 34, 35], [0, 1, 2, 3, 96, 97, 98, 99]])
    assert block_table_from_req_to_token(req_to_token, 4).tolist() == [[16, 8], [0, 24]]


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("bs", [16, 32, 64, 128])
def test_every_page_and_block_size(page_size, bs):
    """Summary store where the page holds whole blocks, recomputed summaries otherwise."""
    r = Requests([3 * bs + 5, 2 * bs - 1, bs + 2], page_size, seed=bs + page_size, shared_prefix_pages=0)
    p = DashParams(block_size=bs, scaling_factor=3.0, topk=2, estimate_diagonal=True)
    store = page_size % bs == 0
    cache = make_cache("vllm" if bs % 32 else "sglang", r.num_pages, page_size, torch.float32, store=store, bs=bs)
    n = r.lengths
    half = [m // 2 for m in n]
    o1 = r.extend(cache, p, [0] * 3, half)
    o2 = r.extend(cache, p, half, n)
    at1 = at2 = 0
    for i, m in enumerate(n):
        got = torch.cat([o1[at1: at1 + half[i]], o2[at2: at2 + m - half[i]]])
        at1, at2 = at1 + half[i], at2 + m - half[i]
        assert torch.allclose(got, r.oracle(i, p, 0, m), atol=1e-5, rtol=1e-5), f"request {i}"


def test_two_requests_sharing_prefix_pages_in_one_batch():
    bs = 16
    r = Requests([80, 72], 16, seed=11, shared_prefix_pages=3)
    p = DashParams(block_size=bs, scaling_factor=4.0, router="shared")
    cache = make_cache("sglang", r.num_pages, 16, torch.float32)
    r.extend(cache, p, [0], [48])  # the shared 3 pages
    out = r.extend(cache, p, [48, 48], [80, 72])  # both extend from the shared prefix
    assert torch.allclose(out[:32], r.oracle(0, p, 48, 80), atol=1e-5)
    assert torch.allclose(out[32:], r.oracle(1, p, 48, 72), atol=1e-5)


def test_a_cache_keeps_what_it_derives_from_itself():
    """``PagedKVCache``: its views are fixed (a new view is a new cache) and its geometry is read from them once;
    ``kept`` builds a value once per key and cache object, and another cache object builds its own."""
    kb, vb = torch.zeros(64, 2, 8), torch.zeros(64, 2, 8)
    cache = PagedKVCache.from_sglang(kb, vb, 16)
    assert (cache.page_size, cache.num_kv_heads, cache.head_dim, cache.num_slots, cache.dtype) == \
        (16, 2, 8, 64, torch.float32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cache.v_pages = cache.v_pages.clone()
    built = []

    def build():
        built.append(cache.k_pages)
        return len(built)

    assert cache.kept(("x", 1), build) == 1 and cache.kept(("x", 1), build) == 1
    assert cache.kept(("x", 2), build) == 2
    assert cache.kept("none", lambda: built.append(None)) is None and cache.kept("none", build) is None  # kept too
    other = PagedKVCache.from_sglang(kb, vb, 16)
    assert other.kept(("x", 1), lambda: "other") == "other" and cache.kept(("x", 1), build) == 1
    assert other == PagedKVCache(other.k_pages, other.v_pages)  # what is kept is no part of the cache's value
