"""Host side of the Triton decode path: validation, static scratch (``DecodeBuffers``), launches.

Nothing here reads a device tensor: every size comes from shapes (batch rows, ``max_pages`` of the
page table, ``topk``), every sequence-dependent decision is taken by the kernels from ``seq_lens``,
so one captured CUDA graph serves every step. A decode step is four launches:

    scores against every candidate summary (split over candidates), routing
      and the new K/V (+ the summary of a block the new token completes)   (kv_write.write_token)
    entmax, group mean, topk cap, prior -> kept blocks per unit      routing (route_tile)
    split-KV attention over local window + kept blocks               decode_attention
    LSE merge of the splits                                          decode_attention
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Optional

import torch

from ..layout import PagedKVCache, check_page_size
from ..params import DashParams
from .decode_attention import decode_attention
from .kv_write import write_args, write_kv_and_summaries
from .routing import route_decode

logger = logging.getLogger(__name__)

KERNEL_DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 128, 256)
MAX_GROUP = 16
BLOCK_SIZES = (16, 32, 64, 128)
MAX_PAGE_SIZE = 256
DEFAULT_NUM_SMS = 132  # H200; used when the device is not CUDA (the Triton interpreter)
SCORE_SPLIT_MIN_CANDIDATES = 128  # a score program handles at least this many candidates
ATTN_SPLIT_MAX = 64
# Largest [bs, D] key tile summarised inside the score kernel (larger ones spill there: own launch).
FUSE_WRITE_MAX = 8192


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_kernel_config(dtype: torch.dtype, num_q_heads: int, cache: PagedKVCache, params: DashParams) -> None:
    """Raise ``ValueError`` unless the Triton kernels support this configuration (issue 4)."""
    hkv, d, ps, bs = cache.num_kv_heads, cache.head_dim, cache.page_size, params.block_size
    if dtype not in KERNEL_DTYPES:
        raise ValueError(f"q dtype {dtype} is not supported by the Triton kernels; use one of {KERNEL_DTYPES}")
    if cache.dtype != dtype:
        raise ValueError(f"KV cache dtype {cache.dtype} must equal the query dtype {dtype}")
    if d not in HEAD_DIMS:
        raise ValueError(f"head_dim = {d} is not supported by the Triton kernels; use one of {HEAD_DIMS}")
    if num_q_heads % hkv or not 1 <= num_q_heads // hkv <= MAX_GROUP:
        raise ValueError(f"num_q_heads / num_kv_heads = {num_q_heads} / {hkv} must be a GQA group size 1..{MAX_GROUP}")
    if bs not in BLOCK_SIZES:
        raise ValueError(f"block_size = {bs} is not supported by the Triton kernels; use one of {BLOCK_SIZES}")
    check_page_size(ps, bs)
    if ps > MAX_PAGE_SIZE:
        raise ValueError(f"page size = {ps} is not supported by the Triton kernels; use a multiple of the DASH "
                         f"block size ({bs}) up to {MAX_PAGE_SIZE}")
    if params.local % bs:
        raise ValueError(f"local = {params.local} must be a multiple of block_size = {bs}")
    if cache.k_pages.stride(-1) != 1 or cache.v_pages.stride(-1) != 1:
        raise ValueError("k_pages and v_pages must be contiguous in head_dim (stride 1)")
    s = cache.summaries
    if s is None:
        raise ValueError("the Triton kernels need a summary store: build the cache with summaries "
                         "(dash_core.layout.alloc_summaries)")
    if s.dtype != cache.dtype or s.stride(-1) != 1 or s.shape[0] < cache.num_slots // bs:
        raise ValueError(f"summaries must be [num_slots // block_size >= {cache.num_slots // bs}, {hkv}, {d}] "
                         f"{cache.dtype}, contiguous in head_dim; got {tuple(s.shape)} {s.dtype}")


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA ``device`` (``DEFAULT_NUM_SMS`` elsewhere: the Triton interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else DEFAULT_NUM_SMS


def _check_on(name: str, x: torch.Tensor, device: torch.device) -> None:
    if x.device != device:
        raise ValueError(f"{name} is on {x.device}, expected {device} (the device of q)")


def check_indexer_query(q: torch.Tensor, iq: Optional[torch.Tensor], k: Optional[torch.Tensor],
                        params: DashParams) -> DashParams:
    """Validate the indexer queries ``iq [T, Hi, D]`` (already rotated) of a Triton launch and return
    the routing parameters: router ``shared`` with an indexer (SPEC.md section 9), else ``params``.
    With an indexer, K/V, the auxiliary rows and the indexer summaries are written first
    (``ops._write_new``), so ``k`` must be None."""
    if iq is None:
        return params
    t, _, d = q.shape
    if iq.dim() != 3 or iq.shape[0] != t or iq.shape[2] != d or iq.dtype != q.dtype or iq.stride(-1) != 1:
        raise ValueError(f"iq must be [T, Hi, D] = [{t}, Hi, {d}] {q.dtype} contiguous in D; got {tuple(iq.shape)} "
                         f"{iq.dtype}")
    if not 1 <= iq.shape[1] <= 8 * MAX_GROUP:
        raise ValueError(f"iq has {iq.shape[1]} indexer heads; the Triton routing supports 1..{8 * MAX_GROUP}")
    _check_on("iq", iq, q.device)
    if k is not None:
        raise ValueError("with an indexer pass k = v = slot_mapping = None to the Triton launch: the op writes "
                         "K/V, the auxiliary rows and the indexer summaries first")
    return indexer_routing(params)


def indexer_routing(params: DashParams) -> DashParams:
    """The routing parameters where an indexer routes: router ``shared`` (SPEC.md section 9)."""
    return replace(params, router="shared")


def check_kernel_query(q: torch.Tensor, cache: PagedKVCache, params: DashParams, rows: str, tensors) -> None:
    """Checks decode and prefill share: ``q [rows, Hq, D]`` contiguous in D with the cache's D, a
    configuration the kernels support, and the cache's pages and summaries and every ``(name, tensor)``
    of ``tensors`` on q's device (``head_cls`` may be None)."""
    if q.dim() != 3 or q.stride(-1) != 1:
        raise ValueError(f"q must be [{rows}, Hq, D] contiguous in D; got {tuple(q.shape)}")
    if q.shape[2] != cache.head_dim:
        raise ValueError(f"q head_dim {q.shape[2]} != cache head_dim {cache.head_dim}")
    check_kernel_config(q.dtype, q.shape[1], cache, params)
    for name, x in (("k_pages", cache.k_pages), ("summaries", cache.summaries), *tensors):
        if x is not None or name != "head_cls":
            _check_on(name, x, q.device)


