"""Triton sparse decode attention over the local window and the routed blocks (docs/semantics.md section 6).

K/V are read straight from the engine's pages (no gather copy). Split-KV: the blocks a (request, KV head) attends
(its local-window blocks, then its kept routed blocks) are divided evenly between ``splits`` programs; each writes a
normalised partial output and its natural-log LSE, and the last to finish combines them by LSE (``_merge_head``; or
``_merge_kernel``, a launch of its own). The log prior of each routed block is added to its logits, so merging by LSE
equals softmax over ``lse_b + log pi_b`` per segment.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from ..common import (LN2, LOG2E, LOG2E_F, block_page, decode_bounds, load_group_query, max_or_zero, pow2, raise_max)


@triton.jit
def _decode_attn_split_kernel(
    q_ptr, sq_n, sq_h, k_ptr, v_ptr, sk_p, sk_r, sk_h, sv_p, sv_r, sv_h,
    bt_ptr, sbt_n, seq_lens_ptr, max_tokens,
    sel_blk_ptr, sel_bias_ptr, ssel_n, ssel_h, count_ptr, scnt_n, scnt_h,
    o_ptr, so_r, so_h, lse_ptr, slse_r, qk_scale, G, NSPLIT,
    out_ptr, sout_n, sout_h, done_ptr, sdone_n,
    G_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, PS: tl.constexpr,
    LOCAL_BLOCKS: tl.constexpr, BLOCK_T: tl.constexpr, NS_PAD: tl.constexpr, FUSE_MERGE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid ``(n, Hkv, NSPLIT)``: program (i, h, s) attends share s of (request i, KV head h)'s blocks.

    The list is ``nloc`` local-window blocks (log prior 0, causal at the query position) followed by
    ``count[i, h]`` routed blocks (physical block ids and log priors from the routing kernels;
    ``scnt_h == ssel_h == 0`` for router ``shared``). Per block: ``[BLOCK_T, D]`` K and V tiles,
    ``[G_PAD, BLOCK_T]`` fp32 logits for the G query heads, online softmax in base 2. Writes the
    normalised ``[G, D]`` fp32 partial output at row ``i * NSPLIT + s`` and its natural-log LSE
    (-inf for an empty share); FUSE_MERGE: the last program of (i, h) to finish merges them into ``out``, counting
    finished programs in ``done [n, Hkv]`` (zero again after). PDL: launched while the select launch ends.
    """
    i = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    length, pos, cur, first_local, _ = decode_bounds(seq_lens_ptr, i, max_tokens, LOCAL_BLOCKS, BS)
    nloc = tl.where(length > 0, cur - first_local + 1, 0)
    if PDL:  # launched while the select launch ends: its selection (and the score launch's K/V write) first
        gdc_wait()
    count = tl.load(count_ptr + i * scnt_n + h * scnt_h)
    count = tl.where(length > 0, count, 0)
    total = nloc + count
    per = tl.cdiv(total, NSPLIT)
    k_lo = s * per
    k_hi = tl.minimum(total, k_lo + per)

    ppb: tl.constexpr = PS // BS
    offs_t = tl.arange(0, BLOCK_T)
    q, heads, g_ok, offs_d = load_group_query(q_ptr, i, sq_n, sq_h, h, G, G_PAD, D)
    bt_row = bt_ptr + i.to(tl.int64) * sbt_n
    sel_row = i.to(tl.int64) * ssel_n + h * ssel_h

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    # the next routed entry is loaded one iteration ahead, so its latency overlaps this block's loads
    nxt_ok = (k_lo >= nloc) & (k_lo < k_hi)
    nxt_blk = tl.load(sel_blk_ptr + sel_row + (k_lo - nloc), mask=nxt_ok, other=0)
    nxt_bias = tl.load(sel_bias_ptr + sel_row + (k_lo - nloc), mask=nxt_ok, other=0.0)
    for kk in range(k_lo, k_hi):
        is_loc = kk < nloc
        pblk = nxt_blk.to(tl.int64)
        bias = nxt_bias * LOG2E
        nxt_ok = (kk + 1 >= nloc) & (kk + 1 < k_hi)
        nxt_blk = tl.load(sel_blk_ptr + sel_row + (kk + 1 - nloc), mask=nxt_ok, other=0)
        nxt_bias = tl.load(sel_bias_ptr + sel_row + (kk + 1 - nloc), mask=nxt_ok, other=0.0)
        # local-window block: logical index -> page table; routed block: physical id from routing
        lblk = first_local + kk
        lpage, lrow = block_page(bt_row, lblk, PS, BS, is_loc)
        page = tl.where(is_loc, lpage, pblk // ppb)
        row0 = tl.where(is_loc, lrow, (pblk % ppb) * BS)
        limit = tl.where(is_loc, pos - lblk * BS, BS - 1)  # causal: token rows <= limit
        for t0 in tl.static_range(0, BS, BLOCK_T):
            t = t0 + offs_t
            t_ok = t <= limit
            rows = (row0 + t).to(tl.int64)
            kt = tl.load(k_ptr + page * sk_p + rows[:, None] * sk_r + h * sk_h + offs_d[None, :],
                         mask=t_ok[:, None], other=0.0)
            vt = tl.load(v_ptr + page * sv_p + rows[:, None] * sv_r + h * sv_h + offs_d[None, :],
                         mask=t_ok[:, None], other=0.0)
            qk = tl.dot(q, tl.trans(kt)) * qk_scale + bias
            qk = tl.where(t_ok[None, :], qk, float("-inf"))
            m_i, l_i, acc = raise_max(m_i, l_i, acc, tl.max(qk, axis=1))
            p = tl.exp2(qk - max_or_zero(m_i)[:, None])
            l_i += tl.sum(p, axis=1)
            acc += tl.dot(p.to(vt.dtype), vt)
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * LN2, float("-inf"))
    r = i * NSPLIT + s
    tl.store(o_ptr + r * so_r + heads[:, None] * so_h + offs_d[None, :], out, mask=g_ok[:, None])
    tl.store(lse_ptr + r * slse_r + heads, lse, mask=g_ok)
    if FUSE_MERGE:  # the program that finishes (i, h) last merges its G heads: no launch of its own
        tl.debug_barrier()  # every thread's partial is stored before the count
        done = tl.atomic_add(done_ptr + i * sdone_n + h, 1, sem="acq_rel", scope="gpu")
        if done == NSPLIT - 1:
            for g in range(G):
                _merge_head(o_ptr, so_r, so_h, lse_ptr, slse_r, out_ptr, sout_n, sout_h, i, h * G + g, NSPLIT,
                            NS_PAD, D, ".cg")  # past L1: other programs wrote the partials
            tl.store(done_ptr + i * sdone_n + h, 0)  # zero again for the next step


