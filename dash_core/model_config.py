"""The DASH serving options of a model's HF config, read once for both engine adapters.

Engine-neutral: this module knows the config keys and the environment variable, no engine. A config
is a mapping or an object with attributes (a HF ``PretrainedConfig``). Keys beyond the ``DashParams``
ones (``DashParams.from_config``: ``chunk_size``, ``scaling_factor``, ``sigma``,
``estimate_diagonal``, ``dash_<field>``):

| key | read by | meaning |
|---|---|---|
| `dash_attention_backend` | `serving_params` | decode attention stage: `TRITON` (default), `FLASHINFER`, |
| | | `FLASH_ATTN` (the last two need `dash_topk`) |
| `DASH_ATTENTION_BACKEND` (environment) | `serving_params` | the same choice in any case; wins over the key when |
| | | set and not blank |
| `dash_indexer_heads` | `AuxConfig` | `Hi`: every layer routes with an indexer (`dash_indexer.wq [Hi * D, hidden]`, |
| | | `.wk [D, hidden]`, `.head_cls [D]`) |
| `dash_page_mode` | `AuxConfig` | true: page mode; the attention op applies page RoPE to unrotated q, k (and iq, ik) |
| `dash_page_start_token_id` | `AuxConfig` | the placeholder id whose prompt tokens get role 1 (first token of a page) |
| `dash_page_token_id` | `AuxConfig` | the placeholder id whose prompt tokens get role 2 (later tokens of that page) |
| `dash_page_rope_tok_pairs` | `DashParams` | page RoPE split `r` (`DashParams.page_rope_tok_pairs`; None = a |
| | | quarter of the rotary dim) |
| `architectures` | `is_dash_model` | a DASH checkpoint names one of `DASH_ARCHITECTURES` |
| `DASH_ALLOW_DENSE` (env.) | `check_attention_choice` | `1`: a DASH checkpoint may start with dense attention |

The rule both adapters apply before the weights load (``check_attention_choice``): a DASH checkpoint
runs DASH attention, and DASH attention runs only a DASH checkpoint. A DASH-trained model served with
dense attention is a different model (its tokens are not the trained model's), so that start is refused
unless ``DASH_ALLOW_DENSE=1`` asks for it; a model without the DASH weights cannot run DASH attention.
``serving_summary`` is the one start-up line each adapter logs: DASH's settings and the path that runs them.

An indexer or page mode needs the auxiliary head (docs/semantics.md section 9): one ``[slots, 2D]`` row per KV
slot in the KV dtype, which each engine lays out its own way (``dash_core.layout``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from dash_core.limits import uses_kernels
from dash_core.params import ATTENTION_BACKENDS, DashParams
from dash_core.rope import ROLE_PAGE, ROLE_PAGE_START, ROLE_TEXT
from dash_core.segments import check_decode_backend

ATTENTION_BACKEND_ENV = "DASH_ATTENTION_BACKEND"  # serving-time choice of the decode attention stage
ALLOW_DENSE_ENV = "DASH_ALLOW_DENSE"  # 1: a DASH checkpoint may be served with dense attention (comparisons)
DASH_ARCHITECTURES = ("DashLlamaForCausalLM",)  # the model classes both adapters register
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


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


def is_dash_model(hf_config: Any) -> bool:
    """Whether the config's ``architectures`` name a DASH model (``DASH_ARCHITECTURES``)."""
    return any(a in DASH_ARCHITECTURES for a in (_get(hf_config, "architectures") or ()))


def allow_dense(environ: Mapping[str, str] = os.environ) -> bool:
    """``DASH_ALLOW_DENSE``: ``1``/``true``/``yes``/``on`` (any case) allows a dense start of a DASH checkpoint;
    unset, blank, ``0``/``false``/``no``/``off`` do not. Raises ``ValueError`` naming the variable otherwise."""
    value = environ.get(ALLOW_DENSE_ENV, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"environment variable {ALLOW_DENSE_ENV} = {environ.get(ALLOW_DENSE_ENV)!r} is not allowed: "
                     f"expected 1 (serve a DASH checkpoint with dense attention, for comparisons) or 0 / unset")


