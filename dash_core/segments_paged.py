"""The segment attention stage addressed in an engine's paged cache: a decode step's routing selection turned into
segments, gathered (``gather_segments``: a copy in the layout of ``dash_core.segments``) or zero-copy
(``segment_pages``: page tables into the cache where its page size equals the block size), and the decode step's
attention stage on a segment backend (``decode_segment_attention``, which ``dash_core.ops`` calls after the Triton
routing).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .layout import PagedKVCache
from .params import DashParams
from .plan_cache import PlanCache, PlanKey
from .segments import (SegmentGeometry, cache_or_default, check_segments,
                       combine_segments, flash_attn_paged, flash_dash_attention, flashinfer_plan, plan_key,
                       prepare_flash_dash_attention, segment_count)

logger = logging.getLogger(__name__)


@dataclass
class _DecodeSelection:
    """Per decode row and unit: the routed blocks (padded to topk) and the local window."""

    length: torch.Tensor  # [n] int64 tokens (0 = padded row)
    pos: torch.Tensor  # [n] int64 position of the decode token
    blk: torch.Tensor  # [n, Hsel, topk] int64 logical block (0 where not ok)
    ok: torch.Tensor  # [n, Hsel, topk] bool, a real routed segment
    first_local: torch.Tensor  # [n] int64 first token of the local window
    used: torch.Tensor  # [n, Hsel, topk + 1] int32
    bias: torch.Tensor  # [n, Hsel, topk] fp32


def _decode_selection(block_table, seq_lens, sel_idx, sel_bias, sel_count, params: DashParams,
                      hkv: int, page_size: int) -> _DecodeSelection:
    topk = segment_count(params)
    bs = params.block_size
    n, hsel, cap = sel_idx.shape
    if cap > topk:
        raise ValueError(f"sel_idx has {cap} entries per unit; at most topk = {topk} allowed")
    want = hkv if params.router == "kv_head" else 1
    if hsel != want:
        raise ValueError(f"sel_idx [n, Hsel, cap] must have Hsel = {want} for router {params.router!r}; "
                         f"got Hsel = {hsel}")
    dev = sel_idx.device
    length = seq_lens.to(torch.long).clamp(min=0, max=block_table.shape[1] * page_size)
    pos = (length - 1).clamp(min=0)
    ok = torch.arange(cap, device=dev)[None, None, :] < sel_count.to(torch.long)[..., None]
    ok = ok & (length > 0)[:, None, None]
    blk = torch.where(ok, sel_idx.to(torch.long), torch.zeros((), dtype=torch.long, device=dev))
    bias = torch.zeros(n, hsel, topk, dtype=torch.float32, device=dev)
    bias[..., :cap] = torch.where(ok, sel_bias.float(), torch.zeros((), device=dev))
    if cap < topk:
        blk = torch.cat([blk, blk.new_zeros(n, hsel, topk - cap)], dim=2)
        ok = torch.cat([ok, ok.new_zeros(n, hsel, topk - cap)], dim=2)
    first_local = (pos // bs - params.local_blocks + 1).clamp(min=0) * bs
    used = torch.empty(n, hsel, topk + 1, dtype=torch.int32, device=dev)
    used[..., :topk] = torch.where(ok, bs, 0).to(torch.int32)
    used[..., topk] = torch.where(length > 0, length - first_local, 0).to(torch.int32)[:, None]
    return _DecodeSelection(length, pos, blk, ok, first_local, used, bias)


def gather_segments(cache: PagedKVCache, block_table: torch.Tensor, seq_lens: torch.Tensor,
                    sel_idx: torch.Tensor, sel_bias: torch.Tensor, sel_count: torch.Tensor,
                    params: DashParams) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gather decode rows' segments from a paged cache into the layout ``flash_dash_attention`` takes.

    block_table: ``[n, max_pages]`` int32; seq_lens: ``[n]`` (including the new token; 0 = padded
    row, all segments empty); the selection as the routing kernels write it: sel_idx ``[n, Hsel,
    cap]`` logical block indices in any order, sel_bias ``[n, Hsel, cap]`` log priors, sel_count
    ``[n, Hsel]`` (entries ``>= count`` ignored), ``cap <= params.topk``. All on the device, no
    host synchronisation (capturable). Returns ``k, v [n * Hsel * S, Hk, D]``, ``used [n, Hsel,
    topk + 1]`` int32 and ``bias [n, Hsel, topk]`` fp32 (0 for empty segments).
    """
    ps, hkv = cache.page_size, cache.num_kv_heads
    sel = _decode_selection(block_table, seq_lens, sel_idx, sel_bias, sel_count, params, hkv, ps)
    bs, local, topk = params.block_size, params.local, params.topk
    n, hsel = sel_idx.shape[:2]
    dev = sel_idx.device
    routed = sel.blk[..., None] * bs + torch.arange(bs, device=dev)  # [n, hsel, topk, bs]
    loc = sel.first_local[:, None] + torch.arange(local, device=dev)[None]
    positions = torch.cat([routed.reshape(n, hsel, topk * bs), loc[:, None].expand(n, hsel, local)], dim=2)
    positions = torch.minimum(positions, sel.pos[:, None, None])  # stay inside the request's pages
    pages = torch.gather(block_table.to(torch.long), 1, (positions // ps).reshape(n, -1)).reshape(positions.shape)
    rows = positions % ps
    if hsel == 1:
        k = cache.k_pages[pages, rows]  # [n, 1, S, Hkv, D]
        v = cache.v_pages[pages, rows]
        hk = hkv
    else:
        heads = torch.arange(hsel, device=dev)[None, :, None]
        k = cache.k_pages[pages, rows, heads]  # [n, Hsel, S, D]
        v = cache.v_pages[pages, rows, heads]
        hk = 1
    s = topk * bs + local
    return (k.reshape(n * hsel * s, hk, cache.head_dim), v.reshape(n * hsel * s, hk, cache.head_dim),
            sel.used, sel.bias)


# ----------------------------------------------------------------------------------------------
# zero-copy variant: segments addressed through page tables into the engine's cache


def fold_kv_heads(pages: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """View ``[P, page_size, Hkv, D]`` pages as single-head pages ``[P', page_size, 1, D]``.

    Page ``(p, h)`` becomes page ``p * m + h`` of the result (no copy), which gives per-KV-head
    selections a plain page table. Needs a head-major page layout (each head's rows of a page
    contiguous in their own span: vLLM's ``[blocks, heads, block_size, C]``, or any HND cache),
    where ``m = page stride / head stride`` (``Hkv``, or the head slots of a page). Token-major
    caches (SGLang's ``[slots, Hkv, D]``) cannot be folded: use the gathered layout for them.
    Returns the folded view and ``m``.
    """
    p, ps, hkv, d = pages.shape
    sp, sr, sh, sd = pages.stride()
    if sd != 1:
        raise ValueError(f"pages must have a contiguous last dimension; strides {pages.stride()}")
    if hkv == 1:
        return pages, 1
    if sh <= 0 or sp % sh or sp // sh < hkv or sr * (ps - 1) + d > sh:
        raise ValueError(f"pages {tuple(pages.shape)} with strides {pages.stride()} are token-major (NHD): "
                         "KV heads cannot be folded into pages; use gather_segments (gathered layout)")
    m = sp // sh
    folded = pages.as_strided((p * m - (m - hkv), ps, 1, d), (sh, sr, sh, 1), pages.storage_offset())
    return folded, m


def segment_pages(cache: PagedKVCache, block_table: torch.Tensor, seq_lens: torch.Tensor,
                  sel_idx: torch.Tensor, sel_bias: torch.Tensor, sel_count: torch.Tensor, params: DashParams
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Page tables of decode rows' segments, for ``flash_dash_attention_paged`` (no K/V copy).

    Same inputs as ``gather_segments``; the cache's page size must equal the block size (a
    routed segment is one page, the local window ``local / bs`` pages). Returns ``k_pages,
    v_pages`` (folded per KV head for router ``kv_head``: ``[P', bs, 1, D]``; as they are for
    ``shared``), ``page_table [n, Hsel, topk + 1, local // bs]`` int32 (a routed segment repeats
    its page), ``used [n, Hsel, topk + 1]`` int32 and ``bias [n, Hsel, topk]`` fp32.
    """
    bs = params.block_size
    if cache.page_size != bs:
        raise ValueError(f"segments align with pages only when the page size equals the block size; page size "
                         f"{cache.page_size}, block size {bs}: use gather_segments (gathered layout)")
    hkv = cache.num_kv_heads
    sel = _decode_selection(block_table, seq_lens, sel_idx, sel_bias, sel_count, params, hkv, bs)
    n, hsel = sel_idx.shape[:2]
    w = params.local_blocks
    dev = sel_idx.device
    bt = block_table.to(torch.long)
    routed = torch.gather(bt, 1, sel.blk.reshape(n, -1)).reshape(sel.blk.shape)  # [n, hsel, topk]
    loc_blk = torch.minimum(sel.first_local[:, None] // bs + torch.arange(w, device=dev)[None],
                            (sel.pos // bs)[:, None])
    local = torch.gather(bt, 1, loc_blk)  # [n, w]
    table = torch.cat([routed[..., None].expand(*routed.shape, w), local[:, None, None].expand(n, hsel, 1, w)], 2)
    if hsel > 1:
        k_pages, m = fold_kv_heads(cache.k_pages)
        v_pages, mv = fold_kv_heads(cache.v_pages)
        if m != mv:
            raise ValueError(f"K and V pages fold differently ({m} vs {mv} head slots per page)")
        table = table * m + torch.arange(hsel, device=dev)[None, :, None, None]
    else:
        k_pages, v_pages = cache.k_pages, cache.v_pages
    return k_pages, v_pages, table.to(torch.int32), sel.used, sel.bias


def check_paged_segments(q, k_pages, v_pages, page_table, used, bias, backend, bs, local) -> SegmentGeometry:
    """Validate a ``flash_dash_attention_paged`` call on the host."""
    if k_pages.dim() != 4 or k_pages.shape != v_pages.shape or k_pages.shape[1] != bs:
        raise ValueError(f"k_pages and v_pages must be equal [pages, bs = {bs}, Hk, D]; got "
                         f"{tuple(k_pages.shape)}, {tuple(v_pages.shape)}")
    if q.dim() != 3 or used.dim() != 3:
        raise ValueError(f"q must be [n, Hq, D] and used [n, Hsel, topk + 1]; got {tuple(q.shape)}, "
                         f"{tuple(used.shape)}")
    n, hsel, c = used.shape
    hk, d = k_pages.shape[2], k_pages.shape[3]
    # validate everything but k/v through the gathered checks, with stand-in k/v of the right shape
    rows = n * hsel * ((c - 1) * bs + local)
    stand_in = k_pages.as_strided((rows, hk, d), (0, 0, 1))  # a zero-stride view: shape, dtype, device
    geo = check_segments(q, stand_in, stand_in, used, bias, backend, bs, local)
    want = (n, hsel, c, local // bs)
    if tuple(page_table.shape) != want or page_table.dtype != torch.int32:
        raise ValueError(f"page_table must be int32 {want}; got {page_table.dtype} {tuple(page_table.shape)}")
    if page_table.device != q.device or k_pages.device != q.device:
        raise ValueError("page_table and pages must be on q's device")
    return geo


def _pages_to_gathered(k_pages, v_pages, page_table, geo: SegmentGeometry):
    """Copy the paged segments into the gathered layout (TORCH and TRITON backends)."""
    topk = geo.topk
    idx = torch.cat([page_table[..., :topk, 0], page_table[..., topk, :]], dim=-1).long()  # [n, hsel, topk + w]
    k = k_pages[idx].reshape(geo.n * geo.hsel * geo.unit_tokens, geo.hk, geo.d)
    v = v_pages[idx].reshape(geo.n * geo.hsel * geo.unit_tokens, geo.hk, geo.d)
    return k, v


def flash_dash_attention_paged(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                               page_table: torch.Tensor, used: torch.Tensor, bias: torch.Tensor,
                               backend: str = "TRITON", bs: int = 64, local: int = 64, *,
                               plan_cache: Optional[PlanCache] = None) -> torch.Tensor:
    """``flash_dash_attention`` over segments addressed through page tables (zero-copy).

    k_pages, v_pages: ``[pages, bs, Hk, D]`` (``segment_pages`` folds KV heads for per-KV-head
    selections); page_table: ``[n, Hsel, topk + 1, local // bs]`` int32, the pages of each
    segment (a routed segment uses its first entry); used, bias as in ``flash_dash_attention``.
    FLASHINFER (paged prefill wrapper) and FLASH_ATTN (``page_table`` / ``block_table`` with
    ``seqused_k``) read the cache in place; TORCH and TRITON copy the segments out first (the
    native zero-copy path of TRITON is the paged decode kernel in ``dash_core.kernels``).
    Rows of a segment's last page past its length are read by some libraries: they must be finite.
    Returns ``[n, Hq, D]`` in q's dtype.
    """
    geo = check_paged_segments(q, k_pages, v_pages, page_table, used, bias, backend, bs, local)
    if geo.n == 0:
        return q.new_zeros(q.shape)
    if backend == "FLASHINFER":
        plan = flashinfer_plan(geo, q.dtype, q.device, cache_or_default(plan_cache), paged=True)
        o, lse = plan.run_paged(q, k_pages, v_pages, page_table, used)
        return combine_segments(o, lse, used, bias, geo, q.dtype)
    if backend == "FLASH_ATTN":
        o, lse = flash_attn_paged(q, k_pages, v_pages, page_table, used, geo)
        return combine_segments(o, lse, used, bias, geo, q.dtype)
    k, v = _pages_to_gathered(k_pages, v_pages, page_table, geo)
    return flash_dash_attention(q, k, v, used, bias, backend, bs, local)


def prepare_flash_dash_attention_paged(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                                       page_table: torch.Tensor, used: torch.Tensor, bias: torch.Tensor,
                                       backend: str, bs: int, local: int, *,
                                       plan_cache: Optional[PlanCache] = None) -> Optional[PlanKey]:
    """``prepare_flash_dash_attention`` for the zero-copy variant (pins the paged FlashInfer plan)."""
    geo = check_paged_segments(q, k_pages, v_pages, page_table, used, bias, backend, bs, local)
    if backend != "FLASHINFER":
        return None
    flashinfer_plan(geo, q.dtype, q.device, cache_or_default(plan_cache), pin=True, paged=True)
    return plan_key(geo, q.dtype, q.device, layout="paged", page_size=bs)


# ----------------------------------------------------------------------------------------------
# a decode step's attention stage on a segment backend (what ops.paged_dash_decode dispatches to)


def zero_copy_possible(cache: PagedKVCache, params: DashParams) -> bool:
    """Whether decode segments can be addressed in place: page size = block size, and KV heads that fold
    into pages (head-major caches such as vLLM's) or one selection for all heads (router ``shared``)."""
    if cache.page_size != params.block_size:
        return False
    if params.router == "shared" or cache.num_kv_heads == 1:
        return True
    try:
        fold_kv_heads(cache.k_pages)
        fold_kv_heads(cache.v_pages)
    except ValueError:
        return False
    return True


def decode_segment_attention(q: torch.Tensor, cache: PagedKVCache, block_table: torch.Tensor,
                             seq_lens: torch.Tensor, sel_idx: torch.Tensor, sel_bias: torch.Tensor,
                             sel_count: torch.Tensor, params: DashParams, backend: str, *,
                             zero_copy: Optional[bool] = None, plan_cache: Optional[PlanCache] = None,
                             pin: bool = False) -> torch.Tensor:
    """Stage 3 of a decode step on a segment backend, from the routing kernels' selection.

    q: ``[n, Hq, D]``; the selection as ``gather_segments`` takes it. zero_copy: address the segments
    in the cache through page tables (``segment_pages``) instead of gathering a copy; None picks it
    whenever ``zero_copy_possible``. pin: make and pin the FlashInfer plan of this shape first (call
    once eagerly before CUDA-graph capture; the key stays pinned for the process). Device work only:
    capturable once the plan exists. Returns ``[n, Hq, D]`` in q's dtype.
    """
    segment_count(params)
    bs, local = params.block_size, params.local
    if zero_copy is None:
        zero_copy = zero_copy_possible(cache, params)
    if zero_copy:
        kp, vp, table, used, bias = segment_pages(cache, block_table, seq_lens, sel_idx, sel_bias, sel_count, params)
        if pin:
            prepare_flash_dash_attention_paged(q, kp, vp, table, used, bias, backend, bs, local, plan_cache=plan_cache)
        return flash_dash_attention_paged(q, kp, vp, table, used, bias, backend, bs, local, plan_cache=plan_cache)
    k, v, used, bias = gather_segments(cache, block_table, seq_lens, sel_idx, sel_bias, sel_count, params)
    if pin:
        prepare_flash_dash_attention(q, k, v, used, bias, backend, bs, local, plan_cache=plan_cache)
    return flash_dash_attention(q, k, v, used, bias, backend, bs, local, plan_cache=plan_cache)
