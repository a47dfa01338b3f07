"""Triton paged prefill / extend: tiled routing through ``route_tile`` and tile-shared sparse attention.

Every request ``i`` of a batch extends its paged history by the tokens ``cu_seqlens_q[i] ..
cu_seqlens_q[i+1] - 1`` at positions ``seq_lens[i] - qlen_i .. seq_lens[i] - 1``; K/V of the new tokens
are already in the cache (``cache_dash_prefill``) and so are the summaries of every block they complete.

Tiles. A tile is up to ``QT`` new tokens of one request at positions ``a0 .. a0 + QT - 1`` with ``a0`` a
multiple of ``QT``, and ``QT`` divides the block size: the tokens of a tile share their block, hence their
candidates (blocks ``0 .. cur - local_blocks``) and their local window. ``QT * G_PAD`` query rows
(tokens x the G query heads of one KV head, padded to a power of two) make one tensor-core tile.
Tiles are numbered request by request (``tile_tables``); a request adds at most one partial tile at
each end.

Waves. Routing needs, per token, the scores of every candidate (``[Hq, max_cand]`` fp32, unless it computes
them again in each pass: below), its ``mp`` and its selection. That scratch is allocated for ``W`` tiles only
(``W`` from a byte budget, default ``SCRATCH_BYTES``, in whole rounds of resident programs: ``wave_tiles``),
and the tiles are processed in waves of ``W``: never a ``[tokens x blocks]`` matrix for the whole prompt. Each
wave is two launches:

- ``_prefill_route_kernel``, grid ``(W, Hkv)`` (``(W, 1)`` for router ``shared``): scores of the tile's
  tokens against every candidate summary (``tl.dot``, read through the page table) into the scratch,
  then ``routing.route_tile`` with the tile's tokens as units: the one routing routine of decode (here
  writing each unit's positive ``mp`` as a list, which the ``topk`` cap and the compaction read instead
  of every candidate). With router ``kv_head`` on long block tables (``recompute_routing``) no score is
  stored: each of the five passes computes the scores again from a copy of the request's summaries in
  candidate order (``gather_summaries``, one launch per call), with ``route_tile``'s arithmetic
  (``_route_recompute``).
- ``_prefill_attn_kernel``, grid ``(W, Hkv)``: the union of the tile's selected blocks (built in
  parallel passes: the candidates some token kept marked in a table of one int32 a candidate, compacted in
  increasing order by a scan, then every token's prior put at its blocks' union positions), then attention of the
  ``QT * G`` rows over the local window (causal) and each union block, loading each K/V block once for
  the tile; rows that did not select a block get ``-inf`` logits there, the others their log prior.
  Queries of a tile routed to the same block share the load and the MMA (how much depends on how
  similar neighbouring tokens' selections are). On Hopper and later, a union tile of one block is loaded
  by TMA where the cache's layout allows (``_kv_descriptors``), else by pointer loads. On the H200, for the
  configurations ``prefill_ws.ws_supported`` names, this launch builds the unions only and a Gluon launch
  (``prefill_ws.prefill_attn_ws``, three warpgroups a program) runs the attention.

Nothing reads a device value on the host: grid and scratch sizes come from shapes (``T``, ``n``,
``max_pages``), tile placement is computed on the device.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..layout import PagedKVCache
from ..params import DashParams
from ..workspace import PrefillWorkspace, check_workspace
from .common import block_page, interpreting, max_or_zero, raise_max, scaled_query, summary_index, summary_scores
from . import prefill_ws
from .prefill_ws import (INFO_A0, INFO_FIRST_LOCAL, INFO_LAST_LOCAL, INFO_OK, INFO_P_HI, INFO_P_LO, INFO_REQ,
                         INFO_TOK_BASE)
from .launcher import check_indexer_query, check_kernel_query, check_step_tensors, sm_count
from .routing import (append_positive, halley_step, mp_key_range, positive_part, route_tile,
                      select_kept)

logger = logging.getLogger(__name__)

SCRATCH_BYTES = 896 << 20  # routing scratch of one wave (scores, mp, selection, union lists): < 1 GB
# Programs of either prefill launch resident on one multiprocessor (registers and shared memory allow 2 at
# D 128 on the H200, ncu); waves are sized in whole rounds of them (``wave_tiles``). 0: the budget alone.
RESIDENT_CTAS = 2
ATTN_ROWS = 64  # query rows of one tile (tokens x padded GQA group)
ROUTE_TILE_BUDGET = 4096  # elements of route_tile's largest register tile (QT units at once; 2048: 14 ms slower at 128k)
ROUTE_WARPS = 8
ROUTE_STAGES = 3  # pipeline stages of its score loops
ROUTE_SCORE_TILE = 64  # candidates of one score tile of the route kernel (half that above D 128)
# The topk cap of a route tile (128k topk 64 on the H200, routing alone: 44.6 ms with these three against 53.6 ms
# with 16 pivots and 16-wide tiles for every pass; 2 or 8 pivots, or 64-wide pivot tiles: 68-69 ms)
ROUTE_PIVOTS = 4  # pivots per pass of the search for the topk-th largest mp of each unit's list
ROUTE_PIVOT_BUDGET = 2048  # elements of the search's [QT, pivots, entries] tile
ROUTE_LIST_BUDGET = 1024  # elements of the [QT, entries] tiles of the ties and compaction passes
ATTN_WARPS = 4
# Routing without a score scratch (router kv_head): the five passes compute the scores again from a copy of each
# request's summaries in candidate order (gather_summaries), made once per call where block tables hold at least
# RECOMPUTE_MIN_CAND blocks (half that for groups of RECOMPUTE_WIDE_GROUP query heads or more) and the copy takes at
# most SUMMARY_COPY_BYTES; else the scores are stored. On the H200 (docs/PERFORMANCE.md, run 31, topk 64 with the
# write) from the copy against stored: 8.21 against 8.71 ms at 32k and 2.07 against 2.26 at 16k (Hkv 8), 4.89 against
# 7.15 at 32k (Hkv 2); at 8k (128 blocks) 1.13 against 0.97 at Hkv 8 (G 4) but 0.70 against 0.84 at Hkv 2 (G 16).
ROUTE_RECOMPUTE = 1
RECOMPUTE_MIN_CAND = 256
RECOMPUTE_WIDE_GROUP = 16
ROUTE_RECOMPUTE_WARPS = 4
ROUTE_RECOMPUTE_MAXNREG = 168  # its register cap (0: none): 3 programs a multiprocessor, not 2 (ptxas takes 255)
ROUTE_RECOMPUTE_STAGES = 3  # pipeline stages of its score passes' summary loads
ROUTE_COPY_TMA = 1  # the passes load the copy by TMA (Hopper and later), else by pointers
SUMMARY_COPY_BYTES = 16 << 20
ATTN_STAGES = 3  # K/V of the union loop two tiles ahead (2: 155 against 137 ms at 128k topk 64 on the H200)
ATTN_KEYS = 64  # keys of one union tile of the attention kernel, a power of two (BLOCK_U; 128 spills at D 128: slower on the H200)
# Union block ids loaded at once: the loop over them loads K/V at addresses it computes. Tiles of one block take
# 32 (16: 3% slower at 128k on the H200, 64: 1%); tiles of several blocks pick ids by tl.gather, which with 32
# ids hit an illegal address on the H200 (triton 3.6; test_long_extend_on_long_history_varlen, bs 32): 16 there.
UNION_CHUNK = 32
UNION_CHUNK_GATHER = 16
ATTN_SCALAR_BASE = 1  # a union tile of one block: its K/V addresses from one scalar base
ATTN_TMA = 1  # union tiles of one block loaded by TMA (Hopper and later; pointer loads otherwise)
ATTN_WS = 1  # the Gluon attention launch (prefill_ws) where it runs; 0: the Triton kernel everywhere
ZERO_TAIL_PROGRAMS = 64  # programs a query head of the launch that zeroes the rows of no request
# Issue a call's waves from its last: a prompt's first waves (short contexts) run in less time than the host takes to
# issue a wave, so issued first they leave the GPU waiting; issued last, they run from the queue the long waves built
WAVES_LAST_FIRST = 1
# elements of the attention kernel's [TU, QT] union-building tiles (2048 took 1 ms more at 128k, measured on the
# table of priors by candidate that the int32 table replaced)
UNION_TILE = 4096
UNION_LIST_TILE = 2048  # elements of its [QT, TJ] tiles of the tokens' lists (4096 spills uncapped at D 128)
# The Halley passes count the entries above tau as a sum of min(x - tau, COUNT_UNIT): exactly COUNT_UNIT (the
# smallest normal fp32) each, times 2^126 at the end; two instructions an entry instead of about three for a compare,
# a select and an integer sum. Only an entry above tau by a subnormal (both under about 2^-102) counts as less.
COUNT_UNIT = tl.constexpr(2.0 ** -126)
# Globals a compiled kernel reads must be constexpr objects.
LOG2E_HOST = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E_HOST)


def _pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def tile_tokens(num_q_heads: int, num_kv_heads: int, block_size: int) -> int:
    """Tokens per tile ``QT``: a power of two dividing ``block_size`` with ``QT * G_PAD <= ATTN_ROWS``."""
    g_pad = _pow2(num_q_heads // num_kv_heads)
    return min(block_size, max(1, ATTN_ROWS // g_pad))


# ------------------------------------------------------------------------------------------------
# tile geometry (device)


@triton.jit
def _tile_bounds(tile, n, tile_req_ptr, tile_off_ptr, cu_ptr, seq_lens_ptr, max_tokens,
                 QT: tl.constexpr, BS: tl.constexpr, LOCAL_BLOCKS: tl.constexpr):
    """Where tile ``tile`` lies: ``(req, ok, tok_base, a0, p_lo, p_hi, first_local, ncand)``.

    The tile's tokens are positions ``p_lo .. p_hi - 1`` (inside ``a0 .. a0 + QT - 1``) of request
    ``req``; position ``p`` is token row ``tok_base + p``. ``ok`` is False for a tile past the last
    one and for a request whose lengths are inconsistent (``qlen > seq_len``) or exceed the page
    table (``seq_len > max_tokens``): its rows are written as zeros. Candidates are blocks
    ``0 .. ncand - 1``; the local window is ``first_local .. a0 // BS``.
    """
    req = tl.load(tile_req_ptr + tile)
    live = req < n
    req = tl.minimum(req, n - 1)
    q0 = tl.load(cu_ptr + req).to(tl.int32)
    qlen = tl.load(cu_ptr + req + 1).to(tl.int32) - q0
    length = tl.load(seq_lens_ptr + req).to(tl.int32)
    start = length - qlen
    ok = live & (start >= 0) & (length <= max_tokens) & (qlen > 0)
    start_c = tl.maximum(start, 0)
    a0 = (start_c // QT + (tile - tl.load(tile_off_ptr + req))) * QT
    p_lo = tl.maximum(a0, start_c)
    p_hi = tl.where(live, tl.minimum(a0 + QT, start_c + qlen), p_lo)
    first_local = tl.maximum(a0 // BS - LOCAL_BLOCKS + 1, 0)
    ncand = tl.where(ok, first_local, 0)
    return req, ok, q0 - start_c, a0, p_lo, p_hi, first_local, ncand


@triton.jit
def _tile_rows(a0, p_lo, p_hi, tok_base, num_tokens, ok, G, QT: tl.constexpr, G_PAD: tl.constexpr,
               PAIRED: tl.constexpr = False):
    """The ``QT * G_PAD`` query rows (token u, head g of the group) of a tile and its ``QT`` units: row
    ``u G_PAD + g``, or with PAIRED (64 rows, ``G_PAD >= 2``) row ``16 w + 8 h + i`` holds token
    ``w L + i % L`` and head ``2 (i // L) + h`` (``L = 16 // G_PAD``): a warpgroup MMA's accumulator gives each
    thread rows ``r`` and ``r + 8``, here two heads of one token, and a token's heads lie in ``G_PAD / 2`` threads
    of one warp, so sums over a token's heads (``_group_sums_tile``) take fewer shuffles.

    Returns ``u_m, g_m, pos_m, tok_m [M]`` (token of the tile, head in the group, position, token row
    int64), ``in_m [M]`` (a new token of the tile and ``g < G``, whether or not its request is ``ok``)
    and ``unit_ok [QT]`` (a new token of an ``ok`` request)."""
    offs_m = tl.arange(0, QT * G_PAD)
    if PAIRED:
        L: tl.constexpr = 16 // G_PAD
        i = offs_m % 8
        u_m = offs_m // 16 * L + i % L
        g_m = 2 * (i // L) + offs_m // 8 % 2
    else:
        u_m = offs_m // G_PAD
        g_m = offs_m % G_PAD
    pos_m = a0 + u_m
    tok_m = (tok_base + pos_m).to(tl.int64)
    in_m = (pos_m >= p_lo) & (pos_m < p_hi) & (tok_m < num_tokens) & (g_m < G)
    pos_u = a0 + tl.arange(0, QT)
    unit_ok = (pos_u >= p_lo) & (pos_u < p_hi) & (tok_base + pos_u < num_tokens) & ok
    return u_m, g_m, pos_m, tok_m, in_m, unit_ok


@triton.jit(do_not_specialize=["n", "nt", "steps"])
def _tile_tables_kernel(cu_ptr, seq_lens_ptr, tile_req_ptr, tile_off_ptr, n, nt, steps,
                        QT: tl.constexpr, R: tl.constexpr):
    """Grid ``(1,)``: ``tile_off`` (a running sum of each request's tiles, ``R`` requests at a time), then
    ``tile_req`` by a binary search of each tile id in it (``steps`` halvings of ``[0, n)``)."""
    offs = tl.arange(0, R)
    tl.store(tile_off_ptr, 0)
    carry = 0
    for c0 in range(0, n, R):
        i = c0 + offs
        m = i < n
        q0 = tl.load(cu_ptr + i, mask=m, other=0).to(tl.int32)
        qlen = tl.load(cu_ptr + i + 1, mask=m, other=0).to(tl.int32) - q0
        start = tl.maximum(tl.load(seq_lens_ptr + i, mask=m, other=0).to(tl.int32) - qlen, 0)
        tiles = tl.where(m & (qlen > 0), (start % QT + qlen + QT - 1) // QT, 0)
        tl.store(tile_off_ptr + i + 1, tl.cumsum(tiles, axis=0) + carry, mask=m)
        carry += tl.sum(tiles, axis=0)
    tl.debug_barrier()  # the offsets are read back by other threads
    for t0 in range(0, nt, R):
        t = t0 + offs
        lo = tl.zeros([R], tl.int32)
        hi = tl.zeros([R], tl.int32) + n
        for _ in range(steps):  # the first request whose tiles end after t (n: past the last tile)
            open_ = lo < hi
            mid = (lo + hi) // 2
            end = tl.load(tile_off_ptr + mid + 1, mask=open_, other=0)
            right = open_ & (end <= t)
            lo = tl.where(right, mid + 1, lo)
            hi = tl.where(open_ & ~right, mid, hi)
        tl.store(tile_req_ptr + t, lo, mask=t < nt)


def tile_tables(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int, qt: int):
    """Device tables placing the tiles, in one launch and without synchronising.

    Returns ``tile_req [NT]`` int32 (request of each tile, ``n`` past the last tile), ``tile_off
    [n + 1]`` int32 (first tile of each request) and the static bound ``NT = T // QT + 2 n``
    (``cdiv(start % QT + qlen, QT) <= qlen // QT + 2`` tiles per request).
    """
    n = seq_lens.shape[0]
    nt = num_tokens // qt + 2 * n
    dev = seq_lens.device
    tile_req = torch.empty(nt, dtype=torch.int32, device=dev)
    tile_off = torch.empty(n + 1, dtype=torch.int32, device=dev)
    _tile_tables_kernel[(1,)](cu_seqlens_q, seq_lens, tile_req, tile_off, n, nt, max(1, n.bit_length()), QT=qt,
                              R=1024, num_warps=4)
    return tile_req, tile_off, nt


def tile_layout_host(cu_seqlens_q, seq_lens, qt: int) -> list:
    """The tiles as host tuples ``(req, a0, p_lo, p_hi, tok_base)`` in tile order (tests, debugging;
    reads device values). Mirrors ``_tile_bounds`` for valid requests."""
    cu = [int(x) for x in cu_seqlens_q.tolist()]
    out = []
    for i, length in enumerate(int(x) for x in seq_lens.tolist()):
        qlen = cu[i + 1] - cu[i]
        if qlen <= 0:
            continue
        start = max(length - qlen, 0)
        a0 = start // qt * qt
        while a0 < start + qlen:
            out.append((i, a0, max(a0, start), min(a0 + qt, start + qlen), cu[i] - start))
            a0 += qt
    return out


# ------------------------------------------------------------------------------------------------
# routing


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


def recompute_routing(params: DashParams, n: int, max_cand: int, hq: int, hkv: int, d: int, itemsize: int,
                      route_heads: Optional[int] = None) -> bool:
    """Whether a call routes without a score scratch (``_route_recompute``): router ``kv_head``, no indexer, block
    tables of at least ``recompute_min_cand(hq // hkv)`` blocks and a summary copy of at most ``SUMMARY_COPY_BYTES``."""
    return (_may_recompute(params, max_cand, hq // hkv, route_heads)
            and n * max_cand * hkv * d * itemsize <= SUMMARY_COPY_BYTES)


def recompute_min_cand(group: int) -> int:
    """The fewest blocks of a block table that route from the summary copy, for ``group`` query heads per KV head:
    ``RECOMPUTE_MIN_CAND``, half that from ``RECOMPUTE_WIDE_GROUP`` heads (measured at 128 blocks: the copy is
    the faster path at 16 heads, the slower at 4, and routes more slowly at 8)."""
    return RECOMPUTE_MIN_CAND // 2 if group >= RECOMPUTE_WIDE_GROUP else RECOMPUTE_MIN_CAND


def _may_recompute(params: DashParams, max_cand: int, group: int, route_heads: Optional[int]) -> bool:
    return (bool(ROUTE_RECOMPUTE) and params.router != "shared" and route_heads is None
            and max_cand >= recompute_min_cand(group))


def gather_summaries(cache: PagedKVCache, block_table: torch.Tensor, seq_lens: torch.Tensor, params: DashParams,
                     scratch: "PrefillScratch") -> None:
    """Copy each request's summaries in candidate order into ``scratch.summary_copy [n, max_cand, Hkv, D]`` (one
    launch), once per call before its route launches; nothing where the scratch has no copy."""
    copy = scratch.summary_copy
    if copy is None:
        return
    summ = cache.summaries
    n, max_cand, hkv, d = copy.shape
    scratch.copied_from = _copy_source(cache, block_table, seq_lens)
    cb = 32
    _gather_summaries_kernel[(n, triton.cdiv(max_cand, cb))](
        summ, summ.stride(0), summ.stride(1), block_table, block_table.stride(0), seq_lens,
        block_table.shape[1] * cache.page_size, copy, max_cand, hkv, D=d, BS=params.block_size, PS=cache.page_size,
        CB=cb, num_warps=4)


@triton.jit
def _scaled_queries(q_ptr, sq_t, sq_h, tok_m, heads, row_ok, sf, offs_d):
    """``sf * q`` of the rows (token ``tok_m``, query head ``heads``), rounded to the query dtype (SPEC.md section 4);
    zero rows where not ``row_ok``."""
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
    ``_tile_rows``' order)."""
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
    not on the MMA's (far fewer instructions; PERFORMANCE.md).
    STAGE_Q: the scaled queries go through the units' mp rows (free until the lists are written) and are loaded
    back, so that the MMAs read them from shared memory; computed in registers, Triton reloads them into registers
    for every score tile (PERFORMANCE.md, run 28)."""
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
    key_min = tl.full([QT], 0x7F800000, tl.int32)
    key_max = tl.zeros([QT], tl.int32)
    # Each tile's group sums are loaded one iteration ahead: waiting for them where they are used took an eighth
    # of the route kernel's stall samples (ncu, 128k topk 64 on the H200).
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


@triton.jit(do_not_specialize=["tile0", "n", "max_tokens", "num_tokens", "G", "HKV", "topk", "sel_cap"])
def _prefill_route_kernel(
    q_ptr, sq_t, sq_h, summ_ptr, ss_b, ss_h, bt_ptr, sbt_n,
    cu_ptr, seq_lens_ptr, tile_req_ptr, tile_off_ptr, tile0, n, max_tokens, num_tokens,
    x_ptr, sx_n, sx_h, mp_ptr, smp_n, smp_h, ck_ptr,
    sel_idx_ptr, sel_blk_ptr, sel_bias_ptr, ssel_n, ssel_h, sel_cap, count_ptr, scnt_n,
    sf, x_scale, G, HKV, topk, inv_sigma, cs_ptr, cs_desc, cs_req,
    QT: tl.constexpr, G_PAD: tl.constexpr, NH_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    PS: tl.constexpr, LOCAL_BLOCKS: tl.constexpr, BLOCK_N: tl.constexpr, TC: tl.constexpr, TS: tl.constexpr,
    NPIV: tl.constexpr, HAS_TOPK: tl.constexpr, EST_DIAG: tl.constexpr, SHARED: tl.constexpr, TL: tl.constexpr,
    RECOMPUTE: tl.constexpr = False, CS_TMA: tl.constexpr = False, HKV_C: tl.constexpr = 1,
    STAGE_Q: tl.constexpr = False,
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
    """
    w = tl.program_id(0)
    hp = tl.program_id(1)
    req, ok, tok_base, a0, p_lo, p_hi, first_local, ncand = _tile_bounds(
        tile0 + w, n, tile_req_ptr, tile_off_ptr, cu_ptr, seq_lens_ptr, max_tokens, QT, BS, LOCAL_BLOCKS)
    if p_lo < p_hi:  # tiles past the last one do nothing
        M: tl.constexpr = QT * G_PAD
        PAIRED: tl.constexpr = RECOMPUTE and M == 64 and G_PAD >= 2  # the summary copy's mp pass sums heads
        offs_d = tl.arange(0, D)
        offs_n = tl.arange(0, BLOCK_N)
        u_m, g_m, pos_m, tok_m, in_m, unit_ok = _tile_rows(a0, p_lo, p_hi, tok_base, num_tokens, ok, G, QT, G_PAD,
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
        else:  # the stored scores
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
                ONE_TILE=False,  # QT units: the mp of every candidate would not fit in registers
                LIST=True, TL=TL,
            )


# ------------------------------------------------------------------------------------------------
# attention


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
        tl.store(ublk_row + j, page * ublk_page + (c % ppb_u) * ublk_step + h * ublk_head, mask=kept)
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
        tl.store(uprior_row + pos * QT + offs_u[:, None], b * _LOG2E, mask=live)
    tl.debug_barrier()  # the union lists are read back by other threads
    return nu


@triton.jit(do_not_specialize=["tile0", "n", "max_tokens", "num_tokens", "G"])
def _prefill_attn_kernel(
    q_ptr, sq_t, sq_h, k_ptr, v_ptr, sk_p, sk_r, sk_h, sv_p, sv_r, sv_h, bt_ptr, sbt_n,
    cu_ptr, seq_lens_ptr, tile_req_ptr, tile_off_ptr, tile0, n, max_tokens, num_tokens,
    sel_idx_ptr, sel_bias_ptr, ssel_n, ssel_h, count_ptr, scnt_n, scnt_h,
    uprior_ptr, spr_w, spr_h, ublk_ptr, sub_w, sub_h, upos_ptr, spos_w, spos_h, o_ptr, so_t, so_h, qk_scale, G,
    k_desc, v_desc, info_ptr, sinfo, nu_ptr, counter_ptr, ublk_page, ublk_step, ublk_head,
    QT: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, PS: tl.constexpr,
    LOCAL_BLOCKS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_U: tl.constexpr, TU: tl.constexpr, TJ: tl.constexpr,
    UCH: tl.constexpr, ONE_BLOCK: tl.constexpr, TMA: tl.constexpr, TMA_HEAD_MAJOR: tl.constexpr,
    UNION_ONLY: tl.constexpr = False,
):
    """Grid ``(W, Hkv)``: program (w, h) attends the ``[QT * G_PAD, D]`` query rows of tile
    ``tile0 + w`` for KV head h.

    1. Union (``_tile_union``): the candidates some token of the tile kept (``sel_* [slot, Hsel, cap]``,
       ``count``; ``ssel_h == scnt_h == 0`` for router ``shared``), marked in ``upos [w, h, c]`` and compacted, in
       increasing order, into ``ublk [w, h, j]`` (physical block, or for ``prefill_ws`` its first row:
       ``ublk_page``, ``ublk_step``, ``ublk_head``) with every token's log2 prior for it in
       ``uprior [w, h, j, u]`` (``-inf``: not kept by token u), so that the attention loop reads them at
       addresses of ``j`` only. ``[TU]``, ``[TU, QT]`` and ``[QT, TJ]`` tiles.
    2. Local window blocks (log prior 0, causal per row) in ``[BLOCK_T, D]`` K/V tiles, then the union
       blocks in ``[BLOCK_U, D]`` tiles (``BLOCK_U // BS`` consecutive union blocks per tile, or
       ``BS // BLOCK_U`` tiles per block) read from the pages once for the tile (addresses depend on the
       loop index only, so loads can be pipelined; with TMA a tile of one block is a box of ``k_desc``,
       ``v_desc`` from ``_kv_descriptors``, which otherwise are the K/V pointers again and unused): ``[M, BLOCK_U]`` fp32 logits plus each row's bias
       for the block of each key, online softmax in base 2.
    Writes ``out [token, h * G + g, :]`` in the output dtype; rows of a tile whose request is
    inconsistent get zeros.

    UNION_ONLY: step 1 only, for ``prefill_ws.prefill_attn_ws``: the union's size to ``nu_ptr [w Hkv + h]``, the
    tile's bounds to row w of ``info_ptr`` (rows ``sinfo`` apart, columns ``prefill_ws.INFO_*``), and 0 to
    ``counter_ptr`` (the Gluon launch's work counter).
    """
    w = tl.program_id(0)
    h = tl.program_id(1)
    req, ok, tok_base, a0, p_lo, p_hi, first_local, ncand = _tile_bounds(
        tile0 + w, n, tile_req_ptr, tile_off_ptr, cu_ptr, seq_lens_ptr, max_tokens, QT, BS, LOCAL_BLOCKS)
    last_local = tl.where(ok, a0 // BS, first_local - 1)
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
        u_m, g_m, pos_m, tok_m, in_m, unit_ok = _tile_rows(a0, p_lo, p_hi, tok_base, num_tokens, ok, G, QT, G_PAD)
        row_ok = in_m & ok
        heads = h * G + g_m
        bt_row = bt_ptr + req.to(tl.int64) * sbt_n
        slot0 = w.to(tl.int64) * QT
        p_max = p_hi - 1  # last position of the tile: keys after it may not be written yet

        # 1. union of the tile's selections (units: its tokens)
        uprior_row = uprior_ptr + w.to(tl.int64) * spr_w + h * spr_h  # [max_cand, QT] contiguous
        ublk_row = ublk_ptr + w.to(tl.int64) * sub_w + h * sub_h
        nu = _tile_union(ncand, unit_ok, slot0, h, bt_row, count_ptr, scnt_n, scnt_h, sel_idx_ptr, sel_bias_ptr, ssel_n,
                         ssel_h, upos_ptr + w.to(tl.int64) * spos_w + h * spos_h, uprior_row, ublk_row, ublk_page,
                         ublk_step, ublk_head, QT, TU, TJ, PS, BS)
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
        # issues them ATTN_STAGES - 1 tiles ahead (an id loaded in the loop held them to one tile ahead)
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


@triton.jit(do_not_specialize=["num_tokens"])
def _zero_tail_kernel(o_ptr, so_t, so_h, cu_end_ptr, num_tokens, D: tl.constexpr, ROWS: tl.constexpr):
    """Grid ``(P, Hq)``: zero the output rows past ``cu_seqlens_q[n]`` (tokens of no request), program p taking
    every P-th chunk of ``ROWS`` of them; with no such row, each program returns after one load (one program a
    chunk of all ``T`` rows took 0.16 ms at 128k on the H200)."""
    hd = tl.program_id(1)
    end = tl.load(cu_end_ptr).to(tl.int64)
    offs = tl.arange(0, D)
    for r0 in range(end + tl.program_id(0) * ROWS, num_tokens, tl.num_programs(0) * ROWS):
        r = (r0 + tl.arange(0, ROWS)).to(tl.int64)  # int64 already (end is): offsets of long outputs
        tl.store(o_ptr + r[:, None] * so_t + hd * so_h + offs[None, :],
                 tl.zeros([ROWS, D], tl.float32).to(o_ptr.dtype.element_ty), mask=(r < num_tokens)[:, None])


# ------------------------------------------------------------------------------------------------
# host side


def _row(max_cand: int) -> int:
    """Entries of a score or mp row of the routing scratch: ``max_cand`` rounded up to 16."""
    return -(-max_cand // 16) * 16


@dataclass
class PrefillScratch:
    """Routing scratch of one wave of ``W`` tiles (``slots = W * QT`` token slots).

    scores ``[slots, Hq, row]`` fp32; mp ``[slots, Hsel, row]`` fp32 and mp_cand like it in int32: each
    unit's positive mp as a list, and their candidates (``row``: ``max_cand`` rounded up to 16, so that every
    row starts 64-byte aligned and the route kernel reads whole groups of 4; routing from the summary copy first
    stages each unit's scaled queries in its mp row where they fit, ``stages_queries``); sel_idx / sel_blk
    ``[slots, Hsel, cap]`` int32, sel_bias ``[slots, Hsel, cap]`` fp32, sel_count ``[slots, Hsel]`` int32,
    union_blk ``[W, Hkv, max_cand]`` int32, union_pos ``[W, Hkv, max_cand]`` int32 (by candidate) and
    union_prior ``[W, Hkv, max_cand, QT]`` fp32 (by union position); for the Gluon attention launch
    (``prefill_ws``), union_count ``[W, Hkv]`` int32 and tile_info ``[W, 9]`` int32 (the tiles' bounds, and in the
    last column of row 0 that launch's work counter, ``ws_counter``).
    ``cap = min(topk, max_cand)`` or ``max_cand`` uncapped. Where ``recompute_routing``, also the summary copy
    (``add_summary_copy``: at most ``SUMMARY_COPY_BYTES``, outside the wave budget), and no score is written: the
    route launch keeps only each unit's group sums of probabilities there (row h of its slot, h < Hkv).

    The two union tables are written and read by the attention launch only, after the wave's route launch
    is done with the scores: they are views of the scores' storage (both when ``Hq >= 2 Hkv``, else
    ``union_pos`` only), which keeps them out of the byte budget. Where routing stores no score
    (``recompute``), that storage is ``[slots, min(Hq, 2 Hkv), row]``: the priors' table after a region of its size
    (which holds the positions' table, one int32 a candidate, and before the union launch the route launch's Hkv rows
    of group sums a slot, ``min(Hq, 2 Hkv) >= Hkv``). Since the positions' table shrank to that size, about
    ``Hkv + 1`` rows a slot would do; the layout is unchanged.
    """

    qt: int
    tiles: int
    max_cand: int
    scores: torch.Tensor
    mp: torch.Tensor
    mp_cand: torch.Tensor
    sel_idx: torch.Tensor
    sel_blk: torch.Tensor
    sel_bias: torch.Tensor
    sel_count: torch.Tensor
    union_blk: torch.Tensor
    union_pos: torch.Tensor
    union_prior: torch.Tensor
    union_count: torch.Tensor
    tile_info: torch.Tensor
    summary_copy: Optional[torch.Tensor] = None  # [n, max_cand, Hkv, D] (recompute_routing), its TMA descriptor
    summary_desc: Optional[TensorDescriptor] = None
    copied_from: Optional[tuple] = None  # what gather_summaries last copied (route_wave checks it)

    @property
    def ws_counter(self) -> torch.Tensor:
        """The Gluon attention launch's work counter: the last column of ``tile_info``'s row 0 (``[1]``)."""
        return self.tile_info[0, prefill_ws.INFO_COLS - 1:]

    @staticmethod
    def _score_rows(hq: int, hkv: int, recompute: bool) -> int:
        """Rows per slot of the scores' storage: ``Hq`` score rows, or (``recompute``) no more than the union tables
        take (at least the Hkv rows of group sums the route launch writes)."""
        return min(hq, 2 * hkv) if recompute else hq

    @staticmethod
    def bytes_per_tile(qt: int, hq: int, hkv: int, max_cand: int, params: DashParams,
                       recompute: bool = False) -> int:
        hsel = 1 if params.router == "shared" else hkv
        cap = min(params.topk, max_cand) if params.topk is not None else max_cand
        rows = PrefillScratch._score_rows(hq, hkv, recompute)
        per_slot = 4 * ((rows + 2 * hsel) * _row(max_cand) + 3 * hsel * cap + hsel)
        own_prior = rows < 2 * hkv  # union_prior lies a table's size into the scores, or in storage of its own
        return qt * per_slot + 4 * hkv * max_cand * (1 + own_prior * qt) + 4 * (hkv + prefill_ws.INFO_COLS)

    def add_summary_copy(self, n: int, hkv: int, d: int, dtype: torch.dtype) -> None:
        """Allocate ``summary_copy`` (and, where TMA serves, a descriptor of the route kernel's score tiles)."""
        self.summary_copy = torch.empty(n, self.max_cand, hkv, d, dtype=dtype, device=self.scores.device)
        if ROUTE_COPY_TMA and _tma_supported(self.scores.device):
            flat = self.summary_copy.view(n * self.max_cand, hkv * d)
            box = [_route_block_n(d, self.max_cand), d]
            self.summary_desc = TensorDescriptor(flat, list(flat.shape), list(flat.stride()), box)

    @classmethod
    def allocate(cls, tiles: int, qt: int, hq: int, hkv: int, max_cand: int, params: DashParams,
                 device, recompute: bool = False) -> "PrefillScratch":
        """recompute: routing stores no score (``_route_recompute``): the scores' storage holds the union tables and,
        while a wave routes, its group sums (the summary copy is added by ``add_summary_copy``)."""
        hsel = 1 if params.router == "shared" else hkv
        cap = min(params.topk, max_cand) if params.topk is not None else max_cand
        slots = tiles * qt
        f32, i32 = torch.float32, torch.int32
        rows = cls._score_rows(hq, hkv, recompute)
        scores = torch.empty(slots, rows, _row(max_cand), dtype=f32, device=device)
        table = tiles * hkv * qt * max_cand  # elements of one union table
        flat = scores.view(-1)
        prior = (flat[table:2 * table] if rows >= 2 * hkv else torch.empty(table, dtype=f32, device=device))
        return cls(
            qt, tiles, max_cand,
            scores=scores,
            mp=torch.empty(slots, hsel, _row(max_cand), dtype=f32, device=device),
            mp_cand=torch.empty(slots, hsel, _row(max_cand), dtype=i32, device=device),
            sel_idx=torch.empty(slots, hsel, cap, dtype=i32, device=device),
            sel_blk=torch.empty(slots, hsel, cap, dtype=i32, device=device),
            sel_bias=torch.empty(slots, hsel, cap, dtype=f32, device=device),
            sel_count=torch.empty(slots, hsel, dtype=i32, device=device),
            union_blk=torch.empty(tiles, hkv, max_cand, dtype=i32, device=device),
            union_pos=flat[:tiles * hkv * max_cand].view(torch.int32).view(tiles, hkv, max_cand),
            union_prior=prior.view(tiles, hkv, max_cand, qt),
            union_count=torch.empty(tiles, hkv, dtype=i32, device=device),
            tile_info=torch.empty(tiles, prefill_ws.INFO_COLS, dtype=i32, device=device),
        )


@dataclass
class PrefillPlan:
    """Static geometry of one prefill call (from shapes only) and its device tile tables."""

    qt: int
    num_tiles: int  # the static bound NT
    wave: int  # tiles per wave
    max_cand: int
    tile_req: torch.Tensor
    tile_off: torch.Tensor
    recompute: bool = False  # routing stores no score (recompute_routing): a smaller scratch per tile

    @classmethod
    def build(cls, q: torch.Tensor, cache: PagedKVCache, block_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
              seq_lens: torch.Tensor, params: DashParams, scratch_bytes: Optional[int] = None,
              route_heads: Optional[int] = None, recompute: Optional[bool] = None) -> "PrefillPlan":
        """route_heads: the indexer's ``Hi`` when it routes (one group of Hi score rows per token): the
        tile then also keeps ``QT * pow2(Hi)`` within ``ATTN_ROWS`` (registers, shared memory), and the
        scratch holds ``max(Hq, Hi)`` score rows per token. recompute: route without a score scratch
        (None: where ``recompute_routing`` says so); the waves are sized for that path's scratch."""
        t, hq, d = q.shape
        hkv = cache.num_kv_heads
        table_tokens = block_table.shape[1] * cache.page_size
        if recompute is None:
            recompute = recompute_routing(params, seq_lens.shape[0], _max_cand(table_tokens, params), hq, hkv, d,
                                          cache.summaries.element_size(), route_heads)
        qt, max_cand, per_tile = _tile_geometry(hq, hkv, table_tokens, params, route_heads, recompute)
        tile_req, tile_off, nt = tile_tables(cu_seqlens_q, seq_lens, t, qt)
        wave = wave_tiles(nt, per_tile, hkv, q.device, scratch_bytes)
        return cls(qt, nt, wave, max_cand, tile_req, tile_off, recompute)

    def waves(self) -> list:
        """``(tile0, tiles)`` of each wave in the order the op issues them: the last first where
        ``WAVES_LAST_FIRST``."""
        waves = [(t0, min(self.wave, self.num_tiles - t0)) for t0 in range(0, self.num_tiles, self.wave)]
        return waves[::-1] if WAVES_LAST_FIRST else waves


def _max_cand(table_tokens: int, params: DashParams) -> int:
    """Candidates per token at most, for block tables of ``table_tokens`` tokens."""
    return max(1, table_tokens // params.block_size)


def _tile_geometry(hq: int, hkv: int, table_tokens: int, params: DashParams,
                   route_heads: Optional[int] = None, recompute: bool = False) -> tuple:
    """``(QT, candidates per token at most, bytes of one tile's routing scratch)`` for block tables of
    ``table_tokens`` tokens (``PrefillPlan.build``)."""
    max_cand = _max_cand(table_tokens, params)
    qt = tile_tokens(hq, hkv, params.block_size)
    if route_heads is not None:
        qt = min(qt, tile_tokens(route_heads, 1, params.block_size))
    score_rows = hq if route_heads is None else max(hq, route_heads)
    return qt, max_cand, PrefillScratch.bytes_per_tile(qt, score_rows, hkv, max_cand, params, recompute)


def scratch_bound(num_tokens: int, max_requests: int, max_context: int, num_q_heads: int, num_kv_heads: int,
                  params: DashParams, route_heads: Optional[int] = None, scratch_bytes: Optional[int] = None) -> int:
    """The most routing scratch (bytes) ``paged_dash_prefill_triton`` allocates for up to ``num_tokens`` new
    tokens in up to ``max_requests`` requests, with block tables of up to ``max_context`` tokens (``max_pages *
    page_size``): ``NT`` tiles (the tile tables' bound) of the widest table's scratch, or the byte budget (one
    tile where a tile is larger) if less; where routing may store no score (``recompute_routing``), the larger of
    that and the same for that path's smaller tiles plus ``SUMMARY_COPY_BYTES``. ``params`` as the kernels run
    them (router ``shared`` with an indexer)."""
    qt, max_cand, per_tile = _tile_geometry(num_q_heads, num_kv_heads, max_context, params, route_heads)
    budget = SCRATCH_BYTES if scratch_bytes is None else scratch_bytes
    nt = num_tokens // qt + 2 * min(max_requests, num_tokens)

    def waves(tile_bytes: int) -> int:
        return min(nt * tile_bytes, max(budget, tile_bytes))

    if not _may_recompute(params, max_cand, num_q_heads // num_kv_heads, route_heads):
        return waves(per_tile)
    recompute_tile = _tile_geometry(num_q_heads, num_kv_heads, max_context, params, route_heads, True)[2]
    return max(waves(per_tile), waves(recompute_tile) + SUMMARY_COPY_BYTES)


def wave_tiles(num_tiles: int, per_tile: int, hkv: int, device, scratch_bytes: Optional[int] = None) -> int:
    """Tiles per wave ``W`` within the byte budget (``scratch_bytes``, default ``SCRATCH_BYTES``), sized in
    whole rounds of resident programs: a launch of ``w x Hkv`` programs takes ``ceil(w Hkv / slots)`` rounds
    (``RESIDENT_CTAS`` per multiprocessor), and a last round that fills a fraction of the GPU costs about as
    much as a full one, once per launch. Of the largest ``W`` the budget allows and the largest multiple of
    ``slots / gcd(slots, Hkv)`` below it (waves of whole rounds), the one with fewer rounds in all; all
    tiles in one wave when they fit (the fewest rounds there are)."""
    budget = SCRATCH_BYTES if scratch_bytes is None else scratch_bytes
    wmax = max(1, min(num_tiles, budget // per_tile))
    if wmax == num_tiles or RESIDENT_CTAS <= 0:
        return wmax
    slots = sm_count(device) * RESIDENT_CTAS
    unit = slots // math.gcd(slots, hkv)

    def cost(w):
        full, rest = divmod(num_tiles, w)
        return full * -(-w * hkv // slots) + -(-rest * hkv // slots), full + (rest > 0)

    return min([w for w in (wmax, wmax // unit * unit) if w > 0], key=cost)


def check_prefill_args(q, k, v, cache, block_table, cu_seqlens_q, seq_lens, slot_mapping, head_cls, params,
                       out, iq: Optional[torch.Tensor] = None, workspace=None) -> None:
    """Validate a prefill call from shapes and dtypes only (no device reads)."""
    check_workspace(workspace)
    check_kernel_query(q, cache, params, "T", (("block_table", block_table), ("cu_seqlens_q", cu_seqlens_q),
                                               ("seq_lens", seq_lens), ("head_cls", head_cls)))
    t, _, d = q.shape
    dev = q.device
    n = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if seq_lens.dim() != 1 or seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"seq_lens must be [n] int32; got {tuple(seq_lens.shape)} {seq_lens.dtype}")
    if tuple(cu_seqlens_q.shape) != (n + 1,) or cu_seqlens_q.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens_q must be [n + 1 = {n + 1}] int32; got {tuple(cu_seqlens_q.shape)} "
                         f"{cu_seqlens_q.dtype}")
    check_step_tensors(k, v, cache, block_table, slot_mapping, head_cls, n, t, "T", d, dev, indexer=iq is not None)
    check_indexer_query(q, iq, k, params)
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.device != dev
                            or out.stride(-1) != 1):
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} on {dev} contiguous in D, got "
                         f"{tuple(out.shape)} {out.dtype}")


def _route_block_n(d: int, max_cand: int) -> int:
    """Candidates of one score tile of the route kernel."""
    return max(16, min(ROUTE_SCORE_TILE if d <= 128 else ROUTE_SCORE_TILE // 2, _pow2(max_cand)))


def _route_constexprs(qt: int, hq: int, hkv: int, d: int, max_cand: int, params: DashParams) -> dict:
    g = hq // hkv
    shared = params.router == "shared"
    nh_pad = _pow2(hq) if shared else _pow2(g)
    return dict(
        QT=qt, G_PAD=_pow2(g), NH_PAD=nh_pad, D=d, BS=params.block_size, LOCAL_BLOCKS=params.local_blocks,
        BLOCK_N=_route_block_n(d, max_cand),
        TC=max(16, min(_pow2(max_cand), ROUTE_TILE_BUDGET // (qt * nh_pad))),
        TS=max(1, min(_pow2(max_cand), ROUTE_PIVOT_BUDGET // (ROUTE_PIVOTS * qt))),
        TL=max(1, min(_pow2(max_cand), ROUTE_LIST_BUDGET // qt)),
        NPIV=ROUTE_PIVOTS, HAS_TOPK=params.topk is not None, EST_DIAG=params.estimate_diagonal, SHARED=shared,
    )


def stages_queries(g: int, q: torch.Tensor, scratch: PrefillScratch) -> bool:
    """Whether the route kernel stages a program's scaled queries through its units' mp rows (``STAGE_Q`` of
    ``_route_recompute``): where one unit's ``G`` padded query rows fit its mp row."""
    return _pow2(g) * q.shape[2] * q.element_size() <= scratch.mp.shape[2] * scratch.mp.element_size()


def route_wave(q: torch.Tensor, cache: PagedKVCache, block_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
               seq_lens: torch.Tensor, params: DashParams, plan: PrefillPlan, scratch: PrefillScratch,
               tile0: int, tiles: int) -> None:
    """Route tiles ``tile0 .. tile0 + tiles - 1`` into ``scratch`` (slot ``w * QT + u``)."""
    t, hq, d = q.shape
    hkv = cache.num_kv_heads
    g = hq // hkv
    shared = params.router == "shared"
    s, summ, bt = scratch, cache.summaries, block_table
    sq, ssum, ssc, smp, ssel = q.stride(), summ.stride(), s.scores.stride(), s.mp.stride(), s.sel_idx.stride()
    copy = s.summary_copy
    recompute = copy is not None
    if recompute and s.copied_from != _copy_source(cache, block_table, seq_lens):
        raise RuntimeError("the summary copy is not this call's: gather_summaries(cache, block_table, seq_lens, "
                           "params, scratch) before the route launches")
    if not recompute and s.scores.shape[1] < hq:
        raise RuntimeError(f"this scratch has room for {s.scores.shape[1]} score rows per token, not {hq}: it was "
                           "allocated to route from a summary copy (add_summary_copy), which it does not hold")
    if recompute and (s.scores.shape[1] < hkv or s.scores.shape[2] < plan.max_cand):
        raise RuntimeError(f"this scratch's score storage is {tuple(s.scores.shape[1:])} a slot: routing from the "
                           f"summary copy keeps group sums there, {hkv} rows of at least {plan.max_cand}")
    _prefill_route_kernel[(tiles, 1 if shared else hkv)](
        q, sq[0], sq[1], summ, ssum[0], ssum[1], bt, bt.stride(0),
        cu_seqlens_q, seq_lens, plan.tile_req, plan.tile_off, tile0, seq_lens.shape[0], bt.shape[1] * cache.page_size,
        t, s.scores, ssc[0], ssc[1], s.mp, smp[0], smp[1],
        s.mp_cand,
        s.sel_idx, s.sel_blk, s.sel_bias, ssel[0], ssel[1], s.sel_idx.shape[2],
        s.sel_count, s.sel_count.stride(0),
        params.scaling_factor, 0.5 / math.sqrt(d), g, hkv, params.topk if params.topk is not None else 0,
        1.0 / params.sigma, copy if recompute else summ, s.summary_desc if s.summary_desc is not None else summ,
        copy.shape[1] if recompute else 0, PS=cache.page_size,
        **_route_constexprs(plan.qt, hq, hkv, d, plan.max_cand, params),
        RECOMPUTE=recompute, CS_TMA=s.summary_desc is not None, HKV_C=hkv,
        STAGE_Q=recompute and stages_queries(g, q, s),
        num_warps=ROUTE_RECOMPUTE_WARPS if recompute else ROUTE_WARPS,
        num_stages=ROUTE_RECOMPUTE_STAGES if recompute else ROUTE_STAGES,
        **({"maxnreg": ROUTE_RECOMPUTE_MAXNREG} if recompute and ROUTE_RECOMPUTE_MAXNREG else {}),
    )


def _tma_supported(device) -> bool:
    """NVIDIA Hopper or later, or the interpreter (which emulates descriptors: the CPU tests run the TMA path)."""
    if interpreting():
        return True
    return (device.type == "cuda" and torch.version.hip is None
            and torch.cuda.get_device_capability(device)[0] >= 9)


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


def _kv_descriptors(cache: PagedKVCache, block_u: int) -> Optional[tuple]:
    """``(k_desc, v_desc, head_major)``: TMA descriptors of the K and V pages for the attention launch's union
    tiles of one block (``ATTN_TMA``; NVIDIA Hopper and later), or None (pointer loads) where the hardware or
    the cache does not fit them. The pages ``[pages, page_size, Hkv, D]`` are described as they are (SGLang's
    layout: ``[1, block_u, 1, D]`` boxes) or, where the head stride exceeds the row stride (vLLM's ``[pages,
    Hkv, page_size, C]``), head-major as ``[pages, Hkv, page_size, D]`` with ``[1, 1, block_u, D]`` boxes
    (``head_major``). These checks precede ``TensorDescriptor``'s own asserts so as to fall back instead."""
    kp, vp = cache.k_pages, cache.v_pages
    if not (ATTN_TMA and _tma_supported(kp.device)):
        return None
    for head_major in (False, True):
        views = [x.permute(0, 2, 1, 3) if head_major else x for x in (kp, vp)]
        if all(_tma_fits(x) for x in views):
            box = [1, 1, block_u, kp.shape[3]] if head_major else [1, block_u, 1, kp.shape[3]]
            k_desc, v_desc = (TensorDescriptor(x, list(x.shape), list(x.stride()), box) for x in views)
            return k_desc, v_desc, head_major
    return None


def attend_wave(q: torch.Tensor, cache: PagedKVCache, block_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
                seq_lens: torch.Tensor, params: DashParams, plan: PrefillPlan, scratch: PrefillScratch,
                out: torch.Tensor, tile0: int, tiles: int) -> None:
    """Attention of tiles ``tile0 .. tile0 + tiles - 1`` over their selections in ``scratch``."""
    t, hq, d = q.shape
    kp, vp, bt = cache.k_pages, cache.v_pages, block_table
    hkv = cache.num_kv_heads
    g = hq // hkv
    bs = params.block_size
    shared = params.router == "shared"
    s = scratch
    g_pad = _pow2(g)
    block_u = ATTN_KEYS if d <= 128 else min(bs, 32)
    one_block = block_u < 2 * bs and bool(ATTN_SCALAR_BASE)  # a tile within one block: one base address, no gather
    geo = (prefill_ws.ws_supported(q, cache, params, g_pad, plan.qt)  # where the Gluon launch's TMA finds the blocks
           if ATTN_WS and one_block and plan.max_cand >= prefill_ws.WS_MIN_CAND else None)
    ws = geo is not None
    # with the Gluon launch, the Triton launch builds the unions only: it loads no K/V
    kv_desc = _kv_descriptors(cache, block_u) if one_block and block_u == bs and not ws else None
    sq, sk, sv, ssel, scnt = q.stride(), kp.stride(), vp.stride(), s.sel_idx.stride(), s.sel_count.stride()
    spr, sub, spos, so = s.union_prior.stride(), s.union_blk.stride(), s.union_pos.stride(), out.stride()
    _prefill_attn_kernel[(tiles, hkv)](
        q, sq[0], sq[1], kp, vp, sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], bt, bt.stride(0),
        cu_seqlens_q, seq_lens, plan.tile_req, plan.tile_off, tile0, seq_lens.shape[0], bt.shape[1] * cache.page_size,
        t, s.sel_idx, s.sel_bias, ssel[0], 0 if shared else ssel[1], s.sel_count, scnt[0], 0 if shared else scnt[1],
        s.union_prior, spr[0], spr[1], s.union_blk, sub[0], sub[1], s.union_pos, spos[0], spos[1],
        out, so[0], so[1], LOG2E_HOST / math.sqrt(d), g,
        *(kv_desc[:2] if kv_desc is not None else (kp, vp)), s.tile_info, s.tile_info.stride(0), s.union_count,
        s.ws_counter, *(prefill_ws.union_rows(geo, bs) if ws else (cache.page_size // bs, 1, 0)),
        QT=plan.qt, G_PAD=g_pad, D=d, BS=bs, PS=cache.page_size, LOCAL_BLOCKS=params.local_blocks,
        BLOCK_T=min(bs, 64 if d <= 128 else 32), BLOCK_U=block_u,
        TU=max(16, min(_pow2(plan.max_cand), UNION_TILE // plan.qt)),
        TJ=max(16, min(_pow2(s.sel_idx.shape[2]), UNION_LIST_TILE // plan.qt)),
        UCH=UNION_CHUNK if one_block else max(UNION_CHUNK_GATHER, block_u // bs),
        ONE_BLOCK=one_block, TMA=kv_desc is not None, TMA_HEAD_MAJOR=bool(kv_desc and kv_desc[2]), UNION_ONLY=ws,
        num_warps=ATTN_WARPS if d <= 128 else 2 * ATTN_WARPS, num_stages=ATTN_STAGES,
    )
    if ws:
        nc = prefill_ws.WS_WARPGROUPS
        k_desc, v_desc = prefill_ws.kv_block_descriptors(cache, bs, geo)
        prefill_ws.prefill_attn_ws[(min(sm_count(q.device), triton.cdiv(tiles * hkv, nc)),)](
            q, sq[0], sq[1], kp, vp, sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], bt, bt.stride(0), k_desc, v_desc,
            s.tile_info, s.tile_info.stride(0), s.union_count, s.union_blk, sub[0], sub[1], s.union_prior, spr[0],
            spr[1], out, so[0], so[1], LOG2E_HOST / math.sqrt(d), g, tiles, t, hkv, s.ws_counter,
            geo[2],
            QT=plan.qt, G_PAD=g_pad, D=d, BS=bs, PPB=cache.page_size // bs, NC=nc, KST=prefill_ws.WS_K_SLOTS,
            VST=prefill_ws.WS_V_SLOTS, REGS=prefill_ws.WS_REGS, num_warps=4,
            maxnreg=prefill_ws.WS_REGS)


def plan_and_scratch(q: torch.Tensor, cache: PagedKVCache, block_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     seq_lens: torch.Tensor, params: DashParams, scratch_bytes: Optional[int] = None,
                     route_heads: Optional[int] = None, recompute: Optional[bool] = None) -> tuple:
    """The plan and the routing scratch of one call (what a workspace keeps), with the summary copy where routing
    computes the scores again in each pass (``recompute``; None: where ``recompute_routing`` says so). Fill the
    copy with ``gather_summaries`` before the route launches of each call."""
    hq, d, hkv = q.shape[1], q.shape[2], cache.num_kv_heads
    plan = PrefillPlan.build(q, cache, block_table, cu_seqlens_q, seq_lens, params, scratch_bytes,
                             route_heads=route_heads, recompute=recompute)
    hs = hq if route_heads is None else max(hq, route_heads)
    scratch = PrefillScratch.allocate(plan.wave, plan.qt, hs, hkv, plan.max_cand, params, q.device, plan.recompute)
    if plan.recompute:
        scratch.add_summary_copy(seq_lens.shape[0], hkv, d, cache.summaries.dtype)
    return plan, scratch


def paged_dash_prefill_triton(q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                              cache: PagedKVCache, block_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
                              seq_lens: torch.Tensor, slot_mapping: Optional[torch.Tensor], head_cls: torch.Tensor,
                              params: DashParams, *, out: Optional[torch.Tensor] = None,
                              scratch_bytes: Optional[int] = None, iq: Optional[torch.Tensor] = None,
                              workspace: Optional[PrefillWorkspace] = None) -> torch.Tensor:
    """Causal DASH for the new tokens of every request with the Triton kernels (the CUDA branch of
    ``ops.paged_dash_prefill``).

    q: ``[T, Hq, D]`` bf16/fp16; k, v: ``[T, Hkv, D]`` written at ``slot_mapping [T]`` first (with the
    summaries of the blocks they complete), or all None when already written; block_table ``[n,
    max_pages]`` int32; cu_seqlens_q ``[n + 1]``; seq_lens ``[n]`` after the extend; head_cls ``[Hkv, D]``.
    scratch_bytes: routing scratch per wave (default ``SCRATCH_BYTES``). Returns ``out [T, Hq, D]`` in
    ``q.dtype``; rows of no request, of padded requests and of inconsistent requests are zero.
    iq: ``[T, Hi, D]`` rotated indexer queries (SPEC.md section 9): the route launches score them
    (router ``shared``) against the cache's 1-head store of ``ik`` summaries, the attention launches
    use q; k, v must then be None (written with the auxiliary rows and summaries by the op).
    workspace: a ``PrefillWorkspace`` the calls of one batch share: the plan (with its tile tables
    launch) and the routing scratch are made by the first call and reused by the others.
    Launches only; never synchronises.
    """
    from .launcher import cache_dash_prefill_triton

    check_prefill_args(q, k, v, cache, block_table, cu_seqlens_q, seq_lens, slot_mapping, head_cls, params, out,
                       iq=iq, workspace=workspace)
    params = check_indexer_query(q, iq, k, params)
    if out is None:
        out = torch.empty_like(q)
    if k is not None:
        cache_dash_prefill_triton(k, v, cache, slot_mapping, params, head_cls)
    t, hq, d = q.shape
    n = seq_lens.shape[0]
    if t == 0:
        return out
    if n == 0:
        return out.zero_()
    route_heads = None if iq is None else iq.shape[1]
    rq, rcache, hs = q, cache, hq  # what routes: the queries over the summaries, or the indexer's
    if iq is not None:
        rq, rcache, hs = iq, cache.indexer_view(), max(hq, route_heads)

    def make() -> tuple:
        return plan_and_scratch(q, cache, block_table, cu_seqlens_q, seq_lens, params, scratch_bytes, route_heads)

    if workspace is None:
        plan, scratch = make()
    else:  # everything the plan and the scratch are made from, besides the length tensors' values
        key = (q.device, t, hq, d, hs, cache.num_kv_heads, cache.page_size, tuple(block_table.shape), params,
               scratch_bytes, route_heads, cache.summaries.dtype)
        plan, scratch = workspace.take(key, (cu_seqlens_q, seq_lens), make)
    gather_summaries(cache, block_table, seq_lens, params, scratch)  # this call's summaries (each layer has its own)
    for tile0, tiles in plan.waves():
        route_wave(rq, rcache, block_table, cu_seqlens_q, seq_lens, params, plan, scratch, tile0, tiles)
        attend_wave(q, cache, block_table, cu_seqlens_q, seq_lens, params, plan, scratch, out, tile0, tiles)
    rows = 16
    _zero_tail_kernel[(min(triton.cdiv(t, rows), ZERO_TAIL_PROGRAMS), hq)](
        out, out.stride(0), out.stride(1), cu_seqlens_q[n:], t, D=d, ROWS=rows)
    return out
