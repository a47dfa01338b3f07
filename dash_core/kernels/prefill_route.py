"""Prefill routing that recomputes the scores in every pass instead of storing them.

``_prefill_route_kernel`` (``dash_core.kernels.prefill``) writes the fp32 scores of a tile's tokens
against every candidate summary to a scratch buffer and reads them back in each pass of the entmax
(row maximum, three Halley steps, probabilities). Those scores are private to the tile: ``QT * Hq``
rows of 4 bytes per candidate, written once and read four times, mostly from HBM at long contexts
(a wave's scratch is hundreds of MB). The summaries they are computed from are shared by every tile of
a request (``2 * D`` bytes per candidate and KV head, a few MB per layer at 128k) and stay in L2.

This kernel therefore recomputes ``x = 0.5 <sf q, s> / sqrt(D)`` with ``tl.dot`` in each pass, from the
summaries, and keeps only ``mp`` (``QT`` values per candidate and unit) in scratch for the cap and
the compaction, which are ``routing.select_kept``, as in decode. Five small matrix products per
candidate replace one product, one fp32 store and four fp32 loads; the score scratch is not allocated,
so waves hold more tiles. The results equal the stored-score kernel's up to the order of fp32 sums.

Selected by ``dash_core.kernels.prefill.ROUTE_RECOMPUTE`` (a module constant, so that the benchmark
can time both: ``benchmarks/prefill.py --tune ROUTE_RECOMPUTE=1``).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..layout import PagedKVCache
from ..params import DashParams
from .common import summary_scores
from .prefill import PrefillPlan, PrefillScratch, ROUTE_WARPS, _route_constexprs, _tile_bounds, _tile_rows
from .routing import append_positive, halley_step, mp_key_range, select_kept


@triton.jit(do_not_specialize=["tile0", "n", "max_tokens", "num_tokens", "G", "HKV", "topk", "sel_cap"])
def _prefill_route_recompute_kernel(
    q_ptr, sq_t, sq_h, summ_ptr, ss_b, ss_h, bt_ptr, sbt_n,
    cu_ptr, seq_lens_ptr, tile_req_ptr, tile_off_ptr, tile0, n, max_tokens, num_tokens,
    mp_ptr, smp_n, smp_h, ck_ptr,
    sel_idx_ptr, sel_blk_ptr, sel_bias_ptr, ssel_n, ssel_h, sel_cap, count_ptr, scnt_n,
    sf, x_scale, G, HKV, topk, inv_sigma,
    QT: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, PS: tl.constexpr,
    LOCAL_BLOCKS: tl.constexpr, BLOCK_N: tl.constexpr, TS: tl.constexpr, NPIV: tl.constexpr,
    HAS_TOPK: tl.constexpr, EST_DIAG: tl.constexpr, SHARED: tl.constexpr,
):
    """Grid ``(W, Hkv)`` (router ``kv_head``) or ``(W, 1)`` (``shared``): program (w, h) routes tile
    ``tile0 + w`` into the same outputs as ``_prefill_route_kernel`` (mp, ``sel_*``, count)."""
    w = tl.program_id(0)
    hp = tl.program_id(1)
    req, ok, tok_base, a0, p_lo, p_hi, first_local, ncand = _tile_bounds(
        tile0 + w, n, tile_req_ptr, tile_off_ptr, cu_ptr, seq_lens_ptr, max_tokens, QT, BS, LOCAL_BLOCKS)
    if p_lo < p_hi:  # tiles past the last one do nothing
        M: tl.constexpr = QT * G_PAD
        offs_d = tl.arange(0, D)
        offs_n = tl.arange(0, BLOCK_N)
        _u, g_m, _pos, tok_m, in_m, unit_ok = _tile_rows(a0, p_lo, p_hi, tok_base, num_tokens, ok, G, QT, G_PAD)
        row_ok = in_m & ok
        bt_row = bt_ptr + req.to(tl.int64) * sbt_n
        ncand_u = tl.where(unit_ok, ncand, 0)
        slot_u = w.to(tl.int64) * QT + tl.arange(0, QT)
        if SHARED:
            h_lo = 0
            h_hi = HKV
            hs = 0
            nrows_f = (G * HKV) * 1.0
        else:
            h_lo = hp
            h_hi = hp + 1
            hs = hp
            nrows_f = G * 1.0
        mp_unit = slot_u * smp_n + hs * smp_h
        mp_u = mp_ptr + mp_unit
        npos = tl.zeros([QT], tl.int32)
        key_min = tl.full([QT], 0x7F800000, tl.int32)  # bits of the smallest positive and the largest mp
        key_max = tl.zeros([QT], tl.int32)
        for h in range(h_lo, h_hi):
            q = tl.load(q_ptr + tok_m[:, None] * sq_t + (h * G + g_m)[:, None] * sq_h + offs_d[None, :],
                        mask=row_ok[:, None], other=0.0)
            qs = (q.to(tl.float32) * sf).to(q.dtype)  # sf * q rounded to the query dtype (SPEC.md section 4)
            # 1.5-entmax threshold of every row: its maximum, then three safeguarded Halley steps
            mx = tl.full([M], float("-inf"), tl.float32)
            for c0 in range(0, ncand, BLOCK_N):
                c = c0 + offs_n
                cm = c < ncand
                x = summary_scores(qs, bt_row, summ_ptr, ss_b, h, ss_h, c, cm, x_scale, offs_d, PS, BS)
                mx = tl.maximum(mx, tl.max(tl.where(cm[None, :], x, float("-inf")), axis=1))
            m = tl.where(row_ok & (ncand > 0), mx, 0.0)
            lo = m - 1.0
            hi = m
            tau = (lo + hi) * 0.5
            for _ in tl.static_range(3):
                ssq = tl.zeros([M], tl.float32)
                sdf = tl.zeros([M], tl.float32)
                cnt = tl.zeros([M], tl.float32)
                for c0 in range(0, ncand, BLOCK_N):
                    c = c0 + offs_n
                    cm = c < ncand
                    x = summary_scores(qs, bt_row, summ_ptr, ss_b, h, ss_h, c, cm, x_scale, offs_d, PS, BS)
                    above = (x > tau[:, None]) & cm[None, :] & row_ok[:, None]
                    diff = tl.where(above, x - tau[:, None], 0.0)
                    ssq += tl.sum(diff * diff, axis=1)
                    sdf += tl.sum(diff, axis=1)
                    cnt += tl.sum(above.to(tl.float32), axis=1)
                tau, lo, hi = halley_step(ssq, sdf, cnt, tau, lo, hi)
            # probabilities summed over the unit's rows of this head; mean over all its rows in mp
            for c0 in range(0, ncand, BLOCK_N):
                c = c0 + offs_n
                cm = c < ncand
                x = summary_scores(qs, bt_row, summ_ptr, ss_b, h, ss_h, c, cm, x_scale, offs_d, PS, BS)
                diff = tl.where((x > tau[:, None]) & cm[None, :] & row_ok[:, None], x - tau[:, None], 0.0)
                part = tl.sum(tl.reshape(diff * diff, [QT, G_PAD, BLOCK_N]), axis=1)
                cok = unit_ok[:, None] & cm[None, :]
                dst = mp_u[:, None] + c[None, :]
                if SHARED:  # the heads' sums accumulate in mp; divided once all heads are in
                    if h > h_lo:
                        part += tl.load(dst, mask=cok, other=0.0)
                    tl.store(dst, part, mask=cok)
                else:
                    mp = part / nrows_f
                    npos_before = npos
                    npos, key_min, key_max = mp_key_range(mp, cok, npos, key_min, key_max)
                    append_positive(mp, c, cok, mp_ptr, ck_ptr, mp_unit, npos_before)
            tl.debug_barrier()
        if SHARED:
            for c0 in range(0, ncand, BLOCK_N):
                c = c0 + offs_n
                cok = unit_ok[:, None] & (c[None, :] < ncand)
                dst = mp_u[:, None] + c[None, :]
                mp = tl.load(dst, mask=cok, other=0.0) / nrows_f
                tl.debug_barrier()  # the list overwrites entries <= c of mp, in place: every thread has read first
                npos_before = npos
                npos, key_min, key_max = mp_key_range(mp, cok, npos, key_min, key_max)
                append_positive(mp, c, cok, mp_ptr, ck_ptr, mp_unit, npos_before)
            tl.debug_barrier()  # the lists are read back by other threads of this program
        select_kept(mp_ptr, mp_unit, ncand_u, tl.max(ncand_u, axis=0), npos, bt_ptr,
                    req.to(tl.int64) * sbt_n + 0 * slot_u, sel_idx_ptr, sel_blk_ptr, sel_bias_ptr,
                    slot_u * ssel_n + hs * ssel_h, sel_cap, count_ptr, slot_u * scnt_n + hs, topk, inv_sigma, npos,
                    key_min, key_max, ck_ptr,
                    QT=QT, TS=TS, NPIV=NPIV, HAS_TOPK=HAS_TOPK, EST_DIAG=EST_DIAG, PS=PS, BS=BS, ONE_TILE=False,
                    X_IN_REGS=False, TC=TS, LIST=True)


def route_wave_recompute(q: torch.Tensor, cache: PagedKVCache, block_table: torch.Tensor,
                         cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, params: DashParams, plan: PrefillPlan,
                         scratch: PrefillScratch, tile0: int, tiles: int) -> None:
    """``prefill.route_wave`` with recomputed scores: the same outputs in ``scratch`` (its ``scores``
    buffer is not used)."""
    t, hq, d = q.shape
    hkv = cache.num_kv_heads
    shared = params.router == "shared"
    s, summ, bt = scratch, cache.summaries, block_table
    cx = _route_constexprs(plan.qt, hq, hkv, d, plan.max_cand, params)
    for name in ("NH_PAD", "TC"):
        cx.pop(name)
    _prefill_route_recompute_kernel[(tiles, 1 if shared else hkv)](
        q, q.stride(0), q.stride(1), summ, summ.stride(0), summ.stride(1), bt, bt.stride(0),
        cu_seqlens_q, seq_lens, plan.tile_req, plan.tile_off, tile0, seq_lens.shape[0], bt.shape[1] * cache.page_size,
        t, s.mp, s.mp.stride(0), s.mp.stride(1), s.mp_cand,
        s.sel_idx, s.sel_blk, s.sel_bias, s.sel_idx.stride(0), s.sel_idx.stride(1), s.sel_idx.shape[2],
        s.sel_count, s.sel_count.stride(0),
        params.scaling_factor, 0.5 / math.sqrt(d), hq // hkv, hkv, params.topk if params.topk is not None else 0,
        1.0 / params.sigma, PS=cache.page_size, **cx, num_warps=ROUTE_WARPS,
    )
