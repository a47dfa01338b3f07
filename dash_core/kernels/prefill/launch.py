"""The prefill call: plan, scratch and the bound launches of each wave (made once per batch through a
``PrefillWorkspace``), then each wave's launches: a route launch (none where the Triton attention routes its own
tiles, ``route.route_fused``), the Triton attention launch (which also zeroes the rows of no request), and the Gluon
attention launch after it where that attends the wave. Launches only: nothing reads a device value on the host.
Arguments are validated by the op (``dash_core.ops``) before anything here runs.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...layout import PagedKVCache
from ...params import DashParams
from ...workspace import PrefillWorkspace
from ..kv_write import write_prefill
from .attention import bind_attention
from .config import PrefillConfig
from .plan import PrefillPlan, PrefillScratch, score_heads
from .route import bind_route, gather_summaries, route_fused


def plan_and_scratch(q: torch.Tensor, cache: PagedKVCache, block_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     seq_lens: torch.Tensor, params: DashParams, config: PrefillConfig,
                     route_heads: Optional[int] = None, recompute: Optional[bool] = None) -> tuple:
    """The plan and the routing scratch of one call (what a workspace keeps), with the summary copy where routing
    computes the scores again in each pass (``recompute``; None: where ``route.recompute_routing`` says so). Fill
    the copy with ``gather_summaries`` before the route launches of each call."""
    hq, d, hkv = q.shape[1], q.shape[2], cache.num_kv_heads
    plan = PrefillPlan.build(q, cache, block_table, cu_seqlens_q, seq_lens, params, config,
                             route_heads=route_heads, recompute=recompute)
    scratch = PrefillScratch.allocate(plan.wave, plan.qt, score_heads(hq, route_heads), hkv, plan.max_cand, params,
                                      q.device, plan.recompute)
    if plan.recompute:
        scratch.add_summary_copy(seq_lens.shape[0], hkv, d, cache.summaries.dtype, config)
    return plan, scratch


def paged_dash_prefill_triton(q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                              cache: PagedKVCache, block_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
                              seq_lens: torch.Tensor, slot_mapping: Optional[torch.Tensor],
                              head_cls: Optional[torch.Tensor], params: DashParams, *,
                              out: Optional[torch.Tensor] = None, iq: Optional[torch.Tensor] = None,
                              workspace: Optional[PrefillWorkspace] = None,
                              config: Optional[PrefillConfig] = None) -> torch.Tensor:
    """Causal DASH for the new tokens of every request with the Triton kernels (the CUDA branch of
    ``ops.paged_dash_prefill``, which validated the arguments).

    Parameters
    ----------
    q : ``[T, Hq, D]`` bf16/fp16.
    k, v : ``[T, Hkv, D]`` written at ``slot_mapping [T]`` first (with the summaries of the blocks they complete),
        or all None when already written.
    block_table : ``[n, max_pages]`` int32. cu_seqlens_q : ``[n + 1]``. seq_lens : ``[n]`` after the extend.
    head_cls : ``[Hkv, D]`` (unused with an indexer).
    iq : ``[T, Hi, D]`` rotated indexer queries: the route launches score them (router ``shared``) against the
        cache's 1-head store of ``ik`` summaries, the attention launches use q; k, v must then be None.
    workspace : shared by the calls of one batch: the plan (with its tile tables launch), the routing scratch and the
        route and attention launches with the step's arguments bound are made by the first call and reused by the
        others (which pass only their own queries, cache, block table and output); its ``config`` tunes the
        launches.
    config : the launches' tuning (default: the workspace's, else ``PrefillConfig()``).

    Returns
    -------
    ``out [T, Hq, D]`` in ``q.dtype``; rows of no request, of padded requests and of inconsistent requests are zero.
    """
    if config is None:
        config = workspace.config if workspace is not None and workspace.config is not None else PrefillConfig()
    params = params.routed_by(iq is not None)
    if out is None:
        out = torch.empty_like(q)
    if k is not None:
        write_prefill(k, v, cache, slot_mapping, params, head_cls, consecutive=True)  # the op's token layout
    t, hq, d = q.shape
    n = seq_lens.shape[0]
    if t == 0:
        return out
    if n == 0:
        return out.zero_()
    route_heads = None if iq is None else iq.shape[1]
    # what routes: the queries over the summaries, or the indexer's
    rq, rcache = (q, cache) if iq is None else (iq, cache.indexer_view())

    def make() -> tuple:
        plan, scratch = plan_and_scratch(q, cache, block_table, cu_seqlens_q, seq_lens, params, config, route_heads)
        step = (block_table, cu_seqlens_q, seq_lens, params, plan, scratch)
        waves = []
        for tile0, tiles in plan.waves():
            fused = iq is None and route_fused(q, cache, params, plan, scratch, tiles)
            waves.append((None if fused else bind_route(rq, rcache, *step, tile0, tiles),
                          bind_attention(q, cache, *step, tile0, tiles, route=fused)))
        return scratch, waves

    if workspace is None:
        scratch, waves = make()
    else:  # everything the plan, scratch and launches are made from, besides the length tensors' values
        key = (q.device, t, hq, d, cache.num_kv_heads, cache.page_size, tuple(block_table.shape), params,
               config, route_heads, cache.summaries.dtype)
        scratch, waves = workspace.take(key, (cu_seqlens_q, seq_lens), make)
    gather_summaries(cache, block_table, seq_lens, params, scratch)  # this call's summaries (each layer has its own)
    for route, attend in waves:
        if route is not None:  # (else the attention launch routes)
            route(rq, rcache, block_table)
        attend(q, cache, block_table, out)
    return out
