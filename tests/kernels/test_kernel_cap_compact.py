"""The ``topk`` cap's compacted pivot search (``routing.select_kept`` with COMPACT, prefill's
``CAP_COMPACT``) picks the same threshold, hence the same kept blocks, as a sort.

The cap is exact (SPEC.md section 5: the ``topk`` largest ``mp``, ties to the lower block), so every
comparison here is exact: no tolerance. Crafted ``mp`` rows stress what the compaction changes: many
ties at the threshold, keys spread over many binades, neighbouring bit patterns, zeros, fewer
positive entries than ``topk``; the prefill kernels are then run with the switch on and off.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from dash_core import DashParams
from dash_core.kernels import prefill as pf
from dash_core.kernels.prefill_route import route_wave_recompute
from dash_core.kernels.routing import mp_key_range, select_kept
from tests.kernels._kernel_env import KERNEL_DEVICE
from tests.kernels._prefill_scenarios import make_prefill_case, plan_and_scratch, token_slots
from tests.kernels.test_kernel_prefill import check_routing

DEV = KERNEL_DEVICE


@triton.jit
def _cap_kernel(mp_ptr, ncand_ptr, ck_ptr, bt_ptr, sel_idx_ptr, sel_blk_ptr, sel_bias_ptr, count_ptr, NMAX, topk,
                QT: tl.constexpr, TS: tl.constexpr, NPIV: tl.constexpr, COMPACT: tl.constexpr):
    """One program caps ``QT`` rows of ``mp [QT, NMAX]`` (row u has ``ncand[u]`` candidates; block
    table = identity) into ``sel_* [QT, topk]`` and ``count [QT]``."""
    offs_u = tl.arange(0, QT)
    offs_s = tl.arange(0, TS)
    ncand = tl.load(ncand_ptr + offs_u)
    unit = offs_u.to(tl.int64) * NMAX
    nmax = tl.max(ncand, axis=0)
    npos = tl.zeros([QT], tl.int32)
    key_min = tl.full([QT], 0x7F800000, tl.int32)
    key_max = tl.zeros([QT], tl.int32)
    for c0 in range(0, nmax, TS):
        c = c0 + offs_s
        cok = c[None, :] < ncand[:, None]
        mp = tl.load(mp_ptr + unit[:, None] + c[None, :], mask=cok, other=0.0)
        npos, key_min, key_max = mp_key_range(mp, cok, npos, key_min, key_max)
    select_kept(mp_ptr, unit, ncand, nmax, npos, bt_ptr, unit * 0, sel_idx_ptr, sel_blk_ptr, sel_bias_ptr,
                offs_u.to(tl.int64) * topk, topk, count_ptr, offs_u, topk, 1.0, npos, key_min, key_max, ck_ptr,
                QT=QT, TS=TS, NPIV=NPIV, HAS_TOPK=True, EST_DIAG=False, PS=1, BS=1, ONE_TILE=False,
                X_IN_REGS=False, TC=TS, COMPACT=COMPACT)


def _crafted_rows(nmax: int, seed: int) -> tuple:
    """Eight ``mp`` rows and their candidate counts: ties over binades, wide spreads, adjacent bit
    patterns, zeros, a row with fewer positive entries than any cap."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.zeros(8, nmax, dtype=torch.float32)
    # powers of two over 120 binades, each repeated ~nmax / 40 times: ties at every threshold
    rows[0] = torch.exp2(-torch.randint(0, 40, (nmax,), generator=g).float() * 3)
    # continuous values over ~60 binades, a third zero
    rows[1] = torch.exp2(torch.rand(nmax, generator=g) * 60 - 50) * (torch.rand(nmax, generator=g) > 0.33)
    # bit patterns one apart around 1.0 and one huge outlier: the bracket narrows to a few ulps
    rows[2] = (0x3F800000 + torch.randint(0, 6, (nmax,), generator=g, dtype=torch.int32)).view(torch.float32)
    rows[2, nmax // 3] = 1e30
    # all equal: every key ties
    rows[3] = 0.25
    # mostly zero, a few values from the smallest normal binade to large ones (no subnormals: log may flush them)
    few = torch.randperm(nmax, generator=g)[:nmax // 4]
    rows[4, few] = torch.tensor([2e-38, 1e-37, 1e-20, 1.0, 3.0e5]).repeat(nmax)[:few.numel()]
    # two values only, the larger rare
    rows[5] = torch.where(torch.rand(nmax, generator=g) < 0.05, 2.0, 1.0)
    # fewer positive entries than the cap (no search)
    rows[6, :3] = torch.tensor([0.5, 0.25, 0.5])
    # random fp32 in (0, 1] with repeats from rounding to bf16
    rows[7] = torch.rand(nmax, generator=g).to(torch.bfloat16).float()
    ncand = torch.tensor([nmax, nmax - 5, nmax, nmax // 2 + 1, nmax, nmax - 1, nmax, nmax // 3], dtype=torch.int32)
    return rows, ncand


def _expected(mp_row: torch.Tensor, topk: int) -> list:
    """The kept candidates of one row: every positive mp, capped to the ``topk`` largest (ties to the
    lower index), in increasing order."""
    pos = [(-float(v), j) for j, v in enumerate(mp_row.tolist()) if v > 0]
    return sorted(j for _, j in sorted(pos)[:topk])


@pytest.mark.parametrize("compact", [True, False])
@pytest.mark.parametrize("topk", [1, 7, 64])
def test_select_kept_threshold_matches_sort(compact, topk):
    nmax = 300  # 19 tiles of TS = 16 per full pass
    rows, ncand = _crafted_rows(nmax, 11 + topk)
    mp = rows.clone()
    for u in range(8):
        mp[u, ncand[u]:] = 7.0  # beyond a row's candidates: never read
    ck = torch.full((8, nmax), -1, dtype=torch.int32)
    sel_idx = torch.full((8, topk), -1, dtype=torch.int32)
    sel_blk = torch.full((8, topk), -1, dtype=torch.int32)
    sel_bias = torch.zeros(8, topk, dtype=torch.float32)
    count = torch.full((8,), -1, dtype=torch.int32)
    bt = torch.arange(nmax, dtype=torch.int32)
    dev = [x.to(DEV) for x in (mp, ncand, ck, bt, sel_idx, sel_blk, sel_bias, count)]
    _cap_kernel[(1,)](*dev, nmax, topk, QT=8, TS=16, NPIV=16, COMPACT=compact)
    mp_d, _, ck_d, _, sel_idx_d, sel_blk_d, sel_bias_d, count_d = [x.cpu() for x in dev]
    for u in range(8):
        want = _expected(rows[u, :ncand[u]], topk)
        c = int(count_d[u])
        got = sel_idx_d[u, :c].tolist()
        assert got == want, f"row {u} (topk {topk}, compact {compact}): kept {got}, sort keeps {want}"
        assert sel_blk_d[u, :c].tolist() == want  # identity block table
        # log of the kept mp in fp32 against float64: within a few fp32 ulps of |log mp| <= 97
        assert torch.allclose(sel_bias_d[u, :c].double(), rows[u, want].double().log(), rtol=0, atol=2e-5)
    if compact:  # the search went past its second pass somewhere and read the lists
        assert (ck_d >= 0).any(), "no unit's keys were compacted: the test does not reach the compacted passes"


def _route(fn, case, compact: int, monkeypatch):
    monkeypatch.setattr(pf, "CAP_COMPACT", compact)
    plan, scratch = plan_and_scratch(case)
    if scratch.cap_keys.numel():
        scratch.cap_keys.fill_(-1)
    fn(case.q, case.cache, case.block_table, case.cu, case.seq_lens, case.params, plan, scratch, 0, plan.num_tiles)
    return plan, scratch


@pytest.mark.parametrize("fn", [pf.route_wave, route_wave_recompute], ids=["stored", "recomputed"])
@pytest.mark.parametrize("router,topk", [("kv_head", 3), ("shared", 5)])
def test_prefill_cap_compaction_keeps_the_same_blocks(fn, router, topk, monkeypatch):
    """The prefill route kernels with ``CAP_COMPACT`` on: the oracle's kept blocks (``check_routing``),
    and bit for bit the selection of the uncompacted search on the same ``mp``."""
    p = DashParams(block_size=16, topk=topk, scaling_factor=0.7, router=router)
    case = make_prefill_case(23, [(16 * 45 + 5, 20), (300, 12)], hq=4, hkv=2, params=p, q_scale=1.5).to(DEV)
    plan, on = _route(fn, case, 1, monkeypatch)
    check_routing(case, plan, on)
    assert (on.cap_keys >= 0).any(), "no unit's keys were compacted: the test does not reach the compacted passes"
    _, off = _route(fn, case, 0, monkeypatch)
    assert off.cap_keys.numel() == 0
    slots = sorted(token_slots(case, plan).values())
    assert torch.equal(on.sel_count[slots], off.sel_count[slots])
    cnt = on.sel_count[slots].cpu()
    for name in ("sel_idx", "sel_blk", "sel_bias"):
        a, b = getattr(on, name)[slots].cpu(), getattr(off, name)[slots].cpu()
        for r in range(len(slots)):
            for u in range(cnt.shape[1]):
                c = int(cnt[r, u])
                assert torch.equal(a[r, u, :c], b[r, u, :c]), f"{name} of slot {slots[r]} unit {u} differs"


def test_scratch_without_cap_keys_is_refused(monkeypatch):
    """A scratch allocated with ``CAP_COMPACT`` off, launched with it on: a ValueError, not int32 key
    lists written over mp."""
    p = DashParams(block_size=16, topk=3)
    case = make_prefill_case(3, [(100, 10)], hq=4, hkv=2, params=p).to(DEV)
    monkeypatch.setattr(pf, "CAP_COMPACT", 0)
    plan, scratch = plan_and_scratch(case)
    monkeypatch.setattr(pf, "CAP_COMPACT", 1)
    with pytest.raises(ValueError, match="cap_keys"):
        pf.route_wave(case.q, case.cache, case.block_table, case.cu, case.seq_lens, p, plan, scratch, 0,
                      plan.num_tiles)
