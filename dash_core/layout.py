"""Views over the engines' paged KV storage, and the block-summary store (docs/semantics.md section 8).

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

from dataclasses import dataclass, field
from typing import Optional

import torch

PAGE_SIZE_ERROR = "page size must be a multiple of the DASH block size"


def check_page_size(page_size: int, block_size: int, flag: str = "page size") -> None:
    """Raise the start-up error of docs/semantics.md section 8 unless ``page_size % block_size == 0``."""
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


def same_objects(a: tuple, b: tuple) -> bool:
    """Whether ``a`` and ``b`` hold the very same objects, in order (identity, not equality: tensors)."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def kept_while_same(store: dict, key, sources: tuple, build):
    """``build()``, kept in ``store`` under ``key`` and returned again while ``sources`` (what it is built from)
    are the same objects; a replaced source gets a new value. The entry holds the sources it was built from."""
    hit = store.get(key)
    if hit is not None and same_objects(hit[0], sources):
        return hit[1]
    value = build()
    store[key] = (tuple(sources), value)
    return value


@dataclass(frozen=True)
class PagedKVCache:
    """K/V pages of one layer plus its summary store and auxiliary head.

    k_pages, v_pages: ``[num_pages, page_size, Hkv, D]`` strided views (no copies).
    summaries: ``[num_slots // block_size, Hkv, D]`` or None (then summaries are recomputed
    from gathered keys, which also works for page sizes that are not multiples of the block);
    for a model with an indexer ``[num_slots // block_size, 1, D]`` (summaries of ``ik``).
    aux: ``[num_pages, page_size, 2D]`` strided view of the auxiliary rows (layout table below), in
    the KV dtype; needed by models with an indexer or page mode, None otherwise.

    The views are fixed (a frozen dataclass: a new view is a new cache), so their geometry (``page_size``,
    ``num_kv_heads``, ``head_dim``, ``num_slots``, ``dtype``) is read once, and what the kernels derive from a
    cache alone (its validation, the K/V write's cache arguments, its TMA descriptors) is built once per cache
    object (``kept``): an engine adapter that keeps a layer's ``PagedKVCache`` from step to step builds it once.
    """

    k_pages: torch.Tensor
    v_pages: torch.Tensor
    summaries: Optional[torch.Tensor] = None
    aux: Optional[torch.Tensor] = None
    page_size: int = field(init=False, repr=False, compare=False)
    num_kv_heads: int = field(init=False, repr=False, compare=False)
    head_dim: int = field(init=False, repr=False, compare=False)
    num_slots: int = field(init=False, repr=False, compare=False)
    dtype: torch.dtype = field(init=False, repr=False, compare=False)
    _kept: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.k_pages.dim() != 4 or self.k_pages.shape != self.v_pages.shape:
            raise ValueError(f"k_pages and v_pages must be equal [pages, page_size, Hkv, D]; got "
                             f"{tuple(self.k_pages.shape)} and {tuple(self.v_pages.shape)}")
        pages, page_size, hkv, d = self.k_pages.shape
        for name, value in (("page_size", page_size), ("num_kv_heads", hkv), ("head_dim", d),
                            ("num_slots", pages * page_size), ("dtype", self.k_pages.dtype)):
            object.__setattr__(self, name, value)
        if self.summaries is not None:
            s = self.summaries
            if s.dim() != 3 or s.shape[1] not in (1, self.num_kv_heads) or s.shape[2] != self.head_dim:
                raise ValueError(f"summaries must be [num_slots // block_size, Hkv or 1 (indexer), D] with "
                                 f"Hkv, D = {self.num_kv_heads}, {self.head_dim}; got {tuple(s.shape)}")
        if self.aux is not None:
            want = (self.k_pages.shape[0], self.page_size, aux_row_width(self.head_dim))
            if tuple(self.aux.shape) != want or self.aux.dtype != self.dtype:
                raise ValueError(f"aux must be [num_pages, page_size, 2D] = {want} in the KV dtype {self.dtype}; "
                                 f"got {tuple(self.aux.shape)} {self.aux.dtype}")

    def kept(self, key, build):
        """``build()``, a value that depends only on this cache (and ``key``, hashable), built at the first call
        for ``key`` and returned again after."""
        if key not in self._kept:
            self._kept[key] = build()
        return self._kept[key]

    @classmethod
    def from_vllm(cls, kv_cache: torch.Tensor, num_kv_heads: int, head_dim: int,
                  summaries: Optional[torch.Tensor] = None, *, aux: bool = False) -> "PagedKVCache":
        """View vLLM's ``[num_blocks, H_slots, block_size, C]`` layer cache (K in ``C[:D]``, V in ``C[D:2D]``).

        aux=True: head slot ``Hkv`` is the auxiliary head (``aux_view_vllm``), so ``H_slots >= Hkv + 1``.
        """
        if kv_cache.dim() != 4 or kv_cache.shape[1] < num_kv_heads or kv_cache.shape[3] < 2 * head_dim:
            raise ValueError(f"vLLM cache must be [num_blocks, >= {num_kv_heads}, block_size, >= {2 * head_dim}]; "
                             f"got {tuple(kv_cache.shape)}")
        kv = kv_cache[:, :num_kv_heads].permute(0, 2, 1, 3)
        rows = aux_view_vllm(kv_cache, num_kv_heads, head_dim) if aux else None
        return cls(kv[..., :head_dim], kv[..., head_dim: 2 * head_dim], summaries, rows)

    @classmethod
    def from_sglang(cls, k_buffer: torch.Tensor, v_buffer: torch.Tensor, page_size: int,
                    summaries: Optional[torch.Tensor] = None, *,
                    aux: Optional[torch.Tensor] = None) -> "PagedKVCache":
        """View SGLang's token-indexed ``[slots, Hkv, D]`` K and V buffers as pages of ``page_size``.

        aux: the ``[slots, 2D]`` buffer of ``alloc_aux_sglang`` (same slots as K and V) or None.
        """
        slots, hkv, d = k_buffer.shape
        if slots % page_size:
            raise ValueError(f"SGLang buffer of {slots} slots is not a whole number of pages of {page_size}")
        rows = None
        if aux is not None:
            if aux.dim() != 2 or aux.shape[0] != slots:
                raise ValueError(f"aux must be the [slots, 2D] = [{slots}, {2 * d}] buffer of alloc_aux_sglang; "
                                 f"got {tuple(aux.shape)}")
            rows = aux.view(slots // page_size, page_size, aux.shape[1])
        return cls(k_buffer.view(slots // page_size, page_size, hkv, d),
                   v_buffer.view(slots // page_size, page_size, hkv, d), summaries, rows)

    def keys(self, slots: torch.Tensor) -> torch.Tensor:
        """K at ``slots [n]`` -> ``[n, Hkv, D]`` (a gather copy)."""
        return self.k_pages[slots // self.page_size, slots % self.page_size]

    def values(self, slots: torch.Tensor) -> torch.Tensor:
        """V at ``slots [n]`` -> ``[n, Hkv, D]`` (a gather copy)."""
        return self.v_pages[slots // self.page_size, slots % self.page_size]

    def aux_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Auxiliary rows at ``slots [n]`` -> ``[n, 2D]`` (a gather copy); needs ``aux``."""
        if self.aux is None:
            raise ValueError("this cache has no auxiliary head (aux=None); models with an indexer or page "
                             "mode need one (PagedKVCache(..., aux=...))")
        return self.aux[slots // self.page_size, slots % self.page_size]

    def index_keys(self, slots: torch.Tensor) -> torch.Tensor:
        """The stored rotated indexer keys at ``slots [n]`` -> ``[n, 1, D]`` (one KV head's shape)."""
        return self.aux_rows(slots)[:, None, : self.head_dim]

    def indexer_view(self) -> "PagedKVCache":
        """The indexer keys as a one-head cache (K = V = ``aux[..., :D]``, no copy) with this cache's
        summary store: what the summary and routing code of a plain cache runs on for an indexer."""
        if self.aux is None:
            self.aux_rows(torch.zeros(0, dtype=torch.long))  # raises the no-aux error
        ik = self.aux[:, :, None, : self.head_dim]
        return PagedKVCache(ik, ik, self.summaries)


def slots_of(block_table: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Slots of ``positions [n]`` of one request whose pages are ``block_table [max_pages]``."""
    return block_table[positions // page_size].to(torch.long) * page_size + positions % page_size


def block_table_from_req_to_token(req_to_token: torch.Tensor, page_size: int) -> torch.Tensor:
    """SGLang ``req_to_token [rows, max_ctx]`` -> page table ``[rows, ceil(max_ctx / page_size)]`` int32."""
    return (req_to_token[:, ::page_size] // page_size).to(torch.int32)


# ---------------------------------------------------------------------------------------------
# The auxiliary head (docs/semantics.md sections 8-9): one extra per-token row next to K and V.
#
# A row has ``2 * D`` elements in the KV dtype (the width of one vLLM head slot, K and V together):
#
#   elements            what                                          encoding
#   [0, D)              the rotated indexer key ``ik``                 the KV dtype (rounded)
#   D                   role (0 text, 1 page start, 2 page token)      one byte
#   D + 1 .. D + 4      tok, the offset inside the page                4 bytes, little-endian
#   D + 5 .. D + 8      page index                                     4 bytes
#   D + 9 .. D + 12     page count P of the request's prompt           4 bytes
#   D + 13 .. D + 16    query page (P + 1, or 0 without pages)         4 bytes
#   D + 17 .. D + 28    token counts of pages 3s, 3s+1, 3s+2 in the    3 x 4 bytes
#                       row of prompt token s, s < ceil((P + 2) / 3);
#                       zeros in every other row
#   D + 29 .. 2D - 1    zero
#
# "One byte" is one element holding an integer 0..255, which bf16 (8 significant bits), fp16 and
# fp32 store exactly, so every integer round-trips through any KV dtype; 4 bytes hold 0 .. 2^32 - 1
# (offsets, page indices and counts up to the largest context). Needs D >= AUX_MIN_HEAD_DIM.
# Three counts per row (docs/semantics.md section 9) keep the counts
# inside the prompt even when it has fewer than P + 2 tokens (a prompt holds at least P tokens, and
# ceil((P + 2) / 3) <= P for P >= 1).
#
# vLLM: the layer cache gets ``Hkv + 1`` head slots; slot ``Hkv`` is this row (``C = 2D`` elements),
# so the auxiliary head costs ``1 / Hkv`` of the KV memory (Hkv = 8: +12.5 %; Hkv = 1: +100 %).
# SGLang: a buffer ``[num_slots, 2D]`` in the KV dtype attached to the token pool and indexed by the
# same slot as K and V (``req_to_token``), the same cost. ``aux_view_vllm``; ``PagedKVCache.from_sglang(..., aux=)``.
# ---------------------------------------------------------------------------------------------

AUX_INT_BYTES = 4
AUX_MAX_INT = (1 << (8 * AUX_INT_BYTES)) - 1
AUX_COUNTS_PER_ROW = 3
AUX_ROLE, AUX_TOK, AUX_PAGE, AUX_NUM_PAGES, AUX_QUERY_PAGE, AUX_COUNTS = 0, 1, 5, 9, 13, 17
AUX_STATE_ELEMS = AUX_COUNTS + AUX_COUNTS_PER_ROW * AUX_INT_BYTES  # 29
AUX_MIN_HEAD_DIM = AUX_STATE_ELEMS


@dataclass
class AuxState:
    """The decoded auxiliary rows of T tokens (all int64 ``[T]`` except where noted).

    ik: ``[T, D]`` in the storage dtype; counts: ``[T, 3]`` (page counts held by the row, else 0).
    """

    ik: torch.Tensor
    role: torch.Tensor
    tok: torch.Tensor
    page: torch.Tensor
    num_pages: torch.Tensor
    query_page: torch.Tensor
    counts: torch.Tensor


def aux_row_width(head_dim: int) -> int:
    """Elements of one auxiliary row: ``2 * head_dim`` (one vLLM head slot)."""
    if head_dim < AUX_MIN_HEAD_DIM:
        raise ValueError(f"head_dim = {head_dim} is too small for the auxiliary head: expected >= {AUX_MIN_HEAD_DIM}")
    return 2 * head_dim


def aux_bytes_per_token(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes the auxiliary head adds per KV slot (``1 / Hkv`` of the K+V bytes)."""
    return aux_row_width(head_dim) * torch.empty((), dtype=dtype).element_size()


def int_to_bytes(x: torch.Tensor, nbytes: int = AUX_INT_BYTES) -> torch.Tensor:
    """Integers ``[...]`` in ``0 .. 256**nbytes - 1`` -> little-endian bytes ``[..., nbytes]`` int64."""
    x = x.to(torch.long)
    shifts = 8 * torch.arange(nbytes, device=x.device)
    return (x[..., None] >> shifts) & 0xFF


def bytes_to_int(b: torch.Tensor) -> torch.Tensor:
    """Little-endian bytes ``[..., nbytes]`` (any dtype holding 0..255 exactly) -> int64 ``[...]``."""
    shifts = 8 * torch.arange(b.shape[-1], device=b.device)
    return (b.to(torch.long) << shifts).sum(-1)


def page_count_rows(counts: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Per-page token counts ``[P + 2]`` -> the count field of the prompt rows ``[num_tokens, 3]`` int64."""
    counts = torch.as_tensor(counts, dtype=torch.long)
    need = -(-counts.numel() // AUX_COUNTS_PER_ROW)
    if need > num_tokens:
        raise ValueError(f"{counts.numel()} page counts need {need} prompt rows, the prompt has {num_tokens}")
    out = torch.zeros(num_tokens * AUX_COUNTS_PER_ROW, dtype=torch.long, device=counts.device)
    out[: counts.numel()] = counts
    return out.reshape(num_tokens, AUX_COUNTS_PER_ROW)


def encode_aux(ik: Optional[torch.Tensor], role: torch.Tensor, tok: torch.Tensor, page: torch.Tensor,
               num_pages: torch.Tensor, query_page: torch.Tensor, *, head_dim: int, dtype: torch.dtype,
               counts: Optional[torch.Tensor] = None, check: bool = True) -> torch.Tensor:
    """Auxiliary rows ``[T, 2 * head_dim]`` in ``dtype`` (layout table above).

    ik: ``[T, head_dim]`` or None (no indexer: zeros); role, tok, page, num_pages, query_page: ``[T]``
    integers (or scalars, broadcast); counts: ``[T, 3]`` from ``page_count_rows`` or None (zeros).
    Raises ValueError for an integer outside ``0 .. 2^32 - 1`` or a role outside 0..2; ``check=False``
    skips these value checks (they read the device; the ops' decode path derives valid values itself).
    """
    width = aux_row_width(head_dim)
    role = torch.as_tensor(role, dtype=torch.long)
    t = role.numel()
    fields = {"tok": tok, "page": page, "num_pages": num_pages, "query_page": query_page}
    ints = {}
    for name, v in fields.items():
        v = (torch.as_tensor(v, dtype=torch.long, device=role.device).expand(t) if t
             else torch.zeros(0, dtype=torch.long, device=role.device))
        if check and v.numel() and (int(v.min()) < 0 or int(v.max()) > AUX_MAX_INT):
            raise ValueError(f"{name} must lie in 0..{AUX_MAX_INT}, got {int(v.min())}..{int(v.max())}")
        ints[name] = v
    if check and t and (int(role.min()) < 0 or int(role.max()) > 2):
        raise ValueError(f"role must be 0, 1 or 2, got {int(role.min())}..{int(role.max())}")
    rows = torch.zeros(t, width, dtype=dtype, device=role.device)
    if ik is not None:
        if tuple(ik.shape) != (t, head_dim):
            raise ValueError(f"ik must be [T, D] = {(t, head_dim)}, got {tuple(ik.shape)}")
        rows[:, :head_dim] = ik.to(dtype)
    base = head_dim
    rows[:, base + AUX_ROLE] = role.to(dtype)
    for off, name in ((AUX_TOK, "tok"), (AUX_PAGE, "page"), (AUX_NUM_PAGES, "num_pages"),
                      (AUX_QUERY_PAGE, "query_page")):
        rows[:, base + off: base + off + AUX_INT_BYTES] = int_to_bytes(ints[name]).to(dtype)
    if counts is not None:
        counts = torch.as_tensor(counts, dtype=torch.long)
        if tuple(counts.shape) != (t, AUX_COUNTS_PER_ROW):
            raise ValueError(f"counts must be [T, 3] = {(t, AUX_COUNTS_PER_ROW)}, got {tuple(counts.shape)}")
        if check and counts.numel() and (int(counts.min()) < 0 or int(counts.max()) > AUX_MAX_INT):
            raise ValueError(f"counts must lie in 0..{AUX_MAX_INT}, got {int(counts.min())}..{int(counts.max())}")
        c0 = base + AUX_COUNTS
        rows[:, c0: c0 + AUX_COUNTS_PER_ROW * AUX_INT_BYTES] = int_to_bytes(counts).reshape(t, -1).to(dtype)
    return rows


def decode_aux(rows: torch.Tensor, head_dim: int) -> AuxState:
    """Auxiliary rows ``[T, 2 * head_dim]`` -> ``AuxState``. Tensor ops only (no host reads)."""
    if rows.dim() != 2 or rows.shape[1] != aux_row_width(head_dim):
        raise ValueError(f"rows must be [T, {2 * head_dim}], got {tuple(rows.shape)}")
    b = rows[:, head_dim:]

    def field(off: int) -> torch.Tensor:
        return bytes_to_int(b[:, off: off + AUX_INT_BYTES])

    c = b[:, AUX_COUNTS: AUX_COUNTS + AUX_COUNTS_PER_ROW * AUX_INT_BYTES]
    counts = bytes_to_int(c.reshape(-1, AUX_COUNTS_PER_ROW, AUX_INT_BYTES))
    return AuxState(ik=rows[:, :head_dim], role=b[:, AUX_ROLE].to(torch.long), tok=field(AUX_TOK),
                    page=field(AUX_PAGE), num_pages=field(AUX_NUM_PAGES), query_page=field(AUX_QUERY_PAGE),
                    counts=counts)


def decode_page_counts(prompt_rows: torch.Tensor, head_dim: int, num_pages: int) -> torch.Tensor:
    """The per-page token counts ``[P + 2]`` int64 from the rows of a request's first prompt tokens."""
    need = -(-(num_pages + 2) // AUX_COUNTS_PER_ROW)
    return decode_aux(prompt_rows[:need], head_dim).counts.reshape(-1)[: num_pages + 2]


def aux_view_vllm(kv_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """The auxiliary rows of a vLLM layer cache ``[num_blocks, Hkv + 1, block_size, C >= 2D]``
    as a strided view ``[num_blocks, block_size, 2D]`` (no copy; slot s -> ``[s // bs, s % bs]``)."""
    width = aux_row_width(head_dim)
    if kv_cache.dim() != 4 or kv_cache.shape[1] < num_kv_heads + 1 or kv_cache.shape[3] < width:
        raise ValueError(f"vLLM cache with an auxiliary head must be [num_blocks, >= {num_kv_heads + 1}, "
                         f"block_size, >= {width}]; got {tuple(kv_cache.shape)}")
    return kv_cache[:, num_kv_heads, :, :width]


def alloc_aux_sglang(num_slots: int, head_dim: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """A zeroed SGLang auxiliary buffer ``[num_slots, 2D]``, indexed by the same slot as K and V."""
    return torch.zeros(num_slots, aux_row_width(head_dim), dtype=dtype, device=device)
