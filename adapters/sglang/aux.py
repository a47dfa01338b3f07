"""The auxiliary-head options of a DASH model's config (SPEC.md section 9), as SGLang serves them.

Config keys (all optional; absent = a plain DASH model):

| key | meaning |
|---|---|
| `dash_indexer_heads` | `Hi`: every layer routes with an indexer (`dash_indexer.wq [Hi * D, hidden]`, `.wk [D, hidden]`, `.head_cls [D]`) |
| `dash_page_mode` | true: page mode; the attention op applies page RoPE to unrotated q, k (and iq, ik) |
| `dash_page_start_token_id` | the placeholder id whose prompt tokens get role 1 (first token of a page) |
| `dash_page_token_id` | the placeholder id whose prompt tokens get role 2 (later tokens of that page) |
| `dash_page_rope_tok_pairs` | page RoPE split `r` (`DashParams.page_rope_tok_pairs`; None = a quarter of the rotary dim) |

Either option needs the auxiliary head: one ``[slots, 2D]`` buffer per layer in the KV dtype,
attached to SGLang's KV pool and indexed by the same slot as K and V.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from dash_core.params import DashParams
from dash_core.rope import ROLE_PAGE, ROLE_PAGE_START, ROLE_TEXT, PageRopeSettings, RotarySettings


def _get(config: Any, key: str, default=None):
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def _bad(key: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"model config {key} = {value!r} is not allowed: expected {allowed}")


@dataclass(frozen=True)
class AuxConfig:
    """Indexer and page-mode settings of one model (``from_config`` validates them)."""

    indexer_heads: Optional[int] = None
    page_mode: bool = False
    page_start_token_id: Optional[int] = None
    page_token_id: Optional[int] = None

    @classmethod
    def from_config(cls, config: Any) -> "AuxConfig":
        """Read the keys of the module docstring from a HF config (object or mapping)."""
        hi = _get(config, "dash_indexer_heads")
        if hi is not None and (not isinstance(hi, int) or isinstance(hi, bool) or hi < 1):
            raise _bad("dash_indexer_heads", hi, "None or an integer >= 1")
        page_mode = _get(config, "dash_page_mode", False)
        if page_mode is None:
            page_mode = False
        if not isinstance(page_mode, bool):
            raise _bad("dash_page_mode", page_mode, "true or false")
        start, page = _get(config, "dash_page_start_token_id"), _get(config, "dash_page_token_id")
        if page_mode:
            vocab = _get(config, "vocab_size")
            for key, v in (("dash_page_start_token_id", start), ("dash_page_token_id", page)):
                if not isinstance(v, int) or isinstance(v, bool) or v < 0 or (vocab is not None and v >= vocab):
                    raise _bad(key, v, f"a token id in 0..{'vocab_size - 1' if vocab is None else vocab - 1} "
                                       f"(page mode needs both placeholder ids)")
            if start == page:
                raise _bad("dash_page_token_id", page, "an id other than dash_page_start_token_id")
        return cls(hi, page_mode, start if page_mode else None, page if page_mode else None)

    @property
    def needs_aux(self) -> bool:
        """Whether the model needs the auxiliary head (an indexer or page mode)."""
        return self.indexer_heads is not None or self.page_mode

    @property
    def summary_heads(self) -> Optional[int]:
        """Heads of the summary store: 1 with an indexer (summaries of ``ik``), None = the KV heads."""
        return 1 if self.indexer_heads is not None else None

    def roles(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Roles ``[T]`` int64 of prompt tokens: 1 at the page-start id, 2 at the page-token id, else 0."""
        ids = input_ids.to(torch.long)
        text = torch.full_like(ids, ROLE_TEXT)
        return torch.where(ids == self.page_start_token_id, ROLE_PAGE_START,
                           torch.where(ids == self.page_token_id, ROLE_PAGE, text))


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
