"""Static buffers and capture/replay for CUDA-graph DASH decode.

A captured decode step must read and write the same tensors at every replay. ``DecodeGraphBuffers``
owns all of them, sized once by static bounds (the largest batch and page-table width), and
``fill`` copies a live step into them in place; rows past the live batch are padded so that
they write nothing (slot -1) and return zeros (``seq_lens`` 0). ``CapturedDecode`` captures
``dash_core.ops.paged_dash_decode`` over those buffers for one batch size and replays it.

Example (GPU)::

    bufs = DecodeGraphBuffers.allocate(max_batch=8, max_pages=2048, num_q_heads=32, num_kv_heads=8,
                                       head_dim=128, page_size=64, params=params, dtype=torch.bfloat16)
    step = CapturedDecode(bufs, cache, head_cls, batch=8)            # warm-up + capture
    out = step(q, k, v, block_table, seq_lens, slot_mapping)          # [n, Hq, D], n <= 8, no host sync
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch

from dash_core.kernels.decode.buffers import DecodeBuffers
from dash_core.layout import PagedKVCache
from dash_core.ops import paged_dash_decode
from dash_core.params import DashParams


@dataclass
class DecodeGraphBuffers:
    """Inputs, output and kernel scratch of a captured decode step, for up to ``max_batch`` rows.

    block_table ``[max_batch, max_pages]`` int32, seq_lens ``[max_batch]`` int32, slot_mapping
    ``[max_batch]`` int64, q/out ``[max_batch, Hq, D]``, k/v ``[max_batch, Hkv, D]`` in the model
    dtype, and ``kernel``: the Triton decode scratch (``DecodeBuffers``: scores, selection, split-K
    partials). An engine adapter whose engine owns q/k/v/out and the slot mapping allocates without
    them (``io=False``: None); ``kernel`` is None where decode runs the PyTorch path; ``positions``
    ``[max_batch]`` int64 (page mode: each row's position) only when asked for.
    """

    params: DashParams
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: Optional[torch.Tensor]
    q: Optional[torch.Tensor]
    k: Optional[torch.Tensor]
    v: Optional[torch.Tensor]
    out: Optional[torch.Tensor]
    kernel: Optional[object]
    positions: Optional[torch.Tensor] = None

    @classmethod
    def allocate(cls, max_batch: int, max_pages: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 page_size: int, params: DashParams, dtype: torch.dtype = torch.bfloat16,
                 device="cuda", *, io: bool = True, kernel: bool = True,
                 positions: bool = False, indexer_heads: Optional[int] = None) -> "DecodeGraphBuffers":
        """Allocate for batches up to ``max_batch`` and contexts up to ``max_pages * page_size`` tokens.

        io: allocate q/k/v/out and the slot mapping (False when the engine owns them); kernel:
        allocate the Triton scratch; positions: allocate the page-mode positions; indexer_heads:
        ``Hi`` for a model that routes with an indexer (its Triton scratch routes ``iq``, router shared).
        """
        dev = torch.device(device)
        z = lambda *shape, dt=dtype: torch.zeros(*shape, dtype=dt, device=dev)
        scratch = None
        if kernel:
            scratch = DecodeBuffers.allocate(max_batch, num_q_heads, num_kv_heads, head_dim, page_size, max_pages,
                                             params, dev, indexer_heads=indexer_heads)
        return cls(
            params=params,
            block_table=z(max_batch, max_pages, dt=torch.int32),
            seq_lens=z(max_batch, dt=torch.int32),
            slot_mapping=torch.full((max_batch,), -1, dtype=torch.int64, device=dev) if io else None,
            q=z(max_batch, num_q_heads, head_dim) if io else None,
            k=z(max_batch, num_kv_heads, head_dim) if io else None,
            v=z(max_batch, num_kv_heads, head_dim) if io else None,
            out=z(max_batch, num_q_heads, head_dim) if io else None,
            kernel=scratch,
            positions=z(max_batch, dt=torch.int64) if positions else None,
        )

    @property
    def max_batch(self) -> int:
        return self.block_table.shape[0]

    def fill(self, q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor], block_table: torch.Tensor,
             seq_lens: torch.Tensor, slot_mapping: Optional[torch.Tensor]) -> int:
        """Copy a live step of ``n`` rows in place; pad rows ``n..`` (no write, zero output). Returns n.

        Shapes are checked on the host (no device reads): ``n <= max_batch`` and a page table no
        wider than the buffers'.
        """
        n = self.fill_metadata(block_table, seq_lens)
        self.q[:n].copy_(q)
        if k is not None:
            self.k[:n].copy_(k)
            self.v[:n].copy_(v)
            self.slot_mapping[:n].copy_(slot_mapping)
        else:
            self.slot_mapping[:n].fill_(-1)
        self.slot_mapping[n:].fill_(-1)
        return n

    def fill_metadata(self, block_table: torch.Tensor, seq_lens: torch.Tensor,
                      positions: Optional[torch.Tensor] = None) -> int:
        """Copy a step's page table ``[n, w]`` int32, ``seq_lens [n]`` (and ``positions [n]``) in
        place, padding rows ``n..`` (zero length) and columns ``w..``; returns n. Host-side shape
        checks only (no device reads).
        """
        n, w = block_table.shape
        if n > self.max_batch or w > self.block_table.shape[1]:
            raise ValueError(f"step of {n} rows x {w} pages does not fit graph buffers of "
                             f"{self.max_batch} x {self.block_table.shape[1]}")
        self.block_table[:n, :w].copy_(block_table, non_blocking=True)
        self.block_table[:n, w:].zero_()
        self.block_table[n:].zero_()
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        self.seq_lens[n:].zero_()
        if positions is not None:
            if self.positions is None:
                raise ValueError("positions given but the buffers were allocated without them (positions=True)")
            self.positions[:n].copy_(positions, non_blocking=True)
            self.positions[n:].zero_()
        return n

    def nbytes(self) -> int:
        """Device bytes held (inputs, output and kernel scratch)."""
        total = 0
        for f in fields(self):
            x = getattr(self, f.name)
            if isinstance(x, torch.Tensor):
                total += x.numel() * x.element_size()
        if self.kernel is not None:
            total += sum(t.numel() * t.element_size() for t in vars(self.kernel).values()
                         if isinstance(t, torch.Tensor))
        return total

    def bytes_per_slot(self) -> float:
        """``nbytes() / max_batch``: the memory one batch slot of the graph costs."""
        return self.nbytes() / self.max_batch


class CapturedDecode:
    """``paged_dash_decode`` captured in a CUDA graph for ``batch`` rows of ``buffers``.

    Writes the new K/V (and completed summaries) into ``cache`` and attends, reading only the
    static buffers: replay after ``buffers.fill`` serves any step whose batch is at most ``batch``
    and whose page table fits, whatever its lengths or pages.
    """

    def __init__(self, buffers: DecodeGraphBuffers, cache: PagedKVCache, head_cls: torch.Tensor, batch: int,
                 warmup: int = 2):
        if batch > buffers.max_batch:
            raise ValueError(f"batch {batch} exceeds the buffers' max_batch {buffers.max_batch}")
        self.buffers, self.cache, self.head_cls, self.batch = buffers, cache, head_cls, batch
        b = buffers
        # Capture with padded rows only: nothing is written to the cache during warm-up or capture.
        b.seq_lens.zero_()
        b.slot_mapping.fill_(-1)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):  # compile and autotune outside the capture
                self._launch()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._launch()

    def _launch(self) -> None:
        b, n = self.buffers, self.batch
        paged_dash_decode(b.q[:n], b.k[:n], b.v[:n], self.cache, b.block_table[:n], b.seq_lens[:n],
                          b.slot_mapping[:n], self.head_cls, b.params, out=b.out[:n], buffers=b.kernel)

    def __call__(self, q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                 block_table: torch.Tensor, seq_lens: torch.Tensor,
                 slot_mapping: Optional[torch.Tensor]) -> torch.Tensor:
        """Refill the buffers with this step and replay; returns ``out[:n]`` (a view of the buffers)."""
        if q.shape[0] > self.batch:
            raise ValueError(f"step of {q.shape[0]} rows exceeds the captured batch {self.batch}")
        n = self.buffers.fill(q, k, v, block_table, seq_lens, slot_mapping)
        self.graph.replay()
        return self.buffers.out[:n]
