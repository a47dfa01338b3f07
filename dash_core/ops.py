"""The public DASH ops over paged KV caches (DESIGN.md, "The public ops").

Tokens are flattened across requests: ``n`` requests, ``T`` new tokens in all. Every op
validates its arguments on the host from shapes alone (no device reads), then dispatches by
device: Triton kernels on CUDA where they exist, the pure-PyTorch paged path
(``dash_core.paged``) otherwise.

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

from .layout import PagedKVCache, check_page_size
from .params import DashParams
from .rope import PageRopeSettings
from .workspace import PrefillWorkspace, check_workspace
from . import paged, recorder

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def cache_dash_prefill(k: torch.Tensor, v: torch.Tensor, cache: PagedKVCache, slot_mapping: torch.Tensor,
                       params: DashParams, *, head_cls: Optional[torch.Tensor] = None,
                       ik: Optional[torch.Tensor] = None, head_cls_i: Optional[torch.Tensor] = None,
                       roles: Optional[torch.Tensor] = None, positions: Optional[torch.Tensor] = None,
                       page_rope: Optional[PageRopeSettings] = None, block_table: Optional[torch.Tensor] = None,
                       cu_seqlens_q: Optional[torch.Tensor] = None) -> None:
    """Write ``k, v [T, Hkv, D]`` at ``slot_mapping [T]`` (int64; < 0 = padding, skipped) and
    summarise every block whose last token is written (needs ``head_cls [Hkv, D]`` when the
    cache has a summary store). Validates everything before writing anything.

    Auxiliary head (SPEC.md section 9; the cache needs ``aux``): ik ``[T, D]`` and head_cls_i ``[D]``
    (together) store the indexer keys and summarise them into the 1-head store instead of K.
    page_rope switches page mode on: k and ik are unrotated and get page RoPE here, at coordinates
    from roles ``[T]`` (None: all 0, e.g. decode tokens) continuing each request's stored state; that
    needs positions ``[T]``, block_table ``[n, max_pages]`` and cu_seqlens_q ``[n + 1]`` (the
    requests' rows). The rows store positions as the coordinates without page mode (0 without them).
    """
    _check_cache(cache, params)
    t = slot_mapping.shape[0]
    _check_tokens("k", k, t, cache)
    _check_tokens("v", v, t, cache)
    if page_rope is not None:
        if block_table is None or cu_seqlens_q is None or block_table.dim() != 2 \
                or tuple(cu_seqlens_q.shape) != (block_table.shape[0] + 1,):
            raise ValueError("page mode needs block_table [n, max_pages] and cu_seqlens_q [n + 1] to read each "
                             f"request's stored state; got {None if block_table is None else tuple(block_table.shape)}"
                             f" and {None if cu_seqlens_q is None else tuple(cu_seqlens_q.shape)}")
    if _check_aux(cache, k, t, None, ik, head_cls_i, roles, positions, page_rope, decode=False,
                  indexer=ik is not None or head_cls_i is not None, roles_optional=True):
        if cache.summaries is not None and head_cls_i is None:
            _check_head_cls(head_cls, cache)
        _, k, _, ik, rows = paged.prepare_aux(cache, None, k, None, ik, roles, positions, page_rope, block_table,
                                              cu_seqlens_q)
        _write_new(cache, k, v, slot_mapping, params, head_cls, ik, head_cls_i, rows)
        return
    if cache.summaries is not None:
        _check_head_cls(head_cls, cache)
    if cache.k_pages.is_cuda and cache.dtype in (torch.float16, torch.bfloat16):  # Triton write + summaries
        from .kernels.launcher import cache_dash_prefill_triton
        cache_dash_prefill_triton(k, v, cache, slot_mapping, params, head_cls)
        return
    paged.write_kv(cache, k, v, slot_mapping)
    if cache.summaries is not None:
        paged.write_summaries(cache, slot_mapping, head_cls, params)


def _write_new(cache, k, v, slot_mapping, params, head_cls, ik, head_cls_i, rows) -> None:
    """Write K/V (summaries of K unless there is an indexer), the auxiliary rows, then the
    summaries of ``ik`` (the indexer view of the cache): Triton on CUDA bf16/fp16, else PyTorch."""
    if cache.k_pages.is_cuda and cache.dtype in (torch.float16, torch.bfloat16):
        from .kernels.launcher import write_new_triton
        write_new_triton(cache, k, v, slot_mapping, params, head_cls, head_cls_i, rows)
        return
    indexer = head_cls_i is not None
    kv = PagedKVCache(cache.k_pages, cache.v_pages, None if indexer else cache.summaries)
    paged.write_kv(kv, k, v, slot_mapping)
    if kv.summaries is not None:
        paged.write_summaries(kv, slot_mapping, head_cls, params)
    if rows is not None:
        paged.write_aux(cache, rows, slot_mapping)
    if indexer and cache.summaries is not None:
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

    q: ``[T, Hq, D]``; k, v: ``[T, Hkv, D]`` new keys/values written at ``slot_mapping [T]``
    first (pass ``k = v = slot_mapping = None`` when the engine already wrote them with
    ``cache_dash_prefill``); block_table: ``[n, max_pages]`` int32 page ids;
    cu_seqlens_q: ``[n + 1]`` int32 row offsets of each request's new tokens;
    seq_lens: ``[n]`` int32 KV lengths after the extend; head_cls: ``[Hkv, D]``.
    Returns ``out [T, Hq, D]`` in ``q.dtype`` (rows of padded requests are zero).
    On CUDA with bf16/fp16 this runs the Triton prefill kernels (``dash_core.kernels.prefill``:
    routing scratch bounded per wave of query tiles, no host synchronisation).

    Auxiliary head (SPEC.md section 9; the cache needs ``aux``): iq ``[T, Hi, D]``, ik ``[T, D]``,
    head_cls_i ``[D]`` route with the indexer (summaries of ``ik`` in a 1-head store, the mean over
    the Hi heads selects for every KV head; ``head_cls`` unused, may be None); ik may be None when
    ``k`` is None (written by ``cache_dash_prefill``). page_rope (a ``PageRopeSettings``) switches page
    mode on: q, k, iq, ik are unrotated, roles ``[T]`` (0 text, 1 page start, 2 page token) and
    positions ``[T]`` int64 give the coordinates; each request's new tokens are the end of its prompt
    (a request with history continues its last stored token's state: prefill a page-mode prompt in
    one chunk).

    workspace: a ``dash_core.workspace.PrefillWorkspace`` shared by the calls of one batch (the
    layers of an engine step): the first call makes the plan and routing scratch, the others reuse
    them. Used by the Triton path; the PyTorch path ignores it.
    """
    check_workspace(workspace)
    if _check_aux(cache, k if k is not None else q, q.shape[0], iq, ik, head_cls_i, roles, positions, page_rope,
                  decode=False, query=q, writes=k is not None):
        return _paged_dash_aux("prefill", q, k, v, cache, block_table, cu_seqlens_q, seq_lens, slot_mapping,
                               head_cls, params, out, iq, ik, head_cls_i, roles, positions, page_rope,
                               workspace=workspace)
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):  # fp32 stays on the torch path
        from .kernels.prefill import paged_dash_prefill_triton
        _check_query(q, cache, head_cls, block_table, seq_lens)
        return paged_dash_prefill_triton(q, k, v, cache, block_table, cu_seqlens_q, seq_lens, slot_mapping,
                                         head_cls, params, out=out, workspace=workspace)
    return _paged_dash("prefill", q, k, v, cache, block_table, cu_seqlens_q, seq_lens, slot_mapping, head_cls,
                       params, out)


