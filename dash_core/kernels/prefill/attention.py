"""Prefill attention: each tile's union of selected blocks, then attention of its query rows over its local
window (causal) and each union block, loading every K/V block once for the tile.

``_prefill_attn_kernel``, grid ``(W, Hkv)``: the union of the tile's selected blocks (built in parallel passes: the
candidates some token kept marked in a table of one int32 a candidate, compacted in increasing order by a scan, then
every token's prior put at its blocks' union positions; on short tables with no cap, in one pass from the tokens'
``mp``), then attention of the ``QT * G`` rows over the local window (causal) and each union block; rows that did
not select a block get ``-inf`` logits there, the others their log prior. Queries of a tile routed to the same block
share the load and the MMA (how much depends on how similar neighbouring tokens' selections are). On Hopper and
later, a union tile of one block is loaded by TMA where the cache's layout allows (``_kv_descriptors``), else by
pointer loads. On Hopper, for the waves ``gluon.attends``, this launch builds the unions only and the Gluon launch
(``gluon.prefill_attn_ws``, several warpgroups a program) runs the attention.
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
from ..common import LOG2E, LOG2E_F, block_page, cdiv, max_or_zero, pow2, raise_max, sm_count, tma_supported
from ..launcher import bind_launch, cached_launch
from ..routing import PRIOR_EPS
from . import gluon
from .config import PrefillConfig
from .route import fused_route_arguments, registers_block_n, route_in_registers, union_from_mp
from .tiles import (INFO_A0, INFO_FIRST_LOCAL, INFO_LAST_LOCAL, INFO_OK, INFO_P_HI, INFO_P_LO, INFO_REQ,
                    INFO_TOK_BASE, tile_bounds, tile_rows, wave_tile)


@triton.jit
def _union_entry(page, c, h, ublk_page, ublk_step, ublk_head, PPB: tl.constexpr):
    """What a union table stores for candidate ``c`` (in page ``page``) of KV head h: ``page ublk_page + (c % PPB)
    ublk_step + h ublk_head`` (its physical block, or for the Gluon launch its first row: ``gluon.union_rows``)."""
    return page * ublk_page + (c % PPB) * ublk_step + h * ublk_head


@triton.jit
def _tile_union(ncand, unit_ok, slot0, h, bt_row, count_ptr, scnt_n, scnt_h, sel_idx_ptr, sel_bias_ptr, ssel_n,
                ssel_h, upos_tile, uprior_row, ublk_row, ublk_page, ublk_step, ublk_head, QT: tl.constexpr,
                TU: tl.constexpr, TJ: tl.constexpr, PS: tl.constexpr, BS: tl.constexpr):
    """Step 1 of ``_prefill_attn_kernel`` for one tile and KV head h: its union's size, its blocks in ``ublk_row``
    (block b of page p as ``p ublk_page + b ublk_step + h ublk_head``) and their priors in ``uprior_row``, in four
    passes through ``upos_tile`` (``[ncand]`` int32 by candidate: 0, then nonzero where a token kept it, then its
    union position plus one). Four bytes a candidate, not a row of ``QT`` priors: a 128k prompt's tiles have about a
    thousand candidates and a union of a few hundred."""
    offs_u = tl.arange(0, QT)
    offs_c = tl.arange(0, TU)
    offs_j = tl.arange(0, TJ)
    sel_u = (slot0 + offs_u) * ssel_n + h * ssel_h
    cnt_u = tl.load(count_ptr + (slot0 + offs_u) * scnt_n + h * scnt_h, mask=unit_ok, other=0)
    nsel = tl.max(cnt_u, axis=0)
    for c0 in range(0, ncand, TU):
        c = c0 + offs_c
        tl.store(upos_tile + c, tl.zeros([TU], tl.int32), mask=c < ncand)
    tl.debug_barrier()  # marked below by other threads
    for j0 in range(0, nsel, TJ):  # each token's kept candidates marked (tokens that share one store the same 1)
        jj = j0 + offs_j
        have = jj[None, :] < cnt_u[:, None]
        idx = tl.load(sel_idx_ptr + sel_u[:, None] + jj[None, :], mask=have, other=0)
        tl.store(upos_tile + idx, tl.full([QT, TJ], 1, tl.int32), mask=have & (idx < ncand))
    tl.debug_barrier()
    nu = 0
    ppb_u: tl.constexpr = PS // BS
    # The marked candidates compacted in increasing order, no token's prior yet; each tile's marks and pages loaded
    # one tile ahead (a tile's stores below touch only its own candidates' marks).
    marks = tl.load(upos_tile + offs_c, mask=offs_c < ncand, other=0)
    pages = tl.load(bt_row + offs_c // ppb_u, mask=offs_c < ncand, other=0)
    for c0 in range(0, ncand, TU):
        c = c0 + offs_c
        kept = marks != 0
        page = pages
        marks = tl.load(upos_tile + c + TU, mask=c + TU < ncand, other=0)
        pages = tl.load(bt_row + (c + TU) // ppb_u, mask=c + TU < ncand, other=0)
        kept_i = kept.to(tl.int32)
        j = nu + tl.cumsum(kept_i, axis=0) - kept_i
        tl.store(ublk_row + j, _union_entry(page, c, h, ublk_page, ublk_step, ublk_head, ppb_u), mask=kept)
        # position plus one: still nonzero for a thread holding a copy of c that loads it after this store
        tl.store(upos_tile + c, j + 1, mask=kept)
        tl.store(uprior_row + j[:, None] * QT + offs_u[None, :], tl.full([TU, QT], float("-inf"), tl.float32),
                 mask=kept[:, None])
        nu += tl.sum(kept_i, axis=0)
    tl.debug_barrier()  # the positions and the -inf rows are read and overwritten below by other threads
    for j0 in range(0, nsel, TJ):  # each token's log2 prior at the union positions of its kept candidates
        jj = j0 + offs_j
        live = (jj[None, :] < cnt_u[:, None])
        idx = tl.load(sel_idx_ptr + sel_u[:, None] + jj[None, :], mask=live, other=0)
        live = live & (idx < ncand)
        b = tl.load(sel_bias_ptr + sel_u[:, None] + jj[None, :], mask=live, other=0.0)
        pos = tl.load(upos_tile + idx, mask=live, other=1) - 1
        tl.store(uprior_row + pos * QT + offs_u[:, None], b * LOG2E, mask=live)
    tl.debug_barrier()  # the union lists are read back by other threads
    return nu


@triton.jit
def _tile_union_from_mp(ncand, unit_ok, slot0, h, bt_row, mp_ptr, smp_n, smp_h, inv_sigma, uprior_row, ublk_row,
                        ublk_page, ublk_step, ublk_head, QT: tl.constexpr, TC: tl.constexpr, PS: tl.constexpr,
                        BS: tl.constexpr, EST_DIAG: tl.constexpr):
    """``_tile_union`` in one pass where the tile's routing kept every positive ``mp`` (no ``topk`` cap can bind) and
    stored it by candidate (``route.route_in_registers``: ``mp [slot, h, c]``, every candidate in one ``[QT, TC]``
    tile): the union is the candidates some token's ``mp`` is positive (above ``PRIOR_EPS`` with EST_DIAG), each
    token's prior ``log mp`` (over the geometric mean, times ``inv_sigma``, with EST_DIAG), as
    ``routing.select_kept`` computes it from the same ``mp``; no selection list is read."""
    offs_u = tl.arange(0, QT)
    offs_c = tl.arange(0, TC)
    mp = tl.load(mp_ptr + (slot0 + offs_u)[:, None] * smp_n + h * smp_h + offs_c[None, :],
                 mask=unit_ok[:, None] & (offs_c < ncand)[None, :], other=0.0)
    if EST_DIAG:
        keep = mp > PRIOR_EPS
        logmp = tl.log(tl.where(keep, mp, 1.0))
        log_g = tl.sum(tl.where(keep, logmp, 0.0), axis=1) / tl.maximum(tl.sum(keep.to(tl.float32), axis=1), 1.0)
        bias = (logmp - log_g[:, None]) * inv_sigma
    else:
        keep = mp > 0
        bias = tl.log(tl.where(keep, mp, 1.0))
    kept = tl.max(keep.to(tl.int32), axis=0)
    j = tl.cumsum(kept, axis=0) - kept
    ppb_u: tl.constexpr = PS // BS
    page = tl.load(bt_row + offs_c // ppb_u, mask=kept > 0, other=0)
    tl.store(ublk_row + j, _union_entry(page, offs_c, h, ublk_page, ublk_step, ublk_head, ppb_u), mask=kept > 0)
    tl.store(uprior_row + j[None, :] * QT + offs_u[:, None], tl.where(keep, bias * LOG2E, float("-inf")),
             mask=(kept > 0)[None, :])
    tl.debug_barrier()  # the union lists are read back by other threads
    return tl.sum(kept, axis=0)


@cached_launch
@triton.jit(do_not_specialize=["tile0", "n", "nt", "max_tokens", "num_tokens", "G"])
def _prefill_attn_kernel(
    q_ptr, sq_t, sq_h, k_ptr, v_ptr, sk_p, sk_r, sk_h, sv_p, sv_r, sv_h, o_ptr, so_t, so_h, k_desc, v_desc,
    ublk_page, ublk_step, ublk_head, bt_ptr, sbt_n, summ_ptr, ss_b, ss_h,
    cu_ptr, seq_lens_ptr, tile_req_ptr, tile_off_ptr, tile0, n, nt, max_tokens, num_tokens,
    sel_idx_ptr, sel_bias_ptr, ssel_n, ssel_h, count_ptr, scnt_n, scnt_h,
    uprior_ptr, spr_w, spr_h, ublk_ptr, sub_w, sub_h, upos_ptr, spos_w, spos_h, qk_scale, G,
    info_ptr, sinfo, nu_ptr, counter_ptr,
    mp_ptr, smp_n, smp_h, ck_ptr, sel_blk_ptr, sel_cap, sf, x_scale, topk, inv_sigma,
    QT: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, PS: tl.constexpr,
    LOCAL_BLOCKS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_U: tl.constexpr, TU: tl.constexpr, TJ: tl.constexpr,
    UCH: tl.constexpr, ONE_BLOCK: tl.constexpr, TMA: tl.constexpr, TMA_HEAD_MAJOR: tl.constexpr,
    UNION_ONLY: tl.constexpr = False, LAST_FIRST: tl.constexpr = False,
    ROUTE: tl.constexpr = False, BLOCK_N: tl.constexpr = 16, TS: tl.constexpr = 16, NPIV: tl.constexpr = 1,
    HAS_TOPK: tl.constexpr = False, EST_DIAG: tl.constexpr = False, TL: tl.constexpr = 16,
    FROM_MP: tl.constexpr = False, TCU: tl.constexpr = 16,
):
    """Grid ``(W, Hkv)``: program (w, h) attends the ``[QT * G_PAD, D]`` query rows of tile
    ``tile0 + w`` for KV head h.

    0. ROUTE: the tile is routed first, by this program (``route.route_in_registers``: the short tables whose
       candidates fit one score tile, router ``kv_head``), into the same scratch (``mp_ptr`` .. ``inv_sigma`` and
       the summaries ``summ_ptr``: ``_prefill_route_kernel``'s; unused otherwise): no route launch precedes this
       one, and a program's routing overlaps other programs' attention.
    1. Union (``_tile_union``; with FROM_MP ``_tile_union_from_mp``, from ``mp`` by candidate in ``[QT, TCU]``):
       the candidates some token of the tile kept (``sel_* [slot, Hsel, cap]``,
       ``count``; ``ssel_h == scnt_h == 0`` for router ``shared``), marked in ``upos [w, h, c]`` and compacted, in
       increasing order, into ``ublk [w, h, j]`` (physical block, or for the Gluon launch its first row:
       ``ublk_page``, ``ublk_step``, ``ublk_head``) with every token's log2 prior for it in
       ``uprior [w, h, j, u]`` (``-inf``: not kept by token u), so that the attention loop reads them at
       addresses of ``j`` only. ``[TU]``, ``[TU, QT]`` and ``[QT, TJ]`` tiles.
    2. Local window blocks (log prior 0, causal per row) in ``[BLOCK_T, D]`` K/V tiles, then the union
       blocks in ``[BLOCK_U, D]`` tiles (``BLOCK_U // BS`` consecutive union blocks per tile, or
       ``BS // BLOCK_U`` tiles per block) read from the pages once for the tile (addresses depend on the
       loop index only, so loads can be pipelined; with TMA a tile of one block is a box of ``k_desc``,
       ``v_desc`` from ``_kv_descriptors``, which otherwise are the K/V pointers again and unused):
       ``[M, BLOCK_U]`` fp32 logits plus each row's bias for the block of each key, online softmax in base 2.
    Writes ``out [token, h * G + g, :]`` in the output dtype; rows of a tile whose request is
    inconsistent get zeros, and the tiles past the last one (of the ``nt`` the tile tables number, at least one)
    zero the rows of no request (``_zero_tail_rows``).

    UNION_ONLY: step 1 only, for ``gluon.prefill_attn_ws``: the union's size to
    ``nu_ptr [w Hkv + h]``, the tile's bounds to row w of ``info_ptr`` (rows ``sinfo`` apart, columns
    ``tiles.INFO_*``), and 0 to ``counter_ptr`` (the Gluon launch's work counter). LAST_FIRST: program w runs
    tile ``W - 1 - w`` instead (``PrefillConfig.last_tiles_first``).
    """
    tl.static_assert(not (ROUTE and UNION_ONLY), "the Gluon waves are routed by a route launch")
    w = wave_tile(LAST_FIRST)
    h = tl.program_id(1)
    req, ok, tok_base, a0, p_lo, p_hi, first_local, ncand = tile_bounds(
        tile0 + w, n, tile_req_ptr, tile_off_ptr, cu_ptr, seq_lens_ptr, max_tokens, QT, BS, LOCAL_BLOCKS)
    last_local = tl.where(ok, a0 // BS, first_local - 1)
    first_dead = tl.load(tile_off_ptr + n)  # the tiles' count
    if tile0 + w >= first_dead:
        _zero_tail_rows(o_ptr, so_t, so_h, h, G, tl.load(cu_ptr + n).to(tl.int32), num_tokens, tile0 + w - first_dead,
                        tl.maximum(nt - first_dead, 1), QT, G_PAD, D)
    if UNION_ONLY:
        if h == 0:
            info = info_ptr + w * sinfo
            tl.store(info + INFO_OK, ok.to(tl.int32))
            tl.store(info + INFO_TOK_BASE, tok_base)
            tl.store(info + INFO_A0, a0)
            tl.store(info + INFO_P_LO, p_lo)
            tl.store(info + INFO_P_HI, p_hi)
            tl.store(info + INFO_FIRST_LOCAL, first_local)
            tl.store(info + INFO_LAST_LOCAL, last_local)
            tl.store(info + INFO_REQ, req)
            if w == 0:
                tl.store(counter_ptr, 0)  # prefill_attn_ws's work counter
    if p_lo < p_hi:  # tiles past the last one do nothing
        M: tl.constexpr = QT * G_PAD
        ppb: tl.constexpr = PS // BS
        offs_d = tl.arange(0, D)
        offs_t = tl.arange(0, BLOCK_T)
        u_m, g_m, pos_m, tok_m, in_m, unit_ok = tile_rows(a0, p_lo, p_hi, tok_base, num_tokens, ok, G, QT, G_PAD)
        row_ok = in_m & ok
        heads = h * G + g_m
        bt_row = bt_ptr + req.to(tl.int64) * sbt_n
        slot0 = w.to(tl.int64) * QT
        p_max = p_hi - 1  # last position of the tile: keys after it may not be written yet

        if ROUTE:  # 0. the tile's routing, read back below by other threads of this program
            route_in_registers(q_ptr, sq_t, sq_h, summ_ptr, ss_b, ss_h, bt_ptr, sbt_n, mp_ptr, smp_n, smp_h, ck_ptr,
                               sel_idx_ptr, sel_blk_ptr, sel_bias_ptr, ssel_n, ssel_h, sel_cap, count_ptr, scnt_n,
                               scnt_h, sf, x_scale, G, topk, inv_sigma, req, h, slot0, tok_m, g_m, row_ok, unit_ok,
                               ncand, QT, G_PAD, D, BS, PS, BLOCK_N, TS, NPIV, HAS_TOPK, EST_DIAG, TL)
            tl.debug_barrier()

        # 1. union of the tile's selections (units: its tokens)
        uprior_row = uprior_ptr + w.to(tl.int64) * spr_w + h * spr_h  # [max_cand, QT] contiguous
        ublk_row = ublk_ptr + w.to(tl.int64) * sub_w + h * sub_h
        if FROM_MP:
            nu = _tile_union_from_mp(ncand, unit_ok, slot0, h, bt_row, mp_ptr, smp_n, smp_h, inv_sigma, uprior_row,
                                     ublk_row, ublk_page, ublk_step, ublk_head, QT, TCU, PS, BS, EST_DIAG)
        else:
            nu = _tile_union(ncand, unit_ok, slot0, h, bt_row, count_ptr, scnt_n, scnt_h, sel_idx_ptr, sel_bias_ptr,
                             ssel_n, ssel_h, upos_ptr + w.to(tl.int64) * spos_w + h * spos_h, uprior_row, ublk_row,
                             ublk_page, ublk_step, ublk_head, QT, TU, TJ, PS, BS)
        if UNION_ONLY:
            tl.store(nu_ptr + w * tl.num_programs(1) + h, nu)
            return
        q = tl.load(q_ptr + tok_m[:, None] * sq_t + heads[:, None] * sq_h + offs_d[None, :],
                    mask=row_ok[:, None], other=0.0)

        m_i = tl.full([M], float("-inf"), tl.float32)
        l_i = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, D], tl.float32)

        # 2a. local window: blocks first_local .. a0 // BS, causal at each row's position; one
        # [BLOCK_T, D] sub-tile per iteration (a flat loop keeps one K/V tile per pipeline stage)
        NSUB: tl.constexpr = BS // BLOCK_T
        for it in range(first_local * NSUB, (last_local + 1) * NSUB):
            lb = it // NSUB
            page, row0 = block_page(bt_row, lb, PS, BS, lb >= 0)
            t = (it % NSUB) * BLOCK_T + offs_t
            tpos = lb * BS + t
            t_ok = tpos <= p_max
            rows = (row0 + t).to(tl.int64)
            kt = tl.load(k_ptr + page * sk_p + rows[:, None] * sk_r + h * sk_h + offs_d[None, :],
                         mask=t_ok[:, None], other=0.0)
            qk = tl.dot(q, tl.trans(kt)) * qk_scale
            qk = tl.where(tpos[None, :] <= pos_m[:, None], qk, float("-inf"))
            m_i, l_i, acc = raise_max(m_i, l_i, acc, tl.max(qk, axis=1))
            p = tl.exp2(qk - max_or_zero(m_i)[:, None])
            l_i += tl.sum(p, axis=1)
            vt = tl.load(v_ptr + page * sv_p + rows[:, None] * sv_r + h * sv_h + offs_d[None, :],
                         mask=t_ok[:, None], other=0.0)
            acc += tl.dot(p.to(vt.dtype), vt)

        # 2b. the union blocks (complete, before the local window): PER consecutive union blocks per tile
        # (or NSUB2 tiles per block), in chunks of UCH blocks whose ids are loaded once per chunk and
        # gathered from registers: K/V addresses then depend on no load of the loop, so the pipeliner
        # issues them attn_stages - 1 tiles ahead (an id loaded in the loop would hold them to one tile ahead)
        PER: tl.constexpr = max(BLOCK_U // BS, 1)
        NSUB2: tl.constexpr = max(BS // BLOCK_U, 1)
        offs_k = tl.arange(0, BLOCK_U)
        offs_ch = tl.arange(0, UCH)
        tl.static_assert(PER == 1 or not ONE_BLOCK, "ONE_BLOCK: a union tile within one block")
        tl.static_assert(ONE_BLOCK or not TMA, "TMA loads whole tiles of one block")
        if not TMA:
            k_off = offs_k[:, None] * sk_r + offs_d[None, :]
            v_off = offs_k[:, None] * sv_r + offs_d[None, :]
        for c0 in range(0, nu, UCH):
            ch_ids = tl.load(ublk_row + c0 + offs_ch, mask=c0 + offs_ch < nu, other=0)
            for it in range(0, tl.cdiv(tl.minimum(nu - c0, UCH), PER) * NSUB2):
                if ONE_BLOCK:  # the loop bound keeps c0 + it // NSUB2 < nu: an all-true mask, folded away
                    phys = tl.sum(tl.where(offs_ch == it // NSUB2, ch_ids, 0), axis=0).to(tl.int64)
                    page = phys // ppb
                    row0 = (phys % ppb) * BS + (it % NSUB2) * BLOCK_U
                    if TMA:  # a box of _kv_descriptors: [page, row0, h, 0], or [page, h, row0, 0] head-major
                        box = [page.to(tl.int32), h if TMA_HEAD_MAJOR else row0.to(tl.int32),
                               row0.to(tl.int32) if TMA_HEAD_MAJOR else h, 0]
                    else:
                        k_ptrs = k_ptr + (page * sk_p + row0 * sk_r + h * sk_h) + k_off
                        v_ptrs = v_ptr + (page * sv_p + row0 * sv_r + h * sv_h) + v_off
                        kv_ok = tl.full([BLOCK_U, 1], 1, tl.int1)
                else:
                    jl = (it // NSUB2) * PER + offs_k // (BLOCK_U // PER)  # union index of each key of the tile
                    phys = tl.gather(ch_ids, jl, axis=0).to(tl.int64)
                    page = phys // ppb
                    rows = (phys % ppb) * BS + (it % NSUB2) * BLOCK_U + offs_k % (BLOCK_U // PER)
                    k_ptrs = k_ptr + page[:, None] * sk_p + rows[:, None] * sk_r + h * sk_h + offs_d[None, :]
                    v_ptrs = v_ptr + page[:, None] * sv_p + rows[:, None] * sv_r + h * sv_h + offs_d[None, :]
                    kv_ok = (c0 + jl < nu)[:, None]
                if TMA:
                    kt = tl.reshape(k_desc.load(box), [BLOCK_U, D])
                else:
                    kt = tl.load(k_ptrs, mask=kv_ok, other=0.0)
                qk = tl.dot(q, tl.trans(kt))
                if ONE_BLOCK:  # each row's log prior for the tile's block (-inf: not selected), one for all its keys:
                    # the row maxima of the raw products give the tile's, and one FMA per entry its exponent
                    bias = tl.load(uprior_row + (c0 + it // NSUB2) * QT + u_m)
                    m_i, l_i, acc = raise_max(m_i, l_i, acc, tl.max(qk, axis=1) * qk_scale + bias)
                    p = tl.exp2(qk * qk_scale + (bias - max_or_zero(m_i))[:, None])
                else:
                    qk = qk * qk_scale
                    for b in tl.static_range(PER):  # each row's log prior for the tile's b-th block
                        jb = c0 + (it // NSUB2) * PER + b
                        bias = tl.load(uprior_row + jb * QT + u_m, mask=jb < nu, other=float("-inf"))
                        in_b = (offs_k // (BLOCK_U // PER)) == b
                        qk = tl.where(in_b[None, :], qk + bias[:, None], qk)
                    m_i, l_i, acc = raise_max(m_i, l_i, acc, tl.max(qk, axis=1))
                    p = tl.exp2(qk - max_or_zero(m_i)[:, None])
                l_i += tl.sum(p, axis=1)
                if TMA:
                    vt = tl.reshape(v_desc.load(box), [BLOCK_U, D])
                else:
                    vt = tl.load(v_ptrs, mask=kv_ok, other=0.0)
                acc += tl.dot(p.to(vt.dtype), vt)

        good = l_i > 0
        o = acc / tl.where(good, l_i, 1.0)[:, None]
        o = tl.where(good[:, None], o, 0.0)
        tl.store(o_ptr + tok_m[:, None] * so_t + heads[:, None] * so_h + offs_d[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=in_m[:, None])


@triton.jit
def _zero_tail_rows(o_ptr, so_t, so_h, h, G, cu_end, num_tokens, k, ndead, QT: tl.constexpr, G_PAD: tl.constexpr,
                    D: tl.constexpr):
    """Tile ``k`` of the ``ndead`` tiles past the last one, for KV head h: zero its share of the output rows from
    ``cu_end`` (``cu_seqlens_q[n]``: tokens of no request) on, every ``ndead``-th chunk of ``QT`` rows, the G query
    heads of h (``[QT * G_PAD, D]`` stores; with no such row, nothing)."""
    offs_m = tl.arange(0, QT * G_PAD)
    g = offs_m % G_PAD
    offs_d = tl.arange(0, D)
    zero = tl.zeros([QT * G_PAD, D], tl.float32).to(o_ptr.dtype.element_ty)
    for r0 in range(cu_end + k * QT, num_tokens, ndead * QT):
        tok = (r0 + offs_m // G_PAD).to(tl.int64)
        ok = (tok < num_tokens) & (g < G)
        tl.store(o_ptr + tok[:, None] * so_t + (h * G + g)[:, None] * so_h + offs_d[None, :], zero, mask=ok[:, None])


def _nested_rows(x: torch.Tensor) -> bool:
    """A 4-D tensor laid out as nested rows, padding allowed: each stride covers the extent of the next
    dimension, the form TMA descriptors describe."""
    st, sh = x.stride(), x.shape
    return st[3] == 1 and st[2] >= sh[3] and st[1] >= st[2] * sh[2] and st[0] >= st[1] * sh[1]


def _tma_fits(x: torch.Tensor) -> bool:
    """``x`` can back a TMA descriptor: nested rows (``_nested_rows``), base and strides multiples of 16 bytes,
    strides under 2^40 bytes, fewer than 2^31 pages."""
    es = x.element_size()
    strides = [st * es for st in x.stride()[:-1]]
    return (_nested_rows(x) and x.data_ptr() % 16 == 0 and all(b % 16 == 0 and b < 2 ** 40 for b in strides)
            and x.shape[0] < 2 ** 31)


def _kv_descriptors(cache: PagedKVCache, block_u: int, config: PrefillConfig) -> Optional[tuple]:
    """``(k_desc, v_desc, head_major)``: TMA descriptors of the K and V pages for the attention launch's union
    tiles of one block (``config.attn_tma``; NVIDIA Hopper and later), or None (pointer loads) where the hardware
    or the cache does not fit them. The pages ``[pages, page_size, Hkv, D]`` are described as they are (SGLang's
    layout: ``[1, block_u, 1, D]`` boxes) or, where the head stride exceeds the row stride (vLLM's ``[pages,
    Hkv, page_size, C]``), head-major as ``[pages, Hkv, page_size, D]`` with ``[1, 1, block_u, D]`` boxes
    (``head_major``). These checks precede ``TensorDescriptor``'s own asserts so as to fall back instead. Built
    once per cache object (``PagedKVCache.kept``)."""
    if not (config.attn_tma and tma_supported(cache.k_pages.device)):
        return None
    return cache.kept(("kv_descriptors", block_u), lambda: _build_kv_descriptors(cache, block_u))


def _build_kv_descriptors(cache: PagedKVCache, block_u: int) -> Optional[tuple]:
    kp, vp = cache.k_pages, cache.v_pages
    for head_major in (False, True):
        views = [x.permute(0, 2, 1, 3) if head_major else x for x in (kp, vp)]
        if all(_tma_fits(x) for x in views):
            box = [1, 1, block_u, kp.shape[3]] if head_major else [1, block_u, 1, kp.shape[3]]
            k_desc, v_desc = (TensorDescriptor(x, list(x.shape), list(x.stride()), box) for x in views)
            return k_desc, v_desc, head_major
    return None


ATTN_LEAD = 24  # the attention kernel's leading arguments, a call's own: queries, K/V, output, table, summaries


def bind_attention(q: torch.Tensor, cache: PagedKVCache, block_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   seq_lens: torch.Tensor, params: DashParams, plan, scratch, tile0: int, tiles: int,
                   route: bool = False):
    """The attention of tiles ``tile0 .. tile0 + tiles - 1`` of ``plan`` (a ``PrefillPlan``, with its config) over
    their selections in ``scratch`` (a ``PrefillScratch``), every argument but the layer's bound: the result attends
    ``(q, cache, block_table, out)`` of any layer of the step (the shapes of those given here). ``route``: the
    launch routes the tiles first (``route.route_fused`` says where it can), and no route launch is needed."""
    t, hq, d = q.shape
    cfg = plan.config
    hkv = cache.num_kv_heads
    g = hq // hkv
    bs = params.block_size
    shared = params.router == "shared"
    s = scratch
    g_pad = pow2(g)
    block_u = cfg.union_keys(d, bs)
    one_block = cfg.union_in_one_block(d, bs)
    ws_attends = gluon.attends(q, cache, params, plan, tiles)
    ssel, scnt = s.sel_idx.stride(), s.sel_count.stride()
    spr, sub, spos = s.union_prior.stride(), s.union_blk.stride(), s.union_pos.stride()
    qk_scale = LOG2E_F / math.sqrt(d)
    route_args, route_kw = fused_route_arguments(q, hkv, params, plan, s)  # (the arguments unused unless route)
    route_kw = route_kw if route else {"EST_DIAG": params.estimate_diagonal}
    from_mp = union_from_mp(q, hkv, params, plan, s)
    kernel = bind_launch(
        _prefill_attn_kernel, (tiles, hkv), ATTN_LEAD,
        (cu_seqlens_q, seq_lens, plan.tile_req, plan.tile_off, tile0, seq_lens.shape[0], plan.num_tiles,
         block_table.shape[1] * cache.page_size, t, s.sel_idx, s.sel_bias, ssel[0], 0 if shared else ssel[1],
         s.sel_count, scnt[0], 0 if shared else scnt[1], s.union_prior, spr[0], spr[1], s.union_blk, sub[0], sub[1],
         s.union_pos, spos[0], spos[1], qk_scale, g, s.tile_info, s.tile_info.stride(0),
         s.union_count, s.ws_counter) + route_args,
        **route_kw, QT=plan.qt, G_PAD=g_pad, D=d, BS=bs, PS=cache.page_size, LOCAL_BLOCKS=params.local_blocks,
        BLOCK_T=min(bs, 64 if d <= 128 else 32), BLOCK_U=block_u,
        TU=max(16, min(pow2(plan.max_cand), cfg.union_tile // plan.qt)),
        TJ=max(16, min(pow2(s.sel_idx.shape[2]), cfg.union_list_tile // plan.qt)),
        UCH=cfg.union_chunk if one_block else max(cfg.union_chunk_gather, block_u // bs), ONE_BLOCK=one_block,
        LAST_FIRST=cfg.last_tiles_first, FROM_MP=from_mp, TCU=registers_block_n(plan.max_cand),
        num_warps=cfg.attn_warps if d <= 128 else 2 * cfg.attn_warps,
        num_stages=cfg.attn_stages)
    ws_kernel = None
    if ws_attends:
        gc = cfg.gluon
        ws_kernel = bind_launch(
            gluon.prefill_attn_ws, (min(sm_count(q.device), cdiv(tiles * hkv, gluon.WARPGROUPS)),), gluon.WS_LEAD,
            (s.tile_info, s.tile_info.stride(0), s.union_count, s.union_blk, sub[0], sub[1], s.union_prior, spr[0],
             spr[1], qk_scale, g, tiles, t, hkv, s.ws_counter),
            QT=plan.qt, G_PAD=g_pad, D=d, BS=bs, PPB=cache.page_size // bs, NC=gluon.WARPGROUPS, KST=gc.k_slots,
            VST=gc.v_slots, REGS=gc.regs, LAST_FIRST=cfg.last_tiles_first, num_warps=4, maxnreg=gc.regs)

    def attend(q: torch.Tensor, cache: PagedKVCache, bt: torch.Tensor, out: torch.Tensor) -> None:
        kp, vp, summ = cache.k_pages, cache.v_pages, cache.summaries
        geo = gluon.ws_supported(q, cache, params, g_pad, plan.qt) if ws_attends else None  # this layer's rows
        ws = geo is not None
        # with the Gluon launch, the Triton launch builds the unions only: it loads no K/V
        kv_desc = _kv_descriptors(cache, block_u, cfg) if one_block and block_u == bs and not ws else None
        sq, sk, sv, so = q.stride(), kp.stride(), vp.stride(), out.stride()
        kernel(q, sq[0], sq[1], kp, vp, sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], out, so[0], so[1],
               *(kv_desc[:2] if kv_desc is not None else (kp, vp)),
               *(gluon.union_rows(geo, bs) if ws else (cache.page_size // bs, 1, 0)), bt, bt.stride(0),
               summ, summ.stride(0), summ.stride(1), TMA=kv_desc is not None,
               TMA_HEAD_MAJOR=bool(kv_desc and kv_desc[2]), UNION_ONLY=ws)
        if ws:
            k_desc, v_desc = gluon.kv_block_descriptors(cache, bs, geo)
            ws_kernel(q, sq[0], sq[1], kp, vp, sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], bt, bt.stride(0), k_desc,
                      v_desc, out, so[0], so[1], geo[2])

    return attend


def attend_wave(q: torch.Tensor, cache: PagedKVCache, block_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
                seq_lens: torch.Tensor, params: DashParams, plan, scratch, out: torch.Tensor, tile0: int,
                tiles: int) -> None:
    """Attention of tiles ``tile0 .. tile0 + tiles - 1`` of ``plan`` into ``out`` (``bind_attention``, called
    once)."""
    bind_attention(q, cache, block_table, cu_seqlens_q, seq_lens, params, plan, scratch, tile0, tiles)(
        q, cache, block_table, out)
