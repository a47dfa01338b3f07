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
from . import paged, recorder

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def cache_dash_prefill(k: torch.Tensor, v: torch.Tensor, cache: PagedKVCache, slot_mapping: torch.Tensor,
                       params: DashParams, *, head_cls: Optional[torch.Tensor] = None) -> None:
    """Write ``k, v [T, Hkv, D]`` at ``slot_mapping [T]`` (int64; < 0 = padding, skipped) and
    summarise every block whose last token is written (needs ``head_cls [Hkv, D]`` when the
    cache has a summary store). Validates everything before writing anything.
    """
    _check_cache(cache, params)
    t = slot_mapping.shape[0]
    _check_tokens("k", k, t, cache)
    _check_tokens("v", v, t, cache)
    if cache.summaries is not None:
        _check_head_cls(head_cls, cache)
    if cache.k_pages.is_cuda and cache.dtype in (torch.float16, torch.bfloat16):  # Triton write + summaries
        from .kernels.launcher import cache_dash_prefill_triton
        cache_dash_prefill_triton(k, v, cache, slot_mapping, params, head_cls)
        return
    paged.write_kv(cache, k, v, slot_mapping)
    if cache.summaries is not None:
        paged.write_summaries(cache, slot_mapping, head_cls, params)


def paged_dash_prefill(q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                       cache: PagedKVCache, block_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
                       seq_lens: torch.Tensor, slot_mapping: Optional[torch.Tensor], head_cls: torch.Tensor,
                       params: DashParams, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Extend every request by its new tokens under causal DASH, on paged history of any length.

    q: ``[T, Hq, D]``; k, v: ``[T, Hkv, D]`` new keys/values written at ``slot_mapping [T]``
    first (pass ``k = v = slot_mapping = None`` when the engine already wrote them with
    ``cache_dash_prefill``); block_table: ``[n, max_pages]`` int32 page ids;
    cu_seqlens_q: ``[n + 1]`` int32 row offsets of each request's new tokens;
    seq_lens: ``[n]`` int32 KV lengths after the extend; head_cls: ``[Hkv, D]``.
    Returns ``out [T, Hq, D]`` in ``q.dtype`` (rows of padded requests are zero).
    On CUDA with bf16/fp16 this runs the Triton prefill kernels (``dash_core.kernels.prefill``:
    routing scratch bounded per wave of query tiles, no host synchronisation).
    """
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):  # fp32 stays on the torch path
        from .kernels.prefill import paged_dash_prefill_triton
        _check_query(q, cache, head_cls, block_table, seq_lens)
        return paged_dash_prefill_triton(q, k, v, cache, block_table, cu_seqlens_q, seq_lens, slot_mapping,
                                         head_cls, params, out=out)
    return _paged_dash("prefill", q, k, v, cache, block_table, cu_seqlens_q, seq_lens, slot_mapping, head_cls,
                       params, out)


def paged_dash_decode(q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                      cache: PagedKVCache, block_table: torch.Tensor, seq_lens: torch.Tensor,
                      slot_mapping: Optional[torch.Tensor], head_cls: torch.Tensor, params: DashParams, *,
                      out: Optional[torch.Tensor] = None, buffers=None, backend: Optional[str] = None,
                      plan_cache=None) -> torch.Tensor:
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
    """
    from .segments import check_decode_backend

    backend = params.attention_backend if backend is None else backend
    check_decode_backend(backend, params)
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


def _check_query(q, cache, head_cls, block_table, seq_lens) -> None:
    if q.dim() != 3 or q.shape[2] != cache.head_dim or q.shape[1] % cache.num_kv_heads:
        raise ValueError(f"q must be [T, Hq, D={cache.head_dim}] with Hq a multiple of Hkv={cache.num_kv_heads}; "
                         f"got {tuple(q.shape)}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q dtype {q.dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    _check_head_cls(head_cls, cache)
    if block_table.dim() != 2 or block_table.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"block_table must be [n, max_pages] with n = len(seq_lens) = {seq_lens.shape[0]}; "
                         f"got {tuple(block_table.shape)}")