def paged_dash_decode(q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                      cache: PagedKVCache, block_table: torch.Tensor, seq_lens: torch.Tensor,
                      slot_mapping: Optional[torch.Tensor], head_cls: Optional[torch.Tensor], params: DashParams, *,
                      out: Optional[torch.Tensor] = None, buffers=None, backend: Optional[str] = None,
                      plan_cache=None, iq: Optional[torch.Tensor] = None, ik: Optional[torch.Tensor] = None,
                      head_cls_i: Optional[torch.Tensor] = None, positions: Optional[torch.Tensor] = None,
                      page_rope: Optional[PageRopeSettings] = None) -> torch.Tensor:
    """One decode step: one query token per request, at position ``seq_lens[i] - 1``.

    q: ``[n, Hq, D]``; k, v: ``[n, Hkv, D]`` (or None when already written); block_table:
    ``[n, max_pages]`` int32; seq_lens: ``[n]`` int32 including the new token (0 marks a padded
    row, whose output is zero); slot_mapping: ``[n]`` int64. Returns ``[n, Hq, D]`` in ``q.dtype``.
    On CUDA with bf16/fp16 this runs the Triton kernels without host synchronisation;
    buffers: a ``dash_core.kernels.launcher.DecodeBuffers`` to reuse (what a CUDA graph owns).
    backend: the attention stage on CUDA (default ``params.attention_backend``): ``"TRITON"`` or a
    segment backend (``"FLASHINFER"``, ``"FLASH_ATTN"``; ``dash_core.segments``), which needs
    ``params.topk``; plan_cache: FlashInfer plans (default: the process-wide cache). The CPU path
    computes the same result with PyTorch whatever the backend.

    Auxiliary head: iq ``[n, Hi, D]``, ik ``[n, D]``, head_cls_i ``[D]`` as in ``paged_dash_prefill``;
    page_rope with positions ``[n]`` int64: page mode, each new token's coordinates derived on the
    device from its request's previous stored row (role 0; no host read, graph-safe).
    """
    from .segments import check_decode_backend

    backend = params.attention_backend if backend is None else backend
    check_decode_backend(backend, params)
    if _check_aux(cache, k if k is not None else q, q.shape[0], iq, ik, head_cls_i, None, positions, page_rope,
                  decode=True, query=q, writes=k is not None):
        cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
        return _paged_dash_aux("decode", q, k, v, cache, block_table, cu, seq_lens, slot_mapping, head_cls, params,
                               out, iq, ik, head_cls_i, None, positions, page_rope, buffers=buffers,
                               backend=backend, plan_cache=plan_cache)
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):  # fp32 stays on the torch path
        from .kernels.launcher import paged_dash_decode_triton
        _check_query(q, cache, head_cls, block_table, seq_lens)
        return paged_dash_decode_triton(q, k, v, cache, block_table, seq_lens, slot_mapping, head_cls, params,
                                        out=out, buffers=buffers, backend=backend, plan_cache=plan_cache)
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return _paged_dash("decode", q, k, v, cache, block_table, cu, seq_lens, slot_mapping, head_cls, params, out)


