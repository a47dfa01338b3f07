"""What the Triton kernels need of a step beyond what every path needs: supported shapes and dtypes
(``dash_core.limits``), layouts (contiguous head dims, int32 page tables), one device. Called once, by the op's
validation (``dash_core.checks``), from shapes and dtypes only: no device reads."""

from __future__ import annotations

from typing import Optional

import torch

from ..layout import PagedKVCache, check_page_size
from ..limits import (KERNEL_DTYPES, KERNEL_HEAD_DIMS, KERNEL_MAX_GROUP, KERNEL_MAX_INDEXER_HEADS,
                      KERNEL_MAX_PAGE_SIZE)
from ..params import DashParams


def check_on(name: str, x: Optional[torch.Tensor], device: torch.device) -> None:
    if x is not None and x.device != device:
        raise ValueError(f"{name} is on {x.device}, expected {device} (the device of q)")


def check_kernel_config(dtype: torch.dtype, num_q_heads: int, cache: PagedKVCache, params: DashParams) -> None:
    """Raise ``ValueError`` unless the Triton kernels support this configuration."""
    hkv, d, ps, bs = cache.num_kv_heads, cache.head_dim, cache.page_size, params.block_size
    if dtype not in KERNEL_DTYPES:
        raise ValueError(f"q dtype {dtype} is not supported by the Triton kernels; use one of {KERNEL_DTYPES}")
    if cache.dtype != dtype:
        raise ValueError(f"KV cache dtype {cache.dtype} must equal the query dtype {dtype}")
    if d not in KERNEL_HEAD_DIMS:
        raise ValueError(f"head_dim = {d} is not supported by the Triton kernels; use one of {KERNEL_HEAD_DIMS}")
    if num_q_heads % hkv or not 1 <= num_q_heads // hkv <= KERNEL_MAX_GROUP:
        raise ValueError(f"num_q_heads / num_kv_heads = {num_q_heads} / {hkv} must be a GQA group size "
                         f"1..{KERNEL_MAX_GROUP}")
    params.check_kernel_support()
    check_page_size(ps, bs)
    if ps > KERNEL_MAX_PAGE_SIZE:
        raise ValueError(f"page size = {ps} is not supported by the Triton kernels; use a multiple of the DASH "
                         f"block size ({bs}) up to {KERNEL_MAX_PAGE_SIZE}")
    if cache.k_pages.stride(-1) != 1 or cache.v_pages.stride(-1) != 1:
        raise ValueError("k_pages and v_pages must be contiguous in head_dim (stride 1)")
    s = cache.summaries
    if s is None:
        raise ValueError("the Triton kernels need a summary store: build the cache with summaries "
                         "(dash_core.layout.alloc_summaries)")
    if s.dtype != cache.dtype or s.stride(-1) != 1 or s.shape[0] < cache.num_slots // bs:
        raise ValueError(f"summaries must be [num_slots // block_size >= {cache.num_slots // bs}, {hkv}, {d}] "
                         f"{cache.dtype}, contiguous in head_dim; got {tuple(s.shape)} {s.dtype}")


def check_write_config(cache: PagedKVCache, params: DashParams) -> None:
    """Raise ``ValueError`` unless the Triton K/V write (and summary) kernel supports ``cache``."""
    if cache.dtype not in KERNEL_DTYPES or cache.k_pages.stride(-1) != 1 or cache.v_pages.stride(-1) != 1:
        raise ValueError(f"the Triton K/V write needs a {KERNEL_DTYPES} cache contiguous in head_dim; "
                         f"got {cache.dtype}")
    if cache.summaries is not None:
        params.check_kernel_support()
        if cache.summaries.stride(-1) != 1:
            raise ValueError("the Triton summary kernel needs summaries contiguous in head_dim")


def check_kernel_tables(device: torch.device, block_table: torch.Tensor, seq_lens: torch.Tensor,
                        cu_seqlens_q: Optional[torch.Tensor]) -> None:
    """A step's tables for the Triton kernels: on ``device`` (q's), an int32 page table contiguous in its last dim.
    ``cu_seqlens_q`` is None for decode."""
    for name, x in (("block_table", block_table), ("seq_lens", seq_lens), ("cu_seqlens_q", cu_seqlens_q)):
        check_on(name, x, device)
    if block_table.dtype != torch.int32 or block_table.stride(-1) != 1:
        raise ValueError(f"block_table must be [n, max_pages] int32 contiguous in its last dim; got "
                         f"{block_table.dtype}")


def check_kernel_step(q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor], cache: PagedKVCache,
                      head_cls: Optional[torch.Tensor], params: DashParams, out: Optional[torch.Tensor],
                      iq: Optional[torch.Tensor]) -> None:
    """What a Triton step needs of a layer's inputs beyond the op's checks (the step's tables:
    ``check_kernel_tables``): a supported configuration, ``q``, ``k``, ``v``, ``iq`` and ``out`` contiguous in D and
    on q's device. What depends on the cache alone is checked once per cache object."""
    if q.dim() != 3 or q.stride(-1) != 1:
        raise ValueError(f"q must be [T, Hq, D] contiguous in D; got {tuple(q.shape)}")
    dev = q.device
    cache.kept(("kernel cache checks", q.dtype, q.shape[1], dev, params), lambda: _check_kernel_cache(q, cache, params))
    for name, x in (("head_cls", head_cls), ("k", k), ("v", v), ("iq", iq), ("out", out)):
        check_on(name, x, dev)
    for name, x in (("k", k), ("v", v)):
        if x is not None and x.stride(-1) != 1:
            raise ValueError(f"{name} must be [T, Hkv, D] contiguous in D")
    if iq is not None:
        if iq.stride(-1) != 1:
            raise ValueError("iq must be [T, Hi, D] contiguous in D")
        if not 1 <= iq.shape[1] <= KERNEL_MAX_INDEXER_HEADS:
            raise ValueError(f"iq has {iq.shape[1]} indexer heads; the Triton routing supports "
                             f"1..{KERNEL_MAX_INDEXER_HEADS}")
    if out is not None and out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} contiguous in D")


def _check_kernel_cache(q: torch.Tensor, cache: PagedKVCache, params: DashParams) -> None:
    """The cache's part of ``check_kernel_step``: the configuration, and its pages and summaries on q's device."""
    check_kernel_config(q.dtype, q.shape[1], cache, params)
    check_on("k_pages", cache.k_pages, q.device)
    check_on("summaries", cache.summaries, q.device)
