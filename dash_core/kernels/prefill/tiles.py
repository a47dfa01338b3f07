"""Prefill tiles: where each tile of a batch lies, computed on the device, and the tile tables that number them.

A tile is up to ``QT`` new tokens of one request at positions ``a0 .. a0 + QT - 1`` with ``a0`` a multiple of
``QT``, and ``QT`` divides the block size: the tokens of a tile share their block, hence their candidates (blocks
``0 .. cur - local_blocks``) and their local window. ``QT * G_PAD`` query rows (tokens x the G query heads of one KV
head, padded to a power of two) make one tensor-core tile. Tiles are numbered request by request
(``tile_tables``); a request adds at most one partial tile at each end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import pow2
from ..launcher import cached_launch

# tile_info: a row of int32 a tile of a wave, written by the union launch (``attention.py``) and read by the Gluon
# attention (``gluon.py``); the columns by name (last_local is first_local - 1 where not ok). Column INFO_COUNTER of
# row 0 is the Gluon launch's work counter.
(INFO_OK, INFO_TOK_BASE, INFO_A0, INFO_P_LO, INFO_P_HI, INFO_FIRST_LOCAL, INFO_LAST_LOCAL,
 INFO_REQ) = (tl.constexpr(i) for i in range(8))
INFO_COUNTER = 8
INFO_COLS = INFO_COUNTER + 1


def tile_tokens(num_q_heads: int, num_kv_heads: int, block_size: int, attn_rows: int) -> int:
    """Tokens per tile ``QT``: a power of two dividing ``block_size`` with ``QT * G_PAD <= attn_rows`` (a power of
    two), or 1 where the padded GQA group ``G_PAD`` alone exceeds ``attn_rows``."""
    g_pad = pow2(num_q_heads // num_kv_heads)
    return min(block_size, max(1, attn_rows // g_pad))


@triton.jit
def wave_tile(LAST_FIRST: tl.constexpr):
    """The wave's tile this program runs, from ``program_id(0)``: in launch order, or with LAST_FIRST from the
    wave's last tile (a request's longest contexts first, so that the short tiles fill the launch's tail)."""
    if LAST_FIRST:
        return tl.num_programs(0) - 1 - tl.program_id(0)
    return tl.program_id(0)


@triton.jit
def tile_bounds(tile, n, tile_req_ptr, tile_off_ptr, cu_ptr, seq_lens_ptr, max_tokens,
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
def tile_rows(a0, p_lo, p_hi, tok_base, num_tokens, ok, G, QT: tl.constexpr, G_PAD: tl.constexpr,
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


@cached_launch
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


def max_tiles(num_tokens: int, n: int, qt: int) -> int:
    """``NT = T // QT + 2 n + 1``: the most tiles ``n`` requests of ``T`` new tokens take
    (``cdiv(start % QT + qlen, QT) <= qlen // QT + 2`` a request), and one past the last at least, whose attention
    programs zero the rows of no request."""
    return num_tokens // qt + 2 * n + 1


def tile_tables(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int, qt: int):
    """Device tables placing the tiles, in one launch and without synchronising.

    Returns ``tile_req [NT]`` int32 (request of each tile, ``n`` past the last tile), ``tile_off
    [n + 1]`` int32 (first tile of each request) and the static bound ``NT`` (``max_tiles``).
    """
    n = seq_lens.shape[0]
    nt = max_tiles(num_tokens, n, qt)
    dev = seq_lens.device
    tile_req = torch.empty(nt, dtype=torch.int32, device=dev)
    tile_off = torch.empty(n + 1, dtype=torch.int32, device=dev)
    _tile_tables_kernel[(1,)](cu_seqlens_q, seq_lens, tile_req, tile_off, n, nt, max(1, n.bit_length()), QT=qt,
                              R=1024, num_warps=4)
    return tile_req, tile_off, nt


def tile_layout_host(cu_seqlens_q, seq_lens, qt: int) -> list:
    """The tiles as host tuples ``(req, a0, p_lo, p_hi, tok_base)`` in tile order (tests, debugging;
    reads device values). Mirrors ``tile_bounds`` for valid requests."""
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