def _paged_dash(op, q, k, v, cache, block_table, cu_seqlens_q, seq_lens, slot_mapping, head_cls, params, out):
    """Validate, record (``DASH_RECORD_DIR``), write the new K/V, then attend."""
    _check_query(q, cache, head_cls, block_table, seq_lens)
    if cu_seqlens_q.shape != (seq_lens.shape[0] + 1,):
        raise ValueError(f"cu_seqlens_q must be [n + 1] = [{seq_lens.shape[0] + 1}], got {tuple(cu_seqlens_q.shape)}")
    out = _out(out, q)
    recorder.record(op, q=q, cache=cache, block_table=block_table, cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens,
                    slot_mapping=slot_mapping, params=params)
    if k is not None:
        cache_dash_prefill(k, v, cache, slot_mapping, params, head_cls=head_cls)
    else:
        _check_cache(cache, params)
    return paged.paged_dash_torch(q, cache, block_table, cu_seqlens_q, seq_lens, head_cls, params, out)


def _paged_dash_aux(op, q, k, v, cache, block_table, cu_seqlens_q, seq_lens, slot_mapping, head_cls, params, out,
                    iq, ik, head_cls_i, roles, positions, page_rope, workspace=None, **decode_kw):
    """The ops with an indexer and/or page mode (arguments validated by ``_check_aux``): page RoPE and
    the auxiliary rows (``paged.prepare_aux``), the writes, then the attention of either path
    (``workspace``: prefill's, ``decode_kw``: decode's)."""
    indexer = iq is not None
    _check_query(q, cache, head_cls, block_table, seq_lens, indexer=indexer)
    if cu_seqlens_q.shape != (seq_lens.shape[0] + 1,):
        raise ValueError(f"cu_seqlens_q must be [n + 1] = [{seq_lens.shape[0] + 1}], got {tuple(cu_seqlens_q.shape)}")
    _check_cache(cache, params)
    if k is not None:
        _check_tokens("k", k, q.shape[0], cache)
        _check_tokens("v", v, q.shape[0], cache)
        if (slot_mapping is None or tuple(slot_mapping.shape) != (q.shape[0],)
                or slot_mapping.dtype not in (torch.int64, torch.int32) or slot_mapping.device != q.device):
            raise ValueError(f"slot_mapping must be [T] = [{q.shape[0]}] int64 on {q.device} with k and v, got "
                             f"{None if slot_mapping is None else (tuple(slot_mapping.shape), slot_mapping.dtype)}"
                             f"{'' if slot_mapping is None else ' on ' + str(slot_mapping.device)}")
        if cache.summaries is not None and not indexer:
            _check_head_cls(head_cls, cache)
    out = _out(out, q)
    triton = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
    if triton:  # the launches' own checks, before anything is written
        from .kernels.launcher import DecodeBuffers, check_decode_args, paged_dash_decode_triton
        from .kernels.prefill import check_prefill_args, paged_dash_prefill_triton
        if op == "decode":
            check_decode_args(q, None, None, cache, block_table, seq_lens, None, head_cls, params, out, iq=iq)
            if isinstance(decode_kw.get("buffers"), DecodeBuffers):
                decode_kw["buffers"].check(q, cache, block_table, params, iq=iq)
        else:
            check_prefill_args(q, None, None, cache, block_table, cu_seqlens_q, seq_lens, None, head_cls, params,
                               out, iq=iq)
    if positions is None:
        positions = paged.token_positions(cu_seqlens_q, seq_lens, q.shape[0], q.device)
    q, k, iq, ik, rows = paged.prepare_aux(cache, q, k, iq, ik, roles, positions, page_rope, block_table,
                                           cu_seqlens_q)
    if k is not None:
        _write_new(cache, k, v, slot_mapping, params, head_cls, ik, head_cls_i, rows)
    if triton:  # Triton launches; iq routes
        if op == "decode":
            return paged_dash_decode_triton(q, None, None, cache, block_table, seq_lens, None, head_cls, params,
                                            out=out, iq=iq, **decode_kw)
        return paged_dash_prefill_triton(q, None, None, cache, block_table, cu_seqlens_q, seq_lens, None, head_cls,
                                         params, out=out, iq=iq, workspace=workspace)
    recorder.record(op, q=q, cache=cache, block_table=block_table, cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens,
                    slot_mapping=slot_mapping, params=params)
    return paged.paged_dash_torch(q, cache, block_table, cu_seqlens_q, seq_lens, head_cls, params, out, iq=iq,
                                  head_cls_i=head_cls_i)


