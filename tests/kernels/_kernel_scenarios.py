"""Random paged decode scenarios for the kernel tests: caches in either engine's layout, shuffled
page tables, shared prefix pages, padded rows; plus the oracle's view of each request."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

import torch
from hypothesis import strategies as st

from dash_core import DashParams
from dash_core.layout import PagedKVCache, alloc_summaries, slots_of
from dash_core.reference import block_summaries


@dataclass
class Scenario:
    params: DashParams
    cache: PagedKVCache
    block_table: torch.Tensor  # [n, max_pages] int32
    seq_lens: torch.Tensor  # [n] int32, 0 = padded row
    q: torch.Tensor  # [n, Hq, D] decode queries (position seq_len - 1)
    k_new: torch.Tensor  # [n, Hkv, D] the decode token's K/V
    v_new: torch.Tensor
    slot_mapping: torch.Tensor  # [n] int64, -1 for padded rows
    head_cls: torch.Tensor  # [Hkv, D]
    k_full: List[Optional[torch.Tensor]]  # per request [Hkv, L, D] (cache dtype), None if padded
    v_full: List[Optional[torch.Tensor]]
    storage: tuple  # the engine tensors behind the cache views

    @property
    def n(self) -> int:
        return self.q.shape[0]

    def slots(self, i: int) -> torch.Tensor:
        """Slots of every position of request i."""
        return slots_of(self.block_table[i].cpu(), torch.arange(int(self.seq_lens[i])), self.cache.page_size)

    def stored_summaries(self, i: int) -> torch.Tensor:
        """Summaries of request i's complete blocks read back from the store: ``[Hkv, nblk, D]`` float64."""
        bs = self.params.block_size
        slots = self.slots(i)
        nblk = int(self.seq_lens[i]) // bs
        return self.cache.summaries.cpu()[slots[: nblk * bs: bs] // bs].permute(1, 0, 2).double()


def batch_lens(checked: st.SearchStrategy, others: st.SearchStrategy, max_others: int = 3) -> st.SearchStrategy:
    """A decode batch's lengths in any order: one drawn from ``checked`` (long enough that the test's check has
    something to check: candidates to route, a block to complete) and up to ``max_others`` from ``others`` (0: a
    padded row). Hypothesis tries the simplest batch first, which would otherwise be one padded row."""
    return st.tuples(checked, st.lists(others, max_size=max_others)).flatmap(
        lambda t: st.permutations([t[0], *t[1]]))


def make_scenario(seed: int, lens: List[int], *, hq: int = 4, hkv: int = 2, d: int = 64, bs: int = 16,
                  pages_per_block: int = 1, layout: str = "sglang", dtype=torch.bfloat16,
                  params: Optional[DashParams] = None, shared_prefix_pages: int = 0, extra_pages: int = 3,
                  spare_table_pages: int = 1, q_scale: float = 1.0, device="cpu") -> Scenario:
    """Build a cache holding ``lens[i] - 1`` history tokens per request (written with the torch path),
    and the decode token of each request (not yet written). ``lens[i] == 0`` is a padded row.

    Request 1 shares its first ``shared_prefix_pages`` pages with request 0 (same page ids, same keys).
    """
    g = torch.Generator().manual_seed(seed)
    params = params or DashParams(block_size=bs)
    ps = bs * pages_per_block
    n = len(lens)
    need = [-(-length // ps) for length in lens]
    shared = 0
    if n >= 2 and shared_prefix_pages and lens[0] > 0 and lens[1] > 0:
        shared = min(shared_prefix_pages, (lens[0] - 1) // ps, (lens[1] - 1) // ps)
    max_pages = max(need) + spare_table_pages
    total = sum(need) - shared + extra_pages
    perm = torch.randperm(total, generator=g).to(torch.int32)
    bt = torch.randint(0, total, (n, max_pages), generator=g, dtype=torch.int32)  # junk past the end
    nxt = 0
    for i in range(n):
        for j in range(need[i]):
            if i == 1 and j < shared:
                bt[1, j] = bt[0, j]
            else:
                bt[i, j] = perm[nxt]
                nxt += 1
    num_slots = total * ps
    if layout == "sglang":
        kb = torch.zeros(num_slots, hkv, d, dtype=dtype)
        vb = torch.zeros(num_slots, hkv, d, dtype=dtype)
        storage = (kb, vb)
        summ = alloc_summaries(num_slots, bs, hkv, d, dtype)
        cache = PagedKVCache.from_sglang(kb, vb, ps, summ)
    else:  # vllm: [num_blocks, H_slots, block_size, C] with spare head slots and channels
        kv = torch.zeros(total, hkv + 1, ps, 2 * d + 16, dtype=dtype)
        storage = (kv,)
        summ = alloc_summaries(num_slots, bs, hkv, d, dtype)
        cache = PagedKVCache.from_vllm(kv, hkv, d, summ)
    head_cls = torch.randn(hkv, d, generator=g).to(dtype)
    k_full, v_full = [], []
    q = torch.randn(n, hq, d, generator=g) * q_scale
    for i, L in enumerate(lens):
        if L == 0:
            k_full.append(None)
            v_full.append(None)
            continue
        k = torch.randn(hkv, L, d, generator=g)
        # give keys a per-block offset so that summaries differ in scale and routing is not flat
        k = k + 0.5 * torch.randn(hkv, -(-L // bs), d, generator=g).repeat_interleave(bs, 1)[:, :L]
        v = torch.randn(hkv, L, d, generator=g)
        if i == 1 and shared:
            k[:, : shared * ps] = k_full[0][:, : shared * ps].float()
            v[:, : shared * ps] = v_full[0][:, : shared * ps].float()
        k_full.append(k.to(dtype))
        v_full.append(v.to(dtype))
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    sc = Scenario(params, cache, bt, seq_lens, q.to(dtype), torch.zeros(n, hkv, d, dtype=dtype),
                  torch.zeros(n, hkv, d, dtype=dtype), torch.full((n,), -1, dtype=torch.int64), head_cls,
                  k_full, v_full, storage)
    for i, L in enumerate(lens):
        if L == 0:
            continue
        slots = sc.slots(i)
        sc.slot_mapping[i] = slots[-1]
        sc.k_new[i] = k_full[i][:, -1]
        sc.v_new[i] = v_full[i][:, -1]
        hist = slots[:-1]
        pg, row = hist // ps, hist % ps
        cache.k_pages[pg, row] = k_full[i][:, :-1].permute(1, 0, 2)
        cache.v_pages[pg, row] = v_full[i][:, :-1].permute(1, 0, 2)
        nblk = (L - 1) // bs
        if nblk:
            s = block_summaries(k_full[i][:, : nblk * bs], head_cls, bs)  # [Hkv, nblk, D]
            cache.summaries[hist[: nblk * bs: bs] // bs] = s.permute(1, 0, 2).to(dtype)
    if device != "cpu":
        sc = sc.to(device)
    return sc


def _to(x, device):
    return x.to(device) if isinstance(x, torch.Tensor) else x


def scenario_to(sc: Scenario, device) -> Scenario:
    storage = tuple(t.to(device) for t in sc.storage)
    summ = sc.cache.summaries.to(device)
    if len(storage) == 2:
        cache = PagedKVCache.from_sglang(storage[0], storage[1], sc.cache.page_size, summ)
    else:
        cache = PagedKVCache.from_vllm(storage[0], sc.cache.num_kv_heads, sc.cache.head_dim, summ)
    return Scenario(sc.params, cache, _to(sc.block_table, device), _to(sc.seq_lens, device), _to(sc.q, device),
                    _to(sc.k_new, device), _to(sc.v_new, device), _to(sc.slot_mapping, device),
                    _to(sc.head_cls, device), sc.k_full, sc.v_full, storage)


Scenario.to = scenario_to


def oracle_scaled_query(sc: Scenario, i: int) -> torch.Tensor:
    """``sf * q`` rounded to the query dtype, as the kernels form it: ``[Hq, 1, D]``."""
    return (sc.q[i].cpu() * sc.params.scaling_factor).to(sc.q.dtype)[:, None, :]


def x_scale(d: int) -> float:
    return 0.5 / math.sqrt(d)


# --- the oracle's view, stage by stage -------------------------------------------------------

EXCUSE = 1e-6  # docs/semantics.md section 7: near-threshold entries that fp32 and float64 may decide apart


def near_decisions(x: torch.Tensor, mp: torch.Tensor, topk: Optional[int]):
    """The entries of one unit's candidates that docs/semantics.md section 7 lets two implementations decide apart, as
    ``(near_tau, near_k)`` ``[c]`` bool: ``|x - tau| <= EXCUSE`` for some head (``x [heads, c]`` float64 scores,
    ``tau`` each head's 1.5-entmax threshold), and ``mp [c]`` within EXCUSE (relative) of the ``topk``-th largest."""
    from dash_core.reference import entmax15_threshold

    tau = entmax15_threshold(x, torch.ones_like(x, dtype=torch.bool))
    near_tau = ((x - tau[:, None]).abs() <= EXCUSE).any(0)
    near_k = torch.zeros_like(near_tau)
    if topk is not None and int((mp > 0).sum()) > topk:
        mp_k = torch.sort(mp, descending=True).values[topk - 1]
        near_k = (mp - mp_k).abs() <= EXCUSE * mp_k
    return near_tau, near_k


def assert_few_differ(groups: dict, fraction: float) -> None:
    """End to end, routing is discontinuous (a block at a threshold may go either way): at most ``fraction`` of each
    group's rows (``{name: bool mask}``, True = outside the attention tolerance) and of all of them may differ from
    the oracle; a group of few rows keeps one row of slack (one block at a threshold)."""
    for name, bad in groups.items():
        assert int(bad.sum()) <= max(1, fraction * bad.numel()), \
            f"{name}: {int(bad.sum())} of {bad.numel()} rows differ from the oracle"
    bad, checked = sum(int(b.sum()) for b in groups.values()), sum(b.numel() for b in groups.values())
    assert bad <= fraction * checked, f"{bad} of {checked} rows differ from the oracle"


def assert_rows_match(bad: dict, excused: dict, max_excused: float = 0.1) -> None:
    """End to end against the oracle fed the kernels' own inputs: no row may miss the attention tolerance
    (``bad``: ``{name: bool mask}``, excused rows already cleared), and at most ``max_excused`` of all rows may be
    excused (``excused``: the same groups' masks of rows of a unit with a near-threshold decision, ``excused_heads``),
    so that the check is not vacuous."""
    for name, rows in bad.items():
        assert not rows.any(), f"{name}: {int(rows.sum())} of {rows.numel()} rows differ from the oracle"
    n_excused, n_rows = sum(int(x.sum()) for x in excused.values()), sum(x.numel() for x in excused.values())
    assert n_excused <= max_excused * n_rows, f"{n_excused} of {n_rows} rows excused"


def summary_tolerance(dtype) -> dict:
    """Summaries are rounded to the KV dtype: an fp32 kernel and the float64 oracle may land one
    unit in the last place apart (2^-7 relative for bf16, 2^-10 for fp16); 1e-5 absolute covers
    the fp32 arithmetic near zero."""
    return {"rtol": (2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10) * 1.01, "atol": 1e-5}


def excused_heads(mp: torch.Tensor, x: torch.Tensor, ncand: torch.Tensor, topk: Optional[int],
                  hq: int) -> torch.Tensor:
    """``[R, hq]`` bool: the query heads of each row whose selection unit has a decision docs/semantics.md section 7
    lets two implementations take apart: a score near a head's threshold, or a second mp at the ``topk``-th (which is
    itself always near it). ``mp [Hsel, R, nblk]`` (the oracle's routing), ``x [Hx, R, nblk]`` the scores (unit u's
    heads are the u-th ``Hx / Hsel`` of them; every head with one unit), ``ncand [R]``. End-to-end tests count no row
    of such a unit."""
    hsel = mp.shape[0]
    gx, go = x.shape[0] // hsel, hq // hsel
    out = torch.zeros(len(ncand), hq, dtype=torch.bool)
    for r, c in enumerate(ncand.tolist()):
        for u in range(hsel if c else 0):
            near_tau, near_k = near_decisions(x[u * gx:(u + 1) * gx, r, :c], mp[u, r, :c], topk)
            out[r, u * go:(u + 1) * go] = bool(near_tau.any()) or int(near_k.sum()) > 1
    return out


def oracle_route(sc: Scenario, i: int, summaries: Optional[torch.Tensor] = None):
    """The oracle's routing of request i's decode row, fed ``summaries`` (default: the stored ones)
    and the kernels' ``sf * q``. Returns ``(routing, x [Hq, ncand], ncand)``; with no candidate (or a padded row), an
    empty selection for every unit."""
    from dash_core.reference import Routing, route

    p = sc.params
    L = int(sc.seq_lens[i])
    ncand = max(0, (L - 1) // p.block_size - p.local_blocks + 1)
    summ = (summaries if summaries is not None else sc.stored_summaries(i))[:, :ncand]
    qs = oracle_scaled_query(sc, i)
    hq, d = qs.shape[0], qs.shape[2]
    g = hq // summ.shape[0]
    if ncand == 0:  # nothing to route: an empty selection for every unit
        z = torch.zeros(p.selection_units(sc.cache.num_kv_heads), 1, 0, dtype=torch.float64)
        return Routing(mp=z, kept=z.bool(), prior=z), torch.zeros(hq, 0, dtype=torch.float64), 0
    rt = route(qs, summ, torch.tensor([ncand]), p)
    x = 0.5 * torch.einsum("hd,hjd->hj", qs[:, 0].double(), summ.repeat_interleave(g, 0)) / math.sqrt(d)
    return rt, x, ncand


def unit_rows(sc: Scenario, u: int) -> slice:
    hq, hkv = sc.q.shape[1], sc.cache.num_kv_heads
    if sc.params.router == "shared":
        return slice(0, hq)
    g = hq // hkv
    return slice(u * g, (u + 1) * g)


def selection_mismatches(sc: Scenario, i: int, u: int, kernel_kept: set, rt, x) -> list:
    """Blocks on which the kernel's kept set and the oracle's differ, less the entries docs/semantics.md
    section 7 exempts (``near_decisions``)."""
    oracle_kept = set(torch.nonzero(rt.kept[u, 0]).flatten().tolist())
    diff = sorted(kernel_kept ^ oracle_kept)
    if not diff:
        return []
    near_tau, near_k = near_decisions(x[unit_rows(sc, u)], rt.mp[u, 0], sc.params.topk)
    return [j for j in diff if not (near_tau[j] or near_k[j])]


def kernel_selection(bufs, i: int, u: int):
    """(kept logical blocks, physical blocks, log priors) of unit u of row i from the buffers."""
    c = int(bufs.sel_count[i, u])
    return (bufs.sel_idx[i, u, :c].cpu().tolist(), bufs.sel_blk[i, u, :c].cpu().tolist(),
            bufs.sel_bias[i, u, :c].cpu().double())


def write_decode_token_torch(sc: Scenario) -> None:
    """Write each request's decode K/V with the torch path (for attention-only tests)."""
    from dash_core.paged import write_kv

    write_kv(sc.cache, sc.k_new, sc.v_new, sc.slot_mapping)


def oracle_decode_rows(sc: Scenario, i: int) -> torch.Tensor:
    """Pure float64 DASH (summaries recomputed from the keys) of request i's decode row: ``[Hq, D]``."""
    from dash_core.reference import dash_rows

    L = int(sc.seq_lens[i])
    k, v = sc.k_full[i], sc.v_full[i]
    summ = block_summaries(k, sc.head_cls.cpu(), sc.params.block_size)
    out, _ = dash_rows(sc.q[i].cpu()[:, None, :], k, v, summ, torch.tensor([L - 1]), sc.params)
    return out[:, 0]


def truncated(sc: Scenario, lens: List[int], seed: int) -> Scenario:
    """The same cache and page tables at shorter lengths ``lens`` (<= the built ones), with fresh
    decode queries: the decode token of row i is position ``lens[i] - 1`` of its full keys."""
    g = torch.Generator().manual_seed(seed)
    dev = sc.q.device
    q = (torch.randn(sc.q.shape, generator=g)).to(sc.q.dtype).to(dev)
    k_new, v_new = torch.zeros_like(sc.k_new), torch.zeros_like(sc.v_new)
    slot_mapping = torch.full_like(sc.slot_mapping, -1)
    k_full, v_full = [], []
    for i, L in enumerate(lens):
        if L == 0:
            k_full.append(None)
            v_full.append(None)
            continue
        assert L <= int(sc.seq_lens[i])
        k_full.append(sc.k_full[i][:, :L])
        v_full.append(sc.v_full[i][:, :L])
        k_new[i] = k_full[i][:, -1].to(dev)
        v_new[i] = v_full[i][:, -1].to(dev)
        slot_mapping[i] = int(slots_of(sc.block_table[i].cpu(), torch.tensor([L - 1]), sc.cache.page_size)[0])
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    return Scenario(sc.params, sc.cache, sc.block_table, seq_lens, q, k_new, v_new, slot_mapping, sc.head_cls,
                    k_full, v_full, sc.storage)


def forget_summaries_from(sc: Scenario, lens: List[int]) -> None:
    """Zero the stored summaries of every block not complete before position ``lens[i] - 1``."""
    bs = sc.params.block_size
    for i, L in enumerate(lens):
        full = int(sc.seq_lens[i])
        if full == 0:
            continue
        first = max(L - 1, 0) // bs
        slots = slots_of(sc.block_table[i].cpu(), torch.arange(full), sc.cache.page_size)
        idx = slots[first * bs: (full // bs) * bs: bs] // bs
        sc.cache.summaries[idx.to(sc.cache.summaries.device)] = 0