def check_step_tensors(k, v, cache, block_table, slot_mapping, head_cls, n: int, t: int, rows: str, d: int,
                       dev, indexer: bool = False) -> None:
    """Checks decode and prefill share: the page table ``[n, max_pages]``, ``head_cls`` and the new
    ``k, v [t, Hkv, D]`` with their ``slot_mapping [t]`` (all three, or none). ``rows`` names t.
    With an indexer ``head_cls`` is unused (may be None)."""
    if block_table.dim() != 2 or block_table.shape[0] != n or block_table.dtype != torch.int32:
        raise ValueError(f"block_table must be [n = {n}, max_pages] int32; got {tuple(block_table.shape)} "
                         f"{block_table.dtype}")
    if block_table.stride(-1) != 1:
        raise ValueError("block_table must be contiguous in its last dim")
    if indexer and head_cls is None:
        pass
    elif tuple(head_cls.shape) != (cache.num_kv_heads, d):
        raise ValueError(f"head_cls must be [Hkv, D] = {(cache.num_kv_heads, d)}, got {tuple(head_cls.shape)}")
    if (k is None) != (v is None) or (k is None) != (slot_mapping is None):
        raise ValueError("pass k, v and slot_mapping together, or none of them (K/V already written)")
    if k is not None:
        want = (t, cache.num_kv_heads, d)
        for name, x in (("k", k), ("v", v)):
            if tuple(x.shape) != want or x.stride(-1) != 1:
                raise ValueError(f"{name} must be [{rows}, Hkv, D] = {want} contiguous in D; got {tuple(x.shape)}")
            _check_on(name, x, dev)
        if tuple(slot_mapping.shape) != (t,) or slot_mapping.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"slot_mapping must be [{rows} = {t}] int64; got {tuple(slot_mapping.shape)} "
                             f"{slot_mapping.dtype}")
        _check_on("slot_mapping", slot_mapping, dev)


