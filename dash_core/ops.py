"""The public DASH ops over paged KV caches (docs/design.md, "The public ops").

Tokens are flattened across requests: ``n`` requests, ``T`` new tokens in all. Every op validates its arguments
once (``dash_core.checks``: shapes, dtypes and devices, no device reads) before anything is written, then runs the
step on one path: the Triton kernels on CUDA with fp16/bf16, the pure-PyTorch paged path (``dash_core.paged``)
otherwise. For decode the op also chooses the attention stage: the kernels' own, or a segment backend
(``dash_core.segments``) fed by the same routing.

Example (one request of 40 tokens in pages of 16, then one decode step)::

    >>> import torch
    >>> from dash_core import DashParams, dash_reference
    >>> from dash_core.layout import PagedKVCache, alloc_summaries
    >>> from dash_core.ops import paged_dash_prefill, paged_dash_decode
    >>> p = DashParams(block_size=16, scaling_factor=2.0)
    >>> q, k, v = torch.randn(41, 4, 32), torch.randn(41, 2, 32), torch.randn(41, 2, 32)
    >>> hc = torch.randn(2, 32)
    >>> cache = PagedKVCache.from_sglang(torch.zeros(128, 2, 32), torch.zeros(128, 2, 32), 16,
    ...                                  alloc_summaries(128, 16, 2, 32, torch.float32))
    >>> bt = torch.tensor([[5, 2, 7]], dtype=torch.int32)
    >>> slots = bt[0, torch.arange(41) // 16].long() * 16 + torch.arange(41) % 16
    >>> o1 = paged_dash_prefill(q[:40], k[:40], v[:40], cache, bt, torch.tensor([0, 40], dtype=torch.int32),
    ...                         torch.tensor([40], dtype=torch.int32), slots[:40], hc, p)
    >>> o2 = paged_dash_decode(q[40:], k[40:], v[40:], cache, bt, torch.tensor([41], dtype=torch.int32),
    ...                        slots[40:], hc, p)
    >>> heads_first = lambda x: x.permute(1, 0, 2)[None]  # [T, H, D] -> [1, H, T, D]
    >>> ref, _ = dash_reference(heads_first(q), heads_first(k), heads_first(v), hc, p)
    >>> bool(torch.allclose(torch.cat([o1, o2]), ref[0].permute(1, 0, 2), atol=1e-5))
    True
"""

from __future__ import annotations

from typing import Optional

import torch

from . import paged, recorder
from .checks import (SLOT_GUARD, Step, check_aux, check_cache, check_slot_mapping, check_step, check_tokens,
                     check_writes)
from .kernels.checks import check_write_config
from .layout import PagedKVCache
from .limits import HAVE_TRITON, uses_kernels
from .params import DashParams
from .rope import PageRopeSettings
from .segments_paged import decode_segment_attention
from .workspace import PrefillWorkspace

if HAVE_TRITON:  # the Triton kernels (Linux); without triton every call takes the PyTorch path
    from .kernels import kv_write
    from .kernels.decode.launch import paged_dash_decode_triton, step_buffers, write_and_route
    from .kernels.prefill.launch import paged_dash_prefill_triton
    from .kernels.prefill.plan import scratch_bound as prefill_scratch_bytes

__all__ = ["cache_dash_prefill", "paged_dash_prefill", "paged_dash_decode", "prefill_scratch_bytes",
           "check_slot_errors", "run_prefill", "run_decode"]


def check_slot_errors(wait: bool = True) -> None:
    """Raise ``ValueError`` if an earlier CUDA call's ``slot_mapping`` held slots outside its cache (those writes
    were skipped). Eager calls check this themselves without waiting; ``wait=True`` synchronises first."""
    SLOT_GUARD.raise_found(wait=wait)