def check_attention_choice(hf_config: Any, dash_attention: bool, chosen: str, dash_flag: str,
                           environ: Mapping[str, str] = os.environ) -> bool:
    """The serving rule of both adapters, from the model config and the engine's attention choice alone.

    Parameters
    ----------
    hf_config : mapping or HF config
        The served model's config (``architectures`` decides whether it is a DASH model).
    dash_attention : bool
        Whether the engine's attention choice is DASH.
    chosen : str
        The engine's choice in its own words, for the message (e.g. ``--attention-backend torch_native``).
    dash_flag : str
        What selects DASH attention in that engine (e.g. ``--attention-backend dash``).
    environ : mapping
        Where ``DASH_ALLOW_DENSE`` is read.

    Returns
    -------
    bool
        True when a DASH checkpoint starts with dense attention because ``DASH_ALLOW_DENSE`` allows it (the
        caller logs a warning), else False.

    Raises
    ------
    ValueError
        DASH attention for a model that is not a DASH model (the message names ``chosen``), or a DASH model
        without DASH attention unless ``DASH_ALLOW_DENSE=1`` (the message names ``dash_flag``, to add).
    """
    archs = list(_get(hf_config, "architectures") or ())
    dash_model = is_dash_model(hf_config)
    if dash_attention and not dash_model:
        raise ValueError(f"{chosen} selects DASH attention, but the model is not a DASH model (architectures "
                         f"{archs}): DASH routes with the per-layer weight of a DASH checkpoint (architectures "
                         f"{list(DASH_ARCHITECTURES)}, weight model.layers.N.self_attn.indexer_q); serve a DASH "
                         f"checkpoint, or drop {chosen}")
    if dash_model and not dash_attention:
        if allow_dense(environ):
            return True
        raise ValueError(f"the model is a DASH checkpoint (architectures {archs}) and {chosen} would serve it "
                         f"with dense attention, which is not the model it was trained as (other tokens): add "
                         f"{dash_flag}. To compare against dense attention on purpose, set {ALLOW_DENSE_ENV}=1")
    return False


def serving_summary(params: DashParams, device: Any, dtype: torch.dtype, aux: Optional["AuxConfig"] = None,
                    page_size: Optional[int] = None) -> str:
    """The one start-up line an adapter logs at INFO: the path DASH runs and its settings.

    ``device`` and ``dtype`` are the engine's (model and KV cache); ``page_size`` the engine's KV page.
    """
    dev = torch.device(device).type
    dt = str(dtype).replace("torch.", "")
    if uses_kernels(device, dtype):
        path = f"Triton kernels ({dev}, {dt}), decode attention stage {params.attention_backend}"
    else:
        stage = ("" if params.attention_backend == "TRITON" else
                 f"; dash_attention_backend {params.attention_backend} applies on CUDA bf16/fp16 only")
        path = (f"PyTorch paged path ({dev}, {dt}: for correctness and tests, slower than the engine's dense "
                f"attention; the kernels need CUDA bf16/fp16{stage})")
    topk = "none" if params.topk is None else str(params.topk)
    extra = ""
    if aux is not None and aux.indexer_heads is not None:
        extra += f", indexer {aux.indexer_heads} heads"
    if aux is not None and aux.page_mode:
        extra += ", page mode"
    page = "" if page_size is None else f", page size {page_size}"
    return (f"DASH attention on: {path}; block size {params.block_size}{page}, topk {topk}, local {params.local}, "
            f"router {params.router}, scaling_factor {params.scaling_factor:g}, sigma {params.sigma:g}, "
            f"estimate_diagonal {params.estimate_diagonal}{extra}")
