"""Triton kernel: write new K/V into the paged cache and summarise the blocks they complete.

Stage 1 of SPEC.md (section 2) on the GPU. A block is summarised by the program of the token
that completes it (``slot % bs == bs - 1``); its other keys are read back from the cache.

- Decode (one new token per request): one launch does both, the completing key is taken from
  the input (``OWN_ROW``), the others were written by earlier steps.
- Prefill (several tokens of a block may arrive in one batch): a write launch, then a summary
  launch that reads every key of the block from the cache.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from ..layout import PagedKVCache


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
    ``summaries[slot // BS, h]`` in the store's dtype. Also called by the decode score kernel.
    """
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if (slot >= 0) & (slot < num_slots):
        offs_d = tl.arange(0, D)
        page = slot // PS
        row = slot % PS
        if WRITE | OWN_ROW:
            k_new = tl.load(k_ptr + t * sk_t + h * sk_h + offs_d).to(kc_ptr.dtype.element_ty)
        if WRITE:
            v_new = tl.load(v_ptr + t * sv_t + h * sv_h + offs_d)
            tl.store(kc_ptr + page * skc_p + row * skc_r + h * skc_h + offs_d, k_new)
            tl.store(vc_ptr + page * svc_p + row * svc_r + h * svc_h + offs_d, v_new.to(vc_ptr.dtype.element_ty))
        if SUMMARIZE:
            if slot % BS == BS - 1:
                offs_t = tl.arange(0, BS)
                row0 = row - (BS - 1)
                kb = tl.load(kc_ptr + page * skc_p + (row0 + offs_t)[:, None] * skc_r + h * skc_h
                             + offs_d[None, :]).to(tl.float32)
                if OWN_ROW:
                    kb = tl.where(offs_t[:, None] == BS - 1, k_new.to(tl.float32)[None, :], kb)
                hc = tl.load(hc_ptr + h * shc_h + offs_d).to(tl.float32)
                logits = tl.sum(kb * hc[None, :], axis=1) * scale
                w = tl.exp(logits - tl.max(logits, axis=0))
                w = w / tl.sum(w, axis=0)
                s = tl.sum(w[:, None] * kb, axis=0)
                tl.store(summ_ptr + (slot // BS) * ss_b + h * ss_h + offs_d, s.to(summ_ptr.dtype.element_ty))


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


def write_args(k: Optional[torch.Tensor], v: Optional[torch.Tensor], cache: PagedKVCache,
               slot_mapping: torch.Tensor, head_cls: Optional[torch.Tensor]) -> tuple:
    """The runtime arguments of ``write_token`` after ``(t, h)`` (placeholders where absent)."""
    kc, vc = cache.k_pages, cache.v_pages
    summarize = cache.summaries is not None
    summ = cache.summaries if summarize else kc  # placeholder pointer, never dereferenced
    hc = head_cls if summarize else kc
    kk = k if k is not None else kc
    vv = v if v is not None else vc
    return (kk, vv, k.stride(0) if k is not None else 0, k.stride(1) if k is not None else 0,
            v.stride(0) if v is not None else 0, v.stride(1) if v is not None else 0,
            kc, vc, kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
            summ, summ.stride(0) if summarize else 0, summ.stride(1) if summarize else 0,
            hc, head_cls.stride(0) if summarize else 0,
            slot_mapping, cache.num_slots, 1.0 / math.sqrt(cache.head_dim))


def write_kv_and_summaries(k: Optional[torch.Tensor], v: Optional[torch.Tensor], cache: PagedKVCache,
                           slot_mapping: torch.Tensor, head_cls: Optional[torch.Tensor], block_size: int,
                           *, decode: bool) -> None:
    """Write ``k, v [T, Hkv, D]`` at ``slot_mapping [T]`` (int64, < 0 = skipped) and summarise every
    block whose last slot is written (when the cache has a summary store).

    decode=True: one launch; each token's block holds no other token of this batch (one new token
    per request). decode=False: a write launch, then a summary launch (prefill, any batch).
    Arguments are assumed validated (``dash_core.kernels.launcher``); nothing is synchronised.
    """
    t = slot_mapping.shape[0]
    if t == 0:
        return
    d = cache.head_dim
    summarize = cache.summaries is not None
    args = write_args(k, v, cache, slot_mapping, head_cls)
    num_warps = 16 if block_size * d >= 32768 else (8 if block_size * d >= 8192 else 4)  # [bs, D] fp32 tile

    def launch(write: bool, summ_on: bool, own_row: bool) -> None:
        _kv_write_kernel[(t, cache.num_kv_heads)](
            *args, D=d, BS=block_size, PS=cache.page_size, WRITE=write, SUMMARIZE=summ_on, OWN_ROW=own_row,
            num_warps=num_warps,
        )

    if k is None:  # K/V already written: summaries only
        if summarize:
            launch(False, True, False)
    elif decode or not summarize:
        launch(True, summarize, summarize)
    else:
        launch(True, False, False)
        launch(False, True, False)
