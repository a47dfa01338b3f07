"""Page coordinates and page RoPE (docs/semantics.md section 9).

A page-mode prompt carries one role per token: 0 text, 1 first token of a page, 2 a later token of
that page. Every token gets two integer coordinates:

- ``page``: 0 for text before the first page; ``i`` for the tokens of the ``i``-th page and the text
  that follows it up to the next page; ``P + 1`` (the query page) for text after the last page and
  for every generated token, ``P`` being the number of pages.
- ``tok``: the offset inside the page, counting from its role-1 token; text continues the offsets of
  the page before it (text before the first page counts from 0, text after the last page starts a
  new run at 0 in the query page).

A prompt without any page (``P = 0``) gets ``tok = page = position``, and generated tokens continue
it (its query page is recorded as 0), so such a prompt of a page-mode model is ordinary RoPE
throughout (every prompt of a page-mode model is in page mode).

Page RoPE rotates the neox pairs ``0 .. r - 1`` by ``tok`` and the pairs ``r .. rot/2 - 1`` by
``page``, each with its usual frequency (``r = DashParams.page_rope_tok_pairs``, default ``rot / 4``).
With ``tok = page = position`` it is ordinary neox RoPE.

Example::

    >>> import torch
    >>> tok, page = page_coordinates(torch.tensor([0, 0, 1, 2, 2, 0, 1, 2, 0, 0]), generated=2)
    >>> tok.tolist(), page.tolist()
    ([0, 1, 0, 1, 2, 3, 0, 1, 0, 1, 2, 3], [0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 3, 3])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from .layout import decode_aux
from .params import DashParams

ROLE_TEXT, ROLE_PAGE_START, ROLE_PAGE = 0, 1, 2


@dataclass(frozen=True)
class RotarySettings:
    """One set of rotary settings (the attention heads' or the indexer's).

    theta: the RoPE base; rotary_dim: rotated leading dims of the head (None = the whole head);
    neox pairing ``(i, i + rotary_dim / 2)`` as in Llama-style models.
    """

    theta: float = 10000.0
    rotary_dim: Optional[int] = None


@dataclass(frozen=True)
class PageRopeSettings:
    """The rotary settings of the attention heads (``main``) and of the indexer, plus the split ``r``."""

    main: RotarySettings = RotarySettings()
    indexer: RotarySettings = RotarySettings()
    tok_pairs: Optional[int] = None

    @classmethod
    def from_params(cls, params: DashParams, main: RotarySettings,
                    indexer: Optional[RotarySettings] = None) -> "PageRopeSettings":
        return cls(main, indexer if indexer is not None else main, params.page_rope_tok_pairs)


def _as_long(x, name: str) -> torch.Tensor:
    t = torch.as_tensor(x)
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got dtype {t.dtype}")
    return t.to(torch.long)


def page_state(roles) -> tuple[int, int]:
    """``(P, query_page)`` of a prompt's ``roles [N]``: the page count and the page of generated tokens."""
    r = _as_long(roles, "roles").reshape(-1)
    p = int((r == ROLE_PAGE_START).sum())
    return p, (p + 1 if p else 0)


def page_coordinates(roles, generated: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tok, page)``, each ``[N + generated]`` int64, of a prompt's ``roles [N]`` (0, 1 or 2).

    The ``generated`` tokens after the prompt belong to the query page. Tensor ops only (no loop
    over tokens), on the device of ``roles``. Raises ValueError for a role outside 0..2 or a role 2
    before the first role-1 token.
    """
    r = _as_long(roles, "roles").reshape(-1)
    if r.numel() and (int(r.min()) < 0 or int(r.max()) > 2):
        raise ValueError(f"roles must be 0 (text), 1 (page start) or 2 (page token); got values "
                         f"{int(r.min())}..{int(r.max())}")
    if generated < 0:
        raise ValueError(f"generated must be >= 0, got {generated}")
    start = r == ROLE_PAGE_START
    pidx = torch.cumsum(start.to(torch.long), 0)
    if bool(((r == ROLE_PAGE) & (pidx == 0)).any()):
        raise ValueError("roles: a page token (2) comes before the first page start (1)")
    dev = r.device
    r = torch.cat([r, torch.zeros(generated, dtype=torch.long, device=dev)])
    pidx = torch.cat([pidx, (pidx[-1:] if pidx.numel() else torch.zeros(1, dtype=torch.long, device=dev))
                      .expand(generated)])
    start = torch.cat([start, torch.zeros(generated, dtype=torch.bool, device=dev)])
    n = r.numel()
    idx = torch.arange(n, device=dev)
    npages = pidx[-1] if n else torch.zeros((), dtype=torch.long, device=dev)
    last_page_tok = torch.where(r > 0, idx, torch.full_like(idx, -1)).amax() if n else idx.sum() - 1
    in_query = (r == ROLE_TEXT) & (idx > last_page_tok) & (npages > 0)
    page = torch.where(in_query, npages + 1, pidx)
    run_start = start | (idx == 0) | (in_query & (idx == last_page_tok + 1))
    first = torch.cummax(torch.where(run_start, idx, torch.zeros_like(idx)), 0).values
    tok = idx - first
    return tok, torch.where(npages > 0, page, tok)  # no page: ordinary RoPE


def decode_coordinates(prev_tok: torch.Tensor, prev_page: torch.Tensor,
                       query_page: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tok, page)`` of a generated token from the previous token's integer state.

    prev_tok, prev_page, query_page: ``[n]`` integer tensors (as decoded from the auxiliary head).
    A token after a query-page token continues its run; after a page token it starts the query
    page at offset 0; without pages (``query_page == 0``) ``tok = page = position``. Device-side
    tensor ops only (no host reads), so it can run in a captured graph.
    """
    no_pages = query_page == 0
    cont = (prev_page == query_page) | no_pages
    tok = torch.where(cont, prev_tok + 1, torch.zeros_like(prev_tok))
    return tok, torch.where(no_pages, tok, query_page)


