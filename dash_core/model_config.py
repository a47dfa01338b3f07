"""The DASH serving options of a model's HF config, read once for both engine adapters.

Engine-neutral: this module knows the config keys and the environment variable, no engine. A config
is a mapping or an object with attributes (a HF ``PretrainedConfig``). Keys beyond the ``DashParams``
ones (``DashParams.from_config``: ``chunk_size``, ``scaling_factor``, ``sigma``,
``estimate_diagonal``, ``dash_<field>``):

| key | read by | meaning |
|---|---|---|
| `dash_attention_backend` | `serving_params` | decode attention stage: `TRITON` (default), `FLASHINFER`, `FLASH_ATTN` (the last two need `dash_topk`) |
| `DASH_ATTENTION_BACKEND` (environment) | `serving_params` | the same choice in any case; wins over the key when set and not blank |
| `dash_indexer_heads` | `AuxConfig` | `Hi`: every layer routes with an indexer (`dash_indexer.wq [Hi * D, hidden]`, `.wk [D, hidden]`, `.head_cls [D]`) |
| `dash_page_mode` | `AuxConfig` | true: page mode; the attention op applies page RoPE to unrotated q, k (and iq, ik) |
| `dash_page_start_token_id` | `AuxConfig` | the placeholder id whose prompt tokens get role 1 (first token of a page) |
| `dash_page_token_id` | `AuxConfig` | the placeholder id whose prompt tokens get role 2 (later tokens of that page) |
| `dash_page_rope_tok_pairs` | `DashParams` | page RoPE split `r` (`DashParams.page_rope_tok_pairs`; None = a quarter of the rotary dim) |

An indexer or page mode needs the auxiliary head (docs/semantics.md section 9): one ``[slots, 2D]`` row per KV
slot in the KV dtype, which each engine lays out its own way (``dash_core.layout``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from dash_core.params import ATTENTION_BACKENDS, DashParams
from dash_core.rope import ROLE_PAGE, ROLE_PAGE_START, ROLE_TEXT
from dash_core.segments import check_decode_backend

ATTENTION_BACKEND_ENV = "DASH_ATTENTION_BACKEND"  # serving-time choice of the decode attention stage


def _get(config: Any, key: str, default=None):
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def _bad(key: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"model config {key} = {value!r} is not allowed: expected {allowed}")


def serving_params(hf_config: Any, environ: Mapping[str, str] = os.environ) -> DashParams:
    """The ``DashParams`` a served model runs with, read once when the engine builds it.

    The config's DASH keys (``dash_attention_backend`` picks the decode attention stage), then the
    environment variable ``DASH_ATTENTION_BACKEND`` (``TRITON``, ``FLASHINFER`` or ``FLASH_ATTN``, any
    case; blank = unset), which wins when set. Raises ``ValueError`` naming the variable or key for a
    bad value, and for a segment backend without ``dash_topk`` (at start-up, not at the first decode).
    """
    overrides = {}
    env = environ.get(ATTENTION_BACKEND_ENV, "").strip()
    if env:
        if env.upper() not in ATTENTION_BACKENDS:
            raise ValueError(f"environment variable {ATTENTION_BACKEND_ENV} = {env!r} is not allowed: expected one "
                             f"of {', '.join(ATTENTION_BACKENDS)} (any case), or unset for the model config's "
                             f"dash_attention_backend (default TRITON)")
        overrides["attention_backend"] = env.upper()
    params = DashParams.from_config(hf_config, **overrides)
    check_decode_backend(params.attention_backend, params)
    return params


@dataclass(frozen=True)
class AuxConfig:
    """Indexer and page-mode settings of one model (``from_config`` validates them)."""

    indexer_heads: Optional[int] = None
    page_mode: bool = False
    page_start_token_id: Optional[int] = None
    page_token_id: Optional[int] = None

    @classmethod
    def from_config(cls, config: Any) -> "AuxConfig":
        """Read the ``AuxConfig`` keys of the module docstring from a HF config (object or mapping)."""
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
        """Roles ``[T]`` int64 of prompt tokens ``input_ids [T]``: 1 at the page-start id, 2 at the
        page-token id, else 0 (text; every token without page mode). No host synchronisation."""
        ids = input_ids.to(torch.long)
        text = torch.full_like(ids, ROLE_TEXT)
        if not self.page_mode:
            return text
        return torch.where(ids == self.page_start_token_id, ROLE_PAGE_START,
                           torch.where(ids == self.page_token_id, ROLE_PAGE, text))