def check_decode_args(q, k, v, cache, block_table, seq_lens, slot_mapping, head_cls, params, out,
                      iq: Optional[torch.Tensor] = None) -> None:
    """Validate a decode step from shapes and dtypes only (no device reads)."""
    check_kernel_query(q, cache, params, "n", (("block_table", block_table), ("seq_lens", seq_lens),
                                               ("head_cls", head_cls)))
    n, _, d = q.shape
    dev = q.device
    if tuple(seq_lens.shape) != (n,) or seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"seq_lens must be [n = {n}] int32; got {tuple(seq_lens.shape)} {seq_lens.dtype}")
    check_step_tensors(k, v, cache, block_table, slot_mapping, head_cls, n, n, "n", d, dev, indexer=iq is not None)
    check_indexer_query(q, iq, k, params)
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.device != dev):
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} on {dev}, got {tuple(out.shape)} {out.dtype}")


@dataclass
class DecodeBuffers:
    """Scratch of the decode kernels, sized once by static bounds so that a CUDA graph can own it.

    Sizes: ``max_cand = max_pages * page_size // bs`` candidate blocks; the selection capacity
    ``cap`` is ``min(topk, max_cand)``, or ``max_cand`` without ``topk`` (an uncapped selection is
    bounded by the number of candidates). Units: ``Hsel = Hkv`` (router ``kv_head``) or 1.

    scores ``[max_batch, Hq, max_cand]`` fp32, pmax ``[max_batch, Hq, score_splits]`` fp32,
    mp ``[max_batch, Hsel, max_cand]`` fp32, sel_idx / sel_blk ``[max_batch, Hsel, cap]`` int32,
    sel_bias ``[max_batch, Hsel, cap]`` fp32, sel_count ``[max_batch, Hsel]`` int32,
    o_part ``[parts, Hq, D]`` fp32 and lse_part ``[parts, Hq]`` fp32 with ``parts`` the most
    ``batch * attn_splits`` over batches up to ``max_batch``.

    With an indexer (``indexer_heads = Hi``) routing is ``shared`` over the Hi indexer queries:
    scores and pmax have ``max(Hq, Hi)`` head rows and the selection one unit.

    The split counts depend only on the batch rows ``n`` (a shape): ``splits(n)``.

    Example::

        >>> bufs = DecodeBuffers.allocate(8, 32, 8, 128, 64, 2048, DashParams(topk=64), "cuda")  # doctest: +SKIP
        >>> out = paged_dash_decode(q, k, v, cache, bt, seq_lens, slots, head_cls, p, buffers=bufs)  # doctest: +SKIP
    """

    max_batch: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    max_cand: int
    params: DashParams
    num_sms: int
    fixed_splits: Optional[tuple]
    scores: torch.Tensor
    pmax: torch.Tensor
    mp: torch.Tensor
    sel_idx: torch.Tensor
    sel_blk: torch.Tensor
    sel_bias: torch.Tensor
    sel_count: torch.Tensor
    o_part: torch.Tensor
    lse_part: torch.Tensor
    indexer_heads: Optional[int] = None

    @staticmethod
    def _splits(n: int, hkv: int, max_cand: int, cap: int, local_blocks: int, num_sms: int,
                fixed: Optional[tuple]) -> tuple:
        if fixed is not None:
            return fixed
        rows = max(1, n * hkv)
        nsr = max(1, min(_cdiv(2 * num_sms, rows), _cdiv(max_cand, SCORE_SPLIT_MIN_CANDIDATES)))
        nsa = max(1, min(_cdiv(4 * num_sms, rows), ATTN_SPLIT_MAX, _cdiv(local_blocks + cap, 2)))
        return nsr, nsa

    def splits(self, n: int) -> tuple:
        """``(score_splits, attn_splits)`` for a batch of ``n`` rows."""
        p = self.params
        return self._splits(n, self.num_kv_heads, self.max_cand, self.sel_idx.shape[2], p.local_blocks,
                            self.num_sms, self.fixed_splits)

    @classmethod
    def allocate(cls, max_batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 max_pages: int, params: DashParams, device, *, num_sms: Optional[int] = None,
                 splits: Optional[tuple] = None, indexer_heads: Optional[int] = None) -> "DecodeBuffers":
        """Allocate for batches up to ``max_batch`` rows and page tables up to ``max_pages`` wide.

        splits: optional fixed ``(score_splits, attn_splits)`` (tests); by default they follow the
        batch and the device's SM count. indexer_heads: ``Hi`` for a model with an indexer.
        """
        device = torch.device(device)
        if indexer_heads is not None:
            params = replace(params, router="shared")
        if num_sms is None:
            num_sms = sm_count(device)
        bs = params.block_size
        max_cand = max(1, max_pages * page_size // bs)
        cap = max(1, min(params.topk, max_cand) if params.topk is not None else max_cand)
        hsel = 1 if params.router == "shared" else num_kv_heads
        nsr_max, parts = 1, 1
        for n in range(1, max_batch + 1):
            nsr, nsa = cls._splits(n, num_kv_heads, max_cand, cap, params.local_blocks, num_sms, splits)
            nsr_max, parts = max(nsr_max, nsr), max(parts, n * nsa)
        f32, i32 = torch.float32, torch.int32
        return cls(
            max_batch, num_q_heads, num_kv_heads, head_dim, max_cand, params, num_sms, splits,
            scores=torch.empty(max_batch, max(num_q_heads, indexer_heads or 0), max_cand, dtype=f32, device=device),
            pmax=torch.empty(max_batch, max(num_q_heads, indexer_heads or 0), nsr_max, dtype=f32, device=device),
            mp=torch.empty(max_batch, hsel, max_cand, dtype=f32, device=device),
            sel_idx=torch.zeros(max_batch, hsel, cap, dtype=i32, device=device),
            sel_blk=torch.zeros(max_batch, hsel, cap, dtype=i32, device=device),
            sel_bias=torch.zeros(max_batch, hsel, cap, dtype=f32, device=device),
            sel_count=torch.zeros(max_batch, hsel, dtype=i32, device=device),
            o_part=torch.empty(parts, num_q_heads, head_dim, dtype=f32, device=device),
            lse_part=torch.empty(parts, num_q_heads, dtype=f32, device=device),
            indexer_heads=indexer_heads,
        )

    @classmethod
    def for_step(cls, q: torch.Tensor, cache: PagedKVCache, block_table: torch.Tensor, params: DashParams,
                 **kw) -> "DecodeBuffers":
        """Buffers sized exactly for this step's shapes."""
        return cls.allocate(q.shape[0], q.shape[1], cache.num_kv_heads, cache.head_dim, cache.page_size,
                            block_table.shape[1], params, q.device, **kw)

    def check(self, q: torch.Tensor, cache: PagedKVCache, block_table: torch.Tensor, params: DashParams,
              iq: Optional[torch.Tensor] = None) -> None:
        """Raise ``ValueError`` unless these buffers fit this step (``iq``: the indexer queries, if any)."""
        n, hq, d = q.shape
        hi = None if iq is None else iq.shape[1]
        if hi is not None:
            params = replace(params, router="shared")
        max_cand = block_table.shape[1] * cache.page_size // params.block_size
        cap = min(params.topk, max_cand) if params.topk is not None else max_cand
        hsel = 1 if params.router == "shared" else cache.num_kv_heads
        p = self.params
        problems = []
        if n > self.max_batch:
            problems.append(f"batch {n} > max_batch {self.max_batch}")
        if (hq, cache.num_kv_heads, d) != (self.num_q_heads, self.num_kv_heads, self.head_dim):
            problems.append(f"heads/head_dim {(hq, cache.num_kv_heads, d)} != "
                            f"{(self.num_q_heads, self.num_kv_heads, self.head_dim)}")
        if max_cand > self.max_cand:
            problems.append(f"block_table addresses {max_cand} blocks > {self.max_cand}")
        if self.sel_idx.shape[1] != hsel or self.sel_idx.shape[2] < cap:
            problems.append(f"selection [{self.sel_idx.shape[1]}, {self.sel_idx.shape[2]}] < [{hsel}, {cap}]")
        if (p.block_size, p.local, p.topk, p.router) != (params.block_size, params.local, params.topk, params.router):
            problems.append("allocated for other DashParams (block_size, local, topk, router)")
        if self.scores.device != q.device:
            problems.append(f"on {self.scores.device}, q on {q.device}")
        if hi != self.indexer_heads:
            problems.append(f"allocated for indexer_heads {self.indexer_heads}, the step has {hi}")
        if problems:
            raise ValueError("buffers do not fit this decode step: " + "; ".join(problems))


def route(q: torch.Tensor, cache: PagedKVCache, block_table: torch.Tensor, seq_lens: torch.Tensor,
          params: DashParams, buffers: DecodeBuffers, write: Optional[tuple] = None,
          only: Optional[str] = None) -> None:
    """Routing (stage 2 + prior) into ``buffers.sel_*``; ``write``: ``write_args(...)`` of the new
    K/V, written by the same launch; ``only``: ``"scores"`` / ``"select"`` (stage timings)."""
    n = q.shape[0]
    nsr, _ = buffers.splits(n)
    b = buffers
    route_decode(q, cache.summaries, block_table, seq_lens, params, cache.page_size, b.scores, b.pmax, b.mp,
                 b.sel_idx, b.sel_blk, b.sel_bias, b.sel_count, num_splits=nsr, write=write,
                 write_summarize=cache.summaries is not None, only=only)


def attend(q: torch.Tensor, cache: PagedKVCache, block_table: torch.Tensor, seq_lens: torch.Tensor,
           params: DashParams, buffers: DecodeBuffers, out: torch.Tensor) -> torch.Tensor:
    """Attention only (stage 3) over the selection in ``buffers.sel_*``: for stage-by-stage tests."""
    _, nsa = buffers.splits(q.shape[0])
    b = buffers
    return decode_attention(q, cache.k_pages, cache.v_pages, block_table, seq_lens, params, b.sel_blk, b.sel_bias,
                            b.sel_count, b.o_part, b.lse_part, out, num_splits=nsa)


def paged_dash_decode_triton(q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                             cache: PagedKVCache, block_table: torch.Tensor, seq_lens: torch.Tensor,
                             slot_mapping: Optional[torch.Tensor], head_cls: torch.Tensor, params: DashParams, *,
                             out: Optional[torch.Tensor] = None,
                             buffers: Optional[DecodeBuffers] = None, backend: str = "TRITON",
                             plan_cache=None, iq: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One DASH decode step with the Triton kernels (the CUDA branch of ``ops.paged_dash_decode``).

    q: ``[n, Hq, D]`` bf16/fp16; k, v: ``[n, Hkv, D]`` written at ``slot_mapping [n]`` first (or
    all None when already written); block_table ``[n, max_pages]`` int32; seq_lens ``[n]``
    including the new token (0 = padded row -> zeros); head_cls ``[Hkv, D]``.
    buffers: ``DecodeBuffers`` to reuse (required under CUDA-graph capture); allocated when None.
    backend: the attention stage, ``"TRITON"`` (the fused paged kernel) or a segment backend of
    ``dash_core.segments`` (``"FLASHINFER"``, ``"FLASH_ATTN"``, ``"TORCH"``) fed by the same routing.
    iq: ``[n, Hi, D]`` rotated indexer queries (SPEC.md section 9): they route (router ``shared``) over
    the cache's 1-head store of ``ik`` summaries; then k, v must be None (the op wrote them, the
    auxiliary rows and the summaries first) and buffers come from ``allocate(..., indexer_heads=Hi)``.
    Returns ``out [n, Hq, D]`` in ``q.dtype``. Launches only; never synchronises.
    """
    check_decode_args(q, k, v, cache, block_table, seq_lens, slot_mapping, head_cls, params, out, iq=iq)
    if buffers is None:
        buffers = DecodeBuffers.for_step(q, cache, block_table, params,
                                         indexer_heads=None if iq is None else iq.shape[1])
    else:
        buffers.check(q, cache, block_table, params, iq=iq)
    params = check_indexer_query(q, iq, k, params)
    if out is None:
        out = torch.empty_like(q)
    fused = None
    if k is not None:
        if params.block_size * cache.head_dim <= FUSE_WRITE_MAX:  # the score launch writes K/V too
            fused = write_args(k, v, cache, slot_mapping, head_cls)
        else:
            write_kv_and_summaries(k, v, cache, slot_mapping, head_cls, params.block_size, decode=True)
    route(q if iq is None else iq, cache, block_table, seq_lens, params, buffers, write=fused)
    if backend != "TRITON":
        from ..segments import decode_segment_attention

        n, b = q.shape[0], buffers
        out.copy_(decode_segment_attention(q, cache, block_table, seq_lens, b.sel_idx[:n], b.sel_bias[:n],
                                           b.sel_count[:n], params, backend, plan_cache=plan_cache))
        return out
    return attend(q, cache, block_table, seq_lens, params, buffers, out)


def check_write_config(cache: PagedKVCache, params: DashParams) -> None:
    """Raise ``ValueError`` unless the Triton K/V write (and summary) kernel supports ``cache``."""
    if cache.dtype not in KERNEL_DTYPES or cache.k_pages.stride(-1) != 1 or cache.v_pages.stride(-1) != 1:
        raise ValueError(f"the Triton K/V write needs a {KERNEL_DTYPES} cache contiguous in head_dim; "
                         f"got {cache.dtype}")
    if cache.summaries is not None:
        if params.block_size not in BLOCK_SIZES or cache.summaries.stride(-1) != 1:
            raise ValueError(f"block_size = {params.block_size} is not supported by the Triton summary kernel; "
                             f"use one of {BLOCK_SIZES}")


def cache_dash_prefill_triton(k: torch.Tensor, v: torch.Tensor, cache: PagedKVCache, slot_mapping: torch.Tensor,
                              params: DashParams, head_cls: Optional[torch.Tensor]) -> None:
    """Write ``k, v [T, Hkv, D]`` at ``slot_mapping [T]`` and summarise the blocks completed (the
    CUDA branch of ``ops.cache_dash_prefill``; arguments already validated there)."""
    check_write_config(cache, params)
    k = k if k.stride(-1) == 1 else k.contiguous()  # the kernel reads whole [D] rows
    v = v if v.stride(-1) == 1 else v.contiguous()
    write_kv_and_summaries(k, v, cache, slot_mapping, head_cls, params.block_size, decode=False)


def write_new_triton(cache: PagedKVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                     params: DashParams, head_cls: Optional[torch.Tensor], head_cls_i: Optional[torch.Tensor],
                     rows: Optional[torch.Tensor]) -> None:
    """The writes of a step with the auxiliary head (arguments validated by the op): K/V with the
    summaries of K (none with an indexer), the auxiliary ``rows [T, 2D]`` (``paged.write_aux``, tensor
    ops), then with an indexer the summaries of the stored ``ik`` with ``head_cls_i [D]`` into the
    1-head store (the summary launch over ``cache.indexer_view()``). Stream-ordered, no host reads."""
    from ..paged import write_aux

    indexer = head_cls_i is not None
    icache = cache.indexer_view() if indexer and cache.summaries is not None else None
    if icache is not None:  # the summary launch of ik is checked before anything is written
        check_write_config(icache, params)
    cache_dash_prefill_triton(k, v, PagedKVCache(cache.k_pages, cache.v_pages, None if indexer else cache.summaries),
                              slot_mapping, params, head_cls)
    if rows is not None:
        write_aux(cache, rows, slot_mapping)
    if icache is not None:
        write_kv_and_summaries(None, None, icache, slot_mapping, head_cls_i[None], params.block_size, decode=False)
