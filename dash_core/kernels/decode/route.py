"""Decode routing: two launches a step, no host synchronisation.

- ``_decode_scores_kernel``, grid ``(n, Hkv, splits)``: each program scores a contiguous share of one request's
  candidates for the G query heads of one KV head (summaries read through the page table) into the score scratch,
  and writes the row maxima of its share (split over the candidates for occupancy: 2048 summaries per KV head at
  128k / bs 64).
- ``_decode_select_kernel``, grid ``(n, Hsel [+ Hkv])``: one unit per program, calls ``routing.route_tile``. With
  the write fused, Hkv more programs a request write the step's new K/V (``kv_write.write_token``) beside the
  selection, off the chain of scores -> selection that bounds a small batch's step: this step's routing never reads
  them (the block the new token completes is in the local window), and the attention launch that does comes after.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..common import decode_bounds, load_group_query, pdl_launch, pdl_supported, pow2, scaled_query, summary_scores
from ..kv_write import no_write_args, write_token
from ..launcher import cached_launch
from ..routing import load_scores, radix_min_keys, route_tile, score_rows
from .config import DecodeConfig


@cached_launch
@triton.jit
def _decode_scores_kernel(
    q_ptr, sq_n, sq_h, summ_ptr, ss_b, ss_h, bt_ptr, sbt_n, seq_lens_ptr, max_tokens,
    x_ptr, sx_n, sx_h, pmax_ptr, spm_n, spm_h, sf, x_scale, G, NSPLIT,
    G_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, PS: tl.constexpr,
    LOCAL_BLOCKS: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    """Grid ``(n, Hkv, NSPLIT)``: program (i, h, s) scores share s of request i's candidates.

    Loads ``sf * q`` rounded to the query dtype for the G heads of KV head h (``[G_PAD, D]``),
    summaries ``[BLOCK_N, D]`` per step through the page table, writes
    ``x = 0.5 * <sf q, s> / sqrt(D)`` (fp32) to the score scratch ``[n, Hq, max_cand]`` and the
    maximum of its share per head to ``pmax [n, Hq, NSPLIT]`` (-inf for an empty share).
    """
    if PDL:  # launched while the kernel before it ends: wait for its results (the query), then let the select
        gdc_wait()  # launch start (it waits for this one's results)
        gdc_launch_dependents()
    i = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    _, _, _, _, ncand = decode_bounds(seq_lens_ptr, i, max_tokens, LOCAL_BLOCKS, BS)
    per = tl.cdiv(tl.cdiv(ncand, NSPLIT), BLOCK_N) * BLOCK_N
    c_start = s * per
    c_end = tl.minimum(ncand, c_start + per)
    offs_n = tl.arange(0, BLOCK_N)
    q, heads, g_ok, offs_d = load_group_query(q_ptr, i, sq_n, sq_h, h, G, G_PAD, D)
    qs = scaled_query(q, sf)
    bt_row = bt_ptr + i.to(tl.int64) * sbt_n
    x_rows = x_ptr + i.to(tl.int64) * sx_n + heads[:, None].to(tl.int64) * sx_h
    mx = tl.full([G_PAD], float("-inf"), tl.float32)
    for c0 in range(c_start, c_end, BLOCK_N):
        c = c0 + offs_n
        cm = c < c_end
        x = summary_scores(qs, bt_row, summ_ptr, ss_b, h, ss_h, c, cm, x_scale, offs_d, PS, BS)
        tl.store(x_rows + c[None, :], x, mask=g_ok[:, None] & cm[None, :])
        mx = tl.maximum(mx, tl.max(tl.where(cm[None, :], x, float("-inf")), axis=1))
    tl.store(pmax_ptr + i * spm_n + heads * spm_h + s, mx, mask=g_ok)


@cached_launch
@triton.jit
def _decode_select_kernel(
    x_ptr, sx_n, sx_h, pmax_ptr, spm_n, spm_h, NSPLIT, bt_ptr, sbt_n, seq_lens_ptr, max_tokens,
    mp_ptr, ck_ptr, smp_n, smp_h, sel_idx_ptr, sel_blk_ptr, sel_bias_ptr, ssel_n, ssel_h, sel_cap,
    count_ptr, scnt_n, NROWS, topk, inv_sigma, HSEL,
    w_k_ptr, w_v_ptr, w_sk_t, w_sk_h, w_sv_t, w_sv_h,
    w_kc_ptr, w_vc_ptr, w_skc_p, w_skc_r, w_skc_h, w_svc_p, w_svc_r, w_svc_h,
    w_summ_ptr, w_ss_b, w_ss_h, w_hc_ptr, w_shc_h, w_slot_ptr, w_num_slots, w_scale,
    NH_PAD: tl.constexpr, NS_PAD: tl.constexpr, TC: tl.constexpr, TS: tl.constexpr, NPIV: tl.constexpr,
    HAS_TOPK: tl.constexpr, EST_DIAG: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, PS: tl.constexpr,
    LOCAL_BLOCKS: tl.constexpr, ONE_TILE: tl.constexpr, X_IN_REGS: tl.constexpr, TL: tl.constexpr,
    RK: tl.constexpr, RCH: tl.constexpr, RADIX_MIN: tl.constexpr, FUSE_WRITE: tl.constexpr, PDL: tl.constexpr,
):
    """Grid ``(n, HSEL [+ Hkv])``: program (i, u) routes unit u of request i (rows ``u*NROWS ..``).

    Row maxima come from the score kernel's ``pmax``; everything else is ``route_tile`` (with X_IN_REGS, each unit's
    positive mp go to a list: ``mp_ptr`` and ``ck_ptr``, rows ``smp_n, smp_h``; the full mp otherwise).
    PDL: launched while the score launch ends, it waits for that launch's results first, and lets the attention
    launch start.
    FUSE_WRITE: program (i, HSEL + h) writes the new K/V of request i, KV head h instead (and the summary of the
    block it completes), without waiting for the score launch: nothing in this step's routing reads them.
    """
    i = tl.program_id(0)
    u = tl.program_id(1)
    writes = False
    if FUSE_WRITE:
        writes = u >= HSEL
    if writes:
        write_token(i, u - HSEL, w_k_ptr, w_v_ptr, w_sk_t, w_sk_h, w_sv_t, w_sv_h,
                    w_kc_ptr, w_vc_ptr, w_skc_p, w_skc_r, w_skc_h, w_svc_p, w_svc_r, w_svc_h,
                    w_summ_ptr, w_ss_b, w_ss_h, w_hc_ptr, w_shc_h, w_slot_ptr, w_num_slots, w_scale,
                    D=D, BS=BS, PS=PS, WRITE=True, SUMMARIZE=True, OWN_ROW=True)
    else:
        _select_unit(x_ptr, sx_n, sx_h, pmax_ptr, spm_n, spm_h, NSPLIT, bt_ptr, sbt_n, seq_lens_ptr, max_tokens,
                     mp_ptr, ck_ptr, smp_n, smp_h, sel_idx_ptr, sel_blk_ptr, sel_bias_ptr, ssel_n, ssel_h, sel_cap,
                     count_ptr, scnt_n, NROWS, topk, inv_sigma, i, u,
                     NH_PAD=NH_PAD, NS_PAD=NS_PAD, TC=TC, TS=TS, NPIV=NPIV, HAS_TOPK=HAS_TOPK, EST_DIAG=EST_DIAG,
                     BS=BS, PS=PS, LOCAL_BLOCKS=LOCAL_BLOCKS, ONE_TILE=ONE_TILE, X_IN_REGS=X_IN_REGS, TL=TL, RK=RK,
                     RCH=RCH, RADIX_MIN=RADIX_MIN, PDL=PDL)


@triton.jit
def _select_unit(
    x_ptr, sx_n, sx_h, pmax_ptr, spm_n, spm_h, NSPLIT, bt_ptr, sbt_n, seq_lens_ptr, max_tokens,
    mp_ptr, ck_ptr, smp_n, smp_h, sel_idx_ptr, sel_blk_ptr, sel_bias_ptr, ssel_n, ssel_h, sel_cap,
    count_ptr, scnt_n, NROWS, topk, inv_sigma, i, u,
    NH_PAD: tl.constexpr, NS_PAD: tl.constexpr, TC: tl.constexpr, TS: tl.constexpr, NPIV: tl.constexpr,
    HAS_TOPK: tl.constexpr, EST_DIAG: tl.constexpr, BS: tl.constexpr, PS: tl.constexpr,
    LOCAL_BLOCKS: tl.constexpr, ONE_TILE: tl.constexpr, X_IN_REGS: tl.constexpr, TL: tl.constexpr,
    RK: tl.constexpr, RCH: tl.constexpr, RADIX_MIN: tl.constexpr, PDL: tl.constexpr,
):
    """Unit u of request i of ``_decode_select_kernel``."""
    _, _, _, _, ncand = decode_bounds(seq_lens_ptr, i, max_tokens, LOCAL_BLOCKS, BS)  # (no launch writes seq_lens)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    offs_r = tl.arange(0, NH_PAD)
    offs_s = tl.arange(0, NS_PAD)
    rows = u * NROWS + offs_r
    r_ok = offs_r < NROWS
    one = tl.zeros([1], tl.int64)
    i64 = i.to(tl.int64)
    x_unit = one + i64 * sx_n + u * NROWS * sx_h
    ncand_u = one.to(tl.int32) + ncand
    pm = tl.load(pmax_ptr + i * spm_n + rows[:, None] * spm_h + offs_s[None, :],
                 mask=r_ok[:, None] & (offs_s[None, :] < NSPLIT), other=float("-inf"))
    x_regs = 0
    if X_IN_REGS:  # the scores' load goes out beside pmax's, before its maxima: one round trip, not two
        x_rows, _, ncand4 = score_rows(x_ptr, x_unit, sx_h, NROWS, ncand_u, NH_PAD)
        x_regs = load_scores(x_rows, tl.arange(0, TC), r_ok, ncand_u, ncand4)
    m = tl.max(pm, axis=1)
    m = tl.where(r_ok & (ncand > 0), m, 0.0)
    route_tile(
        x_ptr, x_unit, sx_h, NROWS, ncand_u, m[None, :],
        mp_ptr, one + i64 * smp_n + u * smp_h, ck_ptr, bt_ptr, one + i64 * sbt_n,
        sel_idx_ptr, sel_blk_ptr, sel_bias_ptr, one + i64 * ssel_n + u * ssel_h, sel_cap,
        count_ptr, one + i64 * scnt_n + u, topk, inv_sigma,
        QT=1, NH_PAD=NH_PAD, TC=TC, TS=TS, NPIV=NPIV, HAS_TOPK=HAS_TOPK, EST_DIAG=EST_DIAG, PS=PS, BS=BS,
        ONE_TILE=ONE_TILE, X_IN_REGS=X_IN_REGS, LIST=X_IN_REGS, TL=TL, x_regs=x_regs, RK=RK,
        RCH=RCH, RADIX_MIN=RADIX_MIN,
    )


def route_decode(q: torch.Tensor, summaries: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                 params, page_size: int, scores: torch.Tensor, pmax: torch.Tensor, mp: torch.Tensor,
                 mp_cand: torch.Tensor, sel_idx: torch.Tensor, sel_blk: torch.Tensor, sel_bias: torch.Tensor,
                 sel_count: torch.Tensor,
                 *, num_splits: int, config: DecodeConfig, write: Optional[tuple] = None, only: Optional[str] = None,
                 scored: Optional[torch.cuda.Event] = None, score_pdl: bool = True) -> None:
    """Route one decode token per request (two launches, no host synchronisation).

    q: ``[n, Hq, D]``; summaries: ``[num_slots // bs, Hkv, D]`` (query dtype); block_table:
    ``[n, max_pages]`` int32; seq_lens: ``[n]`` (including the new token, 0 = padded row).
    Scratch (rows ``>= n`` untouched): scores ``[>= n, Hq, max_cand]`` fp32, pmax
    ``[>= n, Hq, >= num_splits]`` fp32, mp ``[>= n, Hsel, max_cand4]`` fp32 and mp_cand (same shape and strides,
    int32) with ``max_cand = params.max_candidates(max_pages * page_size)`` and ``max_cand4`` that rounded up to 4.
    Outputs: ``sel_idx, sel_blk`` int32 and ``sel_bias`` fp32 ``[>= n, Hsel, cap]``, ``sel_count [>= n, Hsel]``
    int32: per unit, the kept candidate blocks (logical index, physical block, log prior) in increasing order.
    ``cap`` = ``min(topk, max_cand)``, or ``max_cand`` without ``topk`` (the selection is then
    bounded by the number of candidates).
    write: ``kv_write.write_args(k, v, cache, slot_mapping, head_cls)`` to write the new K/V (and the summaries of
    the blocks they complete) in the select launch.
    only: ``"scores"`` or ``"select"`` launches just that kernel (stage timings in the benchmark; ``"scores"``
    writes the score scratch and ``pmax`` only: no selection, no K/V).
    scored: an event recorded between the two launches (another stream may start once the scores are written).
    score_pdl: with ``config.pdl``, the score launch is the programmatic dependent of the kernel before it on the
    stream (False where an event wait, not a kernel, comes before it); the select launch is its dependent either way.
    """
    n, hq, _ = q.shape
    hkv = summaries.shape[1]
    max_cand = params.max_candidates(block_table.shape[1] * page_size)
    hsel = params.selection_units(hkv)
    if n == 0:
        return
    pdl = config.pdl and pdl_supported(q.device)
    if only != "select":  # alone, the score launch has no dependent to let start
        chained = pdl and only is None
        _score_launch(q, summaries, block_table, seq_lens, params, page_size, scores, pmax, num_splits, max_cand,
                      chained, chained and score_pdl, config)
    if scored is not None:
        scored.record()
    if only == "scores":
        return
    _select_launch(scores, pmax, num_splits, block_table, seq_lens, params, page_size, mp, mp_cand, sel_idx, sel_blk,
                   sel_bias, sel_count, hq // hsel, hsel, max_cand, n, config, pdl, q, hkv, q.shape[2], write)


def _score_launch(q, summaries, block_table, seq_lens, params, page_size, scores, pmax, num_splits, max_cand,
                  pdl: bool, dependent: bool, config: DecodeConfig) -> None:
    """pdl: the kernel waits for the kernel before it and lets the select launch start (``PDL``); dependent: it is
    launched as the programmatic dependent of the kernel before it."""
    n, hq, d = q.shape
    hkv = summaries.shape[1]
    g = hq // hkv
    bs = params.block_size
    max_pages = block_table.shape[1]
    block_n = max(16, min(config.score_block if d <= 128 else config.score_block // 2, pow2(max_cand)))
    _decode_scores_kernel[(n, hkv, num_splits)](
        q, q.stride(0), q.stride(1), summaries, summaries.stride(0), summaries.stride(1),
        block_table, block_table.stride(0), seq_lens, max_pages * page_size,
        scores, scores.stride(0), scores.stride(1), pmax, pmax.stride(0), pmax.stride(1),
        params.scaling_factor, 0.5 / math.sqrt(d), g, num_splits,
        G_PAD=max(16, pow2(g)), D=d, BS=bs, PS=page_size, LOCAL_BLOCKS=params.local_blocks, BLOCK_N=block_n,
        PDL=pdl, num_warps=config.score_warps, num_stages=config.score_stages, **pdl_launch(dependent),
    )


def _select_launch(scores, pmax, num_splits, block_table, seq_lens, params, page_size, mp, mp_cand, sel_idx, sel_blk,
                   sel_bias, sel_count, nrows, hsel, max_cand, n, config: DecodeConfig, pdl: bool, q, hkv, d,
                   write) -> None:
    bs = params.block_size
    max_pages = block_table.shape[1]
    nh_pad = pow2(nrows)
    # wide 3-D tiles spill otherwise
    budget = config.select_tile_budget if nh_pad < 16 else config.select_tile_budget // 2
    tc = max(16, min(pow2(max_cand), budget // nh_pad))
    one_tile = pow2(max_cand) <= config.one_tile_max
    if one_tile:  # all candidates in one [TS] tile; fewer pivots per pass keep [NPIV, TS] in budget
        ts = max(16, pow2(max_cand))
        npiv = max(1, min(config.select_pivots, budget // ts))
    else:
        ts = max(16, min(pow2(max_cand), budget // (2 * config.select_pivots)))
        npiv = config.select_pivots
    topk = params.topk if params.topk is not None else 0
    x_in_regs = one_tile and tc == ts  # then each unit's positive mp go to a list, read in tiles of list_tile
    _decode_select_kernel[(n, hsel + (hkv if write is not None else 0))](
        scores, scores.stride(0), scores.stride(1), pmax, pmax.stride(0), pmax.stride(1), num_splits,
        block_table, block_table.stride(0), seq_lens, max_pages * page_size,
        mp, mp_cand, mp.stride(0), mp.stride(1), sel_idx, sel_blk, sel_bias, sel_idx.stride(0), sel_idx.stride(1),
        sel_idx.shape[2], sel_count, sel_count.stride(0), nrows, topk, 1.0 / params.sigma, hsel,
        *(write if write is not None else no_write_args(q, seq_lens)),
        NH_PAD=nh_pad, NS_PAD=pow2(num_splits), TC=tc, TS=ts, NPIV=npiv,
        HAS_TOPK=params.cap_binds(max_cand), EST_DIAG=params.estimate_diagonal, D=d, BS=bs, PS=page_size,
        LOCAL_BLOCKS=params.local_blocks, ONE_TILE=one_tile, X_IN_REGS=x_in_regs,
        TL=min(ts, config.list_tile) if x_in_regs else ts, RK=config.cap_rank_max, RCH=config.cap_rank_chunk,
        RADIX_MIN=radix_min_keys(config.select_warps),
        FUSE_WRITE=write is not None, PDL=pdl,
        num_warps=config.select_warps, **pdl_launch(pdl),
    )
