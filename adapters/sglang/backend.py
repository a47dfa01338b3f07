"""``DashAttnBackend``: SGLang 0.5.23's attention-backend interface over the ``dash_core`` ops.

Each step turns SGLang's batch into ``dash_core`` arguments once (``init_forward_metadata``);
each layer then views its K/V buffers and summary store as a ``PagedKVCache`` and calls
``paged_dash_prefill`` / ``paged_dash_decode``, which write the new K/V and the summaries of
completed blocks, then attend. No attention math lives here.

Mapping (n requests, T new tokens):

    block_table [n, pages] int32      = req_to_token[req_pool_indices, ::page_size] // page_size (eager: the
                                        pages of the longest request; graphs: max_pages)
    seq_lens    [n] int32             = forward_batch.seq_lens (KV length including this step)
    cu_seqlens_q [n + 1] int32        = cumsum of extend_seq_lens (decode: 0, 1, .., n)
    slot_mapping [T] int64            = forward_batch.out_cache_loc
    head_cls    [Hkv_local, D]        = keyword from the model (``DashLlamaForCausalLM``)

The summary store (one ``[slots // block_size, Hkv, D]`` tensor per layer) hangs on the KV pool
as ``pool.dash_summaries``, so every backend instance over one pool (two-batch overlap, draft
runners, PD multiplexing) shares it, and radix-cache pages shared between requests share their
summaries. Its bytes are added to SGLang's per-token KV cost by the plugin's pool-sizing hook.

CUDA graphs (decode): ``init_cuda_graph_state`` allocates ``graphs.decode.DecodeGraphBuffers``
once (block table, lengths and the Triton decode scratch), sized by the largest captured batch and
the longest context; ``init_forward_metadata_out_graph`` refills them in place before capture and
before every replay, so captured kernels always read the same addresses. Padded rows arrive with
``req_pool_indices = 0`` and ``seq_lens = 1``: one token in the padding page.

Indexer and page mode (docs/semantics.md section 9, ``dash_core.model_config.AuxConfig``): the auxiliary head, one
``[slots, 2D]`` buffer per layer, hangs on the pool as ``pool.dash_aux`` next to the summary store
(one head for an indexer model: summaries of ``ik``). The model passes ``iq``, ``ik`` and
``head_cls_i`` as keywords; in page mode the backend adds ``roles`` (from the placeholder token ids
of ``forward_batch.input_ids``, extend only), ``positions`` (``forward_batch.positions``; a static
graph buffer in captured decode) and the model's ``PageRopeSettings``.

Attention-stage backend (``DashParams.attention_backend``: ``TRITON``, ``FLASHINFER``,
``FLASH_ATTN``): the model config's ``dash_attention_backend`` (``--json-model-override-args``), or
the environment variable ``DASH_ATTENTION_BACKEND``, which wins when set; read once when the
backend is built (``dash_core.model_config.serving_params``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import torch

from dash_core.layout import (
    PagedKVCache,
    alloc_aux_sglang,
    alloc_summaries,
    block_table_from_req_to_token,
    check_page_size,
    kept_while_same,
)
from dash_core.limits import OP_DTYPES, uses_kernels
from dash_core.ops import paged_dash_decode, paged_dash_prefill
from dash_core.model_config import AuxConfig, serving_params, serving_summary
from dash_core.workspace import PrefillWorkspace
from graphs.decode import DecodeGraphBuffers
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.runtime_context import get_parallel

from .startup import page_mode_problems, reject

logger = logging.getLogger(__name__)

PAGE_SIZE_FLAG = "--page-size"


@dataclass
class DashForwardMetadata:
    """One step's batch in ``dash_core`` terms (see the module docstring for shapes)."""

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: Optional[torch.Tensor]  # None for captured decode (the decode op takes none)
    graph: bool = False  # built by init_forward_metadata_out_graph: views of the static graph buffers
    positions: Optional[torch.Tensor] = None  # page mode: [T] int64, forward_batch.positions
    roles: Optional[torch.Tensor] = None  # page mode, extend: [T] int64 from the placeholder token ids
    # extend: the plan and routing scratch the batch's layers share (made by the first layer's call)
    workspace: PrefillWorkspace = field(default_factory=PrefillWorkspace)