def resolve_tok_pairs(tok_pairs: Optional[int], rotary_dim: int) -> int:
    """The split ``r`` for a rotary dim: ``tok_pairs`` or, when None, ``rotary_dim // 4``."""
    half = rotary_dim // 2
    r = rotary_dim // 4 if tok_pairs is None else tok_pairs
    if r < 0 or r > half:
        raise ValueError(f"page_rope_tok_pairs = {tok_pairs} does not fit rotary_dim {rotary_dim}: "
                         f"expected 0..{half}")
    return r


def page_rope(x: torch.Tensor, tok: torch.Tensor, page: torch.Tensor,
              settings: Union[PageRopeSettings, RotarySettings], *, main: bool = True,
              tok_pairs: Optional[int] = None) -> torch.Tensor:
    """Page RoPE of ``x [T, ..., D]`` at ``tok, page [T]``; returns a new tensor in ``x.dtype``.

    settings: a ``PageRopeSettings`` (``main`` picks the attention heads' rotary settings, else the
    indexer's) or a single ``RotarySettings`` (then ``tok_pairs`` gives ``r``). Neox pairing; angles
    and the rotation are computed in float32, as engines do (float64 for a float64 ``x``, as the
    reference model does), then rounded to ``x.dtype``.
    """
    if isinstance(settings, PageRopeSettings):
        rot = settings.main if main else settings.indexer
        tok_pairs = settings.tok_pairs if tok_pairs is None else tok_pairs
    elif isinstance(settings, RotarySettings):
        rot = settings
    else:
        raise ValueError(f"settings must be PageRopeSettings or RotarySettings, got {type(settings).__name__}")
    d = x.shape[-1]
    rd = d if rot.rotary_dim is None else rot.rotary_dim
    if rd < 2 or rd > d or rd % 2:
        raise ValueError(f"rotary_dim = {rot.rotary_dim} is not allowed for head_dim {d}: expected an even "
                         f"number in 2..{d}")
    tok, page = _as_long(tok, "tok"), _as_long(page, "page")
    if tok.shape != (x.shape[0],) or page.shape != (x.shape[0],):
        raise ValueError(f"tok and page must be [T] = [{x.shape[0]}], got {tuple(tok.shape)} and {tuple(page.shape)}")
    half = rd // 2
    r = resolve_tok_pairs(tok_pairs, rd)
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    inv_freq = 1.0 / (rot.theta ** (torch.arange(0, rd, 2, dtype=cdt, device=x.device) / rd))
    use_tok = torch.arange(half, device=x.device) < r
    coord = torch.where(use_tok[None, :], tok[:, None], page[:, None]).to(cdt)  # [T, half]
    ang = coord * inv_freq[None, :]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = ang.cos().reshape(shape), ang.sin().reshape(shape)
    xf = x.to(cdt)
    x1, x2 = xf[..., :half], xf[..., half:rd]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, xf[..., rd:]], dim=-1)
    return out.to(x.dtype)


def decode_coordinates_from_aux(prev_rows: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tok, page)`` ``[n]`` of each request's new token from its previous token's auxiliary row.

    prev_rows: ``[n, 2 * head_dim]`` rows as ``dash_core.layout.encode_aux`` wrote them (any KV
    dtype). Device-side tensor ops only. The new token's row carries the same page count and
    query page, with role 0.
    """
    s = decode_aux(prev_rows, head_dim)
    return decode_coordinates(s.tok, s.page, s.query_page)


def token_requests(cu_seqlens: torch.Tensor, t: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rid, lidx) [T]`` int64: each token's request (``cu_seqlens [n + 1]`` row offsets) and its
    index among that request's tokens. Tensor ops only."""
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    g = torch.arange(t, device=device)
    rid = torch.searchsorted(cu[1:].contiguous(), g, right=True).clamp(max=max(cu.numel() - 2, 0))
    return rid, g - cu[:-1][rid]