@triton.jit
def _merge_head(o_part_ptr, so_r, so_h, lse_ptr, slse_r, out_ptr, sout_n, sout_h, i, hq, NSPLIT,
                NS_PAD: tl.constexpr, D: tl.constexpr, CACHE: tl.constexpr):
    """out[i, hq] = sum_s w_s o_s with ``w = softmax_s(lse_s)`` over the NSPLIT partials; zeros when every
    share is empty (a padded row), never NaN."""
    offs_s = tl.arange(0, NS_PAD)
    offs_d = tl.arange(0, D)
    s_ok = offs_s < NSPLIT
    r = i * NSPLIT + offs_s
    lse = tl.load(lse_ptr + r * slse_r + hq, mask=s_ok, other=float("-inf"), cache_modifier=CACHE)
    mx = tl.max(lse, axis=0)
    live = lse > float("-inf")
    w = tl.where(live, tl.exp(lse - tl.where(mx > float("-inf"), mx, 0.0)), 0.0)
    o = tl.load(o_part_ptr + r[:, None] * so_r + hq * so_h + offs_d[None, :], mask=live[:, None], other=0.0,
                cache_modifier=CACHE)
    tot = tl.sum(w, axis=0)
    res = tl.sum(w[:, None] * o, axis=0) / tl.where(tot > 0, tot, 1.0)
    tl.store(out_ptr + i * sout_n + hq * sout_h + offs_d, res.to(out_ptr.dtype.element_ty))


