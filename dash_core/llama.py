"""A Llama-shaped decoder whose attention is DASH through the public ops, or dense attention.

What a user serving a model feels is the whole step: time to first token (one prefill of the
prompt) and time per output token (one decode step), projections and MLPs included. This module
is that model with random weights, so that ``benchmarks/model.py`` and ``python -m dash_core.demo``
time the same code: the Llama-3-8B shape by default (32 layers, hidden 4096, 32 query and 8 KV
heads of 128, MLP 14336, RMSNorm, neox RoPE with theta 500000) and a small vocabulary.

Attention runs through one of three objects with the same two calls (``prepare`` before a step,
then one call per layer):

- ``DashAttention``: the adapters' path. Prefill calls ``ops.paged_dash_prefill`` with the layer's
  new K/V (the op writes them and the summaries of the blocks they complete) and one
  ``PrefillWorkspace`` per step, shared by every layer. Decode calls ``ops.paged_dash_decode`` with
  the page table, lengths and Triton scratch of a ``graphs.DecodeGraphBuffers`` filled in place
  before capture, as the SGLang backend does.
- ``DenseAttention``: the same model with a dense kernel (``PEERS``): PyTorch SDPA with the cuDNN,
  flash or math backend, FlashInfer (ragged prefill, paged decode) or FlashAttention 4. The new K/V
  are written into the same cache first (an index copy, as engines store K/V), then attended.
- ``NoAttention``: neither write nor attention (a zero output): the rest of the step, so that the
  attention's share of a step is the difference.

KV cache (``KVStore``): one SGLang-style ``[slots, Hkv, D]`` K and V buffer and summary store per
layer, so no two layers share KV and decode reads are not served by L2. Requests lie one after
another (request ``r`` owns slots ``r * S .. r * S + S - 1``, ``S`` its context rounded up to a page),
so the page table is the identity and a request's keys are also a strided ``[B, Hkv, L, D]`` view
for the SDPA peers, without copies.

Example (two tiny layers on the CPU: with the dense-equivalent parameters DASH equals dense attention)::

    >>> import torch
    >>> from dash_core import DashParams
    >>> from dash_core.llama import DashAttention, DenseAttention, KVStore, LlamaModel, LlamaShape, LlamaWeights, Step
    >>> shape = LlamaShape.tiny()
    >>> model = LlamaModel(LlamaWeights(shape, torch.float32, "cpu", seed=0))
    >>> x = torch.randn(2 * 32, shape.hidden)                      # two prompts of 32 tokens
    >>> p = DashParams.dense_equivalent(block_size=16)
    >>> logits = []
    >>> for attn in (DashAttention(p, model.weights.head_cls), DenseAttention("sdpa-math")):
    ...     store = KVStore(shape, shape.layers, batch=2, context=32, page_size=16, block_size=16,
    ...                     dtype=torch.float32, device="cpu")
    ...     step = Step.prefill(store)
    ...     attn.prepare(step)                                         # before every step
    ...     logits.append(model.forward(x, step, attn))               # [B, vocab]
    >>> bool(torch.allclose(logits[0], logits[1], atol=1e-4))
    True
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from graphs.decode import DecodeGraphBuffers

from .layout import PagedKVCache, alloc_summaries
from .ops import cache_dash_prefill, paged_dash_decode, paged_dash_prefill
from .params import DashParams
from .workspace import PrefillWorkspace

# Dense peers: PyTorch SDPA with one backend forced, FlashInfer, FlashAttention 4 (flash_attn.cute).
PEERS = ("cudnn", "sdpa", "flashinfer", "flash-attn", "sdpa-math")
# The dense peers PyTorch SDPA runs, by the backend forced (the kernel benchmarks' names: cudnn, sdpa = its flash)
SDPA_BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa": SDPBackend.FLASH_ATTENTION, "sdpa-math": SDPBackend.MATH}
FLASHINFER_WORKSPACE_BYTES = 256 << 20


@dataclass(frozen=True)
class LlamaShape:
    """The decoder's sizes (Llama-3-8B by default, with a small vocabulary)."""

    layers: int = 32
    hidden: int = 4096
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    mlp: int = 14336
    vocab: int = 1024
    rope_theta: float = 500000.0
    eps: float = 1e-5

    @classmethod
    def tiny(cls, layers: int = 2) -> "LlamaShape":
        """A few-KB model for CPU checks: hidden 64, 4 query and 2 KV heads of 16, MLP 128, vocabulary 32."""
        return cls(layers=layers, hidden=64, q_heads=4, kv_heads=2, head_dim=16, mlp=128, vocab=32,
                   rope_theta=10000.0)

    def weight_bytes_per_layer(self, esize: int) -> int:
        """Bytes of one layer's weights (projections, MLP, norms, ``head_cls``)."""
        qkv = (self.q_heads + 2 * self.kv_heads) * self.head_dim * self.hidden
        o = self.hidden * self.q_heads * self.head_dim
        mlp = 3 * self.hidden * self.mlp
        return (qkv + o + mlp + 2 * self.hidden + self.kv_heads * self.head_dim) * esize

    def kv_bytes_per_token(self, esize: int, block_size: int) -> float:
        """K + V bytes of one token in one layer, with its share of the summary store."""
        return 2 * self.kv_heads * self.head_dim * esize * (1 + 1 / (2 * block_size))


