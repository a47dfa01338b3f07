"""Views over the engines' paged KV storage, and the block-summary store (SPEC.md section 8).

Both engines' caches are presented as one strided form, without copying:

    k_pages, v_pages: [num_pages, page_size, Hkv, D]      slot s -> page s // page_size, row s % page_size

- vLLM keeps one tensor per layer, ``[num_blocks, H_slots, block_size, C]`` with K in
  ``C[:D]`` and V in ``C[D:2D]`` (``PagedKVCache.from_vllm``).
- SGLang keeps token-indexed buffers ``[slots, Hkv, D]`` for K and V and a ``req_to_token``
  table (``PagedKVCache.from_sglang``; ``block_table_from_req_to_token``).

The summary of block ``j`` of a request lives at index ``slot // block_size`` of the slots of
that block, in a store ``[num_slots // block_size, Hkv, D]`` in the KV dtype: ``1 / (2 bs)`` of
the KV memory. This requires the page size to be a multiple of the block size (a page then
holds whole, aligned blocks) and makes summaries of shared prefix pages shareable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

PAGE_SIZE_ERROR = "page size must be a multiple of the DASH block size"


def check_page_size(page_size: int, block_size: int, flag: str = "page size") -> None:
    """Raise the start-up error of SPEC.md section 8 unless ``page_size % block_size == 0``."""
    if page_size % block_size:
        raise ValueError(f"{PAGE_SIZE_ERROR}: {flag} is {page_size}, DASH block size is {block_size}; "
                         f"set {flag} to a multiple of {block_size}")


def alloc_summaries(num_slots: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype, device=None) -> torch.Tensor:
    """A zeroed summary store ``[num_slots // block_size, Hkv, D]`` for ``num_slots`` KV slots."""
    return torch.zeros(num_slots // block_size, num_kv_heads, head_dim, dtype=dtype, device=device)


def summary_bytes_per_token(block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> float:
    """Bytes the summary store adds per KV slot (``1 / (2 bs)`` of the K+V bytes)."""
    return num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size() / block_size


@dataclass
class PagedKVCache:
    """K/V pages of one layer plus its summary store.

    k_pages, v_pages: ``[num_pages, page_size, Hkv, D]`` strided views (no copies).
    summaries: ``[num_slots // block_size, Hkv, D]`` or None (then summaries are recomputed
    from gathered keys, which also works for page sizes that are not multiples of the block).
    """

    k_pages: torch.Tensor
    v_pages: torch.Tensor
    summaries: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if self.k_pages.dim() != 4 or self.k_pages.shape != self.v_pages.shape:
            raise ValueError(f"k_pages and v_pages must be equal [pages, page_size, Hkv, D]; got "
                             f"{tuple(self.k_pages.shape)} and {tuple(self.v_pages.shape)}")
        if self.summaries is not None:
            s = self.summaries
            if s.dim() != 3 or tuple(s.shape[1:]) != (self.num_kv_heads, self.head_dim):
                raise ValueError(f"summaries must be [num_slots // block_size, Hkv, D]; got {tuple(s.shape)}")

    @classmethod
    def from_vllm(cls, kv_cache: torch.Tensor, num_kv_heads: int, head_dim: int,
                  summaries: Optional[torch.Tensor] = None) -> "PagedKVCache":
        """View vLLM's ``[num_blocks, H_slots, block_size, C]`` layer cache (K in ``C[:D]``, V in ``C[D:2D]``)."""
        if kv_cache.dim() != 4 or kv_cache.shape[1] < num_kv_heads or kv_cache.shape[3] < 2 * head_dim:
            raise ValueError(f"vLLM cache must be [num_blocks, >= {num_kv_heads}, block_size, >= {2 * head_dim}]; "
                             f"got {tuple(kv_cache.shape)}")
        kv = kv_cache[:, :num_kv_heads].permute(0, 2, 1, 3)
        return cls(kv[..., :head_dim], kv[..., head_dim: 2 * head_dim], summaries)

    @classmethod
    def from_sglang(cls, k_buffer: torch.Tensor, v_buffer: torch.Tensor, page_size: int,
                    summaries: Optional[torch.Tensor] = None) -> "PagedKVCache":
        """View SGLang's token-indexed ``[slots, Hkv, D]`` K and V buffers as pages of ``page_size``."""
        slots, hkv, d = k_buffer.shape
        if slots % page_size:
            raise ValueError(f"SGLang buffer of {slots} slots is not a whole number of pages of {page_size}")
        return cls(k_buffer.view(slots // page_size, page_size, hkv, d),
                   v_buffer.view(slots // page_size, page_size, hkv, d), summaries)

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k_pages.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k_pages.shape[3]

    @property
    def num_slots(self) -> int:
        return self.k_pages.shape[0] * self.k_pages.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.k_pages.dtype

    def keys(self, slots: torch.Tensor) -> torch.Tensor:
        """K at ``slots [n]`` -> ``[n, Hkv, D]`` (a gather copy)."""
        return self.k_pages[slots // self.page_size, slots % self.page_size]

    def values(self, slots: torch.Tensor) -> torch.Tensor:
        """V at ``slots [n]`` -> ``[n, Hkv, D]`` (a gather copy)."""
        return self.v_pages[slots // self.page_size, slots % self.page_size]


def slots_of(block_table: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Slots of ``positions [n]`` of one request whose pages are ``block_table [max_pages]``."""
    return block_table[positions // page_size].to(torch.long) * page_size + positions % page_size


def block_table_from_req_to_token(req_to_token: torch.Tensor, page_size: int) -> torch.Tensor:
    """SGLang ``req_to_token [rows, max_ctx]`` -> page table ``[rows, ceil(max_ctx / page_size)]`` int32."""
    return (req_to_token[:, ::page_size] // page_size).to(torch.int32)