def cache_dash_prefill(k: torch.Tensor, v: torch.Tensor, cache: PagedKVCache, slot_mapping: torch.Tensor,
                       params: DashParams, *, head_cls: Optional[torch.Tensor] = None,
                       ik: Optional[torch.Tensor] = None, head_cls_i: Optional[torch.Tensor] = None,
                       roles: Optional[torch.Tensor] = None, positions: Optional[torch.Tensor] = None,
                       page_rope: Optional[PageRopeSettings] = None, block_table: Optional[torch.Tensor] = None,
                       cu_seqlens_q: Optional[torch.Tensor] = None) -> None:
    """Write new keys and values into the cache and summarise every block whose last token they complete.

    Validates everything before writing anything.

    Parameters
    ----------
    k, v : ``[T, Hkv, D]`` the new keys and values.
    cache : the layer's ``PagedKVCache``.
    slot_mapping : ``[T]`` int64 slot of each token (``< 0``: padding, skipped; a slot at or past
        ``cache.num_slots`` is an error).
    params : the layer's ``DashParams``.
    head_cls : ``[Hkv, D]`` the summary vectors, needed when the cache has a summary store (and no indexer).
    ik, head_cls_i : ``[T, D]`` and ``[D]``, together: the auxiliary head's indexer keys, stored and summarised
        into the 1-head store instead of K (docs/semantics.md section 9; the cache needs ``aux``).
    roles, positions, page_rope : page mode: ``k`` and ``ik`` are unrotated and get page RoPE here, at coordinates
        from ``roles [T]`` (None: all 0, e.g. decode tokens) continuing each request's stored state; that needs
        ``positions [T]``, ``block_table [n, max_pages]`` and ``cu_seqlens_q [n + 1]`` (the requests' rows). The
        auxiliary rows store positions as the coordinates without page mode (0 without them).
    """
    t = k.shape[0] if k is not None and k.dim() else 0
    check_cache(cache, params)
    check_tokens("k", k, t, cache)
    if page_rope is not None:
        if block_table is None or cu_seqlens_q is None or block_table.dim() != 2 \
                or tuple(cu_seqlens_q.shape) != (block_table.shape[0] + 1,):
            raise ValueError("page mode needs block_table [n, max_pages] and cu_seqlens_q [n + 1] to read each "
                             f"request's stored state; got {None if block_table is None else tuple(block_table.shape)}"
                             f" and {None if cu_seqlens_q is None else tuple(cu_seqlens_q.shape)}")
    indexer = ik is not None or head_cls_i is not None
    aux = check_aux(cache, t, None, ik, head_cls_i, roles, positions, page_rope, decode=False, indexer=indexer,
                    roles_optional=True)
    check_writes(k, v, slot_mapping, cache, head_cls, t, summarise_k=not indexer)
    check_slot_mapping(slot_mapping, t, k.device, cache.num_slots)
    kernels = uses_kernels(k.device, k.dtype) and cache.dtype == k.dtype
    if kernels:
        check_write_config(cache, params)
        if indexer and cache.summaries is not None:
            check_write_config(cache.indexer_view(), params)
    rows = None
    if aux:
        _, k, _, ik, rows = paged.prepare_aux(cache, None, k, None, ik, roles, positions, page_rope, block_table,
                                              cu_seqlens_q)
    _write(cache, k, v, slot_mapping, params, head_cls, head_cls_i, rows, kernels)


