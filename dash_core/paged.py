"""Pure-PyTorch paged DASH: gather through the page table, then the oracle's math.

The correctness path used on the CPU (and by the engine adapters there). It writes K/V and
block summaries into a ``PagedKVCache`` exactly as the GPU kernels do, then evaluates every
new token with ``reference.dash_rows`` on keys gathered through the page table. Slow but exact:
its outputs equal the oracle's (float64 inside, cast to the query dtype).
"""

from __future__ import annotations

import torch

from .layout import PagedKVCache, slots_of
from .params import DashParams
from .reference import block_summaries, dash_rows


def write_kv(cache: PagedKVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``k, v [T, Hkv, D]`` at ``slot_mapping [T]``; negative slots (padding) are skipped."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].to(torch.long)
    page, row = slots // cache.page_size, slots % cache.page_size
    cache.k_pages[page, row] = k[keep].to(cache.dtype)
    cache.v_pages[page, row] = v[keep].to(cache.dtype)


def write_summaries(cache: PagedKVCache, slot_mapping: torch.Tensor, head_cls: torch.Tensor,
                    params: DashParams) -> None:
    """Summarise every block whose last token is among ``slot_mapping`` (SPEC.md section 2).

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
                     params: DashParams, out: torch.Tensor) -> torch.Tensor:
    """DASH for the new tokens of every request, reading K/V (already written) from ``cache``.

    q: ``[T, Hq, D]``; request i owns rows ``cu_seqlens_q[i] .. cu_seqlens_q[i+1] - 1``, which
    are its last positions up to ``seq_lens[i] - 1``. Writes ``out [T, Hq, D]`` and returns it.
    Requests with no new token or ``seq_lens == 0`` (padding) are skipped; their rows are zeroed.
    """
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
        else:
            summ = block_summaries(k, head_cls, bs)
        o, _ = dash_rows(q[lo:hi].permute(1, 0, 2), k, v, summ, positions, params)
        out[lo:hi] = o.permute(1, 0, 2).to(out.dtype)
    return out