def summary_store(pool, block_size: int, heads: Optional[int] = None) -> list:
    """The per-layer summary stores attached to SGLang's KV ``pool``, allocated on first use.

    Returns ``pool.dash_summaries``: one ``[(pool.size + page_size) // block_size, heads, D]``
    tensor per layer of the pool, in the pool's dtype, zeroed (index 0 = the padding page);
    ``heads`` is ``Hkv`` by default, 1 for a model with an indexer (summaries of ``ik``).
    """
    heads = pool.head_num if heads is None else heads
    store = getattr(pool, "dash_summaries", None)
    if store is not None:
        if pool.dash_block_size != block_size or store[0].shape[1] != heads:
            raise ValueError(f"the KV pool already holds DASH summaries for block size {pool.dash_block_size} and "
                             f"{store[0].shape[1]} head(s); a second backend asked for {block_size} and {heads}")
        return store
    num_slots = pool.size + pool.page_size
    store = [alloc_summaries(num_slots, block_size, heads, pool.head_dim, pool.dtype, pool.device)
             for _ in range(pool.layer_num)]
    pool.dash_summaries, pool.dash_block_size = store, block_size
    nbytes = sum(s.numel() * s.element_size() for s in store)
    logger.info("DASH summary store: %d layers x %s %s, %.2f MB (block size %d)", pool.layer_num,
                tuple(store[0].shape), pool.dtype, nbytes / 2**20, block_size)
    return store


def aux_store(pool) -> list:
    """The per-layer auxiliary heads attached to SGLang's KV ``pool`` (``pool.dash_aux``), allocated on
    first use: one ``[pool.size + page_size, 2D]`` buffer per layer in the pool's dtype, indexed by the
    same slot as K and V (``dash_core.layout.alloc_aux_sglang``)."""
    store = getattr(pool, "dash_aux", None)
    if store is None:
        num_slots = pool.size + pool.page_size
        store = [alloc_aux_sglang(num_slots, pool.head_dim, pool.dtype, pool.device) for _ in range(pool.layer_num)]
        pool.dash_aux = store
        nbytes = sum(a.numel() * a.element_size() for a in store)
        logger.info("DASH auxiliary head: %d layers x %s %s, %.2f MB", pool.layer_num, tuple(store[0].shape),
                    pool.dtype, nbytes / 2**20)
    return store


