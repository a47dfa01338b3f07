"""The prefill plan: a call's tile geometry and waves (from shapes only, with its device tile tables) and the
routing scratch of one wave.

Routing needs, per token, the scores of every candidate (``[Hq, max_cand]`` fp32, unless it computes them again in
each pass: ``route.recompute_routing``), its ``mp`` and its selection. That scratch is allocated for ``W`` tiles
only (``W`` from a byte budget, ``PrefillConfig.scratch_bytes``, in whole rounds of resident programs:
``wave_tiles``), and the tiles are processed in waves of ``W``: never a ``[tokens x blocks]`` matrix for the whole
prompt. Nothing reads a device value on the host: grid and scratch sizes come from shapes (``T``, ``n``,
``max_pages``), tile placement is computed on the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from ...layout import PagedKVCache
from ...params import DashParams
from ..common import cdiv, sm_count
from .config import PrefillConfig
from .route import may_recompute, recompute_routing, summary_copy_descriptor
from .tiles import INFO_COLS, INFO_COUNTER, max_tiles, tile_tables, tile_tokens


def _row(max_cand: int) -> int:
    """Entries of a score or mp row of the routing scratch: ``max_cand`` rounded up to 16."""
    return cdiv(max_cand, 16) * 16


@dataclass
class PrefillScratch:
    """Routing scratch of one wave of ``W`` tiles (``slots = W * QT`` token slots).

    scores ``[slots, rows, row]`` fp32 (``_storage_rows``); mp ``[slots, Hsel, row]`` fp32 and mp_cand like it in
    int32: each unit's positive mp as a list, and their candidates (by candidate instead where the tiles route from
    scores in registers, ``route.routes_in_registers``: the union launch reads them so, ``route.union_from_mp``)
    (``row``: ``max_cand`` rounded up to 16, so that every row starts 64-byte aligned and the route kernel reads
    whole groups of 4; routing from the summary copy first stages each unit's scaled queries in its mp row where
    they fit, ``stages_queries``); sel_idx / sel_blk ``[slots, Hsel, cap]`` int32, sel_bias ``[slots, Hsel, cap]``
    fp32, sel_count ``[slots, Hsel]`` int32, union_blk ``[W, Hkv, max_cand]`` int32, union_pos ``[W, Hkv,
    max_cand]`` int32 (by candidate) and union_prior ``[W, Hkv, max_cand, QT]`` fp32 (by union position); for the
    Gluon attention launch (``gluon.py``), union_count ``[W, Hkv]`` int32 and tile_info ``[W, INFO_COLS]`` int32
    (the tiles' bounds, and in column ``INFO_COUNTER`` of row 0 that launch's work counter, ``ws_counter``).
    ``cap = min(topk, max_cand)`` or ``max_cand`` uncapped. Where ``recompute_routing``, also the summary copy
    (``add_summary_copy``: at most ``PrefillConfig.summary_copy_bytes``, outside the wave budget), and no score is
    written: the route launch keeps only each unit's group sums of probabilities there (row h of its slot, h < Hkv).

    The two union tables are written and read by the attention launch only, after the wave's route launch
    is done with the scores: they are views of the scores' storage (both when ``Hq >= 2 Hkv``, else
    ``union_pos`` only), which keeps them out of the byte budget. Where routing stores no score
    (``recompute``), that storage is ``[slots, min(Hq, 2 Hkv), row]``: the priors' table after a region of its size
    (which holds the positions' table, one int32 a candidate, and before the union launch the route launch's Hkv rows
    of group sums a slot, ``min(Hq, 2 Hkv) >= Hkv``).
    """

    qt: int
    tiles: int
    max_cand: int
    scores: torch.Tensor
    mp: torch.Tensor
    mp_cand: torch.Tensor
    sel_idx: torch.Tensor
    sel_blk: torch.Tensor
    sel_bias: torch.Tensor
    sel_count: torch.Tensor
    union_blk: torch.Tensor
    union_pos: torch.Tensor
    union_prior: torch.Tensor
    union_count: torch.Tensor
    tile_info: torch.Tensor
    summary_copy: Optional[torch.Tensor] = None  # [n, max_cand, Hkv, D] (recompute_routing), its TMA descriptor
    summary_desc: Optional[TensorDescriptor] = None
    copied_from: Optional[tuple] = None  # what gather_summaries last copied (each route launch checks it)

    def __post_init__(self) -> None:
        # the Gluon attention launch's work counter: the last column of tile_info's row 0 ([1]; a view made once)
        self.ws_counter = self.tile_info[0, INFO_COUNTER:]

    @staticmethod
    def _storage_rows(score_rows: int, hkv: int, recompute: bool) -> int:
        """Rows per slot of the scores' storage: ``score_rows`` (``score_heads``), or (``recompute``) no more than
        the union tables take (at least the Hkv rows of group sums the route launch writes)."""
        return min(score_rows, 2 * hkv) if recompute else score_rows

    @staticmethod
    def bytes_per_tile(qt: int, score_rows: int, hkv: int, max_cand: int, params: DashParams,
                       recompute: bool = False) -> int:
        hsel, cap = params.selection_units(hkv), params.cap(max_cand)
        rows = PrefillScratch._storage_rows(score_rows, hkv, recompute)
        per_slot = 4 * ((rows + 2 * hsel) * _row(max_cand) + 3 * hsel * cap + hsel)
        own_prior = rows < 2 * hkv  # union_prior lies a table's size into the scores, or in storage of its own
        return qt * per_slot + 4 * hkv * max_cand * (1 + own_prior * qt) + 4 * (hkv + INFO_COLS)

    def add_summary_copy(self, n: int, hkv: int, d: int, dtype: torch.dtype, config: PrefillConfig) -> None:
        """Allocate ``summary_copy`` (and, where TMA serves, a descriptor of the route kernel's score tiles)."""
        self.summary_copy = torch.empty(n, self.max_cand, hkv, d, dtype=dtype, device=self.scores.device)
        self.summary_desc = summary_copy_descriptor(self.summary_copy, config)

    @classmethod
    def allocate(cls, tiles: int, qt: int, score_rows: int, hkv: int, max_cand: int, params: DashParams,
                 device, recompute: bool = False) -> "PrefillScratch":
        """recompute: routing stores no score (``_route_recompute``): the scores' storage holds the union tables and,
        while a wave routes, its group sums (the summary copy is added by ``add_summary_copy``)."""
        hsel, cap = params.selection_units(hkv), params.cap(max_cand)
        slots = tiles * qt
        f32, i32 = torch.float32, torch.int32
        rows = cls._storage_rows(score_rows, hkv, recompute)
        scores = torch.empty(slots, rows, _row(max_cand), dtype=f32, device=device)
        table = tiles * hkv * qt * max_cand  # elements of one union table
        flat = scores.view(-1)
        prior = (flat[table:2 * table] if rows >= 2 * hkv else torch.empty(table, dtype=f32, device=device))
        return cls(
            qt, tiles, max_cand,
            scores=scores,
            mp=torch.empty(slots, hsel, _row(max_cand), dtype=f32, device=device),
            mp_cand=torch.empty(slots, hsel, _row(max_cand), dtype=i32, device=device),
            sel_idx=torch.empty(slots, hsel, cap, dtype=i32, device=device),
            sel_blk=torch.empty(slots, hsel, cap, dtype=i32, device=device),
            sel_bias=torch.empty(slots, hsel, cap, dtype=f32, device=device),
            sel_count=torch.empty(slots, hsel, dtype=i32, device=device),
            union_blk=torch.empty(tiles, hkv, max_cand, dtype=i32, device=device),
            union_pos=flat[:tiles * hkv * max_cand].view(torch.int32).view(tiles, hkv, max_cand),
            union_prior=prior.view(tiles, hkv, max_cand, qt),
            union_count=torch.empty(tiles, hkv, dtype=i32, device=device),
            tile_info=torch.empty(tiles, INFO_COLS, dtype=i32, device=device),
        )


@dataclass
class PrefillPlan:
    """Static geometry of one prefill call (from shapes only) and its device tile tables."""

    qt: int
    num_tiles: int  # the static bound NT
    wave: int  # tiles per wave
    max_cand: int
    tile_req: torch.Tensor
    tile_off: torch.Tensor
    config: PrefillConfig = PrefillConfig()
    recompute: bool = False  # routing stores no score (recompute_routing): a smaller scratch per tile

    @classmethod
    def build(cls, q: torch.Tensor, cache: PagedKVCache, block_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
              seq_lens: torch.Tensor, params: DashParams, config: PrefillConfig,
              route_heads: Optional[int] = None, recompute: Optional[bool] = None) -> "PrefillPlan":
        """route_heads: the indexer's ``Hi`` when it routes (one group of Hi score rows per token): the
        tile then also keeps ``QT * pow2(Hi)`` within ``config.attn_rows`` (registers, shared memory), and the
        scratch holds ``max(Hq, Hi)`` score rows per token. recompute: route without a score scratch
        (None: where ``recompute_routing`` says so); the waves are sized for that path's scratch."""
        t, hq, d = q.shape
        hkv = cache.num_kv_heads
        table_tokens = block_table.shape[1] * cache.page_size
        if recompute is None:
            recompute = recompute_routing(params, seq_lens.shape[0], params.max_candidates(table_tokens), hq, hkv, d,
                                          cache.summaries.element_size(), config, route_heads)
        qt, max_cand, per_tile = _tile_geometry(hq, hkv, table_tokens, params, config, route_heads, recompute)
        tile_req, tile_off, nt = tile_tables(cu_seqlens_q, seq_lens, t, qt)
        wave = wave_tiles(nt, per_tile, hkv, q.device, config)
        return cls(qt, nt, wave, max_cand, tile_req, tile_off, config, recompute)

    def waves(self) -> list:
        """``(tile0, tiles)`` of each wave in the order the op issues them: the last first where
        ``config.waves_last_first``."""
        waves = [(t0, min(self.wave, self.num_tiles - t0)) for t0 in range(0, self.num_tiles, self.wave)]
        return waves[::-1] if self.config.waves_last_first else waves


def _tile_geometry(hq: int, hkv: int, table_tokens: int, params: DashParams, config: PrefillConfig,
                   route_heads: Optional[int] = None, recompute: bool = False) -> tuple:
    """``(QT, candidates per token at most, bytes of one tile's routing scratch)`` for block tables of
    ``table_tokens`` tokens (``PrefillPlan.build``)."""
    max_cand = params.max_candidates(table_tokens)
    qt = tile_tokens(hq, hkv, params.block_size, config.attn_rows)
    if route_heads is not None:
        qt = min(qt, tile_tokens(route_heads, 1, params.block_size, config.attn_rows))
    return qt, max_cand, PrefillScratch.bytes_per_tile(qt, score_heads(hq, route_heads), hkv, max_cand, params,
                                                       recompute)


def score_heads(hq: int, route_heads: Optional[int]) -> int:
    """Score rows a token of the routing scratch: ``Hq``, or ``max(Hq, Hi)`` where an indexer's ``Hi`` heads route
    (``route_heads``)."""
    return hq if route_heads is None else max(hq, route_heads)


def scratch_bound(num_tokens: int, max_requests: int, max_context: int, num_q_heads: int, num_kv_heads: int,
                  params: DashParams, config: Optional[PrefillConfig] = None,
                  indexer_heads: Optional[int] = None) -> int:
    """The most routing scratch, in bytes, one CUDA prefill call (and so a ``PrefillWorkspace``) holds for up to
    ``num_tokens`` new tokens of up to ``max_requests`` requests whose block tables cover up to ``max_context``
    tokens (page-table width times page size): ``NT`` tiles (the tile tables' bound) of the widest table's scratch,
    or the byte budget ``config.scratch_bytes`` (one tile where a tile is larger) if less; where routing may store
    no score (``recompute_routing``), the larger of that and the same for that path's smaller tiles plus
    ``config.summary_copy_bytes``. indexer_heads: the indexer's query heads when it routes (its selection is then
    shared by the KV heads). Engines that size their KV cache from a profiled peak add it (the vLLM adapter does)."""
    config = PrefillConfig() if config is None else config
    params = params.routed_by(indexer_heads is not None)
    qt, max_cand, per_tile = _tile_geometry(num_q_heads, num_kv_heads, max_context, params, config, indexer_heads)
    nt = max_tiles(num_tokens, min(max_requests, num_tokens), qt)

    def waves(tile_bytes: int) -> int:
        return min(nt * tile_bytes, max(config.scratch_bytes, tile_bytes))

    if not may_recompute(params, max_cand, num_q_heads // num_kv_heads, indexer_heads, config):
        return waves(per_tile)
    recompute_tile = _tile_geometry(num_q_heads, num_kv_heads, max_context, params, config, indexer_heads, True)[2]
    return max(waves(per_tile), waves(recompute_tile) + config.summary_copy_bytes)


def wave_tiles(num_tiles: int, per_tile: int, hkv: int, device, config: PrefillConfig) -> int:
    """Tiles per wave ``W`` within the byte budget (``config.scratch_bytes``), sized in whole rounds of resident
    programs: a launch of ``w x Hkv`` programs takes ``ceil(w Hkv / slots)`` rounds (``config.resident_ctas`` per
    multiprocessor), and a last round that fills a fraction of the GPU costs about as much as a full one, once per
    launch. Of the largest ``W`` the budget allows and the largest multiple of ``slots / gcd(slots, Hkv)`` below
    it (waves of whole rounds), the one with fewer rounds in all; all tiles in one wave when they fit (the fewest
    rounds there are)."""
    wmax = max(1, min(num_tiles, config.scratch_bytes // per_tile))
    if wmax == num_tiles or config.resident_ctas <= 0:
        return wmax
    slots = sm_count(device) * config.resident_ctas
    unit = slots // math.gcd(slots, hkv)

    def cost(w):
        full, rest = divmod(num_tiles, w)
        return full * cdiv(w * hkv, slots) + cdiv(rest * hkv, slots), full + (rest > 0)

    return min([w for w in (wmax, wmax // unit * unit) if w > 0], key=cost)