class LlamaWeights:
    """Random weights of ``layers`` layers (default ``shape.layers``), every layer its own.

    Projections are drawn with standard deviation ``1 / sqrt(fan_in)``, so that queries and keys have
    unit variance per element, as in the kernel benchmarks' synthetic inputs; norm weights are 1;
    ``head_cls [Hkv, D]`` (the DASH summary vector of each layer) is standard normal.
    Per layer: ``wqkv [(Hq + 2 Hkv) D, hidden]``, ``wo [hidden, Hq D]``, ``wgu [2 mlp, hidden]``,
    ``wd [hidden, mlp]``, ``ln1, ln2 [hidden]``; then ``norm [hidden]`` and ``lm_head [vocab, hidden]``.
    """

    def __init__(self, shape: LlamaShape, dtype: torch.dtype, device, seed: int = 0, layers: Optional[int] = None):
        self.shape, self.dtype, self.device = shape, dtype, torch.device(device)
        self.layers = shape.layers if layers is None else layers
        if self.layers < 1:
            raise ValueError(f"layers must be >= 1, got {self.layers}")
        g = torch.Generator(device=self.device).manual_seed(seed)
        s = shape

        def rand(*size, std=1.0):
            return (torch.randn(*size, generator=g, device=self.device, dtype=torch.float32) * std).to(dtype)

        ones = lambda: torch.ones(s.hidden, dtype=dtype, device=self.device)
        self.wqkv, self.wo, self.wgu, self.wd, self.ln1, self.ln2, self.head_cls = [], [], [], [], [], [], []
        for _ in range(self.layers):
            self.wqkv.append(rand((s.q_heads + 2 * s.kv_heads) * s.head_dim, s.hidden, std=s.hidden ** -0.5))
            self.wo.append(rand(s.hidden, s.q_heads * s.head_dim, std=(s.q_heads * s.head_dim) ** -0.5))
            self.wgu.append(rand(2 * s.mlp, s.hidden, std=s.hidden ** -0.5))
            self.wd.append(rand(s.hidden, s.mlp, std=s.mlp ** -0.5))
            self.ln1.append(ones())
            self.ln2.append(ones())
            self.head_cls.append(rand(s.kv_heads, s.head_dim))
        self.norm = ones()
        self.lm_head = rand(s.vocab, s.hidden, std=s.hidden ** -0.5)

    def to(self, device) -> "LlamaWeights":
        """A copy of these weights on ``device``."""
        out = object.__new__(LlamaWeights)
        out.shape, out.dtype, out.device, out.layers = self.shape, self.dtype, torch.device(device), self.layers
        for name in ("wqkv", "wo", "wgu", "wd", "ln1", "ln2", "head_cls"):
            setattr(out, name, [x.to(device) for x in getattr(self, name)])
        out.norm, out.lm_head = self.norm.to(device), self.lm_head.to(device)
        return out


