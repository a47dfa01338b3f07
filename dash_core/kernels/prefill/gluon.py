"""Hopper prefill attention in Gluon: several warpgroups of one program, each running a tile of its own.

The Triton attention launch of a wave (``attention._prefill_attn_kernel``) fits two programs of one warpgroup on a
multiprocessor. Here one persistent program a multiprocessor holds ``NC`` (``WARPGROUPS``) warpgroups
(``gl.warp_specialize``), each with its own K and V rings, taking (tile, KV head) items from a counter, so that one
warpgroup's softmax runs while another's MMAs do.

A wave's attention is then two launches, after its route launch. The Triton kernel builds each tile's union tables as it
does alone and stops there (``UNION_ONLY``), writing each tile's bounds (``tile_info``) and union size
(``union_count``); ``prefill_attn_ws`` runs the union blocks by TMA, then the local window (causal, pointer loads: the
request's last block may hold rows never written) and writes the output. The same arithmetic as the Triton loop (log2
domain, each row's log prior for a block added to its raw products times the scale); the local window comes after the
union blocks, so the sums round in another order, and the output is the sums times ``1 / l`` (the Triton kernel
divides).

Where it runs (``ws_supported``): NVIDIA Hopper (sm_90), D 128, block size 64 within a page, 64 query rows a tile,
bf16 or fp16, pages whose rows one 2-D TMA descriptor describes (``kv_rows``: SGLang's layout and vLLM's), block tables
of at least ``GluonConfig.min_candidates`` candidates or waves of at least ``GluonConfig.min_tiles`` tiles
(``attends``); else the Triton kernel.
The interpreter cannot run Gluon: the GPU tests check this kernel against the Triton one and the oracle.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..common import pow2, sm90
from ..launcher import cached_launch
from .tiles import (INFO_A0, INFO_FIRST_LOCAL, INFO_LAST_LOCAL, INFO_OK, INFO_P_HI, INFO_P_LO, INFO_REQ,
                    INFO_TOK_BASE)

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    HAVE_GLUON = True
except ImportError:  # a Triton without Gluon: the Triton kernel serves
    HAVE_GLUON = False

ROWS = 64  # query rows of a tile
WARPGROUPS = 3  # warpgroups (tiles) of one program: prefill_attn_ws starts one worker each
WS_LEAD = 19  # prefill_attn_ws's leading arguments, a layer's own: queries, K/V, table, descriptors, output, columns


def kv_rows(cache) -> Optional[tuple]:
    """The K and V pages ``[pages, page_size, Hkv, D]`` seen as rows of one stride (``[rows, columns]``, what a 2-D
    TMA descriptor describes), or None where they are not: ``(rows a page, rows a KV head, columns a KV head)``.
    SGLang's layout (the heads of a token side by side in a row): ``(page_size, 0, D)``; vLLM's (``[pages, head
    slots, page_size, C]``, head-major, K and V in one row of ``C >= 2D``): ``(head slots page_size, page_size, 0)``;
    one KV head: ``(rows a page, 0, 0)``. K and V must share their strides, their bases and rows must be 16-byte
    aligned, and the rows of ``kv_row_views`` (the union launch's int32 coordinates) must number under 2^31."""
    kp, vp = cache.k_pages, cache.v_pages
    pages, ps, hkv, d = kp.shape
    sp, sr, sh, sd = kp.stride()
    if vp.stride() != kp.stride() or sd != 1 or sp % sr or sr < d:
        return None
    if hkv == 1:
        geo = (sp // sr, 0, 0)
    elif d <= sh < sr and (hkv - 1) * sh + d <= sr:  # the heads of a token in one row
        geo = (sp // sr, 0, sh)
    elif sh % sr == 0 and sh >= ps * sr:  # head-major: each head's rows apart
        geo = (sp // sr, sh // sr, 0)
    else:
        return None
    es = kp.element_size()
    aligned = all(x.data_ptr() % 16 == 0 for x in (kp, vp)) and (sr * es) % 16 == 0
    return geo if aligned and _view_rows(kp.shape, geo) < 2 ** 31 else None


def _view_rows(shape, geo: tuple) -> int:
    """Rows of ``kv_row_views``: through the last row of the last page's last head."""
    pages, ps, hkv, _ = shape
    return (pages - 1) * geo[0] + (hkv - 1) * geo[1] + ps


def union_rows(geo: tuple, bs: int) -> tuple:
    """``(page, step, head)`` multipliers of the union launch's ``union_blk`` entries for this kernel (``geo``:
    ``kv_rows``): block ``b`` in page ``p`` of KV head h is stored as ``p page + b step + h head``, its first row in
    ``kv_block_descriptors``."""
    rpp, rph, _ = geo
    return rpp, bs, rph


def ws_supported(q: torch.Tensor, cache, params, g_pad: int, qt: int) -> Optional[tuple]:
    """Where ``prefill_attn_ws`` can run this call's attention (see the module's docstring): the pages' rows
    (``kv_rows``, where its TMA finds the blocks), else None."""
    kp, vp = cache.k_pages, cache.v_pages
    ok = (HAVE_GLUON and sm90(q.device) and kp.shape[3] == 128 and params.block_size == 64 and kp.shape[1] % 64 == 0
          and g_pad * qt == ROWS and q.dtype in (torch.bfloat16, torch.float16) and kp.dtype == q.dtype
          and vp.dtype == q.dtype)
    return kv_rows(cache) if ok else None


def attends(q: torch.Tensor, cache, params, plan, tiles: int) -> bool:
    """Whether ``prefill_attn_ws`` attends a wave of ``tiles`` tiles of ``plan`` (a ``PrefillPlan``) on this cache:
    the config wants it (``PrefillConfig.gluon_wanted``) and it runs here (``ws_supported``); else the Triton kernel
    attends the wave. The attention launch and ``route.route_fused`` both ask this."""
    return (plan.config.gluon_wanted(q.shape[2], params.block_size, plan.max_cand, tiles)
            and ws_supported(q, cache, params, pow2(q.shape[1] // cache.num_kv_heads), plan.qt) is not None)


if HAVE_GLUON:

    @gluon.constexpr_function
    def wgmma_layout(n):
        """The accumulator layout of one warpgroup's ``[64, n]`` MMA."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])

    @gluon.jit
    def softmax_scaled(s, scale, bias, m_i, l_i):
        """One block of the online softmax (log2 domain) over the exponents ``s scale + bias`` (``scale > 0``; bias: a
        scalar, or each row's log prior for the block, ``-inf`` where the row did not select it): ``(p, alpha, m,
        l)``, ``alpha`` rescaling the old sums; a row still at ``-inf`` everywhere keeps zero weights. The row maxima
        come from the raw products, so that an entry costs one FMA and one exponent (``attention._prefill_attn_kernel``
        does the same)."""
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * scale + bias)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s * scale + (bias - m_use)[:, None])
        return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)

    @gluon.jit
    def issue_row(desc, buf, bar, row, pred, col):
        """TMA of the K (or V) rows of a block into one ring slot where ``pred``: the box at row ``row`` (the block's
        first, ``kv_rows``), column ``col`` (the KV head's first)."""
        mbarrier.expect(bar, desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(desc, [row, col], bar, buf, pred=pred)

    @gluon.jit
    def _row_of(ublk, j, nu):
        """Union block j's first row (``ublk[j]``), 0 past the union."""
        return gl.load(ublk + j, mask=j < nu, other=0)

    @gluon.jit
    def _issue_row_at(desc, ring, bars, row, j, n0, nu, col, c: gl.constexpr, ST: gl.constexpr):
        """``issue_row`` of the tile's block j (first row ``row``) into warpgroup c's ring of ``ST`` slots, after
        ``n0`` blocks; nothing when ``j >= nu``."""
        slot = c * ST + (n0 + j) % ST
        issue_row(desc, ring.index(slot), bars.index(slot), row, j < nu, col)

    @gluon.jit
    def _load_rows(ptr, row_off, row_ok, D: gl.constexpr, R: gl.constexpr, layout: gl.constexpr):
        """``[R, D]`` rows at ``ptr + row_off[r]`` (int64 element offsets), zero where not ``row_ok``."""
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
        return gl.load(ptr + row_off[:, None] + cols[None, :], mask=row_ok[:, None], other=0.0)

    @gluon.jit
    def _union_loop(q_s, k_all, v_all, kbar, vbar, k_desc, v_desc, ublk, prow, nu, col, qk_scale, n0,
                    c: gl.constexpr, R: gl.constexpr, QT: gl.constexpr, D: gl.constexpr, BS: gl.constexpr,
                    KST: gl.constexpr, VST: gl.constexpr):
        """The online softmax state ``(m, l, acc)`` of a tile's rows over its union blocks ``0 .. nu - 1`` (the first
        blocks it attends), through warpgroup c's own K and V rings, a slot refilled as soon as its MMA is done;
        ``n0`` blocks went through the rings before (the slots' phases). FlashAttention 3's order: block j's QK and
        block j - 1's PV issued together, then block j's softmax."""
        o_layout: gl.constexpr = wgmma_layout(D)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        s_layout: gl.constexpr = wgmma_layout(BS)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        s_zero = gl.zeros([R, BS], gl.float32, s_layout)
        m_i = gl.full([R], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.full([R], 0.0, gl.float32, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([R, D], gl.float32, o_layout)
        dt: gl.constexpr = q_s.dtype
        for s in gl.static_range(KST):
            _issue_row_at(k_desc, k_all, kbar, _row_of(ublk, s, nu), s, n0, nu, col, c, KST)
        for s in gl.static_range(VST):
            _issue_row_at(v_desc, v_all, vbar, _row_of(ublk, s, nu), s, n0, nu, col, c, VST)
        if nu > 0:  # block 0's QK (acc is still zero: no rescale)
            ks = c * KST + n0 % KST
            prior = gl.load(prow)
            row_k = _row_of(ublk, KST, nu)
            # what the next block takes (its prior, the rows its refills load) is loaded a block ahead: loaded in
            # the block that uses it, it stalls the refills and the softmax behind them
            prior_next = gl.load(prow + QT, mask=nu > 1, other=0.0)
            row_k_next = _row_of(ublk, 1 + KST, nu)
            row_v_next = _row_of(ublk, VST, nu)
            mbarrier.wait(kbar.index(ks), (n0 // KST) & 1)
            s_cur = warpgroup_mma(q_s, k_all.index(ks).permute((1, 0)), s_zero, use_acc=False)
            gl.thread_barrier()
            _issue_row_at(k_desc, k_all, kbar, row_k, KST, n0, nu, col, c, KST)
            p, alpha, m_i, l_i = softmax_scaled(s_cur, qk_scale, prior, m_i, l_i)
            for j in range(1, nu):
                ks = c * KST + (n0 + j) % KST
                vs = c * VST + (n0 + j - 1) % VST
                prior, row_k, row_v = prior_next, row_k_next, row_v_next
                prior_next = gl.load(prow + (j + 1) * QT, mask=j + 1 < nu, other=0.0)
                row_k_next = _row_of(ublk, j + 1 + KST, nu)
                row_v_next = _row_of(ublk, j + VST, nu)
                p_op = gl.convert_layout(p.to(dt), p_layout)
                mbarrier.wait(kbar.index(ks), ((n0 + j) // KST) & 1)
                mbarrier.wait(vbar.index(vs), ((n0 + j - 1) // VST) & 1)
                s_cur = warpgroup_mma(q_s, k_all.index(ks).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                acc = warpgroup_mma(p_op, v_all.index(vs), acc, is_async=True)
                s_cur = warpgroup_mma_wait(1, deps=[s_cur])
                gl.thread_barrier()  # every warp's QK is done with the K slot before it is refilled
                _issue_row_at(k_desc, k_all, kbar, row_k, j + KST, n0, nu, col, c, KST)
                p, alpha, m_i, l_i = softmax_scaled(s_cur, qk_scale, prior, m_i, l_i)
                acc = warpgroup_mma_wait(0, deps=[acc])
                gl.thread_barrier()  # and every warp's PV with the V slot
                _issue_row_at(v_desc, v_all, vbar, row_v, j - 1 + VST, n0, nu, col, c, VST)
                acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            vs = c * VST + (n0 + nu - 1) % VST  # the last block's PV
            mbarrier.wait(vbar.index(vs), ((n0 + nu - 1) // VST) & 1)
            acc = warpgroup_mma(gl.convert_layout(p.to(dt), p_layout), v_all.index(vs), acc)
        return m_i, l_i, acc

    @gluon.jit
    def _local_window(q_s, k_s, v_s, k_ptr, v_ptr, sk_p, sk_r, sv_p, sv_r, bt_row, h_k, h_v, first_local,
                      last_local, p_max, pos_s, qk_scale, m_i, l_i, acc, R: gl.constexpr, D: gl.constexpr,
                      BS: gl.constexpr, PPB: gl.constexpr, ld_layout: gl.constexpr):
        """Local window blocks ``first_local .. last_local`` (log prior 0, causal at each row's position
        ``pos_s``) through one K and one V slot, loaded by pointers with the rows past ``p_max`` zeroed (they may
        never have been written)."""
        o_layout: gl.constexpr = wgmma_layout(D)
        s_layout: gl.constexpr = wgmma_layout(BS)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        HALF: gl.constexpr = BS // 2  # rows loaded at once: half the registers of a block
        t_ld = gl.arange(0, HALF, layout=gl.SliceLayout(1, ld_layout))
        t_s = gl.arange(0, BS, layout=gl.SliceLayout(0, s_layout))
        s_zero = gl.zeros([R, BS], gl.float32, s_layout)
        for lb in range(first_local, last_local + 1):
            page = gl.load(bt_row + lb // PPB).to(gl.int64)
            gl.thread_barrier()  # every warp's MMAs are done with the slots
            for half in gl.static_range(2):
                t = half * HALF + t_ld
                rows = ((lb % PPB) * BS + t).to(gl.int64)
                r_ok = lb * BS + t <= p_max
                k_s.slice(half * HALF, HALF).store(_load_rows(k_ptr, page * sk_p + rows * sk_r + h_k, r_ok, D,
                                                              HALF, ld_layout))
                v_s.slice(half * HALF, HALF).store(_load_rows(v_ptr, page * sv_p + rows * sv_r + h_v, r_ok, D,
                                                              HALF, ld_layout))
            fence_async_shared()
            gl.thread_barrier()
            s_cur = warpgroup_mma(q_s, k_s.permute((1, 0)), s_zero, use_acc=False)
            causal = gl.where((lb * BS + t_s)[None, :] <= pos_s[:, None], s_cur, float("-inf"))
            p, alpha, m_i, l_i = softmax_scaled(causal, qk_scale, 0.0, m_i, l_i)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            acc = warpgroup_mma(gl.convert_layout(p.to(q_s.dtype), p_layout), v_s, acc)
        return m_i, l_i, acc

    @gluon.jit
    def _tile_rows(a0, p_lo, p_hi, tok_base, num_tokens, G, R: gl.constexpr, G_PAD: gl.constexpr,
                   layout: gl.constexpr):
        """The tile's ``R`` rows (token ``r // G_PAD`` of the tile, head ``r % G_PAD`` of the group) in ``layout``:
        ``(token row, head in the group, a new token of the tile and g < G)``, as ``tiles.tile_rows``."""
        r = gl.arange(0, R, layout=layout)
        pos = a0 + r // G_PAD
        tok = tok_base + pos
        g = r % G_PAD
        return tok, g, (pos >= p_lo) & (pos < p_hi) & (tok < num_tokens) & (g < G)

    @gluon.jit
    def _tile(c: gl.constexpr, w, h, n0, rt, QT: gl.constexpr, G_PAD: gl.constexpr, D: gl.constexpr,
              BS: gl.constexpr, PPB: gl.constexpr, KST: gl.constexpr, VST: gl.constexpr):
        """Warpgroup c runs tile w of the wave for KV head h; ``n0`` union blocks went through its rings before.
        Returns the blocks this tile put through them."""
        (q_ptr, sq_t, sq_h, k_ptr, v_ptr, sk_p, sk_r, sk_h, sv_p, sv_r, sv_h, bt_ptr, sbt_n, k_desc, v_desc,
         q_all, k_all, v_all, kbar, vbar, info_ptr, sinfo, nu_ptr, ublk_ptr, sub_w, sub_h, uprior_ptr, spr_w,
         spr_h, o_ptr, so_t, so_h, qk_scale, G, num_tokens, HKV, cols_ph) = rt
        R: gl.constexpr = QT * G_PAD
        info = info_ptr + w * sinfo
        p_lo = gl.load(info + INFO_P_LO)
        p_hi = gl.load(info + INFO_P_HI)
        nu = gl.where(p_lo < p_hi, gl.load(nu_ptr + w * HKV + h), 0)
        # the row's other fields in the same round trip (every tile of the wave has its row); the live test reads
        # them too, through conditions that always hold, else the compiler sinks their loads below it
        ok = gl.load(info + INFO_OK)
        tok_base = gl.load(info + INFO_TOK_BASE)
        a0 = gl.load(info + INFO_A0)
        first_local = gl.load(info + INFO_FIRST_LOCAL)
        last_local = gl.load(info + INFO_LAST_LOCAL)
        req = gl.load(info + INFO_REQ)
        if (p_lo < p_hi) & (ok >= 0) & (a0 >= 0) & (req >= 0) & (tok_base != -2147483648):  # live tiles only
            ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
            o_layout: gl.constexpr = wgmma_layout(D)
            s_layout: gl.constexpr = wgmma_layout(BS)
            # the queries, zero where not a live row of an ok request
            tok_ld, g_ld, in_ld = _tile_rows(a0, p_lo, p_hi, tok_base, num_tokens, G, R, G_PAD,
                                             gl.SliceLayout(1, ld_layout))
            q = _load_rows(q_ptr, tok_ld.to(gl.int64) * sq_t + (h * G + g_ld) * sq_h, in_ld & (ok != 0), D, R,
                           ld_layout)
            q_s = q_all.index(c)
            gl.thread_barrier()  # every warp's MMAs of the previous tile are done with the queries
            q_s.store(q)
            fence_async_shared()
            gl.thread_barrier()
            r_s = gl.arange(0, R, layout=gl.SliceLayout(1, s_layout))
            prow = uprior_ptr + w.to(gl.int64) * spr_w + h * spr_h + r_s // G_PAD
            ublk = ublk_ptr + w.to(gl.int64) * sub_w + h * sub_h
            m_i, l_i, acc = _union_loop(q_s, k_all, v_all, kbar, vbar, k_desc, v_desc, ublk, prow, nu,
                                        h * cols_ph, qk_scale, n0, c, R, QT, D, BS, KST, VST)
            # every TMA this warpgroup issued has been waited for: its first slots take the local window
            bt_row = bt_ptr + req.to(gl.int64) * sbt_n
            m_i, l_i, acc = _local_window(q_s, k_all.index(c * KST), v_all.index(c * VST), k_ptr, v_ptr, sk_p, sk_r,
                                          sv_p, sv_r, bt_row, h * sk_h, h * sv_h, first_local, last_local,
                                          p_hi - 1, a0 + r_s // G_PAD, qk_scale, m_i, l_i, acc, R, D, BS, PPB,
                                          ld_layout)
            # the output: acc / l, zero where no key was attended (l = 0); through the queries' shared memory into
            # the loads' layout, so that each thread stores 16 contiguous bytes of a row (the accumulator's layout
            # gives it pairs of columns)
            l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
            o = acc * (1.0 / gl.where(l_o > 0, l_o, 1.0))[:, None]
            gl.thread_barrier()  # every warp's MMAs are done with the queries
            q_s.store(o.to(q_s.dtype))
            gl.thread_barrier()
            cols = gl.arange(0, D, layout=gl.SliceLayout(0, ld_layout))
            gl.store(o_ptr + (tok_ld.to(gl.int64) * so_t + (h * G + g_ld) * so_h)[:, None] + cols[None, :],
                     q_s.load(ld_layout).to(o_ptr.dtype.element_ty), mask=in_ld[:, None])
        return nu

    @gluon.jit
    def _worker(c: gl.constexpr, rt, tiles, items, counter, QT: gl.constexpr, G_PAD: gl.constexpr, D: gl.constexpr,
                BS: gl.constexpr, PPB: gl.constexpr, KST: gl.constexpr, VST: gl.constexpr, LAST_FIRST: gl.constexpr):
        """Warpgroup c: (tile, KV head) items taken from the wave's counter until none is left, by KV head then
        tile (the launch order of the Triton kernel: neighbouring tiles of a head, which share most of their
        blocks, run at the same time), the wave's last tile first with LAST_FIRST."""
        n0 = 0
        item = gl.atomic_add(counter, 1, sem="relaxed")  # a ticket: no ordering needed (acq_rel fences the GPU)
        while item < items:
            w = item % tiles
            if LAST_FIRST:
                w = tiles - 1 - w
            n0 += _tile(c, w, item // tiles, n0, rt, QT, G_PAD, D, BS, PPB, KST, VST)
            item = gl.atomic_add(counter, 1, sem="relaxed")

    @cached_launch
    @gluon.jit(do_not_specialize=["tiles", "num_tokens", "G"])  # no compile per prompt length
    def prefill_attn_ws(q_ptr, sq_t, sq_h, k_ptr, v_ptr, sk_p, sk_r, sk_h, sv_p, sv_r, sv_h, bt_ptr, sbt_n,
                        k_desc, v_desc, o_ptr, so_t, so_h, cols_ph,
                        info_ptr, sinfo, nu_ptr, ublk_ptr, sub_w, sub_h, uprior_ptr, spr_w, spr_h,
                        qk_scale, G, tiles, num_tokens, HKV, counter_ptr,
                        QT: gl.constexpr, G_PAD: gl.constexpr, D: gl.constexpr, BS: gl.constexpr,
                        PPB: gl.constexpr, NC: gl.constexpr, KST: gl.constexpr, VST: gl.constexpr,
                        REGS: gl.constexpr, LAST_FIRST: gl.constexpr = False):
        """Persistent grid (one program a multiprocessor): ``NC`` (3) warpgroups, each taking (tile, KV head) items
        of the wave from ``counter_ptr`` (zeroed by the union launch) and running the tile over its union
        (``union_blk``: each block's first row, ``union_prior`` and ``union_count`` of the Triton union launch) and
        its local window; writes ``out`` as the Triton kernel does. The parameters up to ``cols_ph`` are a layer's
        own (``WS_LEAD``), the others its step's (``attention.bind_attention`` binds them)."""
        R: gl.constexpr = QT * G_PAD
        dt: gl.constexpr = q_ptr.dtype.element_ty
        q_all = gl.allocate_shared_memory(dt, [NC, R, D], k_desc.layout)
        k_all = gl.allocate_shared_memory(dt, [NC * KST, BS, D], k_desc.layout)
        v_all = gl.allocate_shared_memory(dt, [NC * VST, BS, D], v_desc.layout)
        kbar = gl.allocate_shared_memory(gl.int64, [NC * KST, 1], mbarrier.MBarrierLayout())
        vbar = gl.allocate_shared_memory(gl.int64, [NC * VST, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(NC * KST):
            mbarrier.init(kbar.index(s), count=1)
        for s in gl.static_range(NC * VST):
            mbarrier.init(vbar.index(s), count=1)
        fence_async_shared()
        gl.static_assert(NC == 3, "three warpgroups")
        rt = (q_ptr, sq_t, sq_h, k_ptr, v_ptr, sk_p, sk_r, sk_h, sv_p, sv_r, sv_h, bt_ptr, sbt_n, k_desc, v_desc,
              q_all, k_all, v_all, kbar, vbar, info_ptr, sinfo, nu_ptr, ublk_ptr, sub_w, sub_h, uprior_ptr, spr_w,
              spr_h, o_ptr, so_t, so_h, qk_scale, G, num_tokens, HKV, cols_ph)
        gl.warp_specialize([
            (_worker, (0, rt, tiles, tiles * HKV, counter_ptr, QT, G_PAD, D, BS, PPB, KST, VST, LAST_FIRST)),
            (_worker, (1, rt, tiles, tiles * HKV, counter_ptr, QT, G_PAD, D, BS, PPB, KST, VST, LAST_FIRST)),
            (_worker, (2, rt, tiles, tiles * HKV, counter_ptr, QT, G_PAD, D, BS, PPB, KST, VST, LAST_FIRST)),
        ], [4, 4], [REGS, REGS])


def kv_row_views(cache, geo: tuple) -> tuple:
    """The K and V pages as ``[rows, columns]`` views of one row stride (``geo``: ``kv_rows``): element ``[p, t, h,
    c]`` of the pages at row ``p rows_a_page + h rows_a_head + t``, column ``h columns_a_head + c``."""
    kp = cache.k_pages
    cols = (kp.shape[2] - 1) * geo[2] + kp.shape[3]
    return tuple(x.as_strided((_view_rows(kp.shape, geo), cols), (x.stride(1), 1)) for x in (kp, cache.v_pages))


def kv_block_descriptors(cache, bs: int, geo: tuple) -> tuple:
    """Gluon TMA descriptors of ``kv_row_views`` with ``[bs, D]`` boxes: block ``b`` (``PPB`` a page) of KV head h
    at row ``(b // PPB) rows_a_page + (b % PPB) bs + h rows_a_head`` (what the union launch writes to
    ``union_blk`` for this kernel: ``union_rows``), column ``h columns_a_head`` (``ws_supported`` layouts only).
    Built once per cache object (``PagedKVCache.kept``)."""
    def build() -> tuple:
        kp = cache.k_pages
        layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=kp.element_size() * 8, rank=2)
        return tuple(GluonDescriptor.from_tensor(x, [bs, kp.shape[3]], layout) for x in kv_row_views(cache, geo))

    return cache.kept(("gluon_kv_block_descriptors", bs, geo), build)
