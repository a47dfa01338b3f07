"""Triton sparse decode attention over the local window and the routed blocks (docs/semantics.md section 6).

K/V are read straight from the engine's pages (no gather copy). Split-KV: the blocks a
(request, KV head) attends (its local-window blocks, then its kept routed blocks) are divided
evenly between ``splits`` programs; each writes a normalised partial output and its natural-log
LSE; ``_merge_kernel`` combines them by LSE. The log prior of each routed block is added to its
logits, so merging by LSE equals softmax over ``lse_b + log pi_b`` per segment.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..common import (LN2, LOG2E, LOG2E_F, block_page, decode_bounds, load_group_query, max_or_zero, pdl_launch,
                      pow2, raise_max)
from ..launcher import cached_launch


@cached_launch
@triton.jit
def _decode_attn_split_kernel(
    q_ptr, sq_n, sq_h, k_ptr, v_ptr, sk_p, sk_r, sk_h, sv_p, sv_r, sv_h,
    bt_ptr, sbt_n, seq_lens_ptr, max_tokens,
    sel_blk_ptr, sel_bias_ptr, ssel_n, ssel_h, count_ptr, scnt_n, scnt_h,
    o_ptr, so_r, so_h, lse_ptr, slse_r, qk_scale, G, NSPLIT,
    G_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, PS: tl.constexpr,
    LOCAL_BLOCKS: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr,
):
    """Grid ``(n, Hkv, NSPLIT)``: program (i, h, s) attends share s of (request i, KV head h)'s blocks.

    The list is ``nloc`` local-window blocks (log prior 0, causal at the query position) followed by
    ``count[i, h]`` routed blocks (physical block ids and log priors from the routing kernels;
    ``scnt_h == ssel_h == 0`` for router ``shared``). Per block: ``[BLOCK_T, D]`` K and V tiles,
    ``[G_PAD, BLOCK_T]`` fp32 logits for the G query heads, online softmax in base 2. Writes the
    normalised ``[G, D]`` fp32 partial output at row ``i * NSPLIT + s`` and its natural-log LSE
    (-inf for an empty share). PDL: launched while the select launch ends, it waits for the selection (and the select
    launch's K/V write) after reading its query, and lets the merge launch start.
    """
    i = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    length, pos, cur, first_local, _ = decode_bounds(seq_lens_ptr, i, max_tokens, LOCAL_BLOCKS, BS)
    nloc = tl.where(length > 0, cur - first_local + 1, 0)
    q, heads, g_ok, offs_d = load_group_query(q_ptr, i, sq_n, sq_h, h, G, G_PAD, D)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    count = tl.load(count_ptr + i * scnt_n + h * scnt_h)
    count = tl.where(length > 0, count, 0)
    total = nloc + count
    per = tl.cdiv(total, NSPLIT)
    k_lo = s * per
    k_hi = tl.minimum(total, k_lo + per)

    ppb: tl.constexpr = PS // BS
    offs_t = tl.arange(0, BLOCK_T)
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


@cached_launch
@triton.jit
def _merge_kernel(o_part_ptr, so_r, so_h, lse_ptr, slse_r, out_ptr, sout_n, sout_h, NSPLIT,
                  NS_PAD: tl.constexpr, D: tl.constexpr, PDL: tl.constexpr):
    """Grid ``(n, Hq)``: out[i, hq] = sum_s w_s o_s with ``w = softmax_s(lse_s)``; zeros when every
    share is empty (a padded row), never NaN. PDL: launched while the split launch ends, it waits for it first."""
    if PDL:
        gdc_wait()
    i = tl.program_id(0)
    hq = tl.program_id(1)
    offs_s = tl.arange(0, NS_PAD)
    offs_d = tl.arange(0, D)
    s_ok = offs_s < NSPLIT
    r = i * NSPLIT + offs_s
    lse = tl.load(lse_ptr + r * slse_r + hq, mask=s_ok, other=float("-inf"))
    # every split stores its partial output (zeros for an empty share): loaded beside the LSE, one round trip
    o = tl.load(o_part_ptr + r[:, None] * so_r + hq * so_h + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    mx = tl.max(lse, axis=0)
    live = lse > float("-inf")
    w = tl.where(live, tl.exp(lse - tl.where(mx > float("-inf"), mx, 0.0)), 0.0)
    tot = tl.sum(w, axis=0)
    res = tl.sum(w[:, None] * o, axis=0) / tl.where(tot > 0, tot, 1.0)
    tl.store(out_ptr + i * sout_n + hq * sout_h + offs_d, res.to(out_ptr.dtype.element_ty))


def decode_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, params, sel_blk: torch.Tensor, sel_bias: torch.Tensor,
                     sel_count: torch.Tensor, o_part: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor,
                     *, num_splits: int, pdl: bool, warps: int, stages: int, maxnreg: int, tile_elements: int,
                     merge_thread_elements: int) -> torch.Tensor:
    """Sparse attention of one decode token per request (two launches, no synchronisation).

    q: ``[n, Hq, D]``; k_pages, v_pages: ``[pages, page_size, Hkv, D]`` (strided, last dim
    contiguous); block_table ``[n, max_pages]`` int32; seq_lens ``[n]``. Routed blocks per unit:
    ``sel_blk`` (physical block ids) and ``sel_bias`` (log prior) ``[>= n, Hsel, cap]``,
    ``sel_count [>= n, Hsel]``. Scratch: o_part ``[>= n * num_splits, Hq, D]`` fp32, lse_part
    ``[>= n * num_splits, Hq]`` fp32. pdl: each launch is the programmatic dependent of the one before it (the
    select launch, then the split launch; ``common.pdl_supported``). warps, stages, maxnreg: the split launch's
    ``num_warps``, ``num_stages`` and register cap (0: none; ``DecodeBuffers.attn_stages``, ``attn_maxnreg``);
    tile_elements: of its K (and V) tiles (``DecodeConfig.attn_tile_elements``); merge_thread_elements: of the merge
    program's tile a thread (``DecodeConfig.merge_thread_elements``).
    Writes ``out [n, Hq, D]`` (query dtype) and returns it.
    """
    n, hq, d = q.shape
    if n == 0:
        return out
    _, ps, hkv, _ = k_pages.shape
    g = hq // hkv
    bs = params.block_size
    shared = params.router == "shared"
    block_t = min(bs, max(16, tile_elements // d))
    _decode_attn_split_kernel[(n, hkv, num_splits)](
        q, q.stride(0), q.stride(1), k_pages, v_pages, k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2),
        block_table, block_table.stride(0), seq_lens, block_table.shape[1] * ps,
        sel_blk, sel_bias, sel_blk.stride(0), 0 if shared else sel_blk.stride(1),
        sel_count, sel_count.stride(0), 0 if shared else sel_count.stride(1),
        o_part, o_part.stride(0), o_part.stride(1), lse_part, lse_part.stride(0),
        LOG2E_F / math.sqrt(d), g, num_splits,
        G_PAD=max(16, pow2(g)), D=d, BS=bs, PS=ps, LOCAL_BLOCKS=params.local_blocks, BLOCK_T=block_t, PDL=pdl,
        num_warps=warps, num_stages=stages, **({"maxnreg": maxnreg} if maxnreg else {}), **pdl_launch(pdl),
    )
    _merge_kernel[(n, hq)](
        o_part, o_part.stride(0), o_part.stride(1), lse_part, lse_part.stride(0),
        out, out.stride(0), out.stride(1), num_splits, NS_PAD=pow2(num_splits), D=d, PDL=pdl,
        num_warps=min(8, max(1, pow2(num_splits) * d // (32 * merge_thread_elements))),
        **pdl_launch(pdl),
    )
    return out
