"""Routing (stage 2 + prior) of the Triton kernels against the oracle, fed the same summaries and
the same ``sf * q``: the kept sets must be equal except the entries docs/semantics.md section 7 exempts."""

from __future__ import annotations

import itertools
import os

import torch
from hypothesis import given, settings, strategies as st

from dash_core import DashParams
from dash_core.kernels import routing
from dash_core.kernels.decode import launch as decode_launch
from dash_core.kernels.decode.buffers import DecodeBuffers
from dash_core.kernels.decode.config import DecodeConfig
from tests.kernels._kernel_env import KERNEL_DEVICE
from tests.kernels._kernel_scenarios import (batch_lens, kernel_selection, make_scenario, oracle_route,
                                            selection_mismatches)

EXAMPLES = int(os.environ.get("DASH_KERNEL_EXAMPLES", "10"))
DEV = KERNEL_DEVICE


def check_routing(sc, bufs) -> None:
    p = sc.params
    hsel = bufs.sel_count.shape[1]
    for i in range(sc.n):
        rt, x, ncand = oracle_route(sc, i)
        for u in range(hsel):
            idx, blk, bias = kernel_selection(bufs, i, u)
            assert idx == sorted(set(idx)), f"row {i} unit {u}: kept blocks not increasing/unique: {idx}"
            assert all(0 <= j < ncand for j in idx), f"row {i} unit {u}: {idx} outside 0..{ncand - 1}"
            if p.topk is not None:
                assert len(idx) <= p.topk
            bad = selection_mismatches(sc, i, u, set(idx), rt, x)
            assert not bad, (f"row {i} unit {u}: blocks {bad} differ (kernel {idx}, oracle "
                             f"{torch.nonzero(rt.kept[u, 0]).flatten().tolist()})")
            if not idx:
                continue
            # physical block = the summary index of the logical block (slot // bs)
            slots = sc.slots(i)
            assert blk == (slots[torch.tensor(idx) * p.block_size] // p.block_size).tolist()
            kept_o = set(torch.nonzero(rt.kept[u, 0]).flatten().tolist())
            if p.estimate_diagonal and set(idx) != kept_o:  # the prior is normalised over the (differing) kept set
                continue
            # log prior of the blocks both keep: fp32 vs float64; mp = (x - tau)^2 loses relative
            # precision as x nears tau, so compare pi with 1e-5 absolute + 1e-3 relative
            common = [n for n, j in enumerate(idx) if rt.kept[u, 0, j]]
            pi_k = bias[common].exp()
            pi_o = rt.prior[u, 0, [idx[n] for n in common]]
            torch.testing.assert_close(pi_k, pi_o, atol=1e-5, rtol=1e-3)
        if int(sc.seq_lens[i]) == 0:
            assert int(bufs.sel_count[i].abs().sum()) == 0


@settings(max_examples=EXAMPLES, deadline=None)
@given(seed=st.integers(0, 2**31 - 1),
       # one request with at least two candidates at every local window drawn
       lens=batch_lens(st.integers(80, 260), st.one_of(st.integers(0, 40), st.integers(40, 260))),
       router=st.sampled_from(["kv_head", "shared"]), topk=st.one_of(st.none(), st.integers(1, 8)),
       est=st.booleans(), sigma=st.sampled_from([1.0, 1e6]), sf=st.sampled_from([0.7, 2.0, 4.0, 0.0]),
       local_blocks=st.integers(1, 2), ppb=st.integers(1, 3), layout=st.sampled_from(["sglang", "vllm"]),
       group=st.sampled_from([1, 2, 4]), dtype=st.sampled_from([torch.bfloat16, torch.float16]),
       splits=st.integers(1, 3))
def test_routing_matches_oracle(seed, lens, router, topk, est, sigma, sf, local_blocks, ppb, layout, group, dtype,
                                splits):
    """sigma 1 next to the default 1e6, which flattens the estimated-diagonal prior."""
    bs = 16
    p = DashParams(block_size=bs, topk=topk, local=bs * local_blocks, scaling_factor=sf, estimate_diagonal=est,
                   sigma=sigma, router=router)
    sc = make_scenario(seed, lens, hq=2 * group, hkv=2, bs=bs, pages_per_block=ppb, layout=layout, dtype=dtype,
                       params=p, shared_prefix_pages=1).to(DEV)
    bufs = DecodeBuffers.for_step(sc.q, sc.cache, sc.block_table, p, splits=(splits, 1))
    decode_launch.route(sc.q, sc.cache, sc.block_table, sc.seq_lens, p, bufs)
    check_routing(sc, bufs)


def test_small_topk_on_few_candidates():
    """topk 1-3 over a few candidates (a select tile of 16 keys): on the H200 the radix select on such tiles, with
    its keys in registers, kept the wrong block (23 of 600 short cases in a sweep; now the pivot search runs there;
    ``RADIX_MIN_KEYS``)."""
    for seed in range(4):
        for lens in ([0, 0, 41], [41], [100]):
            _route_small_topk(seed, lens)


def test_small_topk_on_the_smallest_radix_tile():
    """topk 1-3 where the radix select still runs: 129-256 candidates, a select tile of ``RADIX_MIN_KEYS`` keys."""
    assert routing.RADIX_MIN_KEYS.value == 256
    for seed in range(2):
        _route_small_topk(seed, [2100, 16 * 250 + 3])  # 132 and 251 candidates


def test_radix_select_where_the_kernel_runs_it():
    """The kernel's radix select (``routing.radix_kth``, run alone by ``tests/kernels/_radix_probe.py``) on tiles of
    as many keys as the select program has threads (at least ``RADIX_MIN_KEYS``) and more, one key per thread, with
    keys made in registers as the kernel makes them, at ``DecodeConfig.select_warps``: every histogram and
    topk-th key right (on the H200 smaller, replicated tiles get wrong keys in a few percent of the cases, which 40
    cases a shape would catch; the kernel runs the pivot search there)."""
    from tests.kernels._radix_probe import probe

    g = torch.Generator().manual_seed(0)
    config = DecodeConfig()
    smallest = routing.radix_min_keys(config.select_warps)
    for ts in (smallest, 2 * smallest):
        for nh in (2, 4):
            assert probe(DEV, ts, nh, True, config.select_warps, 40, g) == (0, 0)


def test_rank_select_against_torch():
    """The cap's rank search (``routing.rank_kth``) alone on lists up to ``DecodeConfig.cap_rank_max`` long, with
    and without ties at the threshold, on a program of ``DecodeConfig.select_warps`` warps: the key and its counts."""
    from tests.kernels._radix_probe import rank_probe

    g = torch.Generator().manual_seed(1)
    config = DecodeConfig()
    assert rank_probe(DEV, config.cap_rank_max, config.cap_rank_chunk, config.select_warps, 40, g) == 0


def _route_small_topk(seed, lens):
    """topk 1-3 with two query heads a KV head, and with one (keys made from a one-row tile: the prefill route
    kernel's cap compiled wrong there, ``prefill.route.scores_in_registers``); odd seeds with the estimated-diagonal
    prior (sigma 1: informative)."""
    for topk, hq in itertools.product((1, 2, 3), (4, 2)):
        p = DashParams(block_size=16, topk=topk, scaling_factor=0.7, sigma=1.0, estimate_diagonal=seed % 2 == 1)
        sc = make_scenario(seed, lens, hq=hq, hkv=2, bs=16, params=p, shared_prefix_pages=1).to(DEV)
        bufs = DecodeBuffers.for_step(sc.q, sc.cache, sc.block_table, p, splits=(1, 1))
        decode_launch.route(sc.q, sc.cache, sc.block_table, sc.seq_lens, p, bufs)
        check_routing(sc, bufs)


def test_topk_ties_go_to_lower_blocks():
    """sf = 0 makes every candidate score 0: equal mp everywhere, so the cap keeps the first topk."""
    p = DashParams(block_size=16, topk=3, scaling_factor=0.0)
    sc = make_scenario(3, [200, 97], params=p).to(DEV)
    bufs = DecodeBuffers.for_step(sc.q, sc.cache, sc.block_table, p, splits=(2, 1))
    decode_launch.route(sc.q, sc.cache, sc.block_table, sc.seq_lens, p, bufs)
    for i in range(2):
        rt, _, ncand = oracle_route(sc, i)
        assert ncand > 3
        for u in range(2):
            idx, _, bias = kernel_selection(bufs, i, u)
            assert idx == [0, 1, 2] == torch.nonzero(rt.kept[u, 0]).flatten().tolist()
            # all scores equal: three Halley steps from [-1, 0] give tau, every mp = (0 - tau)^2 > 0, the same prior
            torch.testing.assert_close(bias.double().exp(), rt.prior[u, 0, idx], atol=1e-5, rtol=1e-3)
            assert torch.equal(bias, bias[0].expand(3)) and float(rt.prior[u, 0, 0]) > 0


def test_wide_topk_and_long_rows():
    """More candidates than one select tile, topk above and below the support size, a padded row,
    through each of route_tile's register/reload paths."""
    default = DecodeConfig()
    # (tiles reloaded every pass), (cap keys in registers, scores reloaded), (both in registers)
    for budget, one_tile_max in ((64, 0), (64, default.one_tile_max),
                                 (default.select_tile_budget, default.one_tile_max)):
        config = DecodeConfig(select_tile_budget=budget, one_tile_max=one_tile_max)
        for topk in (None, 5, 40):  # capped: with the estimated-diagonal prior (sigma 1: informative)
            p = DashParams(block_size=16, topk=topk, scaling_factor=3.0, estimate_diagonal=topk is not None,
                           sigma=1.0)
            sc = make_scenario(11, [16 * 70 + 5, 0, 33], params=p, q_scale=1.5).to(DEV)
            bufs = DecodeBuffers.for_step(sc.q, sc.cache, sc.block_table, p, splits=(3, 1), config=config)
            decode_launch.route(sc.q, sc.cache, sc.block_table, sc.seq_lens, p, bufs)
            check_routing(sc, bufs)


def test_cap_ranks_short_lists_and_radix_selects_long_ones():
    """A select tile wider than ``DecodeConfig.cap_rank_max`` (300 candidates, 512 keys): with few positive mp the
    cap ranks the unit's list, with more than ``cap_rank_max`` it takes the radix select over the keys in registers.
    The oracle's supports show which path each unit took; both must be seen."""
    rank_max = DecodeConfig().cap_rank_max
    seen = set()
    for sf, q_scale in ((3.0, 1.5), (0.05, 0.2)):
        for topk in (7, 40):
            p = DashParams(block_size=16, topk=topk, scaling_factor=sf, sigma=1.0)
            sc = make_scenario(5, [16 * 300 + 9, 16 * 290 + 1], params=p, q_scale=q_scale).to(DEV)
            bufs = DecodeBuffers.for_step(sc.q, sc.cache, sc.block_table, p, splits=(2, 1))
            decode_launch.route(sc.q, sc.cache, sc.block_table, sc.seq_lens, p, bufs)
            check_routing(sc, bufs)
            for i in range(sc.n):
                rt, _, _ = oracle_route(sc, i)
                seen.update("radix" if int((rt.mp[u, 0] > 0).sum()) > rank_max else "rank"
                            for u in range(rt.mp.shape[0]))
    assert seen == {"rank", "radix"}
