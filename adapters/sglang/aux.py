"""Page RoPE settings from an SGLang layer's rotary embedding (page mode, docs/semantics.md section 9).

The indexer / page-mode config keys and ``AuxConfig`` live in ``dash_core.model_config`` (shared
with the vLLM adapter); this module keeps the SGLang-specific part.
"""

from __future__ import annotations

from dash_core.params import DashParams
from dash_core.rope import PageRopeSettings, RotarySettings


def page_rope_settings(rotary_emb, params: DashParams) -> PageRopeSettings:
    """``PageRopeSettings`` from an SGLang attention layer's ``rotary_emb`` (the indexer shares it) and
    the split ``params.page_rope_tok_pairs`` (config key ``dash_page_rope_tok_pairs``).

    Page RoPE is neox-style RoPE of the layer's theta and rotary dim with positions replaced by page
    coordinates; scaled RoPE variants (YaRN, Llama 3, ...) and GPT-J pairing have no page form here
    and raise ``ValueError``.
    """
    from sglang.srt.layers.rotary_embedding import RotaryEmbedding

    if type(rotary_emb) is not RotaryEmbedding or not rotary_emb.is_neox_style:
        raise ValueError(f"page mode (dash_page_mode) needs plain neox RoPE; this model uses "
                         f"{type(rotary_emb).__name__} (is_neox_style={getattr(rotary_emb, 'is_neox_style', None)}): "
                         f"remove rope_scaling or serve without page mode")
    rot = RotarySettings(theta=float(rotary_emb.base), rotary_dim=int(rotary_emb.rotary_dim))
    return PageRopeSettings.from_params(params, rot)
