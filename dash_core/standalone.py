"""DASH outside the serving engines: a Hugging Face style cache and attention call.

``DashKVCache`` owns K/V pages and the summary store for every layer of a fixed batch;
``dash_attention`` appends a step's keys and values (a whole prompt, a chunk of one, or one
decoded token per sequence) and attends under causal DASH through the same ops the engines use,
so it runs the Triton kernels on a GPU and the PyTorch paged path on the CPU.

Example (prefill 40 tokens, then decode one, equal to the oracle on all 41)::

    >>> import torch
    >>> from dash_core import DashParams, dash_reference
    >>> from dash_core.standalone import DashKVCache, dash_attention
    >>> p = DashParams(block_size=16, scaling_factor=2.0)
    >>> q, k, v = torch.randn(2, 4, 41, 32), torch.randn(2, 2, 41, 32), torch.randn(2, 2, 41, 32)
    >>> hc = torch.randn(2, 32)
    >>> cache = DashKVCache(num_layers=1, batch_size=2, max_length=64, num_kv_heads=2, head_dim=32, params=p)
    >>> o1 = dash_attention(q[:, :, :40], k[:, :, :40], v[:, :, :40], hc, cache, layer=0)
    >>> o2 = dash_attention(q[:, :, 40:], k[:, :, 40:], v[:, :, 40:], hc, cache, layer=0)
    >>> ref, _ = dash_reference(q, k, v, hc, p)
    >>> bool(torch.allclose(torch.cat([o1, o2], dim=2), ref, atol=1e-5))
    True

The cache is contiguous per sequence (its page table is the identity), so it is also the
"contiguous cache" form; any other page table can be used through ``dash_core.ops`` directly.

Models with an indexer or page mode (docs/semantics.md section 9): ``DashKVCache(..., indexer=True)`` or
``aux=True`` adds the auxiliary head (and a 1-head summary store for the indexer), and
``dash_attention`` takes ``iq, ik, head_cls_i`` and ``roles, page_rope`` (the README has a worked
example). In page mode q, k, iq, ik are passed unrotated and a prompt goes in one call.
"""

from __future__ import annotations

from typing import Optional

import torch

from .layout import PagedKVCache, alloc_aux_sglang, alloc_summaries
from .ops import paged_dash_decode, paged_dash_prefill
from .params import DashParams
from .rope import PageRopeSettings
from .workspace import PrefillWorkspace


