"""Prefill routing: scores of each tile's tokens against their candidates' summaries, 1.5-entmax, the top-k cap
and the prior, into the wave's scratch (``plan.PrefillScratch``).

``_prefill_route_kernel``, grid ``(W, Hkv)`` (``(W, 1)`` for router ``shared``): scores of the tile's tokens
against every candidate summary (``tl.dot``, read through the page table) into the scratch, then
``routing.route_tile`` with the tile's tokens as units: the one routing routine of decode (here writing each unit's
positive ``mp`` as a list, which the ``topk`` cap and the compaction read instead of every candidate).

With router ``kv_head`` on long block tables (``recompute_routing``) no score is stored: each of the five passes
computes the scores again from a copy of the request's summaries in candidate order (``gather_summaries``, one launch
per call), with ``route_tile``'s arithmetic (``_route_recompute``). On short ones, every candidate in one score tile
(``scores_in_registers``), none is stored either: the tile's scores stay in registers for the entmax and the cap
(``route_in_registers``), and where the Triton attention attends the wave its launch routes the tiles itself
(``route_fused``): no route launch.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ...layout import PagedKVCache
from ...params import DashParams
from ..common import block_page, cdiv, pow2, scaled_query, summary_index, summary_scores, tma_supported
from ..launcher import bind_launch, cached_launch
from ..routing import INF_BITS, append_positive, halley_step, mp_key_range, positive_part, route_tile, select_kept
from . import gluon
from .config import PrefillConfig
from .tiles import tile_bounds, tile_rows, wave_tile

# The Halley passes count the entries above tau as a sum of min(x - tau, COUNT_UNIT): exactly COUNT_UNIT (the
# smallest normal fp32) each, times 2^126 at the end; two instructions an entry instead of about three for a compare,
# a select and an integer sum. Only an entry above tau by a subnormal (both under about 2^-102) counts as less.
COUNT_UNIT = tl.constexpr(2.0 ** -126)


@cached_launch
@triton.jit(do_not_specialize=["max_tokens", "HKV", "cs_req"])
def _gather_summaries_kernel(summ_ptr, ss_b, ss_h, bt_ptr, sbt_n, seq_lens_ptr, max_tokens, cs_ptr, cs_req, HKV,
                             D: tl.constexpr, BS: tl.constexpr, PS: tl.constexpr, CB: tl.constexpr):
    """Grid ``(n, cdiv(max_cand, CB))``: program (i, b) copies the summaries of request i's complete blocks
    ``b CB .. b CB + CB - 1`` (every KV head, read through the page table) to rows ``i cs_req + c`` of the copy
    ``[n cs_req, Hkv D]``; rows of blocks not complete are zeroed: a route pass's last TMA box reads rows past a
    tile's candidates (these, or the next request's summaries) and adds ``-inf`` to their scores, which must be
    finite to give ``-inf``."""
    i = tl.program_id(0)
    c = tl.program_id(1) * CB + tl.arange(0, CB)
    offs_d = tl.arange(0, D)
    length = tl.maximum(tl.minimum(tl.load(seq_lens_ptr + i).to(tl.int32), max_tokens), 0)
    cm = c < length // BS
    page, _ = block_page(bt_ptr + i.to(tl.int64) * sbt_n, c, PS, BS, mask=cm)
    src = summ_ptr + summary_index(page, c, PS, BS)[:, None] * ss_b + offs_d[None, :]
    dst = cs_ptr + (i.to(tl.int64) * cs_req + c)[:, None] * (HKV * D) + offs_d[None, :]
    for h in range(HKV):
        tl.store(dst + h * D, tl.load(src + h * ss_h, mask=cm[:, None], other=0.0), mask=(c < cs_req)[:, None])


def _copy_source(cache: PagedKVCache, block_table: torch.Tensor, seq_lens: torch.Tensor) -> tuple:
    """What a summary copy is made from (addresses; read on the host, no sync)."""
    return cache.summaries.data_ptr(), block_table.data_ptr(), seq_lens.data_ptr()


def gather_summaries(cache: PagedKVCache, block_table: torch.Tensor, seq_lens: torch.Tensor, params: DashParams,
                     scratch) -> None:
    """Copy each request's summaries in candidate order into ``scratch.summary_copy [n, max_cand, Hkv, D]`` (one
    launch), once per call before its route launches; nothing where the scratch has no copy."""
    copy = scratch.summary_copy
    if copy is None:
        return
    summ = cache.summaries
    n, max_cand, hkv, d = copy.shape
    scratch.copied_from = _copy_source(cache, block_table, seq_lens)
    cb = 32
    _gather_summaries_kernel[(n, cdiv(max_cand, cb))](
        summ, summ.stride(0), summ.stride(1), block_table, block_table.stride(0), seq_lens,
        block_table.shape[1] * cache.page_size, copy, max_cand, hkv, D=d, BS=params.block_size, PS=cache.page_size,
        CB=cb, num_warps=4)


@triton.jit
def _scaled_queries(q_ptr, sq_t, sq_h, tok_m, heads, row_ok, sf, offs_d):
    """``sf * q`` of the rows (token ``tok_m``, query head ``heads``), rounded to the query dtype
    (docs/semantics.md section 4); zero rows where not ``row_ok``."""
    q = tl.load(q_ptr + tok_m[:, None] * sq_t + heads[:, None] * sq_h + offs_d[None, :], mask=row_ok[:, None],
                other=0.0)
    return scaled_query(q, sf)


@triton.jit
def _products_from_copy(qs, cs_ptr, cs_desc, cs_row0, h, c0, ncand, offs_d, D: tl.constexpr, HKV: tl.constexpr,
                        BLOCK_N: tl.constexpr, CS_TMA: tl.constexpr, LAST: tl.constexpr):
    """``([M, BLOCK_N] fp32 products <qs, s>, candidates [BLOCK_N])`` of query rows ``qs [M, D]`` against candidates
    ``c0 .. c0 + BLOCK_N - 1`` of the summary copy (``gather_summaries``: candidate c of KV head h at row ``cs_row0 +
    c``, column ``h D``); the score is the product times ``x_scale``, which the caller folds into its first use (one
    FMA an entry: ``<qs, s> x_scale - tau``). LAST: a pass's last tile, which may end past ``ncand``: ``-inf``
    there (the tiles before it need no select an entry); rows are the caller's to mask. CS_TMA: a box of
    ``cs_desc``, else pointer loads (both at addresses of the loop index only, so the loads pipeline)."""
    c = c0 + tl.arange(0, BLOCK_N)
    if CS_TMA:
        summ = cs_desc.load([(cs_row0 + c0).to(tl.int32), h * D])
    else:
        summ = tl.load(cs_ptr + (cs_row0 + c)[:, None] * (HKV * D) + h * D + offs_d[None, :],
                       mask=(c < ncand)[:, None], other=0.0)
    acc = tl.dot(qs, tl.trans(summ))
    if LAST:
        acc = tl.where(tl.arange(0, BLOCK_N)[None, :] < ncand - c0, acc, float("-inf"))
    return acc, c


@triton.jit
def _column_classes(v, SUM: tl.constexpr):
    """``[M, 4]``: the sum (SUM) or maximum of each row of ``v [M, N]`` (N a multiple of 8) over the columns of each
    class ``(c // 2) % 4``. On the MMA accumulator's layout each class of a row lies in one thread, so a pass
    reduces its tiles within threads and across them once at its end."""
    M: tl.constexpr = v.shape[0]
    N: tl.constexpr = v.shape[1]
    by_class = tl.reshape(tl.permute(tl.reshape(v, [M, N // 8, 4, 2]), (0, 2, 1, 3)), [M, 4, N // 4])
    if SUM:
        return tl.sum(by_class, axis=2)
    else:
        return tl.max(by_class, axis=2)


@triton.jit
def _halley_tile(acc, x_scale, tau, ssq, sdf, cnt):
    """``halley_sums`` of the scores ``acc x_scale`` of a tile above ``tau [M]``, added by column class
    (``_column_classes``) to ``ssq, sdf, cnt [M, 4]``; ``x - tau`` in one FMA an entry."""
    diff = positive_part(acc * x_scale - tau[:, None])
    return (ssq + _column_classes(diff * diff, True), sdf + _column_classes(diff, True),
            cnt + _column_classes(tl.minimum(diff, COUNT_UNIT), True))


@triton.jit
def _group_sums_tile(acc, x_scale, tau, dst, ok, QT: tl.constexpr, G_PAD: tl.constexpr, PAIRED: tl.constexpr):
    """Store at ``dst [QT, N]`` (where ``ok``) each unit's sum over its ``G_PAD`` rows of ``(x - tau)^2`` over
    ``tau`` (the mp pass; the scores ``acc x_scale`` of a tile, ``x - tau`` in one FMA an entry; rows in
    ``tiles.tile_rows``' order)."""
    diff = positive_part(acc * x_scale - tau[:, None])
    N: tl.constexpr = acc.shape[1]
    if G_PAD == 1:  # rows are units (the reshape below gave wrong selections compiled: H200, triton 3.6)
        msum = diff * diff
    elif PAIRED:  # row 16 w + 8 h + L g_hi + i_lo: token w L + i_lo, head 2 g_hi + h
        by_row = tl.reshape(diff * diff, [4, 2, G_PAD // 2, 16 // G_PAD, N])
        msum = tl.sum(tl.reshape(tl.permute(by_row, (0, 3, 2, 1, 4)), [QT, G_PAD, N]), axis=1)
    else:
        msum = tl.sum(tl.reshape(diff * diff, [QT, G_PAD, N]), axis=1)
    tl.store(dst, msum, mask=ok)


@triton.jit
def _route_recompute(q_ptr, sq_t, sq_h, tok_m, u_m, g_m, row_ok, unit_ok, h, G, sf, x_scale, ncand, req, slot0,
                     cs_ptr, cs_desc, cs_req, bt_ptr, sbt_n, x_ptr, sx_n, sx_h, mp_ptr, smp_n, smp_h, ck_ptr,
                     sel_idx_ptr, sel_blk_ptr, sel_bias_ptr, ssel_n, ssel_h, sel_cap, count_ptr, scnt_n,
                     topk, inv_sigma, QT: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                     PS: tl.constexpr, BLOCK_N: tl.constexpr, TS: tl.constexpr, NPIV: tl.constexpr,
                     HAS_TOPK: tl.constexpr, EST_DIAG: tl.constexpr, TL: tl.constexpr, CS_TMA: tl.constexpr,
                     HKV: tl.constexpr, STAGE_Q: tl.constexpr, PAIRED: tl.constexpr):
    """Route a tile's ``QT`` units (token, KV head h) with no score scratch: each of five passes over the
    candidates (row maxima, the three Halley steps, mp with its lists) computes the scores again from the
    summary copy (``_products_from_copy``); the same entmax arithmetic as ``route_tile`` (``halley_step``,
    ``append_positive``; ``halley_sums``' sums, accumulated by column class and reduced once a pass), then its cap
    and compaction (``select_kept``). Rows not ``row_ok`` (zero queries) are left out of the sums and the mp by a
    threshold of ``+inf``; their maxima are set to 0 so that their steps stay finite. The mp pass writes the sum
    of each unit's probabilities over its group (G times its mp) by candidate into the scores' storage (unit u at
    ``x_ptr + slot u * sx_n + h * sx_h``; no score is stored on this path), and a second pass reads them back to
    divide by G and build the lists: there the scan that numbers a tile's positive entries runs on a plain layout,
    not on the MMA's (far fewer instructions).
    STAGE_Q: the scaled queries go through the units' mp rows (free until the lists are written) and are loaded
    back, so that the MMAs read them from shared memory; computed in registers, Triton reloads them into registers
    for every score tile."""
    M: tl.constexpr = QT * G_PAD
    offs_d = tl.arange(0, D)
    qs = _scaled_queries(q_ptr, sq_t, sq_h, tok_m, h * G + g_m, row_ok, sf, offs_d)
    if STAGE_Q:  # row (u, g) at element g * D of unit u's mp row, read as the query dtype
        per: tl.constexpr = 32 // qs.dtype.primitive_bitwidth  # query elements an fp32 entry holds
        q_rows = (mp_ptr.to(tl.pointer_type(qs.dtype), bitcast=True)
                  + per * ((slot0 + u_m) * smp_n + h * smp_h) + g_m * D)
        tl.store(q_rows[:, None] + offs_d[None, :], qs)
        tl.debug_barrier()  # loaded back by other threads of this program
        qs = tl.load(q_rows[:, None] + offs_d[None, :])
    cs_row0 = req.to(tl.int64) * cs_req
    # Each pass runs its whole tiles, then the one that ends past ncand, if any. Row maxima of the products:
    # x_scale > 0 and rounding is monotone, so their maximum times x_scale is the scores' maximum, bit for bit.
    n_full = ncand // BLOCK_N * BLOCK_N
    m4 = tl.full([M, 4], float("-inf"), tl.float32)
    for c0 in range(0, n_full, BLOCK_N):
        acc, _c = _products_from_copy(qs, cs_ptr, cs_desc, cs_row0, h, c0, ncand, offs_d, D, HKV, BLOCK_N, CS_TMA,
                                      False)
        m4 = tl.maximum(m4, _column_classes(acc, False))
    if n_full < ncand:
        acc, _c = _products_from_copy(qs, cs_ptr, cs_desc, cs_row0, h, n_full, ncand, offs_d, D, HKV, BLOCK_N,
                                      CS_TMA, True)
        m4 = tl.maximum(m4, _column_classes(acc, False))
    m = tl.max(m4, axis=1) * x_scale
    m = tl.where(row_ok & (ncand > 0), m, 0.0)
    lo = m - 1.0
    hi = m
    tau = (lo + hi) * 0.5
    tau_r = tl.where(row_ok, tau, float("inf"))  # the threshold the sums use: nothing above it on rows not ok
    for _ in tl.static_range(3):
        ssq = tl.zeros([M, 4], tl.float32)
        sdf = tl.zeros([M, 4], tl.float32)
        cnt = tl.zeros([M, 4], tl.float32)
        for c0 in range(0, n_full, BLOCK_N):
            acc, _c = _products_from_copy(qs, cs_ptr, cs_desc, cs_row0, h, c0, ncand, offs_d, D, HKV, BLOCK_N,
                                          CS_TMA, False)
            ssq, sdf, cnt = _halley_tile(acc, x_scale, tau_r, ssq, sdf, cnt)
        if n_full < ncand:
            acc, _c = _products_from_copy(qs, cs_ptr, cs_desc, cs_row0, h, n_full, ncand, offs_d, D, HKV, BLOCK_N,
                                          CS_TMA, True)
            ssq, sdf, cnt = _halley_tile(acc, x_scale, tau_r, ssq, sdf, cnt)
        tau, lo, hi = halley_step(tl.sum(ssq, axis=1), tl.sum(sdf, axis=1), tl.sum(cnt, axis=1) * (1.0 / COUNT_UNIT),
                                  tau, lo, hi)
        tau_r = tl.where(row_ok, tau, float("inf"))

    slot_u = slot0 + tl.arange(0, QT)
    ncand_u = tl.where(unit_ok, ncand, 0)
    mp_unit = slot_u * smp_n + h * smp_h
    mp_dense = x_ptr + (slot_u * sx_n + h * sx_h)[:, None]
    inv_g = 1.0 / (G * 1.0)  # the mean over the group is a multiply
    for c0 in range(0, n_full, BLOCK_N):
        acc, c = _products_from_copy(qs, cs_ptr, cs_desc, cs_row0, h, c0, ncand, offs_d, D, HKV, BLOCK_N, CS_TMA,
                                     False)
        _group_sums_tile(acc, x_scale, tau_r, mp_dense + c[None, :], unit_ok[:, None], QT, G_PAD, PAIRED)
    if n_full < ncand:
        acc, c = _products_from_copy(qs, cs_ptr, cs_desc, cs_row0, h, n_full, ncand, offs_d, D, HKV, BLOCK_N,
                                     CS_TMA, True)
        _group_sums_tile(acc, x_scale, tau_r, mp_dense + c[None, :], c[None, :] < ncand_u[:, None], QT, G_PAD,
                         PAIRED)
    tl.debug_barrier()  # the group sums are read back by other threads of this program
    npos = tl.zeros([QT], tl.int32)
    key_min = tl.full([QT], INF_BITS, tl.int32)
    key_max = tl.zeros([QT], tl.int32)
    # Each tile's group sums are loaded one iteration ahead: loaded where they are used, the multiplies wait for
    # them.
    offs_l = tl.arange(0, TL)
    sums = tl.load(mp_dense + offs_l[None, :], mask=offs_l[None, :] < ncand_u[:, None], other=0.0)
    for c0 in range(0, ncand, TL):
        c = c0 + offs_l
        cok = c[None, :] < ncand_u[:, None]
        mp = sums * inv_g  # the mean over the group
        sums = tl.load(mp_dense + (c + TL)[None, :], mask=(c + TL)[None, :] < ncand_u[:, None], other=0.0)
        npos_before = npos
        npos, key_min, key_max = mp_key_range(mp, cok, npos, key_min, key_max)
        append_positive(mp, c, cok, mp_ptr, ck_ptr, mp_unit, npos_before)
    tl.debug_barrier()  # the lists are read back by other threads of this program
    select_kept(mp_ptr, mp_unit, ncand_u, tl.max(ncand_u, axis=0), npos, bt_ptr,
                req.to(tl.int64) * sbt_n + 0 * slot_u, sel_idx_ptr, sel_blk_ptr, sel_bias_ptr,
                slot_u * ssel_n + h * ssel_h, sel_cap,
                count_ptr, slot_u * scnt_n + h, topk, inv_sigma, npos, key_min, key_max, ck_ptr,
                QT=QT, TS=TS, NPIV=NPIV, HAS_TOPK=HAS_TOPK, EST_DIAG=EST_DIAG, PS=PS, BS=BS, ONE_TILE=False,
                X_IN_REGS=False, TC=BLOCK_N, LIST=True, TL=TL)


@cached_launch
@triton.jit(do_not_specialize=["tile0", "n", "max_tokens", "num_tokens", "G", "HKV", "topk", "sel_cap"])
def _prefill_route_kernel(
    q_ptr, sq_t, sq_h, summ_ptr, ss_b, ss_h, cs_ptr, cs_desc, bt_ptr, sbt_n,
    cu_ptr, seq_lens_ptr, tile_req_ptr, tile_off_ptr, tile0, n, max_tokens, num_tokens,
    x_ptr, sx_n, sx_h, mp_ptr, smp_n, smp_h, ck_ptr,
    sel_idx_ptr, sel_blk_ptr, sel_bias_ptr, ssel_n, ssel_h, sel_cap, count_ptr, scnt_n,
    sf, x_scale, G, HKV, topk, inv_sigma, cs_req,
    QT: tl.constexpr, G_PAD: tl.constexpr, NH_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    PS: tl.constexpr, LOCAL_BLOCKS: tl.constexpr, BLOCK_N: tl.constexpr, TC: tl.constexpr, TS: tl.constexpr,
    NPIV: tl.constexpr, HAS_TOPK: tl.constexpr, EST_DIAG: tl.constexpr, SHARED: tl.constexpr, TL: tl.constexpr,
    RECOMPUTE: tl.constexpr = False, CS_TMA: tl.constexpr = False, HKV_C: tl.constexpr = 1,
    STAGE_Q: tl.constexpr = False, X_REGS: tl.constexpr = False, LAST_FIRST: tl.constexpr = False,
):
    """Grid ``(W, Hkv)`` (router ``kv_head``) or ``(W, 1)`` (``shared``): program (w, h) routes tile
    ``tile0 + w``.

    Scores: ``[QT * G_PAD, D]`` rows of ``sf * q`` (rounded to the query dtype) against ``[BLOCK_N, D]``
    summaries per step, ``x = 0.5 <sf q, s> / sqrt(D)`` fp32 into ``x [slot, Hq, row]`` (``_row``) with
    slot ``w * QT + u`` for the tile's token u. Then ``route_tile`` with ``QT`` units: (token, KV head
    h) of G rows (``kv_head``) or token of ``Hq`` rows (``shared``, all KV heads scored by this
    program), writing each unit's positive ``mp`` as a list (``mp`` and its candidates in ``ck``, shaped and
    strided like mp), the kept blocks ``sel_* [slot, Hsel, cap]`` and ``count [slot, Hsel]``.
    RECOMPUTE (``kv_head``): no score is stored; ``_route_recompute`` computes them in each pass from the summary
    copy (``cs_ptr``, rows of request r from ``r cs_req``; ``cs_desc`` its TMA descriptor where CS_TMA; ``HKV_C``
    is ``HKV`` as a constexpr, the copy's row length in heads), and ``x`` holds each unit's sum of probabilities
    over its group (G times its mp) by candidate, in row h of its slot, for the lists. Otherwise the three copy
    arguments are unused placeholders.
    X_REGS (``kv_head``, every candidate in one score tile: ``scores_in_registers``): no score is stored; the
    entmax runs on the tile's scores in registers, mp is stored by candidate (no lists) and the cap's keys stay in
    registers (``route_in_registers``).
    LAST_FIRST: program w routes tile ``W - 1 - w`` instead (``PrefillConfig.last_tiles_first``).
    """
    w = wave_tile(LAST_FIRST)
    hp = tl.program_id(1)
    req, ok, tok_base, a0, p_lo, p_hi, first_local, ncand = tile_bounds(
        tile0 + w, n, tile_req_ptr, tile_off_ptr, cu_ptr, seq_lens_ptr, max_tokens, QT, BS, LOCAL_BLOCKS)
    if p_lo < p_hi:  # tiles past the last one do nothing
        M: tl.constexpr = QT * G_PAD
        PAIRED: tl.constexpr = RECOMPUTE and M == 64 and G_PAD >= 2  # the summary copy's mp pass sums heads
        u_m, g_m, pos_m, tok_m, in_m, unit_ok = tile_rows(a0, p_lo, p_hi, tok_base, num_tokens, ok, G, QT, G_PAD,
                                                           PAIRED)
        row_ok = in_m & ok
        slot0 = w.to(tl.int64) * QT
        if RECOMPUTE:
            tl.static_assert(not SHARED, "the summary copy serves one KV head's rows")
            _route_recompute(q_ptr, sq_t, sq_h, tok_m, u_m, g_m, row_ok, unit_ok, hp, G, sf, x_scale, ncand, req, slot0,
                             cs_ptr, cs_desc, cs_req, bt_ptr, sbt_n, x_ptr, sx_n, sx_h, mp_ptr, smp_n, smp_h, ck_ptr,
                             sel_idx_ptr, sel_blk_ptr, sel_bias_ptr, ssel_n, ssel_h, sel_cap, count_ptr, scnt_n,
                             topk, inv_sigma, QT, G_PAD, D, BS, PS, BLOCK_N, TS, NPIV, HAS_TOPK, EST_DIAG, TL,
                             CS_TMA, HKV_C, STAGE_Q, PAIRED)
        elif X_REGS:  # router kv_head: every candidate in one [M, BLOCK_N] tile (rows u G_PAD + g)
            tl.static_assert(not SHARED and NH_PAD == G_PAD and TC == BLOCK_N,
                             "X_REGS: router kv_head, one score tile of TC candidates")
            route_in_registers(q_ptr, sq_t, sq_h, summ_ptr, ss_b, ss_h, bt_ptr, sbt_n, mp_ptr, smp_n, smp_h, ck_ptr,
                               sel_idx_ptr, sel_blk_ptr, sel_bias_ptr, ssel_n, ssel_h, sel_cap, count_ptr, scnt_n, 1,
                               sf, x_scale, G, topk, inv_sigma, req, hp, slot0, tok_m, g_m, row_ok, unit_ok, ncand,
                               QT, G_PAD, D, BS, PS, BLOCK_N, TS, NPIV, HAS_TOPK, EST_DIAG, TL)
        else:
            _route_stored(q_ptr, sq_t, sq_h, summ_ptr, ss_b, ss_h, bt_ptr, sbt_n, x_ptr, sx_n, sx_h, mp_ptr, smp_n,
                          smp_h, ck_ptr, sel_idx_ptr, sel_blk_ptr, sel_bias_ptr, ssel_n, ssel_h, sel_cap, count_ptr,
                          scnt_n, sf, x_scale, G, HKV, topk, inv_sigma, req, hp, slot0, u_m, g_m, tok_m, row_ok,
                          unit_ok, ncand, QT, G_PAD, NH_PAD, D, BS, PS, BLOCK_N, TC, TS, NPIV, HAS_TOPK, EST_DIAG,
                          SHARED, TL)


@triton.jit
def _route_stored(q_ptr, sq_t, sq_h, summ_ptr, ss_b, ss_h, bt_ptr, sbt_n, x_ptr, sx_n, sx_h, mp_ptr, smp_n, smp_h,
                  ck_ptr, sel_idx_ptr, sel_blk_ptr, sel_bias_ptr, ssel_n, ssel_h, sel_cap, count_ptr, scnt_n,
                  sf, x_scale, G, HKV, topk, inv_sigma, req, hp, slot0, u_m, g_m, tok_m, row_ok, unit_ok, ncand,
                  QT: tl.constexpr, G_PAD: tl.constexpr, NH_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                  PS: tl.constexpr, BLOCK_N: tl.constexpr, TC: tl.constexpr, TS: tl.constexpr, NPIV: tl.constexpr,
                  HAS_TOPK: tl.constexpr, EST_DIAG: tl.constexpr, SHARED: tl.constexpr, TL: tl.constexpr):
    """Route the ``QT`` tokens of a tile from stored scores (``_prefill_route_kernel`` without RECOMPUTE or X_REGS):
    score KV head ``hp`` (every KV head where SHARED) into ``x``, then ``route_tile`` reads them back in tiles of
    ``TC`` candidates for each entmax pass; the units' positive ``mp`` go to lists."""
    M: tl.constexpr = QT * G_PAD
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    bt_row = bt_ptr + req.to(tl.int64) * sbt_n
    x_tok = x_ptr + (slot0 + u_m) * sx_n
    mx = tl.full([M], float("-inf"), tl.float32)
    if SHARED:
        h_lo = 0
        h_hi = HKV
    else:
        h_lo = hp
        h_hi = hp + 1
    for h in range(h_lo, h_hi):
        heads = h * G + g_m
        qs = _scaled_queries(q_ptr, sq_t, sq_h, tok_m, heads, row_ok, sf, offs_d)
        x_rows = x_tok + heads.to(tl.int64) * sx_h
        mx = tl.full([M], float("-inf"), tl.float32)
        for c0 in range(0, ncand, BLOCK_N):
            c = c0 + offs_n
            cm = c < ncand
            x = summary_scores(qs, bt_row, summ_ptr, ss_b, h, ss_h, c, cm, x_scale, offs_d, PS, BS)
            tl.store(x_rows[:, None] + c[None, :], x, mask=row_ok[:, None] & cm[None, :])
            mx = tl.maximum(mx, tl.max(tl.where(cm[None, :], x, float("-inf")), axis=1))
    tl.debug_barrier()  # the scores are read back by other threads of this program

    ncand_u = tl.where(unit_ok, ncand, 0)
    slot_u = slot0 + tl.arange(0, QT)
    nrows = G + 0 * ncand  # a tensor even when G == 1 is passed as a constant
    if SHARED:
        nrows = nrows * HKV
        # row maxima over all Hq heads: one pass over the stored scores
        offs_r = tl.arange(0, NH_PAD)
        offs_c = tl.arange(0, TC)
        rows = x_ptr + slot_u[:, None, None] * sx_n + offs_r[None, :, None].to(tl.int64) * sx_h
        m = tl.full([QT, NH_PAD], float("-inf"), tl.float32)
        for c0 in range(0, ncand, TC):
            c = c0 + offs_c
            okc = unit_ok[:, None, None] & (offs_r[None, :, None] < nrows) & (c[None, None, :] < ncand)
            m = tl.maximum(m, tl.max(tl.load(rows + c[None, None, :], mask=okc, other=float("-inf")), axis=2))
        x_unit = slot_u * sx_n
        hs = 0
    else:
        m = tl.reshape(mx, [QT, G_PAD])
        x_unit = slot_u * sx_n + hp * G * sx_h
        hs = hp
    r_ok = tl.arange(0, NH_PAD) < nrows
    m = tl.where(unit_ok[:, None] & r_ok[None, :] & (ncand > 0), m, 0.0)
    route_tile(
        x_ptr, x_unit, sx_h, nrows, ncand_u, m,
        mp_ptr, slot_u * smp_n + hs * smp_h, ck_ptr, bt_ptr, req.to(tl.int64) * sbt_n + 0 * slot_u,
        sel_idx_ptr, sel_blk_ptr, sel_bias_ptr, slot_u * ssel_n + hs * ssel_h, sel_cap,
        count_ptr, slot_u * scnt_n + hs, topk, inv_sigma,
        QT=QT, NH_PAD=NH_PAD, TC=TC, TS=TS, NPIV=NPIV, HAS_TOPK=HAS_TOPK, EST_DIAG=EST_DIAG, PS=PS, BS=BS,
        ONE_TILE=False,  # QT units' mp of every candidate would not fit in registers
        LIST=True, TL=TL,
    )


@triton.jit
def route_in_registers(q_ptr, sq_t, sq_h, summ_ptr, ss_b, ss_h, bt_ptr, sbt_n, mp_ptr, smp_n, smp_h, ck_ptr,
                       sel_idx_ptr, sel_blk_ptr, sel_bias_ptr, ssel_n, ssel_h, sel_cap, count_ptr, scnt_n, scnt_h,
                       sf, x_scale, G, topk, inv_sigma, req, h, slot0, tok_m, g_m, row_ok, unit_ok, ncand,
                       QT: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, PS: tl.constexpr,
                       BLOCK_N: tl.constexpr, TS: tl.constexpr, NPIV: tl.constexpr, HAS_TOPK: tl.constexpr,
                       EST_DIAG: tl.constexpr, TL: tl.constexpr):
    """Route the ``QT`` tokens of a tile for KV head h (router ``kv_head``) with every candidate in one
    ``[QT * G_PAD, BLOCK_N]`` score tile (``scores_in_registers``): the scores stay in registers for the entmax and
    the cap (``route_tile``'s ONE_TILE with X_IN_REGS), mp is stored by candidate (``mp_ptr``), the kept blocks and
    counts as ``_prefill_route_kernel`` writes them (slot ``slot0 + u``; the count at ``u scnt_n + h scnt_h``).
    Rows (``tiles.tile_rows``): token ``tok_m``, head ``g_m`` of the group, real where ``row_ok``."""
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    cm = offs_n < ncand
    qs = _scaled_queries(q_ptr, sq_t, sq_h, tok_m, h * G + g_m, row_ok, sf, offs_d)
    x = summary_scores(qs, bt_ptr + req.to(tl.int64) * sbt_n, summ_ptr, ss_b, h, ss_h, offs_n, cm, x_scale, offs_d,
                       PS, BS)
    m = tl.reshape(tl.max(tl.where(cm[None, :], x, float("-inf")), axis=1), [QT, G_PAD])
    slot_u = slot0 + tl.arange(0, QT)
    nrows = G + 0 * ncand  # a tensor even when G == 1 is passed as a constant
    m = tl.where(unit_ok[:, None] & (tl.arange(0, G_PAD) < nrows)[None, :] & (ncand > 0), m, 0.0)
    route_tile(
        mp_ptr, slot_u * smp_n, 0, nrows, tl.where(unit_ok, ncand, 0), m,  # (x_ptr, x_unit: unused with X_IN_REGS)
        mp_ptr, slot_u * smp_n + h * smp_h, ck_ptr, bt_ptr, req.to(tl.int64) * sbt_n + 0 * slot_u,
        sel_idx_ptr, sel_blk_ptr, sel_bias_ptr, slot_u * ssel_n + h * ssel_h, sel_cap,
        count_ptr, slot_u * scnt_n + h * scnt_h, topk, inv_sigma,
        QT=QT, NH_PAD=G_PAD, TC=BLOCK_N, TS=TS, NPIV=NPIV, HAS_TOPK=HAS_TOPK, EST_DIAG=EST_DIAG, PS=PS, BS=BS,
        ONE_TILE=True, X_IN_REGS=True, LIST=False, TL=TL, x_regs=tl.reshape(x, [QT, G_PAD, BLOCK_N]),
    )


def recompute_routing(params: DashParams, n: int, max_cand: int, hq: int, hkv: int, d: int, itemsize: int,
                      config: PrefillConfig, route_heads: Optional[int] = None) -> bool:
    """Whether a call routes without a score scratch (``_route_recompute``): router ``kv_head``, no indexer, block
    tables of at least ``recompute_min_cand`` blocks and a summary copy of at most ``config.summary_copy_bytes``."""
    return (may_recompute(params, max_cand, hq // hkv, route_heads, config)
            and n * max_cand * hkv * d * itemsize <= config.summary_copy_bytes)


def recompute_min_cand(group: int, config: PrefillConfig) -> int:
    """The fewest blocks of a block table that route from the summary copy, for ``group`` query heads per KV head:
    half as many from ``config.recompute_wide_group`` heads, where the copy is faster on shorter tables."""
    full = config.recompute_min_candidates
    return full // 2 if group >= config.recompute_wide_group else full


def may_recompute(params: DashParams, max_cand: int, group: int, route_heads: Optional[int],
                  config: PrefillConfig) -> bool:
    """Whether block tables of ``max_cand`` candidates route from a summary copy, its size aside."""
    return (params.router != "shared" and route_heads is None
            and max_cand >= recompute_min_cand(group, config))


def route_block_n(d: int, max_cand: int, config: PrefillConfig) -> int:
    """Candidates of one score tile of the route kernel."""
    tile = config.route_score_tile if d <= 128 else config.route_score_tile // 2
    return max(16, min(tile, pow2(max_cand)))


def summary_copy_descriptor(copy: torch.Tensor, config: PrefillConfig) -> Optional[TensorDescriptor]:
    """A TMA descriptor of the route kernel's score tiles over the summary copy ``[n, max_cand, Hkv, D]``, where
    TMA serves (``config.copy_tma``, Hopper and later), else None."""
    if not (config.copy_tma and tma_supported(copy.device)):
        return None
    n, max_cand, hkv, d = copy.shape
    flat = copy.view(n * max_cand, hkv * d)
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [route_block_n(d, max_cand, config), d])


def registers_block_n(max_cand: int) -> int:
    """Candidates of the one score tile of the route kernel with the scores in registers."""
    return max(16, pow2(max_cand))


def scores_in_registers(qt: int, hq: int, hkv: int, d: int, max_cand: int, params: DashParams,
                        config: PrefillConfig) -> bool:
    """Whether the route kernel keeps a tile's scores in registers (``X_REGS``: no score scratch, and the cap's
    keys in registers too): ``config.route_registers``, router ``kv_head``, at least two query heads a KV head, and
    every candidate in one ``[QT x G, candidates]`` score tile within ``config.route_regs_budget`` (a quarter of it
    above D 128, whose summary and query tiles are twice as wide): block tables up to 8k tokens at block size 64.
    With one query head a KV head the keys, made in registers from a ``[QT, 1, TC]`` tile, are held by several
    threads each, and the compiled cap finds the wrong threshold (Triton 3.6, sm_90; the same miscompile as
    ``routing.RADIX_MIN_KEYS`` guards); loaded from the scratch they give the right one."""
    budget = config.route_regs_budget if d <= 128 else config.route_regs_budget // 4
    return (config.route_registers and params.router != "shared" and hq // hkv >= 2
            and qt * pow2(hq // hkv) * registers_block_n(max_cand) <= budget)


def _route_constexprs(qt: int, hq: int, hkv: int, d: int, max_cand: int, params: DashParams,
                      config: PrefillConfig, x_regs: bool) -> dict:
    g = hq // hkv
    shared = params.router == "shared"
    nh_pad = pow2(hq) if shared else pow2(g)
    if x_regs:  # one score tile; the cap's keys in one [QT, TC] tile: fewer pivots keep [QT, NPIV, TC] in its budget
        block_n = tc = ts = registers_block_n(max_cand)
        npiv = max(1, min(config.route_pivots, config.route_pivot_budget // (qt * tc)))
    else:
        block_n = route_block_n(d, max_cand, config)
        tc = max(16, min(pow2(max_cand), config.route_tile_budget // (qt * nh_pad)))
        ts = max(1, min(pow2(max_cand), config.route_pivot_budget // (config.route_pivots * qt)))
        npiv = config.route_pivots
    return dict(
        QT=qt, G_PAD=pow2(g), NH_PAD=nh_pad, D=d, BS=params.block_size, LOCAL_BLOCKS=params.local_blocks,
        BLOCK_N=block_n, TC=tc, TS=ts, TL=max(1, min(pow2(max_cand), config.route_list_budget // qt)),
        NPIV=npiv, HAS_TOPK=params.cap_binds(max_cand), EST_DIAG=params.estimate_diagonal, SHARED=shared, X_REGS=x_regs,
    )


def routes_in_registers(q: torch.Tensor, hkv: int, params: DashParams, plan, scratch) -> bool:
    """Whether the tiles of ``plan`` route from their scores in registers (``scores_in_registers``) with no summary
    copy in ``scratch``: ``route_in_registers``, which stores every candidate's ``mp`` (``q``: the queries that
    route)."""
    return scratch.summary_copy is None and scores_in_registers(plan.qt, q.shape[1], hkv, q.shape[2], plan.max_cand,
                                                                params, plan.config)


def route_fused(q: torch.Tensor, cache: PagedKVCache, params: DashParams, plan, scratch, tiles: int) -> bool:
    """Whether the attention launch of a wave of ``tiles`` tiles of ``plan`` routes them itself
    (``PrefillConfig.fuse_route``; the attention kernel's ``ROUTE``, ``route_in_registers``): where the route
    kernel would keep the scores in registers (``scores_in_registers``: short tables, router ``kv_head``), with no
    summary copy, and the Triton kernel attends the wave (not ``gluon.attends``: routing in the union launch before
    the Gluon attention takes longer than a route launch before it)."""
    return (plan.config.fuse_route and not gluon.attends(q, cache, params, plan, tiles)
            and routes_in_registers(q, cache.num_kv_heads, params, plan, scratch))


def union_from_mp(q: torch.Tensor, hkv: int, params: DashParams, plan, scratch) -> bool:
    """Whether the attention launches of ``plan`` build each tile's union from its tokens' ``mp`` by candidate
    (``attention._tile_union_from_mp``, ``PrefillConfig.union_from_mp``), not from their kept lists: where the
    routing keeps the scores in registers (``routes_in_registers``: ``route_in_registers`` stores every candidate's
    ``mp``) and no ``topk`` cap can bind (every positive ``mp`` is kept)."""
    return (plan.config.union_from_mp and not params.cap_binds(plan.max_cand)
            and routes_in_registers(q, hkv, params, plan, scratch))


def fused_route_arguments(q: torch.Tensor, hkv: int, params: DashParams, plan, scratch) -> tuple:
    """``(trailing arguments, constexprs)`` of the routing an attention launch runs (``route_fused``), as
    ``bind_route`` would give the route kernel's registers path (the arguments are passed, unused, by a launch
    that does not route)."""
    t, hq, d = q.shape
    s = scratch
    rc = _route_constexprs(plan.qt, hq, hkv, d, plan.max_cand, params, plan.config, True)
    args = (s.mp, s.mp.stride(0), s.mp.stride(1), s.mp_cand, s.sel_blk, s.sel_idx.shape[2], params.scaling_factor,
            0.5 / math.sqrt(d), params.topk if params.topk is not None else 0, 1.0 / params.sigma)
    return args, dict(ROUTE=True, **{k: rc[k] for k in ("BLOCK_N", "TS", "NPIV", "HAS_TOPK", "EST_DIAG", "TL")})


def stages_queries(g: int, q: torch.Tensor, scratch) -> bool:
    """Whether the route kernel stages a program's scaled queries through its units' mp rows (``STAGE_Q`` of
    ``_route_recompute``): where one unit's ``G`` padded query rows fit its mp row."""
    return pow2(g) * q.shape[2] * q.element_size() <= scratch.mp.shape[2] * scratch.mp.element_size()


ROUTE_LEAD = 10  # the route kernel's leading arguments, what a call passes: queries, summaries (or their copy), table


def bind_route(q: torch.Tensor, cache: PagedKVCache, block_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
               seq_lens: torch.Tensor, params: DashParams, plan, scratch, tile0: int, tiles: int):
    """The route launch of tiles ``tile0 .. tile0 + tiles - 1`` of ``plan`` (a ``PrefillPlan``, with its config) into
    ``scratch`` (a ``PrefillScratch``; slot ``w * QT + u``), every argument but the layer's bound: the result routes
    ``(q, cache, block_table)`` of any layer of the step (the shapes of those given here)."""
    t, hq, d = q.shape
    cfg = plan.config
    hkv = cache.num_kv_heads
    g = hq // hkv
    shared = params.router == "shared"
    s = scratch
    ssc, smp, ssel = s.scores.stride(), s.mp.stride(), s.sel_idx.stride()
    copy = s.summary_copy
    recompute = copy is not None
    if not recompute and s.scores.shape[1] < hq:
        raise RuntimeError(f"this scratch has room for {s.scores.shape[1]} score rows per token, not {hq}: it was "
                           "allocated to route from a summary copy (add_summary_copy), which it does not hold")
    if recompute and (s.scores.shape[1] < hkv or s.scores.shape[2] < plan.max_cand):
        raise RuntimeError(f"this scratch's score storage is {tuple(s.scores.shape[1:])} a slot: routing from the "
                           f"summary copy keeps group sums there, {hkv} rows of at least {plan.max_cand}")
    x_regs = routes_in_registers(q, hkv, params, plan, s)
    if recompute:
        launch = dict(num_warps=cfg.recompute_warps, num_stages=cfg.recompute_stages,
                      **({"maxnreg": cfg.recompute_maxnreg} if cfg.recompute_maxnreg else {}))
    else:
        launch = dict(num_warps=cfg.route_regs_warps if x_regs else cfg.route_warps, num_stages=cfg.route_stages)
    kernel = bind_launch(
        _prefill_route_kernel, (tiles, 1 if shared else hkv), ROUTE_LEAD,
        (cu_seqlens_q, seq_lens, plan.tile_req, plan.tile_off, tile0, seq_lens.shape[0],
         block_table.shape[1] * cache.page_size, t, s.scores, ssc[0], ssc[1], s.mp, smp[0], smp[1], s.mp_cand,
         s.sel_idx, s.sel_blk, s.sel_bias, ssel[0], ssel[1], s.sel_idx.shape[2], s.sel_count, s.sel_count.stride(0),
         params.scaling_factor, 0.5 / math.sqrt(d), g, hkv, params.topk if params.topk is not None else 0,
         1.0 / params.sigma, copy.shape[1] if recompute else 0),
        PS=cache.page_size, **_route_constexprs(plan.qt, hq, hkv, d, plan.max_cand, params, cfg, x_regs),
        RECOMPUTE=recompute, CS_TMA=s.summary_desc is not None, HKV_C=hkv,
        STAGE_Q=recompute and stages_queries(g, q, s), LAST_FIRST=cfg.last_tiles_first, **launch)

    def route(q: torch.Tensor, cache: PagedKVCache, block_table: torch.Tensor) -> None:
        summ = cache.summaries
        if recompute and s.copied_from != _copy_source(cache, block_table, seq_lens):
            raise RuntimeError("the summary copy is not this call's: gather_summaries(cache, block_table, seq_lens, "
                               "params, scratch) before the route launches")
        sq, ssum = q.stride(), summ.stride()
        kernel(q, sq[0], sq[1], summ, ssum[0], ssum[1], copy if recompute else summ,
               s.summary_desc if s.summary_desc is not None else summ, block_table, block_table.stride(0))

    return route


def route_wave(q: torch.Tensor, cache: PagedKVCache, block_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
               seq_lens: torch.Tensor, params: DashParams, plan, scratch, tile0: int, tiles: int) -> None:
    """Route tiles ``tile0 .. tile0 + tiles - 1`` of ``plan`` into ``scratch`` (``bind_route``, called once)."""
    bind_route(q, cache, block_table, cu_seqlens_q, seq_lens, params, plan, scratch, tile0, tiles)(q, cache,
                                                                                                    block_table)