class KVStore:
    """Per-layer K/V buffers ``[batch * S, Hkv, D]`` and summary stores for ``batch`` requests of up to
    ``context`` tokens each (``S`` = context rounded up to a page; request ``r`` owns slots ``r * S ..``).

    Memory: ``layers * batch * S * shape.kv_bytes_per_token(esize, block_size)`` bytes.
    """

    def __init__(self, shape: LlamaShape, layers: int, batch: int, context: int, page_size: int, block_size: int,
                 dtype: torch.dtype, device):
        if page_size % block_size:
            raise ValueError(f"page_size must be a multiple of block_size; got {page_size} and {block_size}")
        self.shape, self.layers, self.batch, self.context = shape, layers, batch, context
        self.page_size, self.block_size, self.dtype, self.device = page_size, block_size, dtype, torch.device(device)
        self.stride = -(-context // page_size) * page_size
        slots = batch * self.stride
        z = lambda: torch.zeros(slots, shape.kv_heads, shape.head_dim, dtype=dtype, device=self.device)
        self.k = [z() for _ in range(layers)]
        self.v = [z() for _ in range(layers)]
        self.summaries = [alloc_summaries(slots, block_size, shape.kv_heads, shape.head_dim, dtype, self.device)
                          for _ in range(layers)]
        pages = self.stride // page_size
        self.block_table = torch.arange(batch * pages, dtype=torch.int32, device=self.device).view(batch, pages)

    def cache(self, layer: int) -> PagedKVCache:
        """Layer ``layer`` as the ``PagedKVCache`` the ops take (SGLang's buffers viewed as pages)."""
        return PagedKVCache.from_sglang(self.k[layer], self.v[layer], self.page_size, self.summaries[layer])

    def dense_kv(self, layer: int, length: int) -> tuple:
        """The first ``length`` tokens of every request as ``[B, Hkv, length, D]`` K and V views (no copy)."""
        b, s, h, d = self.batch, self.stride, self.shape.kv_heads, self.shape.head_dim
        view = lambda x: x.view(b, s, h, d)[:, :length].transpose(1, 2)
        return view(self.k[layer]), view(self.v[layer])

    def fill_synthetic(self, head_cls: Sequence[torch.Tensor], params: DashParams, seed: int = 0,
                       chunk_tokens: int = 1 << 18) -> None:
        """Random keys and values in every slot of every layer, written with ``ops.cache_dash_prefill`` (which
        summarises every block): Gaussian keys with a per-block offset, so that some blocks stand out as
        trained keys make them, and routing is not flat (the kernel benchmarks' synthetic keys)."""
        h, d, bs = self.shape.kv_heads, self.shape.head_dim, self.block_size
        g = torch.Generator(device=self.device).manual_seed(seed)
        total = self.k[0].shape[0]
        step = max(bs, chunk_tokens // bs * bs)
        for layer in range(self.layers):
            cache = self.cache(layer)
            for s in range(0, total, step):
                n = min(step, total - s)
                k = torch.randn(n, h, d, generator=g, device=self.device, dtype=torch.float32)
                k += 0.5 * torch.randn(-(-n // bs), h, d, generator=g, device=self.device,
                                       dtype=torch.float32).repeat_interleave(bs, 0)[:n]
                v = torch.randn(n, h, d, generator=g, device=self.device, dtype=torch.float32)
                slots = torch.arange(s, s + n, device=self.device)
                cache_dash_prefill(k.to(self.dtype), v.to(self.dtype), cache, slots, params, head_cls=head_cls[layer])

    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in (*self.k, *self.v, *self.summaries))


@dataclass
class Step:
    """One model step of ``batch`` requests, each adding ``new`` tokens to reach ``context`` tokens.

    block_table ``[B, pages]`` int32, seq_lens ``[B]`` int32 (= context), cu_seqlens_q ``[B + 1]`` int32,
    slot_mapping ``[T]`` int64 and positions ``[T]`` int64 of the ``T = B * new`` new tokens (request-major),
    last_rows ``[B]`` int64: the row of each request's last new token (whose logits the step returns).
    """

    store: KVStore
    decode: bool
    batch: int
    new: int
    context: int
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    last_rows: torch.Tensor

    @classmethod
    def _make(cls, store: KVStore, new: int, context: Optional[int], decode: bool) -> "Step":
        b, dev = store.batch, store.device
        ctx = store.context if context is None else context
        if not new <= ctx <= store.stride:
            raise ValueError(f"a step of {new} new tokens to a context of {ctx}: expected new <= context <= "
                             f"{store.stride} (the store's tokens per request)")
        pos = torch.arange(ctx - new, ctx, device=dev)
        positions = pos.repeat(b)
        slot_mapping = (torch.arange(b, device=dev).repeat_interleave(new) * store.stride + positions).to(torch.int64)
        cu = torch.arange(0, (b + 1) * new, new, dtype=torch.int32, device=dev)
        return cls(store, decode, b, new, ctx, store.block_table, torch.full((b,), ctx, dtype=torch.int32, device=dev),
                   cu, slot_mapping, positions.to(torch.int64), (cu[1:] - 1).to(torch.int64))

    @classmethod
    def prefill(cls, store: KVStore, tokens: Optional[int] = None) -> "Step":
        """Every request's whole prompt of ``tokens`` tokens (default ``store.context``) in one step (TTFT)."""
        n = store.context if tokens is None else tokens
        return cls._make(store, n, n, decode=False)

    @classmethod
    def decode_step(cls, store: KVStore, context: Optional[int] = None) -> "Step":
        """One new token per request, the ``context``-th (default ``store.context``; TPOT): the ``context - 1``
        before it are in the cache."""
        return cls._make(store, 1, context, decode=True)

    @property
    def tokens(self) -> int:
        return self.batch * self.new


def rope_tables(shape: LlamaShape, positions: int, dtype: torch.dtype, device) -> tuple:
    """``(cos, sin)`` ``[positions, D / 2]`` of neox RoPE at ``shape.rope_theta`` (angles in float64)."""
    d = shape.head_dim
    inv = shape.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(positions, dtype=torch.float64)[:, None] * inv[None]
    return ang.cos().to(dtype=dtype, device=device), ang.sin().to(dtype=dtype, device=device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox RoPE of ``x [T, H, D]`` at per-token ``cos, sin [T, D / 2]``; returns a new contiguous tensor."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None], sin[:, None]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class LlamaModel:
    """The decoder over ``weights``; ``forward`` runs one step with an attention object."""

    def __init__(self, weights: LlamaWeights):
        self.weights, self.shape = weights, weights.shape
        self._rope: Optional[tuple] = None

    def rope(self, positions: int) -> tuple:
        """Cached ``rope_tables`` covering at least ``positions`` positions."""
        if self._rope is None or self._rope[0].shape[0] < positions:
            self._rope = rope_tables(self.shape, positions, self.weights.dtype, self.weights.device)
        return self._rope

    def qkv(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
        """Layer ``layer``'s attention inputs from the residual ``x [T, hidden]``: rotated ``q [T, Hq, D]``,
        ``k [T, Hkv, D]`` (contiguous) and ``v [T, Hkv, D]`` (a view of the projection)."""
        s, w = self.shape, self.weights
        t = x.shape[0]
        qkv = F.linear(F.rms_norm(x, (s.hidden,), w.ln1[layer], s.eps), w.wqkv[layer])
        nq, nk = s.q_heads * s.head_dim, s.kv_heads * s.head_dim
        q = apply_rope(qkv[:, :nq].view(t, s.q_heads, s.head_dim), cos, sin)
        k = apply_rope(qkv[:, nq: nq + nk].view(t, s.kv_heads, s.head_dim), cos, sin)
        return q, k, qkv[:, nq + nk:].view(t, s.kv_heads, s.head_dim)

    def forward(self, x: torch.Tensor, step: Step, attention, layers: Optional[int] = None) -> torch.Tensor:
        """One step: hidden states ``x [T, hidden]`` of the step's new tokens (request-major) through the first
        ``layers`` layers (default all) with ``attention`` (prepared for ``step``), the final norm and the LM
        head of each request's last new token. Returns logits ``[B, vocab]``. Device work only (no host
        reads), so a decode step can be captured in a CUDA graph."""
        s, w = self.shape, self.weights
        n = w.layers if layers is None else layers
        if n > min(w.layers, step.store.layers):
            raise ValueError(f"layers = {n} exceeds the weights' {w.layers} or the KV store's {step.store.layers}")
        cos, sin = self.rope(step.context)
        cos, sin = cos[step.positions], sin[step.positions]
        t = x.shape[0]
        for layer in range(n):
            q, k, v = self.qkv(layer, x, cos, sin)
            o = attention(layer, q, k, v)
            x = x + F.linear(o.reshape(t, s.q_heads * s.head_dim), w.wo[layer])
            gu = F.linear(F.rms_norm(x, (s.hidden,), w.ln2[layer], s.eps), w.wgu[layer])
            a = F.silu(gu[:, : s.mlp])
            a.mul_(gu[:, s.mlp:])
            del gu
            x = x + F.linear(a, w.wd[layer])
        last = F.rms_norm(x[step.last_rows], (s.hidden,), w.norm, s.eps)
        return F.linear(last, w.lm_head)


# ---------------------------------------------------------------------------------------------- attention

class DashAttention:
    """DASH through ``ops.paged_dash_prefill`` / ``ops.paged_dash_decode``, as the engine adapters call them.

    params: the DASH settings; head_cls: ``[Hkv, D]`` per layer. ``prepare(step)`` before each prefill step
    makes the step's ``PrefillWorkspace``; before a decode step (and before its graph capture) it fills a
    ``graphs.DecodeGraphBuffers`` (page table, lengths, Triton scratch shared by the layers) in place.
    """

    method = "dash"

    def __init__(self, params: DashParams, head_cls: Sequence[torch.Tensor]):
        self.params, self.head_cls = params, list(head_cls)
        self.step: Optional[Step] = None
        self.workspace: Optional[PrefillWorkspace] = None
        self.buffers = None

    def prepare(self, step: Step) -> None:
        self.step = step
        if not step.decode:
            self.workspace = PrefillWorkspace()
            return

        st, s = step.store, step.store.shape
        bufs = self.buffers
        if bufs is None or bufs.max_batch != step.batch or bufs.block_table.shape[1] != step.block_table.shape[1]:
            bufs = self.buffers = DecodeGraphBuffers.allocate(
                step.batch, step.block_table.shape[1], s.q_heads, s.kv_heads, s.head_dim, st.page_size, self.params,
                st.dtype, st.device, io=False, kernel=st.device.type == "cuda")
        bufs.fill_metadata(step.block_table, step.seq_lens)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        st = self.step
        cache = st.store.cache(layer)
        if st.decode:
            b = self.buffers
            return paged_dash_decode(q, k, v, cache, b.block_table[: st.batch], b.seq_lens[: st.batch],
                                     st.slot_mapping, self.head_cls[layer], self.params, buffers=b.kernel)
        return paged_dash_prefill(q, k, v, cache, st.block_table, st.cu_seqlens_q, st.seq_lens, st.slot_mapping,
                                  self.head_cls[layer], self.params, workspace=self.workspace)


class DenseAttention:
    """Dense causal attention with one of ``PEERS``, over the same cache.

    Every call first stores the layer's new K/V at the step's slots (``index_copy_``), then attends:
    ``cudnn``, ``sdpa`` (its flash backend) and ``sdpa-math`` with that SDPA backend forced over the requests'
    ``[B, Hkv, L, D]`` views (GQA native, ``enable_gqa``); ``flashinfer`` with a ragged prefill (planned once per
    step, as engines plan) or a paged decode wrapper in CUDA-graph mode (planned before capture); ``flash-attn``
    with ``flash_attn.cute``'s varlen call over the contiguous requests. Optional libraries are imported by
    ``prepare`` (RuntimeError naming the extra when missing).
    """

    def __init__(self, peer: str):
        if peer not in PEERS:
            raise ValueError(f"peer = {peer!r} is not a dense peer: expected one of {PEERS}")
        self.peer = peer
        self.method = f"dense-{peer}"
        self.step: Optional[Step] = None
        self._fi_ws: Optional[torch.Tensor] = None
        self._wrapper = None
        self._prefill = None
        self._cu_host: Optional[tuple] = None
        self._fn = None
        self._cu_k: Optional[torch.Tensor] = None

    def prepare(self, step: Step) -> None:
        self.step = step
        st, s = step.store, step.store.shape
        if self.peer in SDPA_BACKENDS:
            self._fn = SDPA_BACKENDS[self.peer]
        elif self.peer == "flashinfer":
            try:
                import flashinfer
            except ImportError as e:
                raise RuntimeError(f"peer flashinfer needs FlashInfer: pip install dash-serve[flashinfer] ({e})")
            dev = st.device
            if self._fi_ws is None:
                self._fi_ws = torch.empty(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
            if step.decode:  # graph mode: fixed buffers, planned here, before capture
                pages = -(-step.context // st.page_size)  # the pages the requests use
                indptr = torch.arange(step.batch + 1, dtype=torch.int32, device=dev) * pages
                indices = step.block_table[:, :pages].flatten().contiguous()
                last = torch.full((step.batch,), step.context - (pages - 1) * st.page_size, dtype=torch.int32,
                                  device=dev)
                w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    self._fi_ws, "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=indptr,
                    paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last)
                w.plan(indptr, indices, last, s.q_heads, s.kv_heads, s.head_dim, st.page_size,
                       q_data_type=st.dtype, kv_data_type=st.dtype)
            else:  # one wrapper, planned for every step (host offsets, as engines pass them)
                if st.stride != step.context:
                    raise ValueError("the ragged prefill peers need prompts that fill their pages exactly")
                if self._prefill is None:
                    self._prefill = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self._fi_ws, "NHD")
                if self._cu_host is None or self._cu_host[0] is not step:
                    self._cu_host = (step, step.cu_seqlens_q.cpu())
                w = self._prefill
                cu = self._cu_host[1]
                w.plan(cu, cu, s.q_heads, s.kv_heads, s.head_dim, causal=True, q_data_type=st.dtype,
                       kv_data_type=st.dtype)
            self._wrapper = w
        elif self.peer == "flash-attn":
            try:
                from flash_attn.cute import flash_attn_varlen_func
            except ImportError as e:
                raise RuntimeError(f"peer flash-attn needs FlashAttention 4: pip install dash-serve[flash-attn] ({e})")
            if st.stride != step.context:
                raise ValueError("the flash-attn peer needs contexts that fill their pages exactly")
            self._fn = flash_attn_varlen_func
            self._cu_k = torch.arange(0, (step.batch + 1) * st.stride, st.stride, dtype=torch.int32, device=st.device)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        st = self.step
        store = st.store
        store.k[layer].index_copy_(0, st.slot_mapping, k)
        store.v[layer].index_copy_(0, st.slot_mapping, v)
        b, new, hq, d = st.batch, st.new, q.shape[1], q.shape[2]
        if self.peer in SDPA_BACKENDS:
            kk, vv = store.dense_kv(layer, st.context)
            q4 = q.view(b, new, hq, d).transpose(1, 2)
            with sdpa_kernel([self._fn]):
                o = F.scaled_dot_product_attention(q4, kk, vv, is_causal=not st.decode, enable_gqa=True)
            return o.transpose(1, 2).reshape(b * new, hq, d)
        if self.peer == "flashinfer":
            if st.decode:
                cache = store.cache(layer)
                return self._wrapper.run(q, (cache.k_pages, cache.v_pages))
            n = b * st.context
            return self._wrapper.run(q, store.k[layer][:n], store.v[layer][:n])
        n = b * store.stride
        o = self._fn(q, store.k[layer][:n], store.v[layer][:n], cu_seqlens_q=st.cu_seqlens_q, cu_seqlens_k=self._cu_k,
                     max_seqlen_q=new, max_seqlen_k=st.context, causal=not st.decode)
        return o[0] if isinstance(o, tuple) else o


class NoAttention:
    """No K/V write and no attention: a zero output, so that a step's time without its attention is measured
    with everything else (projections, RoPE, MLPs, norms, LM head) unchanged."""

    method = "no-attention"

    def __init__(self):
        self._zeros: Optional[torch.Tensor] = None

    def prepare(self, step: Step) -> None:
        s = step.store.shape
        want = (step.tokens, s.q_heads, s.head_dim)
        z = self._zeros
        if z is None or tuple(z.shape) != want or z.dtype != step.store.dtype or z.device != step.store.device:
            self._zeros = torch.zeros(want, dtype=step.store.dtype, device=step.store.device)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self._zeros


def correlated_rows(batch: int, n: int, dim: int, rho: float, generator: torch.Generator,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[batch * n, dim]`` hidden states, each request an AR(1) walk over its ``n`` positions
    (``y_t = rho y_{t-1} + sqrt(1 - rho^2) e_t``, unit variance): neighbouring tokens alike, as in the
    prefill benchmark's queries, so that the model's queries and keys are too (``rho = 0``: independent)."""
    dev = generator.device
    e = torch.randn(batch, n, dim, generator=generator, device=dev, dtype=torch.float32)
    if rho == 0 or n == 1:
        return e.reshape(batch * n, dim).to(dtype)
    c = math.sqrt(1 - rho * rho)
    chunk = 64
    j = torch.arange(chunk, device=dev, dtype=torch.float32)
    gap = j[:, None] - j[None, :]
    mix = torch.where(gap >= 0, c * rho ** gap.clamp(min=0), torch.zeros_like(gap))  # [chunk, chunk]
    carry = rho ** (j + 1)  # [chunk]
    out = torch.empty_like(e)
    out[:, 0] = e[:, 0]
    prev = e[:, 0]
    for t0 in range(1, n, chunk):
        m = min(chunk, n - t0)
        y = torch.matmul(mix[:m, :m], e[:, t0: t0 + m]) + carry[:m, None] * prev[:, None]
        out[:, t0: t0 + m] = y
        prev = y[:, -1]
    return out.reshape(batch * n, dim).to(dtype)


def attention_for(method: str, params: Optional[DashParams] = None,
                  head_cls: Optional[List[torch.Tensor]] = None):
    """The attention object of a record's ``method``: ``"dash"``, ``"dense-<peer>"`` or ``"no-attention"``."""
    if method == "dash":
        if params is None or head_cls is None:
            raise ValueError("method 'dash' needs params and head_cls")
        return DashAttention(params, head_cls)
    if method == "no-attention":
        return NoAttention()
    if method.startswith("dense-"):
        return DenseAttention(method[len("dense-"):])
    raise ValueError(f"method = {method!r}: expected 'dash', 'dense-<peer>' (peers {PEERS}) or 'no-attention'")
