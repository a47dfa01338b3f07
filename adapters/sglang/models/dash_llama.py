"""``DashLlamaForCausalLM``: SGLang's Llama plus the per-layer DASH weight ``head_cls``.

Checkpoint (docs/semantics.md section 1): a Llama checkpoint whose ``config.json`` says
``"architectures": ["DashLlamaForCausalLM"]`` (``model_type`` stays ``llama``) and carries the DASH
keys (``chunk_size``, ``scaling_factor``, ``sigma``, ``estimate_diagonal``, ``dash_*``), and one
extra tensor per layer, ``model.layers.{i}.self_attn.indexer_q``, a flat ``[Hkv * D]`` vector.

Each attention layer keeps ``head_cls [Hkv_local, D]``, the rows of the KV heads this
tensor-parallel rank holds (the rows ``QKVParallelLinear`` gives it for ``k_proj``; replicated
where SGLang replicates KV heads), and passes it to the attention backend as a keyword:
``self.attn(q, k, v, forward_batch, head_cls=self.head_cls)``. Under another attention backend
(e.g. ``torch_native``, which takes no extra keywords) the weight is loaded but not passed, and
attention is dense: the engine's own dense run of the same checkpoint.

Indexer and page mode (docs/semantics.md section 9; config keys in ``dash_core.model_config``): with
``dash_indexer_heads = Hi`` each layer also has ``self_attn.dash_indexer`` (``wq [Hi * D, hidden]``,
``wk [D, hidden]``, ``head_cls [D]``, replicated on every tensor-parallel rank: its one shared
selection needs all Hi heads), and passes ``iq = wq(x) [T, Hi * D]``, ``ik = wk(x) [T, D]`` and
``head_cls_i`` of the layer's normed input ``x``. With ``dash_page_mode`` the layer hands q, k, iq, ik
to the backend unrotated and the DASH op applies page RoPE (the model's ``dash_page_rope``);
otherwise iq and ik are rotated like q and k (same theta and head size).
"""

from __future__ import annotations

from typing import Iterable, Optional, Tuple

import torch
from torch import nn

from adapters.sglang.aux import page_rope_settings
from dash_core.model_config import AuxConfig
from dash_core.params import DashParams
from sglang.srt.distributed.utils import get_group_rank_size
from sglang.srt.model_executor.forward_context import get_attn_backend
from sglang.srt.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM

CHECKPOINT_NAME = "self_attn.indexer_q"  # the published per-layer DASH weight
PARAM_NAME = "self_attn.head_cls"
INDEXER_PREFIX = "self_attn.dash_indexer."  # indexer weights: our checkpoint names, loaded as they are
INDEXER_WEIGHTS = ("wq.weight", "wk.weight", "head_cls")


def _backend_takes_head_cls() -> bool:
    """Whether the attention backend of the running forward is DASH's (it declares ``takes_head_cls``)."""
    return getattr(get_attn_backend(), "takes_head_cls", False)


class DashIndexer(nn.Module):
    """The indexer of one layer: ``wq [Hi * D, hidden]``, ``wk [D, hidden]`` (no bias), ``head_cls [D]``."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, dtype, device) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.wq = nn.Linear(hidden_size, num_heads * head_dim, bias=False, dtype=dtype, device=device)
        self.wk = nn.Linear(hidden_size, head_dim, bias=False, dtype=dtype, device=device)
        self.head_cls = nn.Parameter(torch.zeros(head_dim, dtype=dtype, device=device), requires_grad=False)
        for p in (self.wq.weight, self.wk.weight):
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``x [T, hidden]`` -> ``iq [T, Hi * D]``, ``ik [T, D]`` (unrotated)."""
        return self.wq(x), self.wk(x)