class DashKVCache:
    """K/V pages and summaries for ``num_layers`` layers of ``batch_size`` equal-length sequences.

    Memory per layer: ``2 * batch_size * max_length * Hkv * D`` elements of K/V plus
    ``1 / (2 * block_size)`` of that for summaries. Lengths are tracked on the host per layer,
    so a step never reads a device value. indexer: the model routes with an indexer (summaries of
    ``ik``, one head); aux: the auxiliary head (implied by ``indexer``; needed by page mode), which
    adds ``1 / Hkv`` of the K/V memory.
    """

    def __init__(self, num_layers: int, batch_size: int, max_length: int, num_kv_heads: int, head_dim: int,
                 params: DashParams, dtype: torch.dtype = torch.float32, device=None,
                 page_size: Optional[int] = None, *, indexer: bool = False, aux: bool = False):
        self.params = params
        self.page_size = page_size or params.block_size
        self.pages_per_seq = -(-max_length // self.page_size)
        self.max_length = max_length
        slots = batch_size * self.pages_per_seq * self.page_size
        shape = (num_layers, slots, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        heads = 1 if indexer else num_kv_heads
        self.summaries = torch.stack([alloc_summaries(slots, params.block_size, heads, head_dim, dtype, device)
                                      for _ in range(num_layers)])
        self.aux = (torch.stack([alloc_aux_sglang(slots, head_dim, dtype, device) for _ in range(num_layers)])
                    if indexer or aux else None)
        self.block_table = torch.arange(batch_size * self.pages_per_seq, dtype=torch.int32,
                                        device=device).view(batch_size, self.pages_per_seq)
        self.lengths = [0] * num_layers
        self._step: Optional[tuple] = None  # (start, new tokens, device) -> the step's inputs of every layer

    @property
    def batch_size(self) -> int:
        return self.block_table.shape[0]

    def layer(self, i: int) -> PagedKVCache:
        """The ``PagedKVCache`` view of layer ``i``."""
        return PagedKVCache.from_sglang(self.k[i], self.v[i], self.page_size, self.summaries[i],
                                        aux=None if self.aux is None else self.aux[i])

    def reset(self) -> None:
        """Forget every sequence (the memory is reused)."""
        self.lengths = [0] * len(self.lengths)
        self._step = None

    def step_inputs(self, start: int, new: int, device) -> tuple:
        """``seq_lens [B]``, ``cu_seqlens_q [B + 1]`` and the ``PrefillWorkspace`` of a step that appends ``new``
        tokens after ``start``: made by its first layer, shared by the layers after it (the same tensors, so
        the prefill plan and scratch are made once per step)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" names the current device, as q.device would
            device = torch.device("cuda", torch.cuda.current_device())
        key = (start, new, device)
        if self._step is None or self._step[0] != key:
            b = self.batch_size
            seq_lens = torch.full((b,), start + new, dtype=torch.int32, device=device)
            cu = torch.arange(0, (b + 1) * new, new, dtype=torch.int32, device=device)
            self._step = (key, seq_lens, cu, PrefillWorkspace())
        return self._step[1:]


def dash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_cls: Optional[torch.Tensor],
                   cache: DashKVCache, layer: int, *, iq: Optional[torch.Tensor] = None,
                   ik: Optional[torch.Tensor] = None, head_cls_i: Optional[torch.Tensor] = None,
                   roles: Optional[torch.Tensor] = None,
                   page_rope: Optional[PageRopeSettings] = None) -> torch.Tensor:
    """Append ``k, v [B, Hkv, S, D]`` to layer ``layer`` of ``cache`` and attend with ``q [B, Hq, S, D]``.

    The S new tokens of every sequence sit at positions ``L .. L + S - 1`` after the ``L`` tokens
    already cached. Returns ``[B, Hq, S, D]`` in ``q.dtype``.
    Indexer: iq ``[B, Hi, S, D]``, ik ``[B, S, D]``, head_cls_i ``[D]`` (``head_cls`` unused). Page mode:
    page_rope with roles ``[B, S]`` for a prompt (None for decode steps); q, k, iq, ik unrotated.
    """
    b, hq, s, d = q.shape
    if b != cache.batch_size:
        raise ValueError(f"q has batch {b}, the cache was made for {cache.batch_size}")
    start = cache.lengths[layer]
    if start + s > cache.max_length:
        raise ValueError(f"sequence length {start + s} exceeds the cache's max_length {cache.max_length}")
    dev = q.device
    pos = torch.arange(start, start + s, device=dev)
    ps = cache.page_size
    slots = (cache.block_table[:, pos // ps].long() * ps + pos % ps).reshape(-1)  # [B * S]
    seq_lens, cu, workspace = cache.step_inputs(start, s, dev)
    flat = lambda x: x.permute(0, 2, 1, 3).reshape(b * s, x.shape[1], d)
    view = cache.layer(layer)
    extra = {}
    if iq is not None or ik is not None or head_cls_i is not None:
        extra.update(iq=None if iq is None else flat(iq), ik=None if ik is None else ik.reshape(b * s, d),
                     head_cls_i=head_cls_i)
    if page_rope is not None:
        extra.update(page_rope=page_rope, positions=pos.repeat(b))
        if roles is not None:
            extra["roles"] = roles.reshape(b * s)
    elif roles is not None:
        raise ValueError("roles are given without page_rope: page mode needs page_rope (PageRopeSettings)")
    if s == 1 and roles is None:
        out = paged_dash_decode(flat(q), flat(k), flat(v), view, cache.block_table, seq_lens, slots, head_cls,
                                cache.params, **extra)
    else:
        out = paged_dash_prefill(flat(q), flat(k), flat(v), view, cache.block_table, cu, seq_lens, slots, head_cls,
                                 cache.params, workspace=workspace, **extra)
    cache.lengths[layer] = start + s
    return out.view(b, s, hq, d).permute(0, 2, 1, 3)
