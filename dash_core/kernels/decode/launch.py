"""The decode step with the Triton kernels: launches only, never a host synchronisation.

Nothing here reads a device tensor: every size comes from shapes (batch rows, ``max_pages`` of the page table,
``topk``), every sequence-dependent decision is taken by the kernels from ``seq_lens``, so one captured CUDA graph
serves every step. A step is four launches, each the programmatic dependent of the kernel before it, the first of
whatever kernel ran before the step (``DecodeConfig.pdl``, sm_90+: it starts while that one ends and waits for its
results on the device), and a fifth first where a block's keys are too large to summarise in the select launch
(``DecodeConfig.fuse_write_max``): the K/V write on its own.

    scores against every candidate summary (split over candidates)         route.py
    entmax, group mean, topk cap, prior -> kept blocks per unit             route.py (routing.route_tile)
      and, beside it, the new K/V (+ the summary of a block it completes)   route.py (kv_write.write_token)
    split-KV attention over local window + kept blocks                      attention.py
    LSE merge of the splits                                                 attention.py

A wide batch runs as two halves (``DecodeConfig.overlap_halves``): the first half's four launches on the current
stream, the second half's on a stream of the buffers' own from the end of the first half's scores, so that the
second half's routing, bound by latency, runs beside the first half's attention, bound by DRAM.

The op (``dash_core.ops.paged_dash_decode``) validates the arguments, and chooses the attention stage: this
module's, or a segment backend fed by the same routing (``write_and_route`` then ``dash_core.segments``).
"""

from __future__ import annotations

from typing import Optional

import torch

from ...layout import PagedKVCache
from ...params import DashParams
from ..common import pdl_supported
from ..kv_write import write_args, write_kv_and_summaries
from .attention import decode_attention
from .buffers import DecodeBuffers
from .route import route_decode


def route(q: torch.Tensor, cache: PagedKVCache, block_table: torch.Tensor, seq_lens: torch.Tensor,
          params: DashParams, buffers: DecodeBuffers, write: Optional[tuple] = None,
          only: Optional[str] = None, **launch) -> None:
    """Routing (stage 2 + prior) into ``buffers.sel_*``; ``write``: ``kv_write.write_args(...)`` of the new K/V,
    written by the same launch; ``only``: ``"scores"`` / ``"select"`` (stage timings); ``launch``: ``scored``,
    ``score_pdl`` of ``route_decode``."""
    nsr, _ = buffers.splits(q.shape[0])
    b = buffers
    route_decode(q, cache.summaries, block_table, seq_lens, params, cache.page_size, b.scores, b.pmax, b.mp,
                 b.mp_cand, b.sel_idx, b.sel_blk, b.sel_bias, b.sel_count, num_splits=nsr, config=b.config, write=write,
                 only=only, **launch)


def attend(q: torch.Tensor, cache: PagedKVCache, block_table: torch.Tensor, seq_lens: torch.Tensor,
           params: DashParams, buffers: DecodeBuffers, out: torch.Tensor) -> torch.Tensor:
    """Attention (stage 3) over the selection in ``buffers.sel_*`` into ``out [n, Hq, D]``."""
    _, nsa = buffers.splits(q.shape[0])
    b = buffers
    return decode_attention(q, cache.k_pages, cache.v_pages, block_table, seq_lens, params, b.sel_blk, b.sel_bias,
                            b.sel_count, b.o_part, b.lse_part, out, num_splits=nsa,
                            pdl=b.config.pdl and pdl_supported(q.device), warps=b.config.attn_warps,
                            stages=b.attn_stages(q.shape[0]), maxnreg=b.attn_maxnreg(q.shape[0]),
                            tile_elements=b.config.attn_tile_elements,
                            merge_thread_elements=b.config.merge_thread_elements)


