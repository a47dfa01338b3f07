"""Triton kernel: write new K/V into the paged cache and summarise the blocks they complete.

Stage 1 of docs/semantics.md (section 2) on the GPU. A block is summarised by the program of the token
that completes it (``slot % bs == bs - 1``), in the launch that writes the keys.

- Decode (one new token per request): the completing key is taken from the input (``OWN_ROW``), the
  others were written by earlier steps.
- Prefill (several tokens of a block may arrive in one batch, written by other programs): where each
  request's new tokens are consecutive rows (the prefill op), one launch takes a block's keys of this
  batch from the input and the others from the cache; with slots in any order (``cache_dash_prefill``),
  a write launch, then a summary launch reading the cache. Each program takes ``ROWS`` tokens of one KV
  head (a program per token and head left most of a launch to starting programs).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from ..layout import PagedKVCache
from .common import cdiv
from .launcher import cached_launch

ROWS = 64  # tokens of one KV head per program of the prefill write (and summary) launch


@triton.jit
def write_token(
    t, h, k_ptr, v_ptr, sk_t, sk_h, sv_t, sv_h,
    kc_ptr, vc_ptr, skc_p, skc_r, skc_h, svc_p, svc_r, svc_h,
    summ_ptr, ss_b, ss_h, hc_ptr, shc_h,
    slot_ptr, num_slots, scale,
    D: tl.constexpr, BS: tl.constexpr, PS: tl.constexpr,
    WRITE: tl.constexpr, SUMMARIZE: tl.constexpr, OWN_ROW: tl.constexpr,
):
    """Token t of KV head h: WRITE stores ``k[t, h], v[t, h]`` (``[D]``) at ``slot_mapping[t]``
    (skipped when < 0 or out of range). SUMMARIZE, when the slot is the last of its block, loads
    the block's keys ``[BS, D]`` (the last row from ``k`` when OWN_ROW), takes
    ``softmax(K head_cls / sqrt(D))`` in fp32 and stores the weighted key sum at
    ``summaries[slot // BS, h]`` in the store's dtype. Also called by the decode select kernel (its FUSE_WRITE
    programs).
    """
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if (slot >= 0) & (slot < num_slots):
        offs_d = tl.arange(0, D)
        page = slot // PS
        row = slot % PS
        k_new = tl.zeros([D], kc_ptr.dtype.element_ty)  # loaded where WRITE or OWN_ROW; the summary reads it if OWN_ROW
        if WRITE | OWN_ROW:
            k_new = tl.load(k_ptr + t * sk_t + h * sk_h + offs_d).to(kc_ptr.dtype.element_ty)
        if WRITE:
            v_new = tl.load(v_ptr + t * sv_t + h * sv_h + offs_d)
            tl.store(kc_ptr + page * skc_p + row * skc_r + h * skc_h + offs_d, k_new)
            tl.store(vc_ptr + page * svc_p + row * svc_r + h * svc_h + offs_d, v_new.to(vc_ptr.dtype.element_ty))
        if SUMMARIZE:
            if slot % BS == BS - 1:
                summarize_block(slot, h, kc_ptr, skc_p, skc_r, skc_h, summ_ptr, ss_b, ss_h, hc_ptr, shc_h, scale,
                                k_new, D=D, BS=BS, PS=PS, OWN_ROW=OWN_ROW)


@triton.jit
def summarize_block(slot, h, kc_ptr, skc_p, skc_r, skc_h, summ_ptr, ss_b, ss_h, hc_ptr, shc_h, scale, k_last,
                    D: tl.constexpr, BS: tl.constexpr, PS: tl.constexpr, OWN_ROW: tl.constexpr):
    """Summarise KV head h of the block whose last slot is ``slot``: its keys ``[BS, D]`` from the cache
    (the last one ``k_last [D]`` when OWN_ROW), then ``store_summary``."""
    offs_d = tl.arange(0, D)
    offs_t = tl.arange(0, BS)
    page = slot // PS
    row0 = slot % PS - (BS - 1)
    kb = tl.load(kc_ptr + page * skc_p + (row0 + offs_t)[:, None] * skc_r + h * skc_h
                 + offs_d[None, :]).to(tl.float32)
    if OWN_ROW:
        kb = tl.where(offs_t[:, None] == BS - 1, k_last.to(tl.float32)[None, :], kb)
    store_summary(kb, slot, h, summ_ptr, ss_b, ss_h, hc_ptr, shc_h, scale, D=D, BS=BS)


@triton.jit
def store_summary(kb, slot, h, summ_ptr, ss_b, ss_h, hc_ptr, shc_h, scale, D: tl.constexpr, BS: tl.constexpr):
    """``softmax(K head_cls / sqrt(D))`` over a block's keys ``kb [BS, D]`` (fp32), the weighted key sum stored at
    ``summaries[slot // BS, h]`` in the store's dtype."""
    offs_d = tl.arange(0, D)
    hc = tl.load(hc_ptr + h * shc_h + offs_d).to(tl.float32)
    logits = tl.sum(kb * hc[None, :], axis=1) * scale
    w = tl.exp(logits - tl.max(logits, axis=0))
    w = w / tl.sum(w, axis=0)
    s = tl.sum(w[:, None] * kb, axis=0)
    tl.store(summ_ptr + (slot // BS) * ss_b + h * ss_h + offs_d, s.to(summ_ptr.dtype.element_ty))


@triton.jit
def _block_keys_written_now(slot, t, h, k_ptr, sk_t, sk_h, slot_ptr, kc_ptr, skc_p, skc_r, skc_h,
                            D: tl.constexpr, BS: tl.constexpr, PS: tl.constexpr):
    """The keys ``[BS, D]`` (fp32) of the block whose last slot is ``slot``, written by token ``t``: row r from
    this batch's ``k`` where token ``t - (BS - 1 - r)`` writes its slot (a request's new tokens are consecutive
    rows of the batch and fill consecutive slots of a block), else from the cache (written by an earlier call).
    Rounded to the cache's dtype first, as the stored keys are."""
    offs_d = tl.arange(0, D)
    offs_t = tl.arange(0, BS)
    tok = t - (BS - 1) + offs_t
    s_tok = tl.load(slot_ptr + tok, mask=tok >= 0, other=-1)
    new = (tok >= 0) & (s_tok == slot - (BS - 1) + offs_t)
    page = slot // PS
    row0 = slot % PS - (BS - 1)
    kb = tl.load(kc_ptr + page * skc_p + (row0 + offs_t)[:, None] * skc_r + h * skc_h + offs_d[None, :],
                 mask=~new[:, None], other=0.0)
    kn = tl.load(k_ptr + tok.to(tl.int64)[:, None] * sk_t + h * sk_h + offs_d[None, :], mask=new[:, None], other=0.0)
    return tl.where(new[:, None], kn.to(kc_ptr.dtype.element_ty), kb).to(tl.float32)


@cached_launch
@triton.jit
def _kv_write_kernel(
    k_ptr, v_ptr, sk_t, sk_h, sv_t, sv_h,
    kc_ptr, vc_ptr, skc_p, skc_r, skc_h, svc_p, svc_r, svc_h,
    summ_ptr, ss_b, ss_h, hc_ptr, shc_h,
    slot_ptr, num_slots, scale,
    D: tl.constexpr, BS: tl.constexpr, PS: tl.constexpr,
    WRITE: tl.constexpr, SUMMARIZE: tl.constexpr, OWN_ROW: tl.constexpr,
):
    """Grid ``(T, Hkv)``: program (t, h) runs ``write_token`` for token t of KV head h."""
    write_token(tl.program_id(0), tl.program_id(1), k_ptr, v_ptr, sk_t, sk_h, sv_t, sv_h,
                kc_ptr, vc_ptr, skc_p, skc_r, skc_h, svc_p, svc_r, svc_h,
                summ_ptr, ss_b, ss_h, hc_ptr, shc_h, slot_ptr, num_slots, scale,
                D=D, BS=BS, PS=PS, WRITE=WRITE, SUMMARIZE=SUMMARIZE, OWN_ROW=OWN_ROW)


@cached_launch
@triton.jit(do_not_specialize=["num_tokens"])
def _kv_rows_kernel(
    k_ptr, v_ptr, sk_t, sk_h, sv_t, sv_h,
    kc_ptr, vc_ptr, skc_p, skc_r, skc_h, svc_p, svc_r, svc_h,
    summ_ptr, ss_b, ss_h, hc_ptr, shc_h,
    slot_ptr, num_slots, scale, num_tokens,
    D: tl.constexpr, BS: tl.constexpr, PS: tl.constexpr, ROWS: tl.constexpr,
    WRITE: tl.constexpr, SUMMARIZE: tl.constexpr,
):
    """Grid ``(cdiv(T, ROWS), Hkv)``: program (i, h) takes tokens ``i * ROWS ..`` of KV head h. WRITE stores
    their K/V rows at their slots (skipped when < 0 or out of range); SUMMARIZE summarises the block of each token
    whose slot is the last of its block: with WRITE, from the keys of this batch (``_block_keys_written_now``: other
    programs write them into the cache meanwhile; each request's new tokens consecutive) and of the cache; alone,
    from the cache (written by an earlier launch)."""
    h = tl.program_id(1)
    offs_r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    slot = tl.load(slot_ptr + offs_r, mask=offs_r < num_tokens, other=-1).to(tl.int64)
    ok = (slot >= 0) & (slot < num_slots)
    if WRITE:
        offs_d = tl.arange(0, D)
        t64 = offs_r.to(tl.int64)[:, None]
        dst = (slot // PS)[:, None]
        row = (slot % PS)[:, None]
        k = tl.load(k_ptr + t64 * sk_t + h * sk_h + offs_d[None, :], mask=ok[:, None])
        v = tl.load(v_ptr + t64 * sv_t + h * sv_h + offs_d[None, :], mask=ok[:, None])
        tl.store(kc_ptr + dst * skc_p + row * skc_r + h * skc_h + offs_d[None, :], k.to(kc_ptr.dtype.element_ty),
                 mask=ok[:, None])
        tl.store(vc_ptr + dst * svc_p + row * svc_r + h * svc_h + offs_d[None, :], v.to(vc_ptr.dtype.element_ty),
                 mask=ok[:, None])
    if SUMMARIZE:
        last = ok & (slot % BS == BS - 1)
        rank = tl.cumsum(last.to(tl.int32), axis=0) - 1
        for j in range(tl.sum(last.to(tl.int32), axis=0)):  # the j-th token of this program that ends a block
            s_j = tl.max(tl.where(last & (rank == j), slot, -1), axis=0)
            if WRITE:
                t_j = tl.max(tl.where(last & (rank == j), offs_r, -1), axis=0)
                kb = _block_keys_written_now(s_j, t_j, h, k_ptr, sk_t, sk_h, slot_ptr, kc_ptr, skc_p, skc_r, skc_h,
                                             D=D, BS=BS, PS=PS)
                store_summary(kb, s_j, h, summ_ptr, ss_b, ss_h, hc_ptr, shc_h, scale, D=D, BS=BS)
            else:
                summarize_block(s_j, h, kc_ptr, skc_p, skc_r, skc_h, summ_ptr, ss_b, ss_h, hc_ptr, shc_h, scale,
                                None, D=D, BS=BS, PS=PS, OWN_ROW=False)


def write_args(k: Optional[torch.Tensor], v: Optional[torch.Tensor], cache: PagedKVCache,
               slot_mapping: torch.Tensor, head_cls: Optional[torch.Tensor]) -> tuple:
    """The runtime arguments of ``write_token`` after ``(t, h)``, and of ``_kv_rows_kernel`` before ``num_tokens``
    (placeholders where absent)."""
    kc, vc = cache.k_pages, cache.v_pages
    sk = k.stride() if k is not None else (0, 0)
    sv = v.stride() if v is not None else (0, 0)
    hc, shc = (head_cls, head_cls.stride(0)) if cache.summaries is not None else (kc, 0)  # placeholder, unread
    return (k if k is not None else kc, v if v is not None else vc, sk[0], sk[1], sv[0], sv[1],
            *cache.kept("write args", lambda: _cache_args(cache)), hc, shc, slot_mapping, cache.num_slots,
            1.0 / math.sqrt(cache.head_dim))


def no_write_args(placeholder: torch.Tensor, slots: torch.Tensor) -> tuple:
    """``write_args``' layout for a launch that writes nothing: ``placeholder`` for every tensor but the slot
    mapping, ``slots`` (an integer tensor) for that; never dereferenced."""
    t = placeholder
    return (t, t, 0, 0, 0, 0, t, t, 0, 0, 0, 0, 0, 0, t, 0, 0, t, 0, slots, 0, 1.0)


def _cache_args(cache: PagedKVCache) -> tuple:
    """``write_args``' part that depends on the cache alone: the pages and their strides, the summary store (the K
    pages as a placeholder without one) and its strides."""
    kc, vc, summ = cache.k_pages, cache.v_pages, cache.summaries
    ss = summ.stride()[:2] if summ is not None else (0, 0)
    return (kc, vc, *kc.stride()[:3], *vc.stride()[:3], summ if summ is not None else kc, *ss)


def summary_warps(block_size: int, head_dim: int) -> int:
    """Warps of a program that summarises blocks (its ``[block_size, D]`` fp32 key tile)."""
    return 16 if block_size * head_dim >= 32768 else (8 if block_size * head_dim >= 8192 else 4)


def write_kv_and_summaries(k: Optional[torch.Tensor], v: Optional[torch.Tensor], cache: PagedKVCache,
                           slot_mapping: torch.Tensor, head_cls: Optional[torch.Tensor], block_size: int,
                           *, decode: bool, consecutive: bool = False) -> None:
    """Write ``k, v [T, Hkv, D]`` at ``slot_mapping [T]`` (int64, < 0 = skipped) and summarise every
    block whose last slot is written (when the cache has a summary store).

    decode=True: one launch, a program per token and KV head; each token's block holds no other token of
    this batch (one new token per request). decode=False: programs of ``ROWS`` tokens (prefill, any batch): with
    ``consecutive`` (each request's new tokens are consecutive rows filling consecutive slots, as
    ``paged_dash_prefill``'s ``cu_seqlens_q`` and block table place them) one launch, a block's new keys read from
    ``k``; otherwise (slots in any order) a write launch, then a summary launch reading the cache. ``k, v`` None:
    the summaries only. Arguments are assumed validated (``dash_core.checks``); nothing is synchronised.
    """
    t = slot_mapping.shape[0]
    if t == 0 or (k is None and cache.summaries is None):
        return
    d = cache.head_dim
    summarize = cache.summaries is not None
    args = write_args(k, v, cache, slot_mapping, head_cls)
    num_warps = summary_warps(block_size, d)

    def rows(write: bool, summ_on: bool, warps: int) -> None:
        _kv_rows_kernel[(cdiv(t, ROWS), cache.num_kv_heads)](
            *args, t, D=d, BS=block_size, PS=cache.page_size, ROWS=ROWS, WRITE=write, SUMMARIZE=summ_on,
            num_warps=warps,
        )

    if decode:
        _kv_write_kernel[(t, cache.num_kv_heads)](
            *args, D=d, BS=block_size, PS=cache.page_size, WRITE=k is not None, SUMMARIZE=summarize,
            OWN_ROW=summarize and k is not None, num_warps=num_warps,
        )
        return
    if k is not None and summarize and consecutive:  # [ROWS, D] K and V tiles, then each completed block's keys
        rows(True, True, max(num_warps, ROWS * d // 2048))
        return
    if k is not None:
        rows(True, False, max(4, ROWS * d // 2048))
    if summarize:  # after the write: a block's keys may come from several programs
        rows(False, True, num_warps)


def write_prefill(k: torch.Tensor, v: torch.Tensor, cache: PagedKVCache, slot_mapping: torch.Tensor,
                  params, head_cls: Optional[torch.Tensor], consecutive: bool = False) -> None:
    """Write ``k, v [T, Hkv, D]`` at ``slot_mapping [T]`` and summarise the blocks completed (prefill: any batch;
    ``consecutive`` as for ``write_kv_and_summaries``). Arguments validated by the op."""
    k = k if k.stride(-1) == 1 else k.contiguous()  # the kernel reads whole [D] rows
    v = v if v.stride(-1) == 1 else v.contiguous()
    write_kv_and_summaries(k, v, cache, slot_mapping, head_cls, params.block_size, decode=False,
                           consecutive=consecutive)


def write_indexer_summaries(cache: PagedKVCache, slot_mapping: torch.Tensor, head_cls_i: torch.Tensor,
                            params) -> None:
    """Summarise with ``head_cls_i [D]`` the stored indexer keys of the blocks ``slot_mapping`` completes, into
    the cache's 1-head summary store (the auxiliary head; ``cache.indexer_view()``)."""
    write_kv_and_summaries(None, None, cache.indexer_view(), slot_mapping, head_cls_i[None], params.block_size,
                           decode=False)