class DashAttnBackend(AttentionBackend):
    """DASH sparse attention for SGLang (``--attention-backend dash``).

    ``DashParams`` come from the model's HF config (``chunk_size``, ``scaling_factor``, ``sigma``,
    ``estimate_diagonal``, ``dash_topk``, ``dash_local``, ``dash_router``); the page size must be a
    multiple of the DASH block size (``--page-size``).
    """

    takes_head_cls = True  # DashLlamaAttention passes head_cls= only to backends that declare this

    def __init__(self, model_runner):
        super().__init__()
        self.device = model_runner.device
        self.page_size = model_runner.page_size or 1
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.params = serving_params(model_runner.model_config.hf_config)
        self.num_q_heads = model_runner.model_config.get_num_attention_heads(self._attn_tp_size())
        check_page_size(self.page_size, self.params.block_size, PAGE_SIZE_FLAG)
        if uses_kernels(self.device, self.token_to_kv_pool.dtype):  # the kernels' block sizes (dash_core.limits)
            self.params.check_kernel_support()
        self.aux = AuxConfig.from_config(model_runner.model_config.hf_config)
        self._validate_runner(model_runner)
        self.summaries = summary_store(self.token_to_kv_pool, self.params.block_size, self.aux.summary_heads)
        self.aux_rows = aux_store(self.token_to_kv_pool) if self.aux.needs_aux else None
        self._views: dict = {}  # layer index -> its K and V buffers and their PagedKVCache (_cache)
        self.max_context_len = self.req_to_token_pool.req_to_token.shape[1]
        self.max_pages = -(-self.max_context_len // self.page_size)
        self.forward_metadata: Optional[DashForwardMetadata] = None
        self.graph_buffers: Optional[DecodeGraphBuffers] = None  # made by init_cuda_graph_state
        # The one start-up line: the path DASH takes on this device and dtype, and its settings.
        logger.info("%s", serving_summary(self.params, self.device, self.token_to_kv_pool.dtype, self.aux,
                                          self.page_size))

    # ---- start-up checks -------------------------------------------------------------------

    def _validate_runner(self, runner) -> None:
        pool = self.token_to_kv_pool
        dtype = getattr(pool, "dtype", None)
        if dtype not in OP_DTYPES or getattr(pool, "store_dtype", dtype) != dtype:
            raise reject(f"KV cache dtype {dtype}", f"use --kv-cache-dtype auto with one of {OP_DTYPES}")
        for name in ("get_key_buffer", "get_value_buffer", "head_num", "head_dim", "size", "layer_num"):
            if not hasattr(pool, name):
                raise reject(f"the KV pool {type(pool).__name__}", "DASH needs SGLang's MHA token-to-KV pool")
        k0 = pool.get_key_buffer(pool.start_layer)
        if k0.dim() != 3 or tuple(k0.shape[1:]) != (pool.head_num, pool.head_dim):
            raise reject(f"the KV buffer layout {tuple(k0.shape)}",
                         "DASH reads token-major [slots, Hkv, D] buffers (unset SGLANG_USE_HND_KVCACHE and "
                         "--enable-page-major-kv-layout)")
        translator = getattr(runner, "kv_index_translator", None)
        if translator is not None and getattr(translator, "reads_are_translated", False):
            raise reject("the unified KV pool (--enable-unified-memory)",
                         "its slots are virtual and need translation DASH does not do")
        self.kv_index_translator = translator
        spec = getattr(runner, "spec_algorithm", None)
        if spec is not None and not spec.is_none():
            raise reject(f"speculative decoding ({spec})", "TARGET_VERIFY / draft batches are not implemented")
        names = {getattr(runner, "prefill_attention_backend_str", None) or "dash",
                 getattr(runner, "decode_attention_backend_str", None) or "dash"}
        if names != {"dash"}:
            raise reject(f"a hybrid prefill/decode backend pair {sorted(names)}",
                         "DASH must see every K/V write to keep its block summaries; use "
                         "--attention-backend dash for both")
        model = getattr(runner, "model", None)
        if getattr(model, "config", None) is not None and not getattr(model, "dash_layers", None):
            raise reject(f"the model {type(model).__name__}",
                         "it passes no head_cls to attention; serve a DASH checkpoint "
                         "(\"architectures\": [\"DashLlamaForCausalLM\"])")
        self.page_rope = None
        if self.aux.page_mode:
            self.page_rope = getattr(model, "dash_page_rope", None)
            if self.page_rope is None:
                raise reject(f"page mode with the model {type(model).__name__}",
                             "it does not hand unrotated q/k and its page RoPE settings to DASH; serve "
                             "DashLlamaForCausalLM")
            self._check_page_mode_args(runner)
        tp = self._attn_tp_size()
        if self.params.router == "shared" and tp > 1:
            raise reject(f"router 'shared' with attention tensor parallelism {tp}",
                         "its block selection averages routing probabilities over all query heads, which "
                         "would need an all-reduce across ranks every layer; use router 'kv_head'")

    @staticmethod
    def _check_page_mode_args(runner) -> None:
        """Page mode prefills each prompt in one chunk and keeps decode tokens out of extend batches."""
        args = getattr(runner, "server_args", None)
        context = getattr(getattr(runner, "model_config", None), "context_len", None)
        problems = page_mode_problems(getattr(args, "chunked_prefill_size", None), context,
                                      getattr(args, "enable_mixed_chunk", False))
        if problems:
            raise reject(*problems[0])
        if args is not None and not getattr(args, "disable_radix_cache", True):
            logger.warning("DASH page mode with the radix cache: a prefix hit is exact only when the cached part "
                           "has the coordinates the new prompt gives it (docs/sglang.md, 'Indexer and page mode'); "
                           "pass --disable-radix-cache when prompts with different pages share leading tokens")

    @staticmethod
    def _attn_tp_size() -> int:
        try:
            return int(get_parallel().attn_tp_size)
        except Exception:
            return 1

    # ---- metadata --------------------------------------------------------------------------

    def _check_mode(self, mode) -> None:
        if mode.is_target_verify() or mode.is_draft_extend_v2():
            raise NotImplementedError(f"attention backend 'dash' does not support {mode.name} "
                                      f"(speculative decoding)")
        if mode.is_dllm_extend() or mode.is_split_prefill():
            raise NotImplementedError(f"attention backend 'dash' does not support {mode.name}")

    def _block_table(self, req_pool_indices: torch.Tensor, num_pages: int) -> torch.Tensor:
        rows = self.req_to_token_pool.req_to_token[req_pool_indices.long(), : num_pages * self.page_size]
        return block_table_from_req_to_token(rows, self.page_size)

    def init_forward_metadata(self, forward_batch) -> None:
        """Eager path: build this step's block table, lengths and query offsets."""
        mode = forward_batch.forward_mode
        if mode.is_idle():
            self.forward_metadata = None
            return
        self._check_mode(mode)
        n = forward_batch.batch_size
        lens_cpu = forward_batch.seq_lens_cpu
        max_len = int(lens_cpu.max()) if lens_cpu is not None and n else self.max_context_len
        if max_len > self.max_context_len:
            raise ValueError(f"sequence length {max_len} exceeds the context length {self.max_context_len} "
                             f"the request table was sized for")
        num_pages = max(1, -(-max_len // self.page_size))
        seq_lens = forward_batch.seq_lens.to(torch.int32)
        if mode.is_decode():
            cu = torch.arange(n + 1, dtype=torch.int32, device=seq_lens.device)
        else:
            cu = torch.zeros(n + 1, dtype=torch.int32, device=seq_lens.device)
            cu[1:] = torch.cumsum(forward_batch.extend_seq_lens, 0)
        positions = roles = None
        if self.page_rope is not None:
            positions = forward_batch.positions
            if not mode.is_decode():
                roles = self.aux.roles(forward_batch.input_ids)
        self.forward_metadata = DashForwardMetadata(
            self._block_table(forward_batch.req_pool_indices, num_pages), seq_lens, cu, positions=positions,
            roles=roles)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Static decode buffers (``graphs.decode.DecodeGraphBuffers``): block table ``[max_bs, max_pages]``,
        lengths and the Triton decode scratch, shared by every layer (they run one after another)."""
        pool = self.token_to_kv_pool
        # SGLang owns q, k, v, the output and out_cache_loc; the Triton scratch is needed where decode runs it.
        self.graph_buffers = DecodeGraphBuffers.allocate(
            max_bs, self.max_pages, self.num_q_heads, pool.head_num, pool.head_dim, self.page_size, self.params,
            pool.dtype, self.device, io=False, kernel=torch.device(self.device).type == "cuda",
            positions=self.page_rope is not None, indexer_heads=self.aux.indexer_heads)
        logger.info("DASH decode graph buffers: %.2f MB (%d bytes per batch slot)",
                    self.graph_buffers.nbytes() / 2**20, int(self.graph_buffers.bytes_per_slot()))

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        """Refill the static decode buffers in place (before capture and before every replay).

        ``forward_batch`` may be SGLang's replay view (a ``SimpleNamespace`` without methods).
        """
        mode = forward_batch.forward_mode
        self._check_mode(mode)
        if not mode.is_decode():
            raise NotImplementedError(f"attention backend 'dash' captures decode graphs only, got {mode.name}")
        bs, bufs = forward_batch.batch_size, self.graph_buffers
        if bufs is None or bs > bufs.max_batch:
            raise ValueError(f"graph batch size {bs} exceeds init_cuda_graph_state's max_bs "
                             f"{0 if bufs is None else bufs.max_batch}")
        rows = self.req_to_token_pool.req_to_token[forward_batch.req_pool_indices[:bs].long()]
        page_mode = self.page_rope is not None
        bufs.fill_metadata(block_table_from_req_to_token(rows, self.page_size), forward_batch.seq_lens[:bs],
                           forward_batch.positions[:bs] if page_mode else None)
        self.forward_metadata = DashForwardMetadata(bufs.block_table[:bs], bufs.seq_lens[:bs], None, graph=True,
                                                    positions=bufs.positions[:bs] if page_mode else None)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """Padded graph rows get one KV token (in the padding page), as SGLang's own backends."""
        return 1

    # ---- forward ---------------------------------------------------------------------------

    def _cache(self, layer) -> PagedKVCache:
        """The ``PagedKVCache`` views of ``layer``'s buffers, kept while the pool hands out the same K and V tensors
        (so what the kernels derive from a cache alone, its checks, write arguments and TMA descriptors, is made
        once)."""
        pool = self.token_to_kv_pool
        i = layer.layer_id - pool.start_layer
        k, v = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        return kept_while_same(self._views, i, (k, v), lambda: PagedKVCache.from_sglang(
            k, v, self.page_size, self.summaries[i], aux=None if self.aux_rows is None else self.aux_rows[i]))

    def _aux_args(self, op, layer, md: DashForwardMetadata, iq, ik, head_cls_i, d: int) -> dict:
        """The ops' indexer and page-mode keywords for this layer (empty for a plain model)."""
        kw = {}
        if self.aux.indexer_heads is not None:
            if iq is None or head_cls_i is None:
                raise ValueError(f"layer {layer.layer_id}: the model config has dash_indexer_heads = "
                                 f"{self.aux.indexer_heads} but the model passed no iq/head_cls_i; serve "
                                 f"DashLlamaForCausalLM")
            kw.update(iq=iq.reshape(iq.shape[0], -1, d), ik=None if ik is None else ik.reshape(-1, d),
                      head_cls_i=head_cls_i)
        if self.page_rope is not None:
            kw.update(page_rope=self.page_rope, positions=md.positions)
            if op is paged_dash_prefill:
                kw["roles"] = md.roles
        return kw

    def _run(self, op, q, k, v, layer, forward_batch, save_kv_cache, head_cls, iq=None, ik=None, head_cls_i=None):
        if head_cls is None:
            raise ValueError(f"attention backend 'dash' needs head_cls [Hkv, D] from the model (layer "
                             f"{layer.layer_id} passed none); serve a DASH model such as DashLlamaForCausalLM")
        if getattr(layer, "is_cross_attention", False) or getattr(layer, "sliding_window_size", -1) not in (None, -1) \
                or getattr(layer, "logit_cap", 0) not in (None, 0, 0.0):
            raise reject(f"layer {layer.layer_id}'s attention type",
                         "cross attention, sliding windows and logit caps are not part of DASH")
        md = self.forward_metadata
        hq, hkv, d = layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim
        q3 = q.reshape(-1, hq, d)
        cache = self._cache(layer)
        # K/V and summaries are written together by the op. When the model already stored K/V
        # (save_kv_cache=False) the op rewrites the same values, which keeps the summaries current.
        if k is not None:
            k, v, slots = k.reshape(-1, hkv, d), v.reshape(-1, hkv, d), forward_batch.out_cache_loc
        elif save_kv_cache:
            raise ValueError(f"layer {layer.layer_id}: save_kv_cache=True but k/v are None")
        else:
            v = slots = None
        extra = self._aux_args(op, layer, md, iq, ik, head_cls_i, d)
        if k is None:
            extra.pop("ik", None)  # K/V (and ik) were written already
        if op is paged_dash_decode and md.graph:
            extra["buffers"] = self.graph_buffers.kernel  # the captured graph's Triton scratch (None on the CPU)
        if op is paged_dash_prefill:
            extra["workspace"] = md.workspace
        out = op(q3, k, v, cache, md.block_table, *_op_lens(op, md), slots, head_cls, self.params, **extra)
        return out.view(-1, hq * d)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, head_cls=None, iq=None, ik=None,
                       head_cls_i=None, **kwargs):
        """Prefill, chunked prefill and mixed batches: ``q [T, Hq * D]`` -> ``[T, Hq * D]``.

        An indexer model also passes ``iq [T, Hi * D]``, ``ik [T, D]`` and ``head_cls_i [D]``.
        """
        return self._run(paged_dash_prefill, q, k, v, layer, forward_batch, save_kv_cache, head_cls, iq, ik,
                         head_cls_i)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, head_cls=None, iq=None, ik=None,
                       head_cls_i=None, **kwargs):
        """One token per request: ``q [n, Hq * D]`` -> ``[n, Hq * D]`` (indexer inputs as ``forward_extend``)."""
        return self._run(paged_dash_decode, q, k, v, layer, forward_batch, save_kv_cache, head_cls, iq, ik,
                         head_cls_i)


def _op_lens(op, md: DashForwardMetadata) -> tuple:
    """The length arguments each op takes after ``block_table``."""
    if op is paged_dash_decode:
        return (md.seq_lens,)
    return (md.cu_seqlens_q, md.seq_lens)
