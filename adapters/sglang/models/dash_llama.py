"""``DashLlamaForCausalLM``: SGLang's Llama plus the per-layer DASH weight ``head_cls``.

Checkpoint (SPEC.md section 1): a Llama checkpoint whose ``config.json`` says
``"architectures": ["DashLlamaForCausalLM"]`` (``model_type`` stays ``llama``) and carries the DASH
keys (``chunk_size``, ``scaling_factor``, ``sigma``, ``estimate_diagonal``, ``dash_*``), and one
extra tensor per layer, ``model.layers.{i}.self_attn.indexer_q``, a flat ``[Hkv * D]`` vector.

Each attention layer keeps ``head_cls [Hkv_local, D]``, the rows of the KV heads this
tensor-parallel rank holds (the rows ``QKVParallelLinear`` gives it for ``k_proj``; replicated
where SGLang replicates KV heads), and passes it to the attention backend as a keyword:
``self.attn(q, k, v, forward_batch, head_cls=self.head_cls)``. Under another attention backend
(e.g. ``torch_native``, which takes no extra keywords) the weight is loaded but not passed, and
attention is dense: the engine's own dense run of the same checkpoint.
"""

from __future__ import annotations

from typing import Iterable, Tuple

import torch
from torch import nn

from sglang.srt.distributed.utils import get_group_rank_size
from sglang.srt.model_executor.forward_context import get_attn_backend
from sglang.srt.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM

CHECKPOINT_NAME = "self_attn.indexer_q"  # the published per-layer DASH weight
PARAM_NAME = "self_attn.head_cls"


def _backend_takes_head_cls() -> bool:
    """Whether the attention backend of the running forward is DASH's (it declares ``takes_head_cls``)."""
    return getattr(get_attn_backend(), "takes_head_cls", False)


class DashLlamaAttention(LlamaAttention):
    """Llama attention that hands ``head_cls`` to the attention backend.

    Built from a ``LlamaAttention`` by ``DashLlamaAttention.adopt`` (SGLang's ``LlamaModel``
    constructs its layers itself, so the DASH parameter is added to each one afterwards).
    """

    head_cls: nn.Parameter

    @classmethod
    def adopt(cls, attn: LlamaAttention) -> "DashLlamaAttention":
        """Turn ``attn`` into a ``DashLlamaAttention`` in place with a ``head_cls [Hkv_local, D]`` parameter."""
        attn.__class__ = cls
        dtype = attn.qkv_proj.weight.dtype if attn.qkv_proj.weight.is_floating_point() else None
        attn.head_cls = nn.Parameter(torch.zeros(attn.num_kv_heads, attn.head_dim, dtype=dtype,
                                                 device=attn.qkv_proj.weight.device), requires_grad=False)
        attn.head_cls.weight_loader = attn.load_head_cls
        return attn

    def head_cls_rows(self) -> Tuple[int, int]:
        """``(first, count)``: the rows of the checkpoint's ``[Hkv, D]`` this rank keeps.

        Follows ``QKVParallelLinear``'s K shard exactly: KV heads are split across the KV
        tensor-parallel group, or replicated ``num_kv_head_replicas`` times when there are fewer
        KV heads than ranks.
        """
        qkv = self.qkv_proj
        kv_rank, _ = get_group_rank_size(qkv.kv_tp_group)
        shard = kv_rank // qkv.num_kv_head_replicas
        return shard * qkv.num_kv_heads, qkv.num_kv_heads

    def load_head_cls(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Weight loader: checkpoint ``indexer_q [Hkv * D]`` (or ``[Hkv, D]``) -> this rank's rows."""
        total = self.total_num_kv_heads * self.head_dim
        if loaded_weight.numel() != total:
            raise ValueError(f"DASH weight {CHECKPOINT_NAME} of layer {self.attn.layer_id} has shape "
                             f"{tuple(loaded_weight.shape)}; expected [{self.total_num_kv_heads} * {self.head_dim}] "
                             f"(num_key_value_heads * head_dim)")
        first, count = self.head_cls_rows()
        rows = loaded_weight.reshape(self.total_num_kv_heads, self.head_dim)[first: first + count]
        param.data.copy_(rows.to(param.dtype))

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch) -> torch.Tensor:
        q, k, v = self.forward_prepare_native(positions=positions, hidden_states=hidden_states)
        if _backend_takes_head_cls():
            attn_output = self.attn(q, k, v, forward_batch, head_cls=self.head_cls)
        else:
            attn_output = self.attn(q, k, v, forward_batch)
        output, _ = self.o_proj(attn_output)
        return output


class DashLlamaForCausalLM(LlamaForCausalLM):
    """Llama with DASH attention: loads ``indexer_q`` per layer as ``head_cls``."""

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        super().__init__(config, quant_config=quant_config, prefix=prefix)
        self.dash_layers = {}
        for layer in self.model.layers:
            if isinstance(layer, LlamaDecoderLayer):
                attn = DashLlamaAttention.adopt(layer.self_attn)
                self.dash_layers[attn.attn.layer_id] = attn

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]):
        """Llama's loader, with ``...self_attn.indexer_q`` loaded into ``...self_attn.head_cls``.

        Raises ``ValueError`` when a layer of this rank got no DASH weight.
        """
        seen = set()

        def renamed():
            for name, tensor in weights:
                if name.endswith(CHECKPOINT_NAME):
                    name = name[: -len(CHECKPOINT_NAME)] + PARAM_NAME
                if name.endswith(PARAM_NAME):
                    seen.add(name)
                yield name, tensor

        result = super().load_weights(renamed())
        missing = [f"model.layers.{i}.{CHECKPOINT_NAME}" for i in sorted(self.dash_layers)
                   if f"model.layers.{i}.{PARAM_NAME}" not in seen]
        if missing:
            raise ValueError(f"the checkpoint has no DASH weight for {len(missing)} layer(s): {', '.join(missing[:4])}"
                             f"{' ...' if len(missing) > 4 else ''}; a DashLlamaForCausalLM checkpoint needs a flat "
                             f"[num_key_value_heads * head_dim] tensor per layer under that name")
        return result


EntryClass = DashLlamaForCausalLM