def _write(cache: PagedKVCache, k, v, slot_mapping, params: DashParams, head_cls, head_cls_i, rows,
           kernels: bool) -> None:
    """The writes of validated K/V: K/V with the summaries of K (none with an indexer), the auxiliary ``rows [T,
    2D]`` (tensor ops), then with an indexer the summaries of the stored ``ik`` into the 1-head store."""
    SLOT_GUARD.raise_found()
    indexer = head_cls_i is not None
    kv = cache if not indexer else PagedKVCache(cache.k_pages, cache.v_pages, None)
    if kernels:
        SLOT_GUARD.watch(slot_mapping, cache)
        kv_write.write_prefill(k, v, kv, slot_mapping, params, head_cls)
    else:
        paged.write_kv(kv, k, v, slot_mapping)
        paged.write_summaries(kv, slot_mapping, head_cls, params)
    if rows is not None:
        paged.write_aux(cache, rows, slot_mapping)
    if indexer and cache.summaries is not None:
        if kernels:
            kv_write.write_indexer_summaries(cache, slot_mapping, head_cls_i, params)
        else:
            paged.write_summaries(cache.indexer_view(), slot_mapping, head_cls_i[None], params)


def paged_dash_prefill(q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                       cache: PagedKVCache, block_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
                       seq_lens: torch.Tensor, slot_mapping: Optional[torch.Tensor], head_cls: Optional[torch.Tensor],
                       params: DashParams, *, out: Optional[torch.Tensor] = None, iq: Optional[torch.Tensor] = None,
                       ik: Optional[torch.Tensor] = None, head_cls_i: Optional[torch.Tensor] = None,
                       roles: Optional[torch.Tensor] = None, positions: Optional[torch.Tensor] = None,
                       page_rope: Optional[PageRopeSettings] = None,
                       workspace: Optional[PrefillWorkspace] = None) -> torch.Tensor:
    """Extend every request by its new tokens under causal DASH, on paged history of any length.

    Parameters
    ----------
    q : ``[T, Hq, D]`` queries of the new tokens.
    k, v : ``[T, Hkv, D]`` their keys and values, written at ``slot_mapping`` first; pass ``k = v = slot_mapping =
        None`` when the engine already wrote them with ``cache_dash_prefill``.
    cache : the layer's ``PagedKVCache``.
    block_table : ``[n, max_pages]`` int32 page ids of each request.
    cu_seqlens_q : ``[n + 1]`` int32 row offsets of each request's new tokens.
    seq_lens : ``[n]`` int32 KV lengths after the extend (0: a padded request).
    slot_mapping : ``[T]`` int64 (``< 0``: padding): each new token's slot, where the block table places its position.
    head_cls : ``[Hkv, D]`` the summary vectors (unused with an indexer, may be None).
    params : the layer's ``DashParams``.
    out : ``[T, Hq, D]`` to write into (optional).
    iq, ik, head_cls_i : ``[T, Hi, D]``, ``[T, D]``, ``[D]``: the auxiliary head's indexer routes (summaries of
        ``ik`` in a 1-head store; the mean over the Hi heads selects for every KV head); ``ik`` may be None when
        ``k`` is None (written by ``cache_dash_prefill``). The cache needs ``aux``.
    roles, positions, page_rope : page mode: q, k, iq, ik are unrotated; ``roles [T]`` (0 text, 1 page start, 2
        page token) and ``positions [T]`` int64 give the coordinates; each request's new tokens are the end of its
        prompt (a request with history continues its last stored token's state: prefill a page-mode prompt in one
        chunk).
    workspace : a ``PrefillWorkspace`` shared by the calls of one batch (the layers of an engine step): the first
        call makes the plan and routing scratch, the others reuse them; its ``config`` tunes the kernels. The
        PyTorch path ignores it.

    Returns
    -------
    ``out [T, Hq, D]`` in ``q.dtype``; rows of padded requests and of no request are zero. On CUDA with bf16/fp16
    the Triton kernels run it with no host synchronisation (routing scratch bounded per wave of query tiles).
    """
    step = check_step(q, k, v, cache, block_table, cu_seqlens_q, seq_lens, slot_mapping, head_cls, params, out,
                      iq=iq, ik=ik, head_cls_i=head_cls_i, roles=roles, positions=positions, page_rope=page_rope,
                      workspace=workspace)
    return run_prefill(step, q, k, v, cache, block_table, cu_seqlens_q, seq_lens, slot_mapping, head_cls, params,
                       out=out, iq=iq, ik=ik, head_cls_i=head_cls_i, roles=roles, positions=positions,
                       page_rope=page_rope, workspace=workspace)


