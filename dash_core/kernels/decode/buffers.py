"""The decode step's scratch: ``DecodeBuffers``, sized once by static bounds so that a CUDA graph can own it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch

from ...layout import PagedKVCache
from ...params import DashParams
from ..common import cdiv, sm_count
from .config import DecodeConfig


@dataclass
class DecodeBuffers:
    """Scratch of the decode kernels, sized once by static bounds so that a CUDA graph can own it.

    Sizes: ``max_cand = params.max_candidates(max_pages * page_size)`` candidate blocks; the selection capacity
    ``cap`` is ``min(topk, max_cand)``, or ``max_cand`` without ``topk`` (an uncapped selection is
    bounded by the number of candidates). Units: ``Hsel = Hkv`` (router ``kv_head``) or 1.

    scores ``[max_batch, Hq, max_cand]`` fp32, pmax ``[max_batch, Hq, score_splits]`` fp32,
    mp ``[max_batch, Hsel, max_cand4]`` fp32 and mp_cand ``[max_batch, Hsel, max_cand4]`` int32 (a unit's list of
    positive mp and their candidates; ``max_cand4``: ``max_cand`` rounded up to 4),
    sel_idx / sel_blk ``[max_batch, Hsel, cap]`` int32,
    sel_bias ``[max_batch, Hsel, cap]`` fp32, sel_count ``[max_batch, Hsel]`` int32,
    o_part ``[parts, Hq, D]`` fp32 and lse_part ``[parts, Hq]`` fp32 with ``parts`` the most
    ``batch * attn_splits`` over batches up to ``max_batch``.

    With an indexer (``indexer_heads = Hi``) routing is ``shared`` over the Hi indexer queries:
    scores and pmax have ``max(Hq, Hi)`` head rows and the selection one unit.

    The split counts depend only on the batch rows ``n`` (a shape): ``splits(n)``. A wide batch may run as two
    halves (``config.overlap_halves``, ``halved(n)``): each half's launches on views of these buffers
    (``halves(n)``, kept per ``n``), the second half's on ``side``, a stream of the buffers' own, forked at
    ``scored``, their event (both None on the CPU: one half after the other).

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
    mp_cand: torch.Tensor
    sel_idx: torch.Tensor
    sel_blk: torch.Tensor
    sel_bias: torch.Tensor
    sel_count: torch.Tensor
    o_part: torch.Tensor
    lse_part: torch.Tensor
    indexer_heads: Optional[int] = None
    config: DecodeConfig = DecodeConfig()
    side: Optional[torch.cuda.Stream] = None
    scored: Optional[torch.cuda.Event] = None
    _halves: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @staticmethod
    def _splits(n: int, hkv: int, max_cand: int, cap: int, local_blocks: int, num_sms: int,
                fixed: Optional[tuple], config: DecodeConfig) -> tuple:
        if fixed is not None:
            return fixed
        rows = max(1, n * hkv)
        per_sm = config.score_programs_per_sm_wide if _wide(n, hkv, num_sms) else config.score_programs_per_sm
        nsr = max(1, min(cdiv(per_sm * num_sms, rows), cdiv(max_cand, config.score_split_min_candidates)))
        nsa = max(1, min(cdiv(config.attn_programs_per_sm * num_sms, rows), config.attn_split_max,
                         cdiv(local_blocks + cap, config.attn_split_min_blocks)))
        return nsr, nsa

    def splits(self, n: int) -> tuple:
        """``(score_splits, attn_splits)`` for a batch of ``n`` rows."""
        return self._splits(n, self.num_kv_heads, self.max_cand, self.sel_idx.shape[2], self.params.local_blocks,
                            self.num_sms, self.fixed_splits, self.config)

    def halved(self, n: int) -> bool:
        """Whether a batch of ``n`` rows runs as two halves: ``config.overlap_halves`` where its (request, KV head)
        rows outnumber the multiprocessors."""
        return _halved(n, self.num_kv_heads, self.num_sms, self.config)

    def halves(self, n: int) -> tuple:
        """The buffers of rows ``[0, n // 2)`` and ``[n // 2, n)``: views, the second half's partial outputs after
        the first half's."""
        if n not in self._halves:
            h, rest = _half_rows(n)
            self._halves[n] = self._rows(0, h, 0), self._rows(h, rest, h * self.splits(h)[1])
        return self._halves[n]

    def _rows(self, row0: int, rows: int, part0: int) -> "DecodeBuffers":
        per_row = ("scores", "pmax", "mp", "mp_cand", "sel_idx", "sel_blk", "sel_bias", "sel_count")
        return dataclasses.replace(
            self, max_batch=rows, **{f: getattr(self, f)[row0:row0 + rows] for f in per_row},
            o_part=self.o_part[part0:], lse_part=self.lse_part[part0:])

    def attn_stages(self, n: int) -> int:
        """``num_stages`` of the split attention for a batch of ``n`` rows: ``config.attn_stages_wide`` where its
        (request, KV head) rows outnumber the multiprocessors, else ``config.attn_stages``."""
        return self.config.attn_stages_wide if _wide(n, self.num_kv_heads, self.num_sms) else self.config.attn_stages

    def attn_maxnreg(self, n: int) -> int:
        """Register cap of the split attention for a batch of ``n`` rows (0: none): ``config.attn_maxnreg`` at head
        dim 128 with the narrow pipeline (``attn_stages``), else none."""
        wide = _wide(n, self.num_kv_heads, self.num_sms)
        return self.config.attn_maxnreg if self.head_dim == 128 and not wide else 0

    @classmethod
    def allocate(cls, max_batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 max_pages: int, params: DashParams, device, *, num_sms: Optional[int] = None,
                 splits: Optional[tuple] = None, indexer_heads: Optional[int] = None,
                 config: Optional[DecodeConfig] = None) -> "DecodeBuffers":
        """Allocate for batches up to ``max_batch`` rows and page tables up to ``max_pages`` wide.

        splits: optional fixed ``(score_splits, attn_splits)`` (tests); by default they follow the
        batch and the device's SM count. indexer_heads: ``Hi`` for a model with an indexer.
        config: the decode launches' tuning (default ``DecodeConfig()``).
        """
        device = torch.device(device)
        config = DecodeConfig() if config is None else config
        params = params.routed_by(indexer_heads is not None)
        if num_sms is None:
            num_sms = sm_count(device)
        max_cand = params.max_candidates(max_pages * page_size)
        cap = max(1, params.cap(max_cand))
        hsel = params.selection_units(num_kv_heads)
        nsr_max, parts = 1, 1
        for n in range(1, max_batch + 1):
            nsr, nsa = cls._splits(n, num_kv_heads, max_cand, cap, params.local_blocks, num_sms, splits, config)
            nsr_max, parts = max(nsr_max, nsr), max(parts, n * nsa)
            if _halved(n, num_kv_heads, num_sms, config):  # both halves' partials
                parts = max(parts, sum(m * cls._splits(m, num_kv_heads, max_cand, cap, params.local_blocks, num_sms,
                                                       splits, config)[1] for m in _half_rows(n)))
        f32, i32 = torch.float32, torch.int32
        mp_row = cdiv(max_cand, 4) * 4  # a unit's list is read in whole groups of 4
        score_rows = max(num_q_heads, indexer_heads or 0)
        two_streams = config.overlap_halves and device.type == "cuda"
        return cls(
            max_batch, num_q_heads, num_kv_heads, head_dim, max_cand, params, num_sms, splits,
            scores=torch.empty(max_batch, score_rows, max_cand, dtype=f32, device=device),
            pmax=torch.empty(max_batch, score_rows, nsr_max, dtype=f32, device=device),
            mp=torch.empty(max_batch, hsel, mp_row, dtype=f32, device=device),
            mp_cand=torch.empty(max_batch, hsel, mp_row, dtype=i32, device=device),
            sel_idx=torch.zeros(max_batch, hsel, cap, dtype=i32, device=device),
            sel_blk=torch.zeros(max_batch, hsel, cap, dtype=i32, device=device),
            sel_bias=torch.zeros(max_batch, hsel, cap, dtype=f32, device=device),
            sel_count=torch.zeros(max_batch, hsel, dtype=i32, device=device),
            o_part=torch.empty(parts, num_q_heads, head_dim, dtype=f32, device=device),
            lse_part=torch.empty(parts, num_q_heads, dtype=f32, device=device),
            indexer_heads=indexer_heads, config=config,
            side=torch.cuda.Stream(device) if two_streams else None,
            scored=torch.cuda.Event() if two_streams else None,
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
        params = params.routed_by(hi is not None)
        max_cand = params.max_candidates(block_table.shape[1] * cache.page_size)
        cap = params.cap(max_cand)
        hsel = params.selection_units(cache.num_kv_heads)
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
        if any(x.stride(2) != 1 or x.stride(1) % 4 or x.stride(0) % 4 or x.data_ptr() % 16
               for x in (self.mp, self.mp_cand)):
            problems.append("mp and mp_cand must be 16-byte aligned with contiguous rows a multiple of 4 long (the "
                            "select reads a unit's list in groups of 4), as allocate makes them")
        if problems:
            raise ValueError("buffers do not fit this decode step: " + "; ".join(problems))


def _wide(n: int, hkv: int, num_sms: int) -> bool:
    """A batch of ``n`` rows has more (request, KV head) rows than the GPU has multiprocessors: the score launch
    splits less and the split attention takes the deeper pipeline."""
    return n * hkv > num_sms


def _half_rows(n: int) -> tuple:
    """Rows of the two halves of a batch of ``n`` rows: ``(n // 2, n - n // 2)``."""
    return n // 2, n - n // 2


def _halved(n: int, hkv: int, num_sms: int, config: DecodeConfig) -> bool:
    """A batch of ``n`` rows runs as two halves (``DecodeBuffers.halved``)."""
    return config.overlap_halves and n >= 2 and _wide(n, hkv, num_sms)