@triton.jit
def _merge_kernel(o_part_ptr, so_r, so_h, lse_ptr, slse_r, out_ptr, sout_n, sout_h, NSPLIT,
                  NS_PAD: tl.constexpr, D: tl.constexpr):
    """Grid ``(n, Hq)``: ``_merge_head`` of (i, hq)."""
    _merge_head(o_part_ptr, so_r, so_h, lse_ptr, slse_r, out_ptr, sout_n, sout_h, tl.program_id(0),
                tl.program_id(1), NSPLIT, NS_PAD, D, "")


def decode_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, params, sel_blk: torch.Tensor, sel_bias: torch.Tensor,
                     sel_count: torch.Tensor, o_part: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor,
                     *, num_splits: int, done: torch.Tensor = None, pdl: bool = False) -> torch.Tensor:
    """Sparse attention of one decode token per request (one launch, no synchronisation; two with ``done=None``: a
    merge launch of its own).

    q: ``[n, Hq, D]``; k_pages, v_pages: ``[pages, page_size, Hkv, D]`` (strided, last dim
    contiguous); block_table ``[n, max_pages]`` int32; seq_lens ``[n]``. Routed blocks per unit:
    ``sel_blk`` (physical block ids) and ``sel_bias`` (log prior) ``[>= n, Hsel, cap]``,
    ``sel_count [>= n, Hsel]``. Scratch: o_part ``[>= n * num_splits, Hq, D]`` fp32, lse_part
    ``[>= n * num_splits, Hq]`` fp32, done ``[>= n, Hkv]`` int32 zeros (the splits' merge in the attention launch),
    or None. pdl: launched as the dependent of the launch before it (``common.pdl_supported``). Writes ``out [n, Hq,
    D]`` (query dtype) and returns it.
    """
    n, hq, d = q.shape
    if n == 0:
        return out
    _, ps, hkv, _ = k_pages.shape
    g = hq // hkv
    bs = params.block_size
    shared = params.router == "shared"
    block_t = min(bs, max(16, 8192 // d))
    _decode_attn_split_kernel[(n, hkv, num_splits)](
        q, q.stride(0), q.stride(1), k_pages, v_pages, k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2),
        block_table, block_table.stride(0), seq_lens, block_table.shape[1] * ps,
        sel_blk, sel_bias, sel_blk.stride(0), 0 if shared else sel_blk.stride(1),
        sel_count, sel_count.stride(0), 0 if shared else sel_count.stride(1),
        o_part, o_part.stride(0), o_part.stride(1), lse_part, lse_part.stride(0),
        LOG2E_F / math.sqrt(d), g, num_splits,
        out, out.stride(0), out.stride(1), seq_lens if done is None else done, 0 if done is None else done.stride(0),
        G_PAD=max(16, pow2(g)), D=d, BS=bs, PS=ps, LOCAL_BLOCKS=params.local_blocks, BLOCK_T=block_t,
        NS_PAD=pow2(num_splits), FUSE_MERGE=done is not None, PDL=pdl, num_warps=4, num_stages=2,
        **({"launch_pdl": True} if pdl else {}),
    )
    if done is not None:
        return out
    _merge_kernel[(n, hq)](
        o_part, o_part.stride(0), o_part.stride(1), lse_part, lse_part.stride(0),
        out, out.stride(0), out.stride(1), num_splits, NS_PAD=pow2(num_splits), D=d,
        num_warps=8 if pow2(num_splits) * d >= 4096 else (4 if d >= 128 else 2),  # [splits, D] fp32 tile
    )
    return out
