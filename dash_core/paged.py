"""Pure-PyTorch paged DASH: gather through the page table, then the oracle's math.

The correctness path used on the CPU (and by the engine adapters there). It writes K/V and
block summaries into a ``PagedKVCache`` exactly as the GPU kernels do, then evaluates every
new token with ``reference.dash_rows`` on keys gathered through the page table. Slow but exact:
its outputs equal the oracle's (float64 inside, cast to the query dtype).
"""

from __future__ import annotations

from typing import Optional

import torch

from .layout import PagedKVCache, decode_aux, encode_aux, slots_of
from .params import DashParams
from .reference import block_summaries, dash_rows
from .rope import PageRopeSettings, extend_coordinates, page_rope, token_requests


def write_kv(cache: PagedKVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``k, v [T, Hkv, D]`` at ``slot_mapping [T]``; negative slots (padding) are skipped."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].to(torch.long)
    page, row = slots // cache.page_size, slots % cache.page_size
    cache.k_pages[page, row] = k[keep].to(cache.dtype)
    cache.v_pages[page, row] = v[keep].to(cache.dtype)


def write_summaries(cache: PagedKVCache, slot_mapping: torch.Tensor, head_cls: torch.Tensor,
                    params: DashParams) -> None:
    """Summarise every block whose last token is among ``slot_mapping`` (docs/semantics.md section 2).

    With a page size that is a multiple of the block size a block's slots are
    ``bs * j .. bs * j + bs - 1`` for ``j = slot // bs``, so the last slot alone names the
    block; its earlier tokens are already in the cache (written before, or in this batch).
    """
    if cache.summaries is None:
        return
    bs = params.block_size
    slots = slot_mapping[slot_mapping >= 0].to(torch.long)
    last = slots[slots % bs == bs - 1]
    if last.numel() == 0:
        return
    first = last - (bs - 1)
    blk_slots = first[:, None] + torch.arange(bs)[None, :]  # [nb, bs]
    k = cache.keys(blk_slots.reshape(-1)).reshape(last.numel(), bs, cache.num_kv_heads, cache.head_dim)
    s = block_summaries(k.permute(0, 2, 1, 3), head_cls, bs)  # [nb, Hkv, 1, D] float64
    cache.summaries[last // bs] = s[:, :, 0].to(cache.summaries.dtype)


def paged_dash_torch(q: torch.Tensor, cache: PagedKVCache, block_table: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, head_cls: torch.Tensor,
                     params: DashParams, out: torch.Tensor, iq: Optional[torch.Tensor] = None,
                     head_cls_i: Optional[torch.Tensor] = None) -> torch.Tensor:
    """DASH for the new tokens of every request, reading K/V (already written) from ``cache``.

    q: ``[T, Hq, D]``; request i owns rows ``cu_seqlens_q[i] .. cu_seqlens_q[i+1] - 1``, which
    are its last positions up to ``seq_lens[i] - 1``. Writes ``out [T, Hq, D]`` and returns it.
    Requests with no new token or ``seq_lens == 0`` (padding) are skipped; their rows are zeroed.
    Indexer: iq ``[T, Hi, D]`` routes over the summaries of the stored indexer keys (the cache's
    1-head store, or recomputed with ``head_cls_i [D]`` without one).
    """
    if iq is not None:
        icache = cache.indexer_view()
    ps, bs = cache.page_size, params.block_size
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    out.zero_()
    for i, seq_len in enumerate(lens):
        lo, hi = cu[i], cu[i + 1]
        if hi <= lo or seq_len <= 0:
            continue
        positions = torch.arange(seq_len - (hi - lo), seq_len)
        slots = slots_of(block_table[i], torch.arange(seq_len), ps)
        k = cache.keys(slots).permute(1, 0, 2)  # [Hkv, L, D]
        v = cache.values(slots).permute(1, 0, 2)
        nblk = seq_len // bs
        if cache.summaries is not None and ps % bs == 0:
            summ = cache.summaries[slots[: nblk * bs : bs] // bs].permute(1, 0, 2).to(torch.float64)
        elif iq is not None:
            summ = block_summaries(icache.keys(slots).permute(1, 0, 2), head_cls_i[None], bs)
        else:
            summ = block_summaries(k, head_cls, bs)
        qi = None if iq is None else iq[lo:hi].permute(1, 0, 2)
        o, _ = dash_rows(q[lo:hi].permute(1, 0, 2), k, v, summ, positions, params, iq=qi)
        out[lo:hi] = o.permute(1, 0, 2).to(out.dtype)
    return out


# ---------------------------------------------------------------------------------------------
# The auxiliary head in the ops (docs/semantics.md section 9): page RoPE of the new inputs and the rows of
# the new tokens. Tensor ops only (no host reads), shared by the PyTorch and the Triton paths.
# ---------------------------------------------------------------------------------------------


def token_positions(cu_seqlens: torch.Tensor, seq_lens: torch.Tensor, t: int, device) -> torch.Tensor:
    """Positions ``[T]`` int64 of the new tokens: request i's are its last ``cu[i+1] - cu[i]`` positions."""
    rid, lidx = token_requests(cu_seqlens, t, device)
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    return seq_lens.to(device=device, dtype=torch.long)[rid] - (cu[1:] - cu[:-1])[rid] + lidx


def _slots(cache: PagedKVCache, block_table: torch.Tensor, rid: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    ps = cache.page_size
    slot = block_table[rid, pos // ps].to(torch.long) * ps + pos % ps
    return slot.clamp(0, cache.num_slots - 1)  # padded rows: any valid slot (their results are unused)


def prepare_aux(cache: PagedKVCache, q: Optional[torch.Tensor], k: Optional[torch.Tensor],
                iq: Optional[torch.Tensor], ik: Optional[torch.Tensor], roles: Optional[torch.Tensor],
                positions: Optional[torch.Tensor], page_rope: Optional[PageRopeSettings],
                block_table: Optional[torch.Tensor], cu_seqlens_q: Optional[torch.Tensor]):
    """Page RoPE of ``q, k, iq, ik`` and the auxiliary rows of the new tokens (arguments validated).

    q ``[T, Hq, D]``, k ``[T, Hkv, D]`` (None: already written), iq ``[T, Hi, D]``, ik ``[T, D]``,
    roles ``[T]`` (None: all 0), positions ``[T]``. In page mode (``page_rope`` given) the new tokens'
    coordinates continue the stored row of each request's previous token (``extend_coordinates``)
    when ``k`` is given; with ``k = None`` they are read back from the rows already written at the
    query tokens' slots. Without page mode nothing is rotated and rows store ``tok = page = position``.
    Returns ``(q, k, iq, ik, rows)`` with rows ``[T, 2D]`` in the KV dtype, or None when nothing is to
    be written (no ``k``, or a cache without ``aux``).
    """
    x = k if k is not None else q
    t, dev, d = x.shape[0], x.device, cache.head_dim
    if page_rope is None:
        if k is None or cache.aux is None:
            return q, k, iq, ik, None
        pos = positions.to(torch.long) if positions is not None else torch.zeros(t, dtype=torch.long, device=dev)
        zero = torch.zeros(t, dtype=torch.long, device=dev)
        rows = encode_aux(ik, zero, pos, pos, zero, zero, head_dim=d, dtype=cache.dtype, check=False)
        return q, k, iq, ik, rows
    n = cu_seqlens_q.shape[0] - 1
    rid, _ = token_requests(cu_seqlens_q, t, dev)
    pos = positions.to(device=dev, dtype=torch.long)
    rows = None
    if k is None:
        st = decode_aux(cache.aux_rows(_slots(cache, block_table, rid, pos)), d)
        tok, page = st.tok, st.page
    else:
        cu = cu_seqlens_q.to(device=dev, dtype=torch.long)
        first = pos[cu[:-1].clamp(max=max(t - 1, 0))] if t else torch.zeros(n, dtype=torch.long, device=dev)
        has_prev = (first > 0) & (cu[1:] > cu[:-1])
        req = torch.arange(n, device=dev)
        prev = decode_aux(cache.aux_rows(_slots(cache, block_table, req, (first - 1).clamp(min=0))), d)
        r = roles.to(device=dev, dtype=torch.long) if roles is not None else torch.zeros(t, dtype=torch.long,
                                                                                          device=dev)
        tok, page, npages, qpage, counts = extend_coordinates(r, cu_seqlens_q, has_prev, prev.tok, prev.page,
                                                              prev.num_pages, prev.query_page)
        k = _page_rope(k, tok, page, page_rope, True)
        ik = _page_rope(ik, tok, page, page_rope, False)
        rows = encode_aux(ik, r, tok, page, npages[rid], qpage[rid], head_dim=d, dtype=cache.dtype,
                          counts=counts, check=False)
    return (_page_rope(q, tok, page, page_rope, True), k, _page_rope(iq, tok, page, page_rope, False), ik, rows)


def _page_rope(x, tok, page, settings, main):
    return None if x is None else page_rope(x, tok, page, settings, main=main)


def write_aux(cache: PagedKVCache, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store auxiliary ``rows [T, 2D]`` at ``slot_mapping [T]``; negative slots (padding) are skipped.

    No host reads: a padded row rewrites the first kept row's slot with that row's value (or slot 0
    with its own value when no row is kept), so the writes stay graph-safe and deterministic.
    """
    t = rows.shape[0]
    if t == 0:
        return
    keep = slot_mapping >= 0
    src = torch.where(keep, torch.arange(t, device=rows.device), keep.to(torch.long).argmax())
    any_keep = keep.any()
    slots = torch.where(any_keep, slot_mapping.to(torch.long)[src], torch.zeros_like(src))
    page, row = slots // cache.page_size, slots % cache.page_size
    vals = torch.where(any_keep, rows[src], cache.aux[page, row])
    cache.aux[page, row] = vals