def paged_dash_decode(q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                      cache: PagedKVCache, block_table: torch.Tensor, seq_lens: torch.Tensor,
                      slot_mapping: Optional[torch.Tensor], head_cls: Optional[torch.Tensor], params: DashParams, *,
                      out: Optional[torch.Tensor] = None, buffers=None, backend: Optional[str] = None,
                      plan_cache=None, iq: Optional[torch.Tensor] = None, ik: Optional[torch.Tensor] = None,
                      head_cls_i: Optional[torch.Tensor] = None, positions: Optional[torch.Tensor] = None,
                      page_rope: Optional[PageRopeSettings] = None) -> torch.Tensor:
    """One decode step: one query token per request, at position ``seq_lens[i] - 1``.

    Parameters
    ----------
    q : ``[n, Hq, D]``.
    k, v : ``[n, Hkv, D]`` written at ``slot_mapping [n]`` int64 first, or None when already written.
    cache, head_cls, params : as for ``paged_dash_prefill``.
    block_table : ``[n, max_pages]`` int32.
    seq_lens : ``[n]`` int32 including the new token (0 marks a padded row, whose output is zero).
    out : ``[n, Hq, D]`` to write into (optional).
    buffers : a ``dash_core.kernels.decode.buffers.DecodeBuffers`` to reuse (what a CUDA graph owns; it also
        carries the kernels' ``DecodeConfig``); allocated per call when None.
    backend : the attention stage on CUDA (default ``params.attention_backend``): ``"TRITON"`` or a segment
        backend (``"FLASHINFER"``, ``"FLASH_ATTN"``; ``dash_core.segments``), which needs ``params.topk``. The CPU
        path computes the same result with PyTorch whatever the backend.
    plan_cache : FlashInfer plans (default: the process-wide cache).
    iq, ik, head_cls_i : the auxiliary head's indexer, as in ``paged_dash_prefill``.
    positions, page_rope : ``[n]`` int64 positions and page mode: each new token's coordinates derived on the
        device from its request's previous stored row (role 0; no host read, graph-safe).

    Returns
    -------
    ``[n, Hq, D]`` in ``q.dtype``. On CUDA with bf16/fp16 the Triton kernels run it without host synchronisation.
    """
    backend = params.attention_backend if backend is None else backend
    step = check_step(q, k, v, cache, block_table, None, seq_lens, slot_mapping, head_cls, params, out, iq=iq,
                      ik=ik, head_cls_i=head_cls_i, positions=positions, page_rope=page_rope, backend=backend,
                      buffers=buffers)
    return run_decode(step, q, k, v, cache, block_table, seq_lens, slot_mapping, head_cls, params, out=out,
                      buffers=buffers, backend=backend, plan_cache=plan_cache, iq=iq, ik=ik, head_cls_i=head_cls_i,
                      positions=positions, page_rope=page_rope)


def run_prefill(step: Step, q, k, v, cache: PagedKVCache, block_table, cu_seqlens_q, seq_lens, slot_mapping,
                head_cls, params: DashParams, *, out=None, iq=None, ik=None, head_cls_i=None, roles=None,
                positions=None, page_rope=None, workspace=None) -> torch.Tensor:
    """``paged_dash_prefill`` after its validation (``checks.check_step``), on the path ``step`` names."""
    if step.aux:
        q, iq = _aux_writes(step, q, k, v, cache, block_table, cu_seqlens_q, seq_lens, slot_mapping, head_cls,
                            params, iq, ik, head_cls_i, roles, positions, page_rope)
        k = v = slot_mapping = None
    if not step.kernels:
        return _attend_torch("prefill", q, k, v, cache, block_table, cu_seqlens_q, seq_lens, slot_mapping,
                             head_cls, params, out, iq, head_cls_i)
    if k is not None:
        SLOT_GUARD.raise_found()
        SLOT_GUARD.watch(slot_mapping, cache)
    return paged_dash_prefill_triton(q, k, v, cache, block_table, cu_seqlens_q, seq_lens, slot_mapping, head_cls,
                                     params, out=out, iq=iq, workspace=workspace)


