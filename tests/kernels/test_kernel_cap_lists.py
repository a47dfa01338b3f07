"""The ``topk`` cap over lists of positive mp (``routing.select_kept`` with LIST, filled by
``append_positive``, as the prefill route kernels do) keeps the same blocks as a sort, and as the
search over every candidate (LIST off, as decode does for long rows).

The cap is exact (docs/semantics.md section 5: the ``topk`` largest ``mp``, ties to the lower block), so every
comparison here is exact: no tolerance. Crafted ``mp`` rows stress what the lists change: many
ties at the threshold, keys spread over many binades, neighbouring bit patterns, zeros, fewer
positive entries than ``topk``, positives spread over several tiles of the list.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from dash_core import DashParams
from dash_core.kernels.prefill import route as pf_route
from dash_core.kernels.prefill.config import PrefillConfig
from dash_core.kernels.routing import append_positive, mp_key_range, select_kept
from tests.kernels._kernel_env import KERNEL_DEVICE
from tests.kernels._prefill_scenarios import make_prefill_case, plan_and_scratch, token_slots
from tests.kernels.test_kernel_prefill import check_routing

DEV = KERNEL_DEVICE


@triton.jit
def _cap_kernel(mp_ptr, ncand_ptr, ck_ptr, bt_ptr, sel_idx_ptr, sel_blk_ptr, sel_bias_ptr, count_ptr, NMAX, topk,
                QT: tl.constexpr, TS: tl.constexpr, NPIV: tl.constexpr, LIST: tl.constexpr, TL: tl.constexpr):
    """One program caps ``QT`` rows of ``mp [QT, NMAX]`` (row u has ``ncand[u]`` candidates; block
    table = identity) into ``sel_* [QT, topk]`` and ``count [QT]``. LIST: the rows are first rewritten
    in place as lists of their positive entries (candidates in ``ck``)."""
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
        npos_before = npos
        npos, key_min, key_max = mp_key_range(mp, cok, npos, key_min, key_max)
        if LIST:
            tl.debug_barrier()  # in place: every thread has read the tile before entries <= c are written
            append_positive(mp, c, cok, mp_ptr, ck_ptr, unit, npos_before)
    tl.debug_barrier()
    select_kept(mp_ptr, unit, ncand, nmax, npos, bt_ptr, unit * 0, sel_idx_ptr, sel_blk_ptr, sel_bias_ptr,
                offs_u.to(tl.int64) * topk, topk, count_ptr, offs_u, topk, 1.0, npos, key_min, key_max, ck_ptr,
                QT=QT, TS=TS, NPIV=NPIV, HAS_TOPK=True, EST_DIAG=False, PS=1, BS=1, ONE_TILE=False,
                X_IN_REGS=False, TC=TS, LIST=LIST, TL=TL)


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


@pytest.mark.parametrize("lists", [True, False])
@pytest.mark.parametrize("topk", [1, 7, 64])
def test_select_kept_threshold_matches_sort(lists, topk):
    nmax = 300  # 19 tiles of TS = 16 per pivot pass over every candidate (10 of TL = 32 for the list's ties
    # and compaction). lists: prefill's shape of the search (few pivots, wider tiles for the ties and
    # compaction); otherwise decode's (16 pivots, one tile width)
    npiv, tl_w = (4, 32) if lists else (16, 16)
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
    _cap_kernel[(1,)](*dev, nmax, topk, QT=8, TS=16, NPIV=npiv, LIST=lists, TL=tl_w)
    mp_d, _, ck_d, _, sel_idx_d, sel_blk_d, sel_bias_d, count_d = [x.cpu() for x in dev]
    for u in range(8):
        want = _expected(rows[u, :ncand[u]], topk)
        c = int(count_d[u])
        got = sel_idx_d[u, :c].tolist()
        assert got == want, f"row {u} (topk {topk}, lists {lists}): kept {got}, sort keeps {want}"
        assert sel_blk_d[u, :c].tolist() == want  # identity block table
        # log of the kept mp in fp32 against float64: within a few fp32 ulps of |log mp| <= 97
        assert torch.allclose(sel_bias_d[u, :c].double(), rows[u, want].double().log(), rtol=0, atol=2e-5)
        if lists:  # the list: the row's positive entries in candidate order
            pos = (rows[u, :ncand[u]] > 0).nonzero().flatten()
            assert torch.equal(ck_d[u, :pos.numel()], pos.to(torch.int32))
            assert torch.equal(mp_d[u, :pos.numel()], rows[u, pos])


@pytest.mark.parametrize("topk", [1, 7, 64])
def test_select_kept_stops_at_an_exact_split(topk):
    """Rows whose topk largest mp are distinct and above a run of ties (the search stops at a pivot with exactly
    topk keys at or above it: nothing of the ties below may be kept), beside rows with one key fewer above the
    ties (the threshold falls in the ties: the lowest candidates among them are kept) and with the ties above."""
    nmax = 300
    g = torch.Generator().manual_seed(5 + topk)
    rows = torch.zeros(8, nmax, dtype=torch.float32)
    for u in range(8):
        above = topk - (u % 3 == 1)  # u % 3: exact split, one key short of it, no key above the ties
        above = 0 if u % 3 == 2 else above
        perm = torch.randperm(nmax, generator=g)
        rows[u, perm[:above]] = 1.0 + torch.rand(above, generator=g) * (1 + u)  # distinct with probability ~1
        rows[u, perm[above:above + 100]] = 0.5 / (1 + u)  # the ties
        rows[u, perm[above + 100:above + 150]] = torch.rand(50, generator=g) * 0.1 / (1 + u)  # below the ties
    ncand = torch.full((8,), nmax, dtype=torch.int32)
    sel_idx = torch.full((8, topk), -1, dtype=torch.int32)
    dev = [x.to(DEV) for x in (rows.clone(), ncand, torch.full((8, nmax), -1, dtype=torch.int32),
                               torch.arange(nmax, dtype=torch.int32), sel_idx, sel_idx.clone(),
                               torch.zeros(8, topk), torch.full((8,), -1, dtype=torch.int32))]
    _cap_kernel[(1,)](*dev, nmax, topk, QT=8, TS=16, NPIV=4, LIST=True, TL=32)
    sel_d, count_d = dev[4].cpu(), dev[7].cpu()
    for u in range(8):
        want = _expected(rows[u], topk)
        assert sel_d[u, :int(count_d[u])].tolist() == want, f"row {u}, topk {topk}"


@pytest.mark.parametrize("router,topk", [("kv_head", 3), ("shared", 5), ("kv_head", None)])
def test_prefill_route_lists_keep_the_oracle_blocks(router, topk):
    """The prefill route kernel (which caps and compact from the lists of positive mp, on tables longer than one
    score tile: 16 candidates here): the oracle's kept blocks (``check_routing``), and each unit's list holds its
    positive mp in candidate order."""
    p = DashParams(block_size=16, topk=topk, scaling_factor=0.7, router=router)
    case = make_prefill_case(23, [(16 * 45 + 5, 20), (300, 12)], hq=4, hkv=2, params=p, q_scale=1.5).to(DEV)
    config = PrefillConfig(route_score_tile=16, route_registers=False)
    plan, scratch = plan_and_scratch(case, config)
    assert not pf_route.scores_in_registers(plan.qt, 4, 2, case.q.shape[2], plan.max_cand, p, config)
    scratch.mp_cand.fill_(-1)
    pf_route.route_wave(case.q, case.cache, case.block_table, case.cu, case.seq_lens, case.params, plan, scratch, 0,
                        plan.num_tiles)
    check_routing(case, plan, scratch)
    cand = scratch.mp_cand.cpu()
    mp = scratch.mp.cpu()
    listed = 0
    for slot in token_slots(case, plan).values():
        for u in range(cand.shape[1]):
            row = cand[slot, u]
            n = int((row >= 0).sum())
            assert torch.all(row[:n] >= 0) and torch.all(row[n:] == -1), "a list is not contiguous"
            assert torch.all(row[1:n] > row[:n - 1]), "a list is not in candidate order"
            assert torch.all(mp[slot, u, :n] > 0)
            listed += n
    assert listed > 0