def _check_aux(cache, x, t, iq, ik, head_cls_i, roles, positions, page_rope, *, decode, query=None,
               writes=True, indexer=None, roles_optional=False) -> bool:
    """Validate the auxiliary-head inputs from shapes and dtypes (values of roles only off CUDA);
    True when there is one (an indexer or page mode), False for a plain call. decode: roles are not
    taken; roles_optional: None means all 0 (``cache_dash_prefill``)."""
    if indexer is None:
        indexer = iq is not None or head_cls_i is not None or (ik is not None and writes)
    if not indexer and page_rope is None:
        if roles is not None:
            raise ValueError("roles are given without page_rope: page mode needs page_rope (PageRopeSettings)")
        if ik is not None:
            raise ValueError("ik is given without iq and head_cls_i: the indexer needs all three")
        _check_kv_store(cache)
        return False
    d = cache.head_dim
    if cache.aux is None:
        raise ValueError("an indexer or page mode needs the cache's auxiliary head: build the PagedKVCache with aux "
                         "(from_vllm(..., aux=True) with Hkv + 1 head slots, or from_sglang(..., aux=alloc_aux_sglang(...)))")
    if indexer:
        need_ik = writes
        if head_cls_i is None or (query is not None and iq is None) or (need_ik and ik is None):
            raise ValueError(f"iq, ik and head_cls_i go together (ik may be None when k is None); got iq "
                             f"{iq is not None}, ik {ik is not None}, head_cls_i {head_cls_i is not None}")
        if tuple(head_cls_i.shape) != (d,):
            raise ValueError(f"head_cls_i must be [D] = [{d}], got {tuple(head_cls_i.shape)}")
        if iq is not None and (iq.dim() != 3 or iq.shape[0] != t or iq.shape[2] != d or iq.dtype != query.dtype):
            raise ValueError(f"iq must be [T, Hi, D] = [{t}, Hi, {d}] in the query dtype {query.dtype}; got "
                             f"{tuple(iq.shape)} {iq.dtype}")
        if ik is not None and (tuple(ik.shape) != (t, d) or ik.dtype not in SUPPORTED_DTYPES):
            raise ValueError(f"ik must be [T, D] = {(t, d)} in one of {SUPPORTED_DTYPES}; got {tuple(ik.shape)} "
                             f"{ik.dtype}")
        if cache.summaries is not None and cache.summaries.shape[1] != 1:
            raise ValueError(f"with an indexer the summary store holds summaries of ik, one head: "
                             f"alloc_summaries(num_slots, bs, 1, D, ...); got {tuple(cache.summaries.shape)}")
    else:
        _check_kv_store(cache)
    if positions is not None and (tuple(positions.shape) != (t,) or positions.dtype.is_floating_point
                                  or positions.dtype == torch.bool):
        raise ValueError(f"positions must be [T] = [{t}] integers, got {tuple(positions.shape)} {positions.dtype}")
    if page_rope is None:
        if roles is not None:
            raise ValueError("roles are given without page_rope: page mode needs page_rope (PageRopeSettings)")
        return True
    if not isinstance(page_rope, PageRopeSettings):
        raise ValueError(f"page_rope must be a dash_core.rope.PageRopeSettings, got {type(page_rope).__name__}")
    if positions is None:
        raise ValueError(f"page mode needs positions [T] = [{t}] int64 (missing)")
    if decode and roles is not None:
        raise ValueError("decode takes no roles: generated tokens are text (role 0)")
    if not decode and writes and (roles is not None or not roles_optional):
        if roles is None or tuple(roles.shape) != (t,) or roles.dtype.is_floating_point or roles.dtype == torch.bool:
            raise ValueError(f"page-mode prefill needs roles [T] = [{t}] integers (0 text, 1 page start, 2 page "
                             f"token); got {None if roles is None else (tuple(roles.shape), roles.dtype)}")
        if not roles.is_cuda and roles.numel() and (int(roles.min()) < 0 or int(roles.max()) > 2):
            raise ValueError(f"roles must be 0 (text), 1 (page start) or 2 (page token); got values "
                             f"{int(roles.min())}..{int(roles.max())}")
    return True