class DashLlamaAttention(LlamaAttention):
    """Llama attention that hands ``head_cls`` to the attention backend.

    Built from a ``LlamaAttention`` by ``DashLlamaAttention.adopt`` (SGLang's ``LlamaModel``
    constructs its layers itself, so the DASH parameter is added to each one afterwards).
    """

    head_cls: nn.Parameter
    dash_indexer: Optional[DashIndexer]
    dash_page_mode: bool

    @classmethod
    def adopt(cls, attn: LlamaAttention, aux: Optional[AuxConfig] = None) -> "DashLlamaAttention":
        """Turn ``attn`` into a ``DashLlamaAttention`` in place with a ``head_cls [Hkv_local, D]`` parameter
        (and the indexer of ``aux.indexer_heads`` heads, and page mode, where ``aux`` says so)."""
        aux = aux or AuxConfig()
        attn.__class__ = cls
        dtype = attn.qkv_proj.weight.dtype if attn.qkv_proj.weight.is_floating_point() else None
        device = attn.qkv_proj.weight.device
        attn.head_cls = nn.Parameter(torch.zeros(attn.num_kv_heads, attn.head_dim, dtype=dtype, device=device),
                                     requires_grad=False)
        attn.head_cls.weight_loader = attn.load_head_cls
        attn.dash_indexer = None
        if aux.indexer_heads is not None:
            attn.dash_indexer = DashIndexer(attn.hidden_size, aux.indexer_heads, attn.head_dim, dtype, device)
        attn.dash_page_mode = aux.page_mode
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
        if not _backend_takes_head_cls():  # another backend: the plain Llama layer (dense attention)
            q, k, v = self.forward_prepare_native(positions=positions, hidden_states=hidden_states)
            attn_output = self.attn(q, k, v, forward_batch)
            output, _ = self.o_proj(attn_output)
            return output
        if self.dash_page_mode:  # unrotated: the DASH op applies page RoPE
            qkv, _ = self.qkv_proj(hidden_states)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        else:
            q, k, v = self.forward_prepare_native(positions=positions, hidden_states=hidden_states)
        extra = {}
        if self.dash_indexer is not None:
            iq, ik = self.dash_indexer(hidden_states)
            if not self.dash_page_mode:
                iq, ik = self.rotary_emb(positions, iq, ik)
            extra = dict(iq=iq, ik=ik, head_cls_i=self.dash_indexer.head_cls)
        attn_output = self.attn(q, k, v, forward_batch, head_cls=self.head_cls, **extra)
        output, _ = self.o_proj(attn_output)
        return output


class DashLlamaForCausalLM(LlamaForCausalLM):
    """Llama with DASH attention: loads ``indexer_q`` per layer as ``head_cls``."""

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        super().__init__(config, quant_config=quant_config, prefix=prefix)
        self.dash_aux = AuxConfig.from_config(config)
        self.dash_layers = {}
        self.dash_page_rope = None  # PageRopeSettings of a page-mode model (read by the backend)
        for layer in self.model.layers:
            if isinstance(layer, LlamaDecoderLayer):
                attn = DashLlamaAttention.adopt(layer.self_attn, self.dash_aux)
                self.dash_layers[attn.attn.layer_id] = attn
                if self.dash_aux.page_mode:
                    rope = page_rope_settings(attn.rotary_emb, DashParams.from_config(config))
                    if self.dash_page_rope not in (None, rope):
                        raise ValueError(f"page mode needs one rotary setting for all layers; layer "
                                         f"{attn.attn.layer_id} has {rope}, earlier layers {self.dash_page_rope}")
                    self.dash_page_rope = rope

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]):
        """Llama's loader, with ``...self_attn.indexer_q`` loaded into ``...self_attn.head_cls``.

        Raises ``ValueError`` when a layer of this rank got no DASH weight.
        """
        seen = set()

        def renamed():
            for name, tensor in weights:
                if name.endswith(CHECKPOINT_NAME):
                    name = name[: -len(CHECKPOINT_NAME)] + PARAM_NAME
                if name.endswith(PARAM_NAME) or INDEXER_PREFIX in name:
                    seen.add(name)
                yield name, tensor

        result = super().load_weights(renamed())
        missing = [f"model.layers.{i}.{CHECKPOINT_NAME}" for i in sorted(self.dash_layers)
                   if f"model.layers.{i}.{PARAM_NAME}" not in seen]
        if self.dash_aux.indexer_heads is not None:
            missing += [f"model.layers.{i}.{INDEXER_PREFIX}{w}" for i in sorted(self.dash_layers)
                        for w in INDEXER_WEIGHTS if f"model.layers.{i}.{INDEXER_PREFIX}{w}" not in seen]
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} DASH weight(s): {', '.join(missing[:4])}"
                             f"{' ...' if len(missing) > 4 else ''}; a DashLlamaForCausalLM checkpoint needs a flat "
                             f"[num_key_value_heads * head_dim] indexer_q per layer (and, with dash_indexer_heads, "
                             f"dash_indexer.wq.weight [Hi * D, hidden], .wk.weight [D, hidden], .head_cls [D])")
        return result


EntryClass = DashLlamaForCausalLM