def run_decode(step: Step, q, k, v, cache: PagedKVCache, block_table, seq_lens, slot_mapping, head_cls,
               params: DashParams, *, out=None, buffers=None, backend: str = "TRITON", plan_cache=None, iq=None,
               ik=None, head_cls_i=None, positions=None, page_rope=None) -> torch.Tensor:
    """``paged_dash_decode`` after its validation (``checks.check_step``), on the path ``step`` names; on the
    kernels' path the attention stage is ``backend``'s."""
    if step.aux:
        cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
        q, iq = _aux_writes(step, q, k, v, cache, block_table, cu, seq_lens, slot_mapping, head_cls, params, iq,
                            ik, head_cls_i, None, positions, page_rope)
        k = v = slot_mapping = None
    if not step.kernels:
        cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
        return _attend_torch("decode", q, k, v, cache, block_table, cu, seq_lens, slot_mapping, head_cls, params,
                             out, iq, head_cls_i)
    if k is not None:
        SLOT_GUARD.raise_found()
        SLOT_GUARD.watch(slot_mapping, cache)
    if backend == "TRITON":
        return paged_dash_decode_triton(q, k, v, cache, block_table, seq_lens, slot_mapping, head_cls, params,
                                        out=out, buffers=buffers, iq=iq)
    buffers, out = step_buffers(q, cache, block_table, params, buffers, out, iq)
    write_and_route(q, k, v, cache, block_table, seq_lens, slot_mapping, head_cls, params, buffers, iq=iq)
    routed = params.routed_by(iq is not None)
    n, b = q.shape[0], buffers
    out.copy_(decode_segment_attention(q, cache, block_table, seq_lens, b.sel_idx[:n], b.sel_bias[:n],
                                       b.sel_count[:n], routed, backend, plan_cache=plan_cache))
    return out


def _aux_writes(step: Step, q, k, v, cache, block_table, cu_seqlens_q, seq_lens, slot_mapping, head_cls, params,
                iq, ik, head_cls_i, roles, positions, page_rope) -> tuple:
    """The auxiliary head's part of a validated step: page RoPE of the queries and keys, then the writes of K/V,
    the auxiliary rows and (with an indexer) the summaries of ``ik``. Returns the rotated ``(q, iq)``."""
    if positions is None:
        positions = paged.token_positions(cu_seqlens_q, seq_lens, q.shape[0], q.device)
    q, k, iq, ik, rows = paged.prepare_aux(cache, q, k, iq, ik, roles, positions, page_rope, block_table,
                                           cu_seqlens_q)
    if k is not None:
        _write(cache, k, v, slot_mapping, params, head_cls, head_cls_i, rows, step.kernels)
    return q, iq


def _attend_torch(op: str, q, k, v, cache, block_table, cu_seqlens_q, seq_lens, slot_mapping, head_cls, params,
                  out, iq, head_cls_i) -> torch.Tensor:
    """The PyTorch paged path of a validated step: record it (``DASH_RECORD_DIR``), write the new K/V, attend."""
    out = torch.empty_like(q) if out is None else out
    recorder.record(op, q=q, cache=cache, block_table=block_table, cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens,
                    slot_mapping=slot_mapping, params=params)
    if k is not None:
        _write(cache, k, v, slot_mapping, params, head_cls, None, None, False)
    return paged.paged_dash_torch(q, cache, block_table, cu_seqlens_q, seq_lens, head_cls, params, out, iq=iq,
                                  head_cls_i=head_cls_i)
