"""DASH hyper-parameters (docs/semantics.md section 1), validated once at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping, Optional

from .limits import BLOCK_SIZE_RANGE, kernel_block_size_error

ROUTERS = ("kv_head", "shared")
ATTENTION_BACKENDS = ("TRITON", "FLASH_ATTN", "FLASHINFER")

# DashParams field -> the key published DASH checkpoints use in their model config.
CONFIG_KEYS = {
    "block_size": "chunk_size",
    "topk": "dash_topk",
    "local": "dash_local",
    "scaling_factor": "scaling_factor",
    "sigma": "sigma",
    "estimate_diagonal": "estimate_diagonal",
    "router": "dash_router",
    "attention_backend": "dash_attention_backend",
    "page_rope_tok_pairs": "dash_page_rope_tok_pairs",
}


def _bad(field: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"DashParams.{field} = {value!r} is not allowed: expected {allowed}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class DashParams:
    """The routing and attention settings of one DASH layer.

    Example::

        >>> p = DashParams(block_size=64, topk=32)
        >>> p.local, p.local_blocks
        (64, 1)
        >>> DashParams.dense_equivalent(block_size=16).scaling_factor
        0.0

    Fields (docs/semantics.md section 1):
        block_size: tokens per block, a power of two in 16..256 (config key ``chunk_size``).
        topk: cap on routed blocks per query (and per KV head for router ``kv_head``); None = no cap.
        local: local-window tokens, a multiple of ``block_size``; None means ``block_size``.
        scaling_factor: routing temperature ``sf``; finite and >= 0.
        sigma: temperature of the estimated-diagonal prior, >= 1.
        estimate_diagonal: normalise the prior by its geometric mean (docs/semantics.md section 5).
        router: ``"kv_head"`` (one selection per KV head) or ``"shared"`` (one for all heads).
        attention_backend: what runs the attention stage, ``"TRITON"`` (native kernels) or the
            segment backends ``"FLASH_ATTN"``, ``"FLASHINFER"`` (``dash_core.segments``; need ``topk``).
        page_rope_tok_pairs: page mode (docs/semantics.md section 9): rotary pairs ``0 .. r - 1`` rotate by the
            in-page offset, the rest by the page index; None = a quarter of the rotary dim.
    """

    block_size: int = 64
    topk: Optional[int] = None
    local: Optional[int] = None
    scaling_factor: float = 1.0
    sigma: float = 1e6
    estimate_diagonal: bool = False
    router: str = "kv_head"
    attention_backend: str = "TRITON"
    page_rope_tok_pairs: Optional[int] = None

    def __post_init__(self) -> None:
        bs = self.block_size
        lo, hi = BLOCK_SIZE_RANGE
        if not _is_int(bs) or bs < lo or bs > hi or bs & (bs - 1):
            raise _bad("block_size", bs, f"a power of two in {lo}..{hi}")
        if self.topk is not None and (not _is_int(self.topk) or self.topk < 1):
            raise _bad("topk", self.topk, "None or an integer >= 1")
        if self.local is None:
            object.__setattr__(self, "local", bs)
        elif not _is_int(self.local) or self.local < bs or self.local % bs:
            raise _bad("local", self.local, f"None or a multiple of block_size ({bs}), >= {bs}")
        sf = self.scaling_factor
        if isinstance(sf, bool) or not isinstance(sf, (int, float)) or not math.isfinite(sf) or sf < 0:
            raise _bad("scaling_factor", sf, "a finite number >= 0")
        object.__setattr__(self, "scaling_factor", float(sf))
        sg = self.sigma
        if isinstance(sg, bool) or not isinstance(sg, (int, float)) or not math.isfinite(sg) or sg < 1:
            raise _bad("sigma", sg, "a finite number >= 1")
        object.__setattr__(self, "sigma", float(sg))
        if not isinstance(self.estimate_diagonal, bool):
            raise _bad("estimate_diagonal", self.estimate_diagonal, "True or False")
        if self.router not in ROUTERS:
            raise _bad("router", self.router, f"one of {ROUTERS}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise _bad("attention_backend", self.attention_backend, f"one of {ATTENTION_BACKENDS}")
        r = self.page_rope_tok_pairs
        if r is not None and (not _is_int(r) or r < 0):
            raise _bad("page_rope_tok_pairs", r, "None or an integer >= 0 (at most rotary_dim / 2)")

    @property
    def local_blocks(self) -> int:
        """Blocks in the local window (``local // block_size``)."""
        return self.local // self.block_size

    def max_candidates(self, table_tokens: int) -> int:
        """Candidate blocks a token has at most where block tables span ``table_tokens`` tokens (page-table width
        times page size): the complete blocks there, at least 1 (the scratch's width)."""
        return max(1, table_tokens // self.block_size)

    def cap(self, num_candidates: int) -> int:
        """Blocks one unit may keep out of ``num_candidates``: ``min(topk, num_candidates)``, or all of them
        without ``topk``."""
        return num_candidates if self.topk is None else min(self.topk, num_candidates)

    def cap_binds(self, num_candidates: int) -> bool:
        """Whether the ``topk`` cap can drop a block of tables of ``num_candidates``: only with more candidates than
        ``topk`` (kernels compile the cap where it can).

        >>> DashParams(topk=64).cap_binds(64), DashParams(topk=64).cap_binds(65), DashParams().cap_binds(4096)
        (False, True, False)
        """
        return self.topk is not None and self.topk < num_candidates

    def selection_units(self, num_kv_heads: int) -> int:
        """Selections per token: one per KV head (router ``kv_head``) or one for all heads (``shared``)."""
        return 1 if self.router == "shared" else num_kv_heads

    def routed_by(self, indexer: bool) -> "DashParams":
        """The routing settings of a step: an indexer's selection serves every KV head, so it routes with router
        ``shared`` (docs/semantics.md section 9); without one, these."""
        return replace(self, router="shared") if indexer and self.router != "shared" else self

    def check_kernel_support(self) -> None:
        """Raise ``ValueError`` unless the Triton kernels (GPU) run these settings (``dash_core.limits``)."""
        problem = kernel_block_size_error(self.block_size)
        if problem:
            raise ValueError(problem)

    @classmethod
    def dense_equivalent(cls, block_size: int = 64, local: Optional[int] = None) -> "DashParams":
        """The configuration in which DASH equals dense causal attention (docs/semantics.md section 1)."""
        return cls(block_size=block_size, local=local, scaling_factor=0.0, estimate_diagonal=True)

    @classmethod
    def from_config(cls, config: Any, **overrides: Any) -> "DashParams":
        """Build from a model config (a mapping or an object with attributes, e.g. a HF config).

        Reads the published keys (``chunk_size``, ``scaling_factor``, ``sigma``,
        ``estimate_diagonal``) and the ``dash_*`` keys (``dash_topk``, ``dash_local``,
        ``dash_router``); a ``dash_<field>`` key overrides the published key of the same field,
        and keyword ``overrides`` override both. Keys that are absent keep the defaults.
        """
        get = config.get if isinstance(config, Mapping) else (lambda k, d=None: getattr(config, k, d))
        missing = object()
        values: dict = {}
        for f in fields(cls):
            for key in (CONFIG_KEYS[f.name], f"dash_{f.name}"):
                v = get(key, missing)
                if v is not missing and not (v is None and key != "dash_topk"):
                    values[f.name] = v
        values.update(overrides)
        return cls(**values)