def extend_coordinates(roles: torch.Tensor, cu_seqlens: torch.Tensor, has_prev: torch.Tensor,
                       prev_tok: torch.Tensor, prev_page: torch.Tensor, prev_num_pages: torch.Tensor,
                       prev_query_page: torch.Tensor):
    """Page coordinates of a batch of extends, each continuing its request's stored state.

    roles: ``[T]`` int (0 for generated tokens); cu_seqlens: ``[n + 1]`` row offsets of the requests;
    has_prev: ``[n]`` bool, whether a request has history (its first new token is not position 0);
    prev_*: ``[n]`` int64, the state of the last history token (``decode_aux`` of its row; ignored
    where ``has_prev`` is False). A request's new tokens are treated as the end of its prompt:
    pages counted on from the last history token's page (from ``prev_num_pages`` when that token is in
    its prompt's query page), text after the chunk's last page in the query page, text
    before it continuing the previous token's run. Without history this is ``page_coordinates``;
    for one role-0 token with history it is ``decode_coordinates``.

    Returns ``tok, page [T]``, ``num_pages, query_page [n]`` int64 and ``counts [T, 3]`` int64 (the
    page-count field, filled for requests without history: ``page_count_rows`` of their pages).
    Tensor ops only, no host reads (graph-safe).
    """
    dev = roles.device
    r = roles.to(torch.long)
    t, n = r.numel(), cu_seqlens.numel() - 1
    gidx = torch.arange(t, device=dev)
    rid, lidx = token_requests(cu_seqlens, t, dev)
    seg0 = gidx - lidx
    first_of_seg = seg0.clamp(max=max(t - 1, 0))

    def seg_cumsum(x: torch.Tensor) -> torch.Tensor:  # inclusive cumsum restarted at each request
        cs = torch.cumsum(x.to(torch.long), 0)
        return cs - (cs[first_of_seg] - x.to(torch.long)[first_of_seg])

    has_prev = has_prev.to(torch.bool)
    start = r == ROLE_PAGE_START
    # pages before the new tokens: the last history token's page index, or the page count of the prompt
    # that wrote it when that token is in its query page (a decode, or text after its last page); none
    # when that prompt had no page. (Not prev_num_pages alone: a prefix cached by a prompt with more pages
    # would shift this prompt's page indices.)
    prev_page, prev_qp = prev_page.to(torch.long), prev_query_page.to(torch.long)
    pp = torch.where(prev_page == prev_qp, prev_num_pages.to(torch.long), prev_page)
    pp = torch.where(prev_qp == 0, torch.zeros_like(pp), pp)
    p_prev = torch.where(has_prev, pp, torch.zeros_like(pp))
    pidx = p_prev[rid] + seg_cumsum(start)
    npages = p_prev + torch.zeros(n, dtype=torch.long, device=dev).index_add_(0, rid, start.to(torch.long))
    qpage = torch.where(npages > 0, npages + 1, torch.zeros_like(npages))
    last = torch.full((n,), -1, dtype=torch.long, device=dev).scatter_reduce(
        0, rid, torch.where(r > 0, lidx, torch.full_like(lidx, -1)), "amax", include_self=True)
    in_query = (r == ROLE_TEXT) & (lidx > last[rid]) & (npages[rid] > 0)
    page = torch.where(in_query, qpage[rid], pidx)
    first_in_query = (last < 0) & (npages > 0)
    cont = has_prev & ~(first_in_query & (prev_page != prev_qp))
    base = torch.where(cont, prev_tok.to(torch.long) + 1, torch.zeros_like(p_prev))
    run_start = (start | (in_query & (lidx == last[rid] + 1) & (last[rid] >= 0))
                 | ((lidx == 0) & ~cont[rid]))
    first = torch.cummax(torch.where(run_start | (lidx == 0), gidx, torch.zeros_like(gidx)), 0).values
    seen = seg_cumsum(run_start) > 0
    tok = gidx - first + torch.where(seen, torch.zeros_like(gidx), base[rid])
    page = torch.where(npages[rid] > 0, page, tok)  # no page: ordinary RoPE
    # page counts of requests without history: pages 3s .. 3s + 2 in the row of local token s
    nslot = t + 2 * n
    cpage = torch.where((npages[rid] > 0) & ~has_prev[rid], page, torch.zeros_like(page))  # <= P + 1 <= len + 1
    hist = torch.zeros(nslot, dtype=torch.long, device=dev).index_add_(
        0, seg0 + 2 * rid + cpage, torch.ones_like(cpage))
    want = 3 * lidx[:, None] + torch.arange(3, device=dev)[None, :]
    ok = (want < (npages[rid] + 2)[:, None]) & ~has_prev[rid][:, None]
    idx = (seg0 + 2 * rid)[:, None] + want
    counts = torch.where(ok, hist[idx.clamp(max=max(nslot - 1, 0))], torch.zeros_like(want))
    return tok, page, npages, qpage, counts