def write_and_route(q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor], cache: PagedKVCache,
                    block_table: torch.Tensor, seq_lens: torch.Tensor, slot_mapping: Optional[torch.Tensor],
                    head_cls: Optional[torch.Tensor], params: DashParams, buffers: DecodeBuffers,
                    iq: Optional[torch.Tensor] = None, **launch) -> None:
    """Write the new ``k, v [n, Hkv, D]`` at ``slot_mapping [n]`` (None: already written) and route each request's
    token into ``buffers.sel_*`` (``iq [n, Hi, D]``: the indexer's queries route instead of q, router ``shared``;
    ``launch``: ``scored``, ``score_pdl`` of ``route_decode``)."""
    params = params.routed_by(iq is not None)
    fused = None
    if k is not None:
        if params.block_size * cache.head_dim <= buffers.config.fuse_write_max:  # the select launch writes K/V too
            fused = write_args(k, v, cache, slot_mapping, head_cls)
        else:
            write_kv_and_summaries(k, v, cache, slot_mapping, head_cls, params.block_size, decode=True)
    route(q if iq is None else iq, cache, block_table, seq_lens, params, buffers, write=fused, **launch)


def step_buffers(q: torch.Tensor, cache: PagedKVCache, block_table: torch.Tensor, params: DashParams,
                 buffers: Optional[DecodeBuffers], out: Optional[torch.Tensor],
                 iq: Optional[torch.Tensor] = None) -> tuple:
    """``(buffers, out)`` of a step: those given, else allocated for it (``out`` like ``q``)."""
    if buffers is None:
        buffers = DecodeBuffers.for_step(q, cache, block_table, params,
                                         indexer_heads=None if iq is None else iq.shape[1])
    return buffers, torch.empty_like(q) if out is None else out


def paged_dash_decode_triton(q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                             cache: PagedKVCache, block_table: torch.Tensor, seq_lens: torch.Tensor,
                             slot_mapping: Optional[torch.Tensor], head_cls: Optional[torch.Tensor],
                             params: DashParams, *, out: Optional[torch.Tensor] = None,
                             buffers: Optional[DecodeBuffers] = None,
                             iq: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One DASH decode step with the Triton kernels and their attention (the CUDA branch of
    ``ops.paged_dash_decode`` with the ``TRITON`` backend, which validated the arguments).

    Parameters
    ----------
    q : ``[n, Hq, D]`` bf16/fp16.
    k, v : ``[n, Hkv, D]`` written at ``slot_mapping [n]`` first, or all None when already written.
    block_table : ``[n, max_pages]`` int32. seq_lens : ``[n]`` including the new token (0 = padded row -> zeros).
    head_cls : ``[Hkv, D]``.
    buffers : ``DecodeBuffers`` to reuse (required under CUDA-graph capture); allocated when None.
    iq : ``[n, Hi, D]`` rotated indexer queries: they route (router ``shared``) over the cache's 1-head store of
        ``ik`` summaries; then k, v must be None and buffers come from ``allocate(..., indexer_heads=Hi)``.

    Returns
    -------
    ``out [n, Hq, D]`` in ``q.dtype``.
    """
    buffers, out = step_buffers(q, cache, block_table, params, buffers, out, iq)
    n = q.shape[0]
    if iq is not None or not buffers.halved(n):  # (an indexer's step routes its batch whole)
        write_and_route(q, k, v, cache, block_table, seq_lens, slot_mapping, head_cls, params, buffers, iq=iq)
        return attend(q, cache, block_table, seq_lens, params.routed_by(iq is not None), buffers, out)
    first, second = buffers.halves(n)
    side, scored = buffers.side, buffers.scored

    def half(rows: slice, bufs: DecodeBuffers, **launch) -> None:
        def cut(x):
            return None if x is None else x[rows]
        write_and_route(q[rows], cut(k), cut(v), cache, block_table[rows], seq_lens[rows], cut(slot_mapping),
                        head_cls, params, bufs, **launch)
        attend(q[rows], cache, block_table[rows], seq_lens[rows], params, bufs, out[rows])

    h = first.max_batch  # the first half's rows, as the views hold them
    half(slice(0, h), first, scored=scored)
    if side is None:  # the CPU: one half after the other
        half(slice(h, n), second)
        return out
    main = torch.cuda.current_stream(q.device)
    side.wait_event(scored)
    with torch.cuda.stream(side):
        half(slice(h, n), second, score_pdl=False)
    main.wait_stream(side)
    return out
