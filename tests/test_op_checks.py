"""One validation of a step's inputs at the public ops (``dash_core.checks``): every op refuses a bad
``slot_mapping`` (dtype, shape, a slot outside the cache) with a ``ValueError`` naming it, before anything is
written; the kernels' supported block sizes come from one table (``dash_core.limits``) that ``DashParams`` reads."""

from __future__ import annotations

import pytest
import torch

from dash_core import DashParams, limits
from dash_core.layout import PagedKVCache, alloc_summaries
from dash_core.ops import cache_dash_prefill, paged_dash_decode, paged_dash_prefill

HQ, HKV, D, PS, BS = 4, 2, 16, 16, 16


def setup(pages=4):
    g = torch.Generator().manual_seed(0)
    cache = PagedKVCache.from_sglang(torch.zeros(pages * PS, HKV, D), torch.zeros(pages * PS, HKV, D), PS,
                                     alloc_summaries(pages * PS, BS, HKV, D, torch.float32))
    t = 20
    q, k, v = (torch.randn(t, h, D, generator=g) for h in (HQ, HKV, HKV))
    bt = torch.tensor([[2, 0]], dtype=torch.int32)
    slots = (bt[0, torch.arange(t) // PS].long() * PS + torch.arange(t) % PS)
    return cache, q, k, v, bt, slots, torch.randn(HKV, D, generator=g)


def calls(cache, q, k, v, bt, slots, hc, p, bad):
    """The three ops, each writing ``k, v`` at its tokens' slots changed by ``bad`` (decode: the last token)."""
    t = q.shape[0]
    cu, seq = torch.tensor([0, t], dtype=torch.int32), torch.tensor([t], dtype=torch.int32)
    return {
        "cache_dash_prefill": lambda: cache_dash_prefill(k, v, cache, bad(slots), p, head_cls=hc),
        "paged_dash_prefill": lambda: paged_dash_prefill(q, k, v, cache, bt, cu, seq, bad(slots), hc, p),
        "paged_dash_decode": lambda: paged_dash_decode(q[-1:], k[-1:], v[-1:], cache, bt, seq, bad(slots[-1:]), hc,
                                                       p),
    }


@pytest.mark.parametrize("op", ["cache_dash_prefill", "paged_dash_prefill", "paged_dash_decode"])
@pytest.mark.parametrize("bad, match", [
    (lambda s: s.float(), "slot_mapping must be"),  # a float32 slot mapping is not cast and written through
    (lambda s: s[:-1], "slot_mapping must be"),
    (lambda s: torch.where(torch.arange(s.numel()) == s.numel() - 1, 4 * PS, s), "outside the cache's 64 slots"),
])
def test_bad_slot_mapping_is_refused_before_any_write(op, bad, match):
    cache, q, k, v, bt, slots, hc = setup()
    before = [x.clone() for x in (cache.k_pages, cache.v_pages, cache.summaries)]
    call = calls(cache, q, k, v, bt, slots, hc, DashParams(block_size=BS), bad)[op]
    with pytest.raises(ValueError, match=match):
        call()
    assert all(torch.equal(x, y) for x, y in zip((cache.k_pages, cache.v_pages, cache.summaries), before))


@pytest.mark.parametrize("op", ["cache_dash_prefill", "paged_dash_prefill", "paged_dash_decode"])
def test_padding_slots_are_skipped(op):
    """Negative slots mark padding: accepted by every op, and nothing is written for them (K/V land at the other
    tokens' slots only)."""
    cache, q, k, v, bt, slots, hc = setup()

    def pad(s):
        s = s.clone()
        s[-1 if s.numel() == 1 else 5] = -1
        return s

    calls(cache, q, k, v, bt, slots, hc, DashParams(block_size=BS), pad)[op]()
    sent = pad(slots if op != "paged_dash_decode" else slots[-1:])
    written = torch.zeros(cache.k_pages.shape[:2], dtype=torch.bool).flatten()
    written[sent[sent >= 0]] = True
    for pages in (cache.k_pages, cache.v_pages):
        assert torch.equal(pages.flatten(2).any(2).flatten(), written)


def test_kernel_block_sizes_are_one_table():
    """``DashParams`` takes powers of two in ``BLOCK_SIZE_RANGE`` and tells which of them the kernels run."""
    lo, hi = limits.BLOCK_SIZE_RANGE
    for bs in (lo, 2 * lo, hi):
        p = DashParams(block_size=bs)
        if bs in limits.KERNEL_BLOCK_SIZES:
            p.check_kernel_support()
        else:
            with pytest.raises(ValueError, match=f"block_size = {bs} is not supported by the Triton kernels"):
                p.check_kernel_support()
    with pytest.raises(ValueError, match="block_size"):
        DashParams(block_size=2 * hi)


def test_params_rules():
    """The cap, the selection units and the indexer's router, stated once on ``DashParams``."""
    p = DashParams(topk=8)
    assert (p.cap(5), p.cap(100), DashParams().cap(100)) == (5, 8, 100)
    assert (p.selection_units(4), DashParams(router="shared").selection_units(4)) == (4, 1)
    assert p.routed_by(True).router == "shared" and p.routed_by(False) is p


def test_kernel_cache_checks_run_once_per_cache(monkeypatch):
    """The kernel path's checks of what depends on the cache alone (its dtype, head dim, page size, summary
    store and device) run at a cache object's first step for a query dtype, head count, device and ``DashParams``;
    a cache they refuse is refused again at every step, and another cache object is checked anew."""
    from dash_core.kernels import checks as kchecks

    ran = []
    check = kchecks._check_kernel_cache
    monkeypatch.setattr(kchecks, "_check_kernel_cache", lambda *a: ran.append(a[1]) or check(*a))
    d, dt, p = 64, torch.bfloat16, DashParams(block_size=BS)

    def step(cache, hq=HQ):
        q = torch.zeros(3, hq, d, dtype=dt)
        kchecks.check_kernel_step(q, None, None, cache, torch.zeros(HKV, d, dtype=dt), p, None, None)

    def cache_of(summaries=True):
        kv = [torch.zeros(4 * PS, HKV, d, dtype=dt) for _ in range(2)]
        return PagedKVCache.from_sglang(*kv, PS, alloc_summaries(4 * PS, BS, HKV, d, dt) if summaries else None)

    cache = cache_of()
    step(cache)
    step(cache)
    assert ran == [cache]
    step(cache, hq=2 * HQ)  # another head count is another configuration
    other = cache_of()
    step(other)
    assert ran == [cache, cache, other]
    bare = cache_of(summaries=False)
    for _ in range(2):
        with pytest.raises(ValueError, match="the Triton kernels need a summary store"):
            step(bare)
    assert ran[3:] == [bare, bare]


def test_a_workspace_checks_a_steps_tables_once(monkeypatch):
    """With a ``PrefillWorkspace`` the step's tables (block table, lengths, slot mapping) are checked at the first
    call that passes them, not at the calls that pass the same tensors again; each call's own inputs are checked
    at every call, and other tables (or a failed check) are checked anew."""
    from dash_core import checks
    from dash_core.workspace import PrefillWorkspace

    ran = []
    real = checks.check_tables
    monkeypatch.setattr(checks, "check_tables", lambda *a: ran.append(a[0]) or real(*a))
    cache, q, k, v, bt, slots, hc = setup()
    t, p, ws = q.shape[0], DashParams(block_size=BS), PrefillWorkspace()
    cu, seq = torch.tensor([0, t], dtype=torch.int32), torch.tensor([t], dtype=torch.int32)
    for _ in range(2):
        paged_dash_prefill(q, k, v, cache, bt, cu, seq, slots, hc, p, workspace=ws)
    assert len(ran) == 1
    with pytest.raises(ValueError, match="k must be"):
        paged_dash_prefill(q, k[:, :1], v, cache, bt, cu, seq, slots, hc, p, workspace=ws)
    with pytest.raises(ValueError, match="block_table must be"):
        paged_dash_prefill(q, k, v, cache, bt.float(), cu, seq, slots, hc, p, workspace=ws)
    paged_dash_prefill(q, k, v, cache, bt, cu, seq, slots, hc, p, workspace=ws)
    assert len(ran) == 3 and ran[1][0].dtype == torch.float32 and ran[2][0] is bt
