"""Random paged extend batches for the prefill kernel tests, built on the decode scenarios.

A case is ``n`` requests; request i has ``total_i`` tokens after the extend, of which the last
``new_i`` are new (its history is ``total_i - new_i`` tokens, possibly 0). The cache, page tables,
head_cls and every key/value come from ``_kernel_scenarios.make_scenario`` (shuffled pages, either
engine's layout, optional shared prefix pages); the history and its summaries are in the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from dash_core import DashParams
from dash_core.kernels.prefill import launch as pf_launch, route as pf_route, tiles as pf_tiles
from dash_core.kernels.prefill.config import PrefillConfig
from dash_core.reference import Routing, route, routing_scores
from tests.kernels._kernel_scenarios import Scenario, make_scenario, near_decisions


@dataclass
class PrefillCase:
    sc: Scenario  # cache, page tables, head_cls, full keys/values per request
    reqs: List[Tuple[int, int]]  # (total, new) per request
    seq_lens: torch.Tensor  # [n] int32, after the extend
    cu: torch.Tensor  # [n + 1] int32
    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hkv, D] new keys (also in sc.k_full)
    v: torch.Tensor
    slot_mapping: torch.Tensor  # [T] int64

    @property
    def params(self) -> DashParams:
        return self.sc.params

    @property
    def cache(self):
        return self.sc.cache

    @property
    def block_table(self):
        return self.sc.block_table

    @property
    def head_cls(self):
        return self.sc.head_cls

    def positions(self, i: int) -> torch.Tensor:
        total, new = self.reqs[i]
        return torch.arange(total - new, total)

    def rows(self, i: int) -> slice:
        return slice(int(self.cu[i]), int(self.cu[i + 1]))

    def slots(self, i: int, positions: torch.Tensor) -> torch.Tensor:
        ps = self.cache.page_size
        return self.sc.block_table[i].cpu()[positions // ps].long() * ps + positions % ps


def make_prefill_case(seed: int, reqs: List[Tuple[int, int]], *, q_scale: float = 1.0, device="cpu",
                      **scenario_kw) -> PrefillCase:
    """``reqs``: ``(total, new)`` per request (``(0, 0)`` = a padded request). ``scenario_kw`` go to
    ``make_scenario`` (hq, hkv, d, bs, pages_per_block, layout, dtype, params, shared_prefix_pages)."""
    lens = [t + 1 if t > 0 else 0 for t, _ in reqs]  # the scenario's extra decode token is unused
    sc = make_scenario(seed, lens, **scenario_kw)
    g = torch.Generator().manual_seed(seed + 1)
    dtype = sc.q.dtype
    hq, d = sc.q.shape[1], sc.q.shape[2]
    cu = [0]
    ks, vs, slots = [], [], []
    for i, (total, new) in enumerate(reqs):
        cu.append(cu[-1] + new)
        if new:
            pos = torch.arange(total - new, total)
            ks.append(sc.k_full[i][:, total - new: total].permute(1, 0, 2))
            vs.append(sc.v_full[i][:, total - new: total].permute(1, 0, 2))
            ps = sc.cache.page_size
            slots.append(sc.block_table[i][pos // ps].long() * ps + pos % ps)
        if total:  # keys beyond `total` (the scenario's decode token) are not part of this case
            sc.k_full[i] = sc.k_full[i][:, :total]
            sc.v_full[i] = sc.v_full[i][:, :total]
    t = cu[-1]
    hkv = sc.cache.num_kv_heads
    q = (torch.randn(t, hq, d, generator=g) * q_scale).to(dtype)
    k = torch.cat(ks) if ks else torch.zeros(0, hkv, d, dtype=dtype)
    v = torch.cat(vs) if vs else torch.zeros(0, hkv, d, dtype=dtype)
    sm = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64)
    case = PrefillCase(sc, list(reqs), torch.tensor([r[0] for r in reqs], dtype=torch.int32),
                       torch.tensor(cu, dtype=torch.int32), q, k, v, sm)
    return case.to(device) if device != "cpu" else case


def case_to(case: PrefillCase, device) -> PrefillCase:
    return PrefillCase(case.sc.to(device), case.reqs, case.seq_lens.to(device), case.cu.to(device),
                       case.q.to(device), case.k.to(device), case.v.to(device), case.slot_mapping.to(device))


PrefillCase.to = case_to


def wipe_new_tokens(case: PrefillCase) -> None:
    """Zero the cache slots of the new tokens and the summaries of the blocks they complete, so that a
    call that writes them is checked for writing them."""
    bs = case.params.block_size
    cache = case.cache
    ps = cache.page_size
    for i, (total, new) in enumerate(case.reqs):
        if not new:
            continue
        pos = case.positions(i)
        sl = case.slots(i, pos).to(cache.k_pages.device)
        cache.k_pages[sl // ps, sl % ps] = 0
        cache.v_pages[sl // ps, sl % ps] = 0
        last = pos[pos % bs == bs - 1]
        if last.numel():
            cache.summaries[(case.slots(i, last) // bs).to(cache.summaries.device)] = 0


def stored_summaries(case: PrefillCase, i: int) -> torch.Tensor:
    """Summaries of request i's complete blocks as stored: ``[Hkv, total // bs, D]`` float64."""
    bs = case.params.block_size
    total = case.reqs[i][0]
    nblk = total // bs
    blk_slots = case.slots(i, torch.arange(nblk) * bs)
    return case.cache.summaries.cpu()[blk_slots // bs].permute(1, 0, 2).double()


def scaled_queries(case: PrefillCase, i: int) -> torch.Tensor:
    """``sf * q`` rounded to the query dtype, as the kernels form it: ``[Hq, R, D]``."""
    q = case.q[case.rows(i)].cpu()
    return (q * case.params.scaling_factor).to(q.dtype).permute(1, 0, 2)


def oracle_routing(case: PrefillCase, i: int, summaries: Optional[torch.Tensor] = None) -> Tuple[Routing, torch.Tensor]:
    """The oracle's routing of request i's new rows fed ``summaries`` (default: the stored ones) and
    the kernels' ``sf * q``. Returns ``(routing [Hsel, R, nblk], x [Hq, R, nblk])``."""
    p = case.params
    pos = case.positions(i)
    ncand = (pos // p.block_size - p.local_blocks + 1).clamp(min=0)
    nblk = int(ncand.max()) if ncand.numel() else 0
    summ = (summaries if summaries is not None else stored_summaries(case, i))[:, :nblk]
    qs = scaled_queries(case, i)
    hq, r, _ = qs.shape
    hsel = 1 if p.router == "shared" else case.cache.num_kv_heads
    if nblk == 0:
        z = torch.zeros(hsel, r, 0, dtype=torch.float64)
        return Routing(z, z.bool(), z), torch.zeros(hq, r, 0, dtype=torch.float64)
    return route(qs, summ, ncand, p), routing_scores(qs, summ)


def exempt(case: PrefillCase, rt: Routing, x: torch.Tensor, unit: int, row: int, ncand: int) -> torch.Tensor:
    """``[nblk]`` bool: entries docs/semantics.md section 7 lets two implementations decide apart
    (``near_decisions``)."""
    p = case.params
    hq = x.shape[0]
    g = hq // case.cache.num_kv_heads
    heads = slice(0, hq) if p.router == "shared" else slice(unit * g, (unit + 1) * g)
    near_tau, near_k = near_decisions(x[heads, row, :ncand], rt.mp[unit, row, :ncand], p.topk)
    out = torch.zeros(rt.mp.shape[-1], dtype=torch.bool)
    out[:ncand] = near_tau | near_k
    return out


# --- the kernels' stages, one wave covering every tile ----------------------------------------------


def plan_and_scratch(case: PrefillCase, config: Optional[PrefillConfig] = None, recompute: Optional[bool] = None):
    """The plan and scratch of one call; config: the kernels' tuning (default: one wave covering every tile);
    recompute: route without a score scratch (from the summary copy, made here as the op makes it), None: where the
    op would (``pf_route.recompute_routing``)."""
    p = case.params
    config = PrefillConfig(scratch_bytes=1 << 40) if config is None else config
    plan, scratch = pf_launch.plan_and_scratch(case.q, case.cache, case.block_table, case.cu, case.seq_lens, p,
                                               config, recompute=recompute)
    pf_route.gather_summaries(case.cache, case.block_table, case.seq_lens, p, scratch)
    return plan, scratch


def token_slots(case: PrefillCase, plan) -> dict:
    """``{(request, position): slot}`` for the one-wave layout (slot ``tile * QT + position - a0``)."""
    slots = {}
    for w, (i, a0, lo, hi, _) in enumerate(pf_tiles.tile_layout_host(case.cu, case.seq_lens, plan.qt)):
        assert w < plan.num_tiles
        for pos in range(lo, hi):
            slots[(i, pos)] = w * plan.qt + pos - a0
    return slots