def _check_kv_store(cache: PagedKVCache) -> None:
    """A call without an indexer summarises K: the store (if any) must have the Hkv heads of K."""
    if cache.summaries is not None and cache.summaries.shape[1] != cache.num_kv_heads:
        raise ValueError(f"summaries must be [num_slots // block_size, Hkv = {cache.num_kv_heads}, D] without an "
                         f"indexer; got {tuple(cache.summaries.shape)} (a 1-head indexer store needs iq, ik and "
                         f"head_cls_i)")


def _out(out: Optional[torch.Tensor], q: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype}, got {tuple(out.shape)} {out.dtype}")
    return out


def _check_cache(cache: PagedKVCache, params: DashParams) -> None:
    if cache.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"KV cache dtype {cache.dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    if cache.summaries is not None:
        check_page_size(cache.page_size, params.block_size)


def _check_tokens(name: str, x: torch.Tensor, t: int, cache: PagedKVCache) -> None:
    want = (t, cache.num_kv_heads, cache.head_dim)
    if x is None or tuple(x.shape) != want:
        raise ValueError(f"{name} must be [T, Hkv, D] = {want}, got {None if x is None else tuple(x.shape)}")


def _check_head_cls(head_cls: Optional[torch.Tensor], cache: PagedKVCache) -> None:
    want = (cache.num_kv_heads, cache.head_dim)
    if head_cls is None:
        raise ValueError(f"head_cls [Hkv, D] = {want} is required to summarise blocks (missing)")
    if tuple(head_cls.shape) != want:
        raise ValueError(f"head_cls must be [Hkv, D] = {want}, got {tuple(head_cls.shape)}")


def _check_query(q, cache, head_cls, block_table, seq_lens, indexer: bool = False) -> None:
    if q.dim() != 3 or q.shape[2] != cache.head_dim or q.shape[1] % cache.num_kv_heads:
        raise ValueError(f"q must be [T, Hq, D={cache.head_dim}] with Hq a multiple of Hkv={cache.num_kv_heads}; "
                         f"got {tuple(q.shape)}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q dtype {q.dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    if not indexer:  # with an indexer head_cls is unused
        _check_head_cls(head_cls, cache)
    if block_table.dim() != 2 or block_table.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"block_table must be [n, max_pages] with n = len(seq_lens) = {seq_lens.shape[0]}; "
                         f"got {tuple(block_table.shape)}")
