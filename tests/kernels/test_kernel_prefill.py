"""Triton prefill / extend (``dash_core.kernels.prefill``) against the oracle, stage by stage, then
end to end; under the interpreter on the CPU, compiled on a GPU (``-m gpu``).

Stages (docs/design.md, "Tests"): the K/V + summary write (summaries bit-identical to the decode kernel's),
routing fed the very same summaries and ``sf * q`` (kept sets equal except docs/semantics.md section 7's
near-threshold entries), attention fed the oracle's selection (attention tolerance), row ``p`` of a
prefill against a decode step at ``p``, and whole extends whose routing may differ from a float64
oracle on a bounded fraction of rows. Shapes are small: the interpreter runs every program in numpy.
"""

from __future__ import annotations

import dataclasses
import itertools
import os

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from dash_core import DashParams
from dash_core.kernels import common, kv_write
from dash_core.kernels.kv_write import write_kv_and_summaries
from dash_core.kernels.prefill import (attention as pf_attention, gluon, launch as pf_launch, plan as pf_plan,
                                       route as pf_route, tiles as pf_tiles)
from dash_core.kernels.prefill.config import GluonConfig, PrefillConfig
from dash_core.ops import prefill_scratch_bytes
from dash_core.reference import attend, block_summaries
from dash_core.workspace import PrefillWorkspace
from tests.kernels._kernel_env import KERNEL_DEVICE
from tests.kernels._kernel_ops import kernel_decode, kernel_prefill
from tests.kernels._kernel_scenarios import assert_rows_match, excused_heads, summary_tolerance
from tests.kernels._prefill_scenarios import (exempt, make_prefill_case, oracle_routing, plan_and_scratch,
                                              stored_summaries, token_slots, wipe_new_tokens)
from tests.kernels.test_kernel_decode_attention import TOL
from dash_core.kernels.decode import launch as decode_launch
from dash_core.kernels.decode.buffers import DecodeBuffers

EXAMPLES = int(os.environ.get("DASH_PREFILL_EXAMPLES", "3"))
DEV = KERNEL_DEVICE
def prefill(case, config=None, write=True, workspace=None, lens=None):
    """The op on ``case`` on the kernels' path (``config``: the kernels' tuning, through a workspace of this call's
    own; ``lens``: the ``(cu_seqlens_q, seq_lens)`` tensors to pass, default the case's)."""
    args = (case.k, case.v, case.slot_mapping) if write else (None, None, None)
    cu, seq_lens = lens if lens is not None else (case.cu, case.seq_lens)
    if workspace is None and config is not None:
        workspace = PrefillWorkspace(config)
    return kernel_prefill(case.q, args[0], args[1], case.cache, case.block_table, cu, seq_lens, args[2],
                          case.head_cls, case.params, workspace=workspace)


def differing_rows(case, out, requests=None) -> tuple:
    """``({request: [R, Hq] bool}, {request: [R, Hq] bool})``: for each request with new tokens (of ``requests``,
    default all), its rows outside the attention tolerance against the oracle fed the kernels' own inputs (the stored
    summaries and the kernels' ``sf * q``: ``oracle_routing``, then its attention), and its rows of a selection unit
    with a near-threshold decision (``excused_heads``), which are not counted in the first."""
    out = out.cpu()
    assert torch.isfinite(out).all()
    tol = TOL[case.q.dtype]
    bad, excused = {}, {}
    for i, (_, new) in enumerate(case.reqs):
        if new and (requests is None or i in requests):
            rt, x = oracle_routing(case, i)
            pos = case.positions(i)
            q = case.q[case.rows(i)].cpu().permute(1, 0, 2)
            ref = attend(q, case.sc.k_full[i], case.sc.v_full[i], pos, rt, case.params).permute(1, 0, 2)  # [R, Hq, D]
            ncand = (pos // case.params.block_size - case.params.local_blocks + 1).clamp(min=0)
            ex = excused_heads(rt.mp, x, ncand, case.params.topk, case.q.shape[1])
            err = (out[case.rows(i)].double() - ref).abs() - tol["rtol"] * ref.abs()
            bad[i], excused[i] = (err.amax(-1) > tol["atol"]) & ~ex, ex
    return bad, excused


# --- stage 1: K/V + summaries --------------------------------------------------------------------


@pytest.mark.parametrize("chunks", [[40, 23, 1, 16, 17], [64], [5, 70]])
def test_summaries_identical_whichever_path(chunks):
    """A prompt written by the prefill kernel in chunks (starting and ending mid-block and on block
    boundaries) and the same prompt written one decode token at a time give bit-identical summaries,
    within one ulp of the oracle; every block the prompt completes is summarised, no other."""
    total = sum(chunks)
    case = make_prefill_case(3, [(total, total)], bs=16, pages_per_block=2, hkv=2, d=64).to(DEV)
    wipe_new_tokens(case)
    summ0 = case.cache.summaries.clone()
    start = 0
    for c in chunks:  # prefill path, chunk by chunk (the cache keeps earlier chunks)
        sl = slice(start, start + c)
        kv_write.write_prefill(case.k[sl], case.v[sl], case.cache, case.slot_mapping[sl], case.params,
                                           case.head_cls)
        start += c
    by_prefill = case.cache.summaries.clone()
    k_prefill = case.cache.k_pages.clone()
    case.cache.summaries.copy_(summ0)
    wipe_new_tokens(case)
    for t in range(total):  # decode path: one token per launch, OWN_ROW summaries
        write_kv_and_summaries(case.k[t:t + 1], case.v[t:t + 1], case.cache, case.slot_mapping[t:t + 1],
                               case.head_cls, 16, decode=True)
    assert torch.equal(case.cache.k_pages, k_prefill)
    assert torch.equal(case.cache.summaries, by_prefill), "summaries differ between the prefill and decode paths"
    nblk = total // 16
    ref = block_summaries(case.sc.k_full[0][:, : nblk * 16], case.head_cls.cpu(), 16)  # [Hkv, nblk, D]
    torch.testing.assert_close(stored_summaries(case, 0), ref, **summary_tolerance(case.q.dtype))
    untouched = torch.ones(by_prefill.shape[0], dtype=torch.bool)
    untouched[case.slots(0, torch.arange(nblk) * 16) // 16] = False
    assert torch.equal(by_prefill.cpu()[untouched], summ0.cpu()[untouched])


@pytest.mark.parametrize("bs,d", [(16, 64), (64, 128)])
def test_summaries_identical_prefill_and_decode_op(bs, d):
    """The decode op writes a step's K/V and the summary its token completes inside its score launch:
    a prompt decoded token by token through ``paged_dash_decode_triton`` leaves the same summaries,
    bit for bit, as the prefill write of the whole prompt; also at the benchmarks' block size and head size,
    where the prefill's summary launch runs more warps than the decode score launch."""
    total = 2 * bs if bs < 64 else bs
    p = DashParams(block_size=bs, scaling_factor=2.0)
    case = make_prefill_case(6, [(total, total)], bs=bs, hq=4, hkv=2, d=d, params=p).to(DEV)
    wipe_new_tokens(case)
    summ0 = case.cache.summaries.clone()
    kv_write.write_prefill(case.k, case.v, case.cache, case.slot_mapping, p, case.head_cls)
    by_prefill = case.cache.summaries.clone()
    case.cache.summaries.copy_(summ0)
    wipe_new_tokens(case)
    bt = case.block_table[:1]
    for t in range(total):
        seq = torch.tensor([t + 1], dtype=torch.int32, device=case.q.device)
        kernel_decode(case.q[t:t + 1], case.k[t:t + 1], case.v[t:t + 1], case.cache, bt, seq,
                                          case.slot_mapping[t:t + 1], case.head_cls, p)
    assert torch.equal(case.cache.summaries, by_prefill), "summaries differ between the prefill write and decode"


# --- stage 2: routing ----------------------------------------------------------------------------


def check_routing(case, plan, scratch) -> None:
    """Every new token's kept blocks (kernel) against the oracle's, fed the stored summaries and the
    kernels' ``sf * q``; physical ids and log priors of the blocks both keep."""
    p = case.params
    slots = token_slots(case, plan)
    hsel = scratch.sel_count.shape[1]
    sel_count, sel_idx = scratch.sel_count.cpu(), scratch.sel_idx.cpu()
    sel_blk, sel_bias = scratch.sel_blk.cpu(), scratch.sel_bias.cpu()
    for i, (total, new) in enumerate(case.reqs):
        if not new:
            continue
        rt, x = oracle_routing(case, i)
        for r, pos in enumerate(case.positions(i).tolist()):
            ncand = max(0, pos // p.block_size - p.local_blocks + 1)
            slot = slots[(i, pos)]
            for u in range(hsel):
                c = int(sel_count[slot, u])
                idx = sel_idx[slot, u, :c].tolist()
                assert idx == sorted(set(idx)) and all(0 <= j < ncand for j in idx), (i, pos, u, idx)
                if p.topk is not None:
                    assert c <= p.topk
                oracle = set(torch.nonzero(rt.kept[u, r]).flatten().tolist()) if ncand else set()
                diff = sorted(set(idx) ^ oracle)
                if diff:
                    ex = exempt(case, rt, x, u, r, ncand)
                    bad = [j for j in diff if not ex[j]]
                    assert not bad, f"request {i} position {pos} unit {u}: blocks {bad} differ ({idx} vs {oracle})"
                if not idx:
                    continue
                phys = case.slots(i, torch.tensor(idx) * p.block_size) // p.block_size
                assert sel_blk[slot, u, :c].tolist() == phys.tolist()
                if diff and p.estimate_diagonal:  # the prior's geometric mean is over the kept set, which differs
                    continue
                both = [n for n, j in enumerate(idx) if j in oracle]
                # pi = (x - tau)^2 / G in fp32 against float64: 1e-5 absolute + 1e-3 relative (as decode)
                torch.testing.assert_close(sel_bias[slot, u, both].double().exp(),
                                           rt.prior[u, r, [idx[n] for n in both]], atol=1e-5, rtol=1e-3)


def _requests(history: st.SearchStrategy, new: st.SearchStrategy) -> st.SearchStrategy:
    """``(total tokens, new tokens)`` of a request drawn from its history and new tokens."""
    return st.tuples(history, new).map(lambda t: (t[0] + t[1], t[1]))


# 1 to 3 requests in any order, one of them with new tokens past three blocks of 32 (every token of it has candidates
# at each block size and local window the tests draw), so that no example checks nothing
REQS = st.tuples(_requests(st.integers(96, 140), st.integers(1, 50)),
                 st.lists(_requests(st.integers(0, 140), st.integers(0, 50)), max_size=2)).flatmap(
    lambda t: st.permutations([t[0], *t[1]]))


@settings(max_examples=EXAMPLES, deadline=None)
# one query head a KV head, a cap of one over two candidates: compiled, the scores kept in registers gave the wrong
# block (scores_in_registers now leaves that case to the stored scores)
@example(seed=0, reqs=[(33, 33)], router="kv_head", topk=1, est=False, sigma=1.0, sf=0.7, local_blocks=1, ppb=1,
         layout="sglang", group=1, dtype=torch.bfloat16, stored=True)
@given(seed=st.integers(0, 2**31 - 1), reqs=REQS, router=st.sampled_from(["kv_head", "shared"]),
       topk=st.one_of(st.none(), st.integers(1, 6)), est=st.booleans(), sigma=st.sampled_from([1.0, 1e6]),
       sf=st.sampled_from([0.7, 2.0, 4.0]), local_blocks=st.integers(1, 2), ppb=st.integers(1, 3),
       layout=st.sampled_from(["sglang", "vllm"]), group=st.sampled_from([1, 2, 3]),
       dtype=st.sampled_from([torch.bfloat16, torch.float16]), stored=st.booleans())
def test_routing_matches_oracle(seed, reqs, router, topk, est, sigma, sf, local_blocks, ppb, layout, group, dtype,
                                stored):
    """stored: the scores in the scratch (every router) rather than computed again from the summary copy in
    each pass (router kv_head, where the op routes that way)."""
    p = DashParams(block_size=16, topk=topk, local=16 * local_blocks, scaling_factor=sf, estimate_diagonal=est,
                   sigma=sigma, router=router)
    case = make_prefill_case(seed, reqs, hq=2 * group, hkv=2, bs=16, pages_per_block=ppb, layout=layout,
                             dtype=dtype, params=p, shared_prefix_pages=1).to(DEV)
    plan, scratch = plan_and_scratch(case, recompute=router == "kv_head" and not stored)
    assert (scratch.summary_copy is not None) == (router == "kv_head" and not stored)
    pf_route.route_wave(case.q, case.cache, case.block_table, case.cu, case.seq_lens, p, plan, scratch, 0,
                        plan.num_tiles)
    check_routing(case, plan, scratch)


def test_routing_wide_rows_and_caps():
    """More candidates than one route tile (several tiles per pass), topk below and above the support,
    a GQA group of 4 (one tile = 16 tokens x 4 heads), and a scratch full of NaN past each unit's list."""
    # 16-wide score tiles over 44 candidates; 4-wide tiles for the cap's pivot search and 8-wide tiles for
    # its ties and compaction, over lists of up to 44 positive mp (20+ with topk 3)
    pivots = PrefillConfig().route_pivots
    config = PrefillConfig(scratch_bytes=1 << 40, route_tile_budget=256, route_pivot_budget=4 * 16 * pivots,
                           route_list_budget=8 * 16, route_registers=False,  # the stored scores, in tiles
                           route_score_tile=16)  # the passes that compute the scores again: 16 a tile too
    # estimate_diagonal (sigma 1: the default 1e6 flattens the prior): the priors also depend on the geometric
    # mean of the kept mp, which the ties pass sums over the list tiles (exact ties at the threshold are the cap
    # tests' job: test_kernel_cap_lists)
    for (topk, est), recompute in itertools.product(
            ((None, False), (3, False), (30, False), (3, True), (30, True)), (False, True)):
        p = DashParams(block_size=16, topk=topk, scaling_factor=3.0, estimate_diagonal=est, sigma=1.0)
        case = make_prefill_case(21, [(16 * 45 + 5, 20), (40, 40)], hq=8, hkv=2, params=p, q_scale=1.5).to(DEV)
        plan, scratch = plan_and_scratch(case, config, recompute=recompute)
        # the cap reads each unit's list in groups of 4: what lies past its end must not count
        scratch.mp.fill_(float("nan"))
        scratch.scores.fill_(float("nan"))  # the stored scores' rows, or the group sums of the copy path
        scratch.mp_cand.fill_(1 << 30)
        pf_route.route_wave(case.q, case.cache, case.block_table, case.cu, case.seq_lens, p, plan, scratch, 0,
                      plan.num_tiles)
        check_routing(case, plan, scratch)


@pytest.mark.parametrize("topk,est", [(None, False), (3, True), (30, False)])
def test_routing_scores_in_registers(topk, est):
    """Short block tables (every candidate in one score tile, ``scores_in_registers``; 100 candidates here, a
    128-wide tile): the route kernel keeps the scores in registers and stores none (the score scratch stays NaN),
    caps in registers (topk below, near and above the support), and keeps the oracle's blocks with their priors."""
    p = DashParams(block_size=16, topk=topk, scaling_factor=3.0, estimate_diagonal=est, sigma=1.0)
    case = make_prefill_case(22, [(16 * 40 + 5, 30), (40, 40), (16 * 100 + 3, 12)], hq=8, hkv=2, params=p,
                             q_scale=1.5).to(DEV)
    config = PrefillConfig(scratch_bytes=1 << 40)
    plan, scratch = plan_and_scratch(case, config, recompute=False)
    assert plan.max_cand > 64
    assert pf_route.scores_in_registers(plan.qt, 8, 2, case.q.shape[2], plan.max_cand, p, config)
    assert not pf_route.scores_in_registers(plan.qt, 2, 2, case.q.shape[2], plan.max_cand, p, config)  # G 1
    assert not pf_route.scores_in_registers(plan.qt, 8, 2, case.q.shape[2], 2 * plan.max_cand, p, config)
    scratch.scores.fill_(float("nan"))
    pf_route.route_wave(case.q, case.cache, case.block_table, case.cu, case.seq_lens, p, plan, scratch, 0,
                        plan.num_tiles)
    assert bool(scratch.scores.isnan().all()), "scores were stored"
    check_routing(case, plan, scratch)


# G 1 (rows are units), G 2 (two rows a unit), G 3 (a padded row per token); the first two stage the scaled
# queries through the units' mp rows (``stages_queries``: 64 candidates and more hold two rows of D 64), G 3 keeps
# them in registers
@pytest.mark.parametrize("group", [1, 2, 3])
@pytest.mark.parametrize("topk,est", [(None, False), (3, True)])
@pytest.mark.parametrize("tma", [1, 0])  # the copy loaded by TMA boxes, or by pointers
def test_routing_from_the_summary_copy(group, topk, est, tma):
    """Routing that computes its scores again in every pass, from the summary copy: several 16-candidate tiles
    per pass, pages of two blocks, a local window of two blocks, a padded request, and a copy full of NaN before
    the gather (which zeroes the rows past each request's complete blocks: the last TMA box of a pass reads them,
    and adds ``-inf`` to their scores)."""
    config = PrefillConfig(route_score_tile=16, copy_tma=bool(tma))
    p = DashParams(block_size=16, topk=topk, scaling_factor=3.0, estimate_diagonal=est, sigma=1.0, local=32)
    case = make_prefill_case(7, [(16 * 64 + 5, 12), (0, 0), (16 * 20 + 3, 9)], hq=2 * group, hkv=2, bs=16,
                             pages_per_block=2, params=p, q_scale=1.5).to(DEV)
    plan, scratch = pf_launch.plan_and_scratch(case.q, case.cache, case.block_table, case.cu, case.seq_lens, p,
                                               config, recompute=True)
    assert pf_route.stages_queries(group, case.q, scratch) == (group < 3)
    assert (scratch.summary_desc is not None) == bool(tma)
    if case.q.shape[1] > 4:  # a scratch sized for the copy (rows for the union tables only) but without it
        bare = pf_plan.PrefillScratch.allocate(plan.wave, plan.qt, case.q.shape[1], 2, plan.max_cand, p, DEV, True)
        with pytest.raises(RuntimeError, match="score rows"):
            pf_route.route_wave(case.q, case.cache, case.block_table, case.cu, case.seq_lens, p, plan, bare, 0, 1)
    scratch.summary_copy.fill_(float("nan"))
    with pytest.raises(RuntimeError, match="gather_summaries"):  # the copy is not this call's yet
        pf_route.route_wave(case.q, case.cache, case.block_table, case.cu, case.seq_lens, p, plan, scratch, 0, 1)
    pf_route.gather_summaries(case.cache, case.block_table, case.seq_lens, p, scratch)
    copy = scratch.summary_copy.float().cpu()
    for i, length in enumerate(case.seq_lens.tolist()):
        done = length // p.block_size
        assert not copy[i, :done].isnan().any() and not copy[i, done:].any()
    narrow = dataclasses.replace(scratch, scores=scratch.scores[:, :1])  # no room for the second KV head's sums
    with pytest.raises(RuntimeError, match="group sums"):
        pf_route.route_wave(case.q, case.cache, case.block_table, case.cu, case.seq_lens, p, plan, narrow, 0, 1)
    scratch.scores.fill_(float("nan"))  # the group sums' pass reads back only what the mp pass wrote
    scratch.mp.fill_(float("nan"))  # and the MMAs only the queries staged there
    pf_route.route_wave(case.q, case.cache, case.block_table, case.cu, case.seq_lens, p, plan, scratch, 0,
                        plan.num_tiles)
    check_routing(case, plan, scratch)


# --- stage 3: attention given the oracle's selection ---------------------------------------------


def fill_selection(case, plan, scratch) -> list:
    """The oracle's routing (stored summaries, kernels' ``sf * q``) written into the scratch: the kept lists, and
    ``mp`` by candidate (where ``route.union_from_mp`` holds, the attention launch builds the unions from that)."""
    p = case.params
    slots = token_slots(case, plan)
    hsel = scratch.sel_count.shape[1]
    scratch.sel_count.zero_()
    routings = []
    for i, (total, new) in enumerate(case.reqs):
        rt = oracle_routing(case, i)[0] if new else None
        routings.append(rt)
        for r, pos in enumerate(case.positions(i).tolist() if new else []):
            slot = slots[(i, pos)]
            for u in range(hsel):
                nc = min(rt.mp.shape[-1], scratch.mp.shape[2])
                scratch.mp[slot, u, :nc] = rt.mp[u, r, :nc].float().to(DEV)
                js = torch.nonzero(rt.kept[u, r]).flatten() if rt.kept.shape[-1] else torch.zeros(0, dtype=torch.long)
                c = js.numel()
                scratch.sel_count[slot, u] = c
                if c:
                    scratch.sel_idx[slot, u, :c] = js.to(torch.int32).to(DEV)
                    scratch.sel_blk[slot, u, :c] = (case.slots(i, js * p.block_size) // p.block_size).to(
                        torch.int32).to(DEV)
                    scratch.sel_bias[slot, u, :c] = rt.prior[u, r, js].log().float().to(DEV)
    return routings


def check_attention(case) -> None:
    plan, scratch = plan_and_scratch(case)
    routings = fill_selection(case, plan, scratch)
    out = torch.full_like(case.q, float("nan"))
    pf_attention.attend_wave(case.q, case.cache, case.block_table, case.cu, case.seq_lens, case.params, plan, scratch,
                             out, 0,
                   plan.num_tiles)
    out = out.cpu()
    for i, (total, new) in enumerate(case.reqs):
        if not new:
            continue
        q = case.q[case.rows(i)].cpu().permute(1, 0, 2)
        ref = attend(q, case.sc.k_full[i], case.sc.v_full[i], case.positions(i), routings[i], case.params)
        torch.testing.assert_close(out[case.rows(i)].double(), ref.permute(1, 0, 2), **TOL[case.q.dtype])


@settings(max_examples=EXAMPLES, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), reqs=REQS, router=st.sampled_from(["kv_head", "shared"]),
       topk=st.one_of(st.none(), st.integers(1, 5)), est=st.booleans(), sigma=st.sampled_from([1.0, 1e6]),
       local_blocks=st.integers(1, 3), bs=st.sampled_from([16, 32]), ppb=st.integers(1, 2),
       layout=st.sampled_from(["sglang", "vllm"]), group=st.sampled_from([1, 3, 4]),
       dtype=st.sampled_from([torch.bfloat16, torch.float16]))
@example(seed=0, reqs=[(17, 17)], router="kv_head", topk=None, est=False, sigma=1.0, local_blocks=1, bs=16, ppb=1,
         layout="sglang", group=3, dtype=torch.bfloat16)  # the union from mp (no cap, scores in registers)
def test_attention_matches_oracle(seed, reqs, router, topk, est, sigma, local_blocks, bs, ppb, layout, group, dtype):
    p = DashParams(block_size=bs, topk=topk, local=bs * local_blocks, scaling_factor=2.0, estimate_diagonal=est,
                   sigma=sigma, router=router)
    case = make_prefill_case(seed, reqs, hq=2 * group, hkv=2, bs=bs, pages_per_block=ppb, layout=layout,
                             dtype=dtype, params=p, shared_prefix_pages=1).to(DEV)
    check_attention(case)


def test_attention_head_dims():
    """Head sizes 128 and 256 (sub-tiles of a block), block size 64, G = 8 (4 tokens per tile)."""
    for d, bs in ((128, 64), (256, 32)):
        p = DashParams(block_size=bs, topk=2, scaling_factor=1.0)
        case = make_prefill_case(5, [(2 * bs + 3, bs // 2 + 3), (bs, 2)], hq=16, hkv=2, d=d, bs=bs, params=p).to(DEV)
        check_attention(case)


def _restrided(x: torch.Tensor, pad: int, start: int) -> torch.Tensor:
    """A copy of ``x [pages, page_size, Hkv, D]`` as a view of a wider buffer (``D + pad`` per row, from ``start``):
    the same values under other strides and, with ``start`` not a multiple of 8, a base off 16 bytes."""
    buf = torch.zeros(*x.shape[:3], x.shape[3] + pad, dtype=x.dtype, device=x.device)
    view = buf[..., start:start + x.shape[3]]
    view.copy_(x)
    return view


@pytest.mark.parametrize("layout", ["sglang", "vllm"])
def test_tma_loads_follow_the_cache_layout(layout):
    """The attention launch's TMA descriptors (emulated by the interpreter) describe the pages as they are where
    they are nested rows (SGLang's layout, and a copy with padded rows), head-major where the head stride exceeds
    the row stride (vLLM's layout, and a head-major copy with padded rows), and are refused for a base or a
    stride off 16 bytes in either order; every variant gives the output of the pointer loads (``attn_tma`` off),
    bit for bit. Two blocks per page, so that boxes start mid-page."""
    if not common.tma_supported(torch.device(DEV)):
        pytest.skip("no TMA on this device")
    p = DashParams(block_size=64, topk=2, scaling_factor=1.0)
    case = make_prefill_case(7, [(5 * 64 + 5, 100), (3 * 64, 3)], hq=8, hkv=2, d=128, bs=64, pages_per_block=2,
                             layout=layout, params=p).to(DEV)
    prefill(case)  # writes K/V and summaries
    pointers = PrefillConfig(attn_tma=False)
    cache = case.cache
    assert pf_attention._kv_descriptors(cache, 64, pointers) is None
    want = prefill(case, write=False, workspace=PrefillWorkspace(pointers))

    def copy(pad, start, head_major=False):
        def one(x):
            if head_major:  # [pages, Hkv, page_size, D + pad] storage
                return _restrided(x.permute(0, 2, 1, 3), pad, start).permute(0, 2, 1, 3)
            return _restrided(x, pad, start)
        return type(cache)(one(cache.k_pages), one(cache.v_pages), cache.summaries)

    # (cache, how the descriptors describe it: None = pointer loads, else head-major or not)
    variants = [(cache, layout == "vllm"), (copy(16, 0), False), (copy(16, 0, True), True),
                (copy(8, 1), None), (copy(8, 1, True), None), (copy(1, 0), None), (copy(1, 0, True), None)]
    for c, head_major in variants:  # padded rows, a base 2 bytes off 16, rows of 129 elements
        desc = pf_attention._kv_descriptors(c, 64, PrefillConfig())
        assert (None if desc is None else desc[2]) == head_major
        got = pf_launch.paged_dash_prefill_triton(case.q, None, None, c, case.block_table, case.cu, case.seq_lens,
                                                  None, case.head_cls, p)
        assert torch.equal(got, want)


def test_kv_descriptors_are_built_once_per_cache():
    """The attention's K/V TMA descriptors are built at a cache object's first call and returned again after
    (``PagedKVCache.kept``): a layer's later steps reuse them, a new cache object gets its own."""
    if not common.tma_supported(torch.device(DEV)):
        pytest.skip("no TMA on this device")
    case = make_prefill_case(3, [(3 * 64, 64)], hq=8, hkv=2, d=128, bs=64, pages_per_block=1,
                             params=DashParams(block_size=64, topk=2, scaling_factor=1.0)).to(DEV)
    cache, cfg = case.cache, PrefillConfig()
    first = pf_attention._kv_descriptors(cache, 64, cfg)
    assert first is not None and first[0].base is cache.k_pages
    assert pf_attention._kv_descriptors(cache, 64, cfg) is first
    other = type(cache)(cache.k_pages, cache.v_pages, cache.summaries)
    assert pf_attention._kv_descriptors(other, 64, cfg) is not first
    moved = type(cache)(cache.k_pages.clone(), cache.v_pages, cache.summaries)
    again = pf_attention._kv_descriptors(moved, 64, cfg)
    assert again is not first and again[0].base is moved.k_pages and again[1].base is moved.v_pages


# --- prefill row p == decode step at p -------------------------------------------------------------


def test_prefill_row_equals_decode_step():
    """Same cache and summaries: the prefill's selection of every new token equals the decode kernels'
    at that position (one routing routine; docs/semantics.md section 7, near-threshold entries exempt), with the
    same log priors, and the outputs of rows routed alike agree to the attention tolerance."""
    p = DashParams(block_size=16, scaling_factor=3.0, topk=3, estimate_diagonal=True, sigma=2.0)
    case = make_prefill_case(9, [(102, 12)], hq=8, hkv=2, params=p, q_scale=1.3).to(DEV)
    plan, scratch = plan_and_scratch(case)
    pf_route.route_wave(case.q, case.cache, case.block_table, case.cu, case.seq_lens, p, plan, scratch, 0,
                        plan.num_tiles)
    out_pf = torch.empty_like(case.q)
    pf_attention.attend_wave(case.q, case.cache, case.block_table, case.cu, case.seq_lens, p, plan, scratch, out_pf, 0,
                   plan.num_tiles)
    # a decode batch with one row per new position (90 .. 101), all on request 0's pages
    pos = case.positions(0)
    n = pos.numel()
    bt = case.block_table[:1].expand(n, -1).contiguous()
    seq = (pos + 1).to(torch.int32).to(DEV)
    bufs = DecodeBuffers.for_step(case.q, case.cache, bt, p, splits=(2, 2))
    decode_launch.route(case.q, case.cache, bt, seq, p, bufs)
    out_dec = torch.empty_like(case.q)
    decode_launch.attend(case.q, case.cache, bt, seq, p, bufs, out_dec)
    slots = token_slots(case, plan)
    rt, x = oracle_routing(case, 0)
    hsel = bufs.sel_count.shape[1]
    alike = 0
    for r, ps in enumerate(pos.tolist()):
        slot = slots[(0, ps)]
        ncand = max(0, ps // 16 - p.local_blocks + 1)
        row_alike = True
        for u in range(hsel):
            c_pf, c_dec = int(scratch.sel_count[slot, u]), int(bufs.sel_count[r, u])
            kp = scratch.sel_idx[slot, u, :c_pf].cpu().tolist()
            kd = bufs.sel_idx[r, u, :c_dec].cpu().tolist()
            if kp == kd:
                # the two score launches may round x differently in the last place (other MMA shapes):
                # pi = (x - tau)^2 / G then moves by more than an ulp where x is near tau (as check_routing)
                torch.testing.assert_close(scratch.sel_bias[slot, u, :c_pf].cpu().double().exp(),
                                           bufs.sel_bias[r, u, :c_dec].cpu().double().exp(), atol=1e-5, rtol=1e-3)
                continue
            row_alike = False
            ex = exempt(case, rt, x, u, r, ncand)
            bad = [j for j in sorted(set(kp) ^ set(kd)) if not ex[j]]
            assert not bad, f"position {ps} unit {u}: prefill {kp} vs decode {kd}"
        if row_alike:
            alike += 1
            torch.testing.assert_close(out_pf[r].cpu().double(), out_dec[r].cpu().double(), **TOL[case.q.dtype])
    assert alike >= 0.9 * n


# --- end to end ----------------------------------------------------------------------------------


def test_dense_equivalent_is_causal_attention():
    """sf = 0 with estimate_diagonal routes every candidate with prior 1 (docs/semantics.md section 1): every row
    of an extend on paged history equals dense causal attention (no routing discontinuity)."""
    p = DashParams.dense_equivalent(16, local=32)
    case = make_prefill_case(4, [(90, 40), (33, 33), (0, 0), (50, 1)], hq=4, hkv=2, params=p,
                             pages_per_block=2, shared_prefix_pages=1).to(DEV)
    wipe_new_tokens(case)
    out = prefill(case).cpu()
    for i, (total, new) in enumerate(case.reqs):
        if not new:
            continue
        k = case.sc.k_full[i].double().repeat_interleave(2, 0)
        v = case.sc.v_full[i].double().repeat_interleave(2, 0)
        q = case.q[case.rows(i)].cpu().double().permute(1, 0, 2)
        mask = torch.arange(total)[None, :] <= case.positions(i)[:, None]
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        torch.testing.assert_close(out[case.rows(i)].double(), ref.permute(1, 0, 2), **TOL[case.q.dtype])


CASES = [  # (requests (total, new), DashParams kwargs, scenario kwargs)
    # history 0; mid-block start and end; one-token extend; a request without new tokens; a padded one
    ([(60, 60), (70, 21), (45, 1), (50, 0), (0, 0)], dict(scaling_factor=2.0), dict()),
    ([(110, 30), (40, 17)], dict(scaling_factor=4.0, topk=3), dict(layout="vllm", pages_per_block=2)),
    ([(100, 20), (100, 7)], dict(scaling_factor=1.0, estimate_diagonal=True, router="shared"),
     dict(shared_prefix_pages=3)),
    ([(90, 25), (65, 10)], dict(scaling_factor=3.0, topk=5, local=32), dict(hq=8, pages_per_block=4)),
    ([(96, 30)], dict(scaling_factor=2.0, estimate_diagonal=True, sigma=1.0, topk=4),
     dict(dtype=torch.float16, layout="vllm")),
]


def test_extends_match_oracle():
    """Varlen extends written and attended by the op, against the oracle fed the stored summaries
    (``differing_rows``): every row within the attention tolerance but those of a unit with a near-threshold
    decision; a multi-wave run (tiny scratch) and a run taking the tiles in launch order (not the last first) equal
    the one-wave run exactly, and where the attention launch routes its own tiles (``route.route_fused``: the router
    ``kv_head`` cases) so does a run with a route launch before it; rows past ``cu_seqlens_q[n]`` are zero."""
    groups, excused, fused = {}, {}, 0
    for n, (reqs, pk, sk) in enumerate(CASES):
        p = DashParams(block_size=16, **pk)
        case = make_prefill_case(200 + n, reqs, params=p, **sk).to(DEV)
        wipe_new_tokens(case)
        out = prefill(case)
        bad, ex = differing_rows(case, out)
        groups.update({f"case {n} request {i}": rows for i, rows in bad.items()})
        excused.update({f"case {n} request {i}": rows for i, rows in ex.items()})
        plan, scratch = plan_and_scratch(case, PrefillConfig())
        (_, tiles), = plan.waves()
        if pf_route.route_fused(case.q, case.cache, p, plan, scratch, tiles):
            fused += 1
            assert torch.equal(prefill(case, PrefillConfig(fuse_route=False), write=False), out), n
        if n == 0:  # two tiles per wave
            plan = pf_plan.PrefillPlan.build(case.q, case.cache, case.block_table, case.cu, case.seq_lens, p,
                                             PrefillConfig())
            per_tile = pf_plan.PrefillScratch.bytes_per_tile(plan.qt, case.q.shape[1], case.cache.num_kv_heads,
                                                        plan.max_cand, p, plan.recompute)
            again = prefill(case, PrefillConfig(scratch_bytes=2 * per_tile), write=False)
            assert torch.equal(again, out)
            assert torch.equal(prefill(case, PrefillConfig(last_tiles_first=False), write=False), out)
    assert fused == 4
    assert_rows_match(groups, excused)


def _record_gluon_launches(monkeypatch) -> list:
    """The Gluon attention launch (which the interpreter cannot run) replaced by a recorder, on any device: the list
    that receives the grid of each launch."""
    launched = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *a, **kw: launched.append(grid)

    monkeypatch.setattr(gluon, "ws_supported", lambda q, cache, *a: gluon.kv_rows(cache))
    monkeypatch.setattr(gluon, "kv_block_descriptors", lambda *a: (None, None))
    monkeypatch.setattr(gluon, "prefill_attn_ws", Recorder(), raising=False)
    return launched


def test_union_launch_stores_the_gluon_rows(monkeypatch):
    """For the Gluon attention (``gluon.py``), the union launch stores each union block as its first row in
    ``kv_row_views`` (``union_rows``; vLLM's head-major pages with a spare head slot, two blocks a page): the blocks
    the Triton attention's launch lists as ids, in the same order. The Gluon launch is replaced by a recorder (the
    interpreter cannot run it)."""
    p = DashParams(block_size=64, topk=4, scaling_factor=2.0)
    case = make_prefill_case(5, [(700, 300), (400, 400)], hq=8, hkv=2, d=64, bs=64, pages_per_block=2,
                             layout="vllm", params=p).to(DEV)
    plan, scratch = plan_and_scratch(case, PrefillConfig(scratch_bytes=1 << 40, gluon=GluonConfig(min_candidates=0)))
    (tile0, tiles), = plan.waves()
    pf_route.route_wave(case.q, case.cache, case.block_table, case.cu, case.seq_lens, p, plan, scratch, tile0, tiles)
    args = (case.q, case.cache, case.block_table, case.cu, case.seq_lens, p, plan, scratch, torch.empty_like(case.q),
            tile0, tiles)
    pf_attention.attend_wave(*args)  # the Triton attention: block ids
    ids = scratch.union_blk.clone()
    launched = _record_gluon_launches(monkeypatch)
    pf_attention.attend_wave(*args)
    assert launched, "the wave did not take the Gluon path"
    geo = gluon.kv_rows(case.cache)
    page_m, step_m, head_m = gluon.union_rows(geo, 64)
    ppb, checked = case.cache.page_size // 64, 0
    assert geo[1] > 0 and ppb == 2  # head-major, two blocks a page
    info = scratch.tile_info
    for w in range(tiles):
        if info[w, gluon.INFO_P_LO.value] >= info[w, gluon.INFO_P_HI.value]:
            continue  # a tile past the last one: no union (its count is not written)
        for h in range(case.cache.num_kv_heads):
            n = int(scratch.union_count[w, h])
            blk = ids[w, h, :n].long()
            want = (blk // ppb) * page_m + (blk % ppb) * step_m + h * head_m
            assert torch.equal(scratch.union_blk[w, h, :n].long(), want), (w, h)
            checked += n
    assert checked > 2 * tiles


@pytest.mark.parametrize("topk, est", [(None, False), (64, False), (None, True)])
def test_union_from_mp_equals_union_from_lists(monkeypatch, topk, est):
    """Where no cap can bind and the routing stored every candidate's ``mp`` (short tables: ``route.union_from_mp``),
    the union launch builds each tile's union from the ``mp`` in one pass: the same blocks, in the same order, with
    the same priors as built from the tokens' kept lists (``PrefillConfig.union_from_mp`` off), on the same routing
    (uncapped, ``topk`` above the candidates, the estimated-diagonal prior, whose geometric mean may sum in another
    order on the GPU: close there). The Gluon launch is replaced by a recorder; the union launch then stores the union
    sizes too."""
    p = DashParams(block_size=64, topk=topk, scaling_factor=2.0, estimate_diagonal=est)
    case = make_prefill_case(8, [(700, 300), (400, 400), (90, 90)], hq=8, hkv=2, d=64, bs=64, pages_per_block=2,
                             layout="vllm", params=p).to(DEV)
    config = PrefillConfig(scratch_bytes=1 << 40, gluon=GluonConfig(min_candidates=0))
    plan, scratch = plan_and_scratch(case, config)
    (tile0, tiles), = plan.waves()
    assert pf_route.union_from_mp(case.q, 2, p, plan, scratch)
    pf_route.route_wave(case.q, case.cache, case.block_table, case.cu, case.seq_lens, p, plan, scratch, tile0, tiles)
    _record_gluon_launches(monkeypatch)
    unions = []
    for from_mp in (False, True):
        plan.config = dataclasses.replace(config, union_from_mp=from_mp)
        pf_attention.attend_wave(case.q, case.cache, case.block_table, case.cu, case.seq_lens, p, plan, scratch,
                                 torch.empty_like(case.q), tile0, tiles)
        unions.append((scratch.union_count.clone(), scratch.union_blk.clone(), scratch.union_prior.clone()))
    (cnt, blk, prior), (cnt2, blk2, prior2) = unions
    info, checked = scratch.tile_info, 0
    for w in range(tiles):
        if info[w, gluon.INFO_P_LO.value] >= info[w, gluon.INFO_P_HI.value]:
            continue  # a tile past the last one: no union
        for h in range(2):
            n = int(cnt[w, h])
            assert int(cnt2[w, h]) == n, (w, h)
            assert torch.equal(blk2[w, h, :n], blk[w, h, :n]), (w, h)
            if est:  # the log-mean of up to 64 logs under 100 in another order: a few fp32 ulps, over sigma
                torch.testing.assert_close(prior2[w, h, :n], prior[w, h, :n], rtol=1e-6, atol=1e-3 / p.sigma)
            else:
                assert torch.equal(prior2[w, h, :n], prior[w, h, :n]), (w, h)
            checked += n
    assert checked > 2 * tiles


@pytest.mark.parametrize("min_cand, min_tiles, want", [(0, 1 << 30, True), (1 << 30, 1, True),
                                                       (1 << 30, 1 << 30, False)])
def test_gluon_launch_on_long_tables_or_long_waves(monkeypatch, min_cand, min_tiles, want):
    """A wave takes the Gluon attention where its block tables have at least ``GluonConfig.min_candidates``
    candidates or it has at least ``min_tiles`` tiles (many short prompts in one call), and ``enabled``; else the
    Triton attention alone. The Gluon launch is replaced by a recorder."""
    p = DashParams(block_size=64, topk=4, scaling_factor=2.0)
    case = make_prefill_case(6, [(300, 100), (200, 200)], hq=8, hkv=2, d=64, bs=64, params=p).to(DEV)
    config = PrefillConfig(scratch_bytes=1 << 40, gluon=GluonConfig(min_candidates=min_cand, min_tiles=min_tiles))
    plan, scratch = plan_and_scratch(case, config)
    (tile0, tiles), = plan.waves()
    assert config.gluon.wanted(plan.max_cand, tiles) is want
    pf_route.route_wave(case.q, case.cache, case.block_table, case.cu, case.seq_lens, p, plan, scratch, tile0, tiles)
    launched = _record_gluon_launches(monkeypatch)
    out = torch.zeros_like(case.q)
    pf_attention.attend_wave(case.q, case.cache, case.block_table, case.cu, case.seq_lens, p, plan, scratch, out,
                             tile0, tiles)
    assert bool(launched) is want
    assert dataclasses.replace(config.gluon, enabled=False).wanted(plan.max_cand, tiles) is False


@pytest.mark.parametrize("bs, hopper, attends", [(64, True, True), (64, False, False), (16, True, False)])
def test_one_predicate_says_which_launch_attends_a_wave(monkeypatch, bs, hopper, attends):
    """``gluon.attends`` answers for the attention launch and for ``route.route_fused`` alike: with the Gluon launch
    wanted (``GluonConfig.wanted``), a wave whose union tiles span one block (64 keys at block size 64) goes to it
    where it runs (``ws_supported``, here made to answer as a Hopper GPU would) and keeps its route launch; where it
    does not run, or at block size 16 (a union tile spans several blocks), the Triton kernel attends the wave and
    routes it in the same launch."""
    if hopper:
        monkeypatch.setattr(gluon, "ws_supported", lambda q, cache, *a: gluon.kv_rows(cache))
    else:
        monkeypatch.setattr(gluon, "ws_supported", lambda *a: None)
    p = DashParams(block_size=bs, topk=4, scaling_factor=2.0)
    case = make_prefill_case(7, [(160, 96)], hq=8, hkv=2, d=128, bs=bs, params=p).to(DEV)
    config = PrefillConfig(scratch_bytes=1 << 40, gluon=GluonConfig(min_candidates=0))
    plan, scratch = plan_and_scratch(case, config)
    (tile0, tiles), = plan.waves()
    assert config.gluon.wanted(plan.max_cand, tiles)
    assert config.gluon_wanted(128, bs, plan.max_cand, tiles) is (bs == 64)
    assert gluon.attends(case.q, case.cache, p, plan, tiles) is attends
    assert pf_route.route_fused(case.q, case.cache, p, plan, scratch, tiles) is not attends


def test_config_refuses_tile_sizes_the_kernels_cannot_shape():
    """``PrefillConfig``'s tile sizes are powers of two of at least 16 (``tl.arange`` spans them): any other is a
    ``ValueError`` when the config is built, not a compile error in a launch; a tile's tokens ``QT`` then keep
    ``QT * G_PAD`` within ``attn_rows``, down to one token where the padded group alone exceeds it."""
    for name in ("attn_rows", "attn_keys"):
        for bad in (8, 48):
            with pytest.raises(ValueError, match=name):
                PrefillConfig(**{name: bad})
    assert pf_tiles.tile_tokens(32, 8, 64, 64) == 16
    assert pf_tiles.tile_tokens(32, 8, 16, 128) == 16  # at most a block
    assert pf_tiles.tile_tokens(24, 1, 64, 16) == 1  # G_PAD 32 > 16 rows


def test_waves_take_every_tile_once_from_the_last():
    """``PrefillPlan.waves``: consecutive tiles, each in one wave, the partial last wave issued first (or, without
    ``waves_last_first``, in tile order)."""
    plan = pf_plan.PrefillPlan(qt=16, num_tiles=10, wave=4, max_cand=1, tile_req=None, tile_off=None)
    assert plan.waves() == [(8, 2), (4, 4), (0, 4)]
    plan = dataclasses.replace(plan, config=PrefillConfig(waves_last_first=False))
    assert plan.waves() == [(0, 4), (4, 4), (8, 2)]


def _allocated(scratch: pf_plan.PrefillScratch) -> int:
    """Bytes of the distinct storages a scratch's tensors view."""
    storages = {}
    for f in dataclasses.fields(scratch):
        x = getattr(scratch, f.name)
        if isinstance(x, torch.Tensor):
            storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("hq, hkv, router, topk, budget", [
    (8, 2, "kv_head", 2, None),  # union_prior inside the scores' storage
    (4, 4, "kv_head", None, None),  # Hq < 2 Hkv: union_prior on its own
    (8, 2, "shared", 3, None),
    (8, 2, "kv_head", 2, 300_000),  # the byte budget binds: a wave of fewer tiles
])
@pytest.mark.parametrize("min_cand", [1, 1 << 20])  # tables long enough for the summary copy, or never
def test_scratch_bound_is_what_the_largest_call_allocates(hq, hkv, router, topk, budget, min_cand):
    """``scratch_bound`` (``workspace.prefill_scratch_bytes``, what the vLLM adapter reserves while vLLM profiles
    memory) against the scratch a call allocates: equal for ``max_requests`` requests on the widest block table
    where the budget does not bind, the budget where it binds; never below a call with fewer requests or a
    narrower table; never smaller for a wider one."""
    config = PrefillConfig(recompute_min_candidates=min_cand, **({} if budget is None else {"scratch_bytes": budget}))
    p = DashParams(block_size=16, topk=topk, scaling_factor=1.0, router=router)
    for reqs in ([(150, 150), (40, 7), (90, 33)], [(300, 190)]):
        case = make_prefill_case(3, reqs, hq=hq, hkv=hkv, bs=16, params=p).to(DEV)
        t, width = case.q.shape[0], case.block_table.shape[1] * case.cache.page_size
        plan, scratch = pf_launch.plan_and_scratch(case.q, case.cache, case.block_table, case.cu, case.seq_lens, p,
                                                   config)
        total = _allocated(scratch)  # the routing scratch and the summary copy, as the op allocates them
        # the summary copy of routing without a score scratch: bounded apart (summary_copy_bytes), outside the budget
        recompute = scratch.summary_copy is not None
        assert recompute == plan.recompute == (router == "kv_head" and plan.max_cand >= min_cand)
        made = scratch.summary_copy.untyped_storage().nbytes() if recompute else 0
        copy = config.summary_copy_bytes if recompute else 0
        assert 0 < made <= copy or not recompute
        # the same call routing from stored scores: larger tiles, no copy
        stored = _allocated(pf_launch.plan_and_scratch(case.q, case.cache, case.block_table, case.cu, case.seq_lens,
                                                       p, config, recompute=False)[1])
        assert total - made <= stored and (total - made < stored or not recompute or hq < 2 * hkv)
        full = pf_plan.scratch_bound(t, len(reqs), width, hq, hkv, p, config)
        assert total <= full and stored <= full
        if budget is None:  # the larger of the two paths, the copy at its bound
            assert full == max(stored, total - made + copy)
        else:  # the budget (or the one tile a wave holds at least) where it binds
            assert full <= max(budget, stored) + copy

        def bound(requests, context):
            return pf_plan.scratch_bound(t, requests, context, hq, hkv, p, config)

        assert full <= bound(3, width) and full <= bound(len(reqs), 2 * width)
        for context in (width // 2, width - 16):
            assert bound(len(reqs), context) <= full
            assert bound(len(reqs), context) < full or budget is not None
    assert (prefill_scratch_bytes(t, 3, width, hq, hkv, p, config)
            == pf_plan.scratch_bound(t, 3, width, hq, hkv, p, config))


def test_scratch_bound_where_the_copy_fits_fewer_requests():
    """The summary copy may fit for one request and not for three (``summary_copy_bytes``): one call then routes from
    the copy (smaller tiles plus the copy), the other from stored scores; the bound for three requests covers both."""
    p = DashParams(block_size=16, topk=2, scaling_factor=1.0)
    cases = [make_prefill_case(3, reqs, hq=8, hkv=2, bs=16, params=p).to(DEV)
             for reqs in ([(150, 150)], [(150, 150), (40, 7), (90, 33)])]
    width = cases[0].block_table.shape[1] * cases[0].cache.page_size
    assert all(c.block_table.shape[1] * c.cache.page_size == width for c in cases)
    summ = cases[0].cache.summaries
    one_copy = p.max_candidates(width) * 2 * summ.shape[-1] * summ.element_size()  # [1, max_cand, Hkv, D]
    config = PrefillConfig(recompute_min_candidates=1, summary_copy_bytes=one_copy)
    made = [pf_launch.plan_and_scratch(c.q, c.cache, c.block_table, c.cu, c.seq_lens, p, config)[1] for c in cases]
    assert made[0].summary_copy is not None and made[1].summary_copy is None
    t = max(c.q.shape[0] for c in cases)
    bound = pf_plan.scratch_bound(t, 3, width, 8, 2, p, config)
    assert all(_allocated(s) <= bound for s in made)
    assert bound == _allocated(made[1])  # here the stored path's scratch is the larger: the bound is tight


def test_scratch_bound_of_an_indexer():
    """With an indexer the kernels route with router ``shared`` over ``max(Hq, Hi)`` score rows: the bound the vLLM
    adapter asks for (its layer's parameters, router ``kv_head``) equals what such a call allocates."""
    p, hi = DashParams(block_size=16, topk=2, scaling_factor=1.0), 6
    case = make_prefill_case(3, [(150, 150), (90, 33)], hq=8, hkv=2, bs=16, params=p).to(DEV)
    t, width = case.q.shape[0], case.block_table.shape[1] * case.cache.page_size
    shared = dataclasses.replace(p, router="shared")
    plan = pf_plan.PrefillPlan.build(case.q, case.cache, case.block_table, case.cu, case.seq_lens, shared,
                                     PrefillConfig(), route_heads=hi)
    got = _allocated(pf_plan.PrefillScratch.allocate(plan.wave, plan.qt, pf_plan.score_heads(8, hi), 2,
                                                     plan.max_cand, shared, case.q.device))
    assert prefill_scratch_bytes(t, 2, width, 8, 2, p, indexer_heads=hi) == got


def test_the_profile_reservation_holds_the_largest_until_released():
    """What ``reserve_prefill_scratch`` holds (on CUDA; the holder itself on any device): one tensor per device,
    replaced by a larger request only, freed by ``release_prefill_scratch``; nothing held on the CPU."""
    import dash_core.workspace as ws

    cpu = torch.device("cpu")
    ws.release_prefill_scratch()
    ws.reserve_prefill_scratch(1 << 20, cpu)
    assert not ws._RESERVED
    ws._hold(1000, cpu)
    first = ws._RESERVED[cpu]
    ws._hold(10, cpu)
    assert ws._RESERVED[cpu] is first and first.numel() == 1000
    ws._hold(5000, cpu)
    assert ws._RESERVED[cpu].numel() == 5000
    ws.release_prefill_scratch()
    assert not ws._RESERVED


@pytest.mark.parametrize("min_cand", [1, 1 << 20])  # routing from each layer's summary copy, or stored scores
def test_workspace_shared_by_the_layers_of_a_batch(min_cand):
    """Layers of one batch (different caches and queries, the same length tensors) sharing a workspace: the
    first call makes the plan and scratch, the second reuses them (in three waves, over the first layer's
    leftover scratch; the summary copy made again from its own cache) and both outputs equal calls without a
    workspace exactly. A new length tensor or another token count makes them again."""
    p = DashParams(block_size=16, scaling_factor=2.0, topk=3)
    reqs = [(70, 40), (0, 0), (33, 33), (50, 7)]
    layers = [make_prefill_case(60 + i, reqs, params=p).to(DEV) for i in range(2)]
    for case in layers:
        assert torch.equal(case.cu, layers[0].cu) and torch.equal(case.seq_lens, layers[0].seq_lens)
    config = PrefillConfig(recompute_min_candidates=min_cand)
    plan = pf_plan.PrefillPlan.build(layers[0].q, layers[0].cache, layers[0].block_table, layers[0].cu,
                                     layers[0].seq_lens, p, config)
    assert plan.recompute == (min_cand == 1)
    budget = -(-plan.num_tiles // 3) * pf_plan.PrefillScratch.bytes_per_tile(
        plan.qt, layers[0].q.shape[1], layers[0].cache.num_kv_heads, plan.max_cand, p, plan.recompute)
    config = dataclasses.replace(config, scratch_bytes=budget)
    alone = [prefill(case, config) for case in layers]
    ws = PrefillWorkspace(config)
    lens = (layers[0].cu, layers[0].seq_lens)
    shared = [prefill(case, write=False, workspace=ws, lens=lens) for case in layers]
    assert ws.builds == 1
    for a, b in zip(alone, shared):
        assert torch.equal(a, b)
    again = prefill(layers[1], write=False, workspace=ws, lens=(lens[0].clone(), lens[1]))
    assert ws.builds == 2 and torch.equal(again, alone[1])
    short = make_prefill_case(62, [(70, 40), (33, 33)], params=p).to(DEV)
    out = prefill(short, workspace=ws)
    assert ws.builds == 3 and torch.equal(out, prefill(short, config, write=False))
    with pytest.raises(TypeError, match="PrefillWorkspace"):
        prefill(short, workspace=object())


def test_chunked_prompt_every_boundary_class():
    """One prompt extended chunk by chunk through the op (each chunk on the history the previous ones
    wrote, summaries included): chunks that start and end on block boundaries, start mid-block, end
    mid-block, lie inside one block, hold one token, span several blocks (local window of two blocks,
    so a chunk's first tokens attend the previous chunk's block locally). Every row against the oracle
    on the whole prompt."""
    chunks = [16, 7, 1, 8, 20, 12, 1, 15, 9]  # boundaries at 16, 23, 24, 32, 52, 64, 65, 80, 89
    total = sum(chunks)
    p = DashParams(block_size=16, scaling_factor=2.5, topk=4, local=32)
    full = make_prefill_case(31, [(total, total)], hq=4, hkv=2, params=p, pages_per_block=2).to(DEV)
    wipe_new_tokens(full)
    out = torch.empty_like(full.q)
    start = 0
    for c in chunks:
        sl = slice(start, start + c)
        cu = torch.tensor([0, c], dtype=torch.int32, device=full.q.device)
        seq = torch.tensor([start + c], dtype=torch.int32, device=full.q.device)
        out[sl] = kernel_prefill(full.q[sl], full.k[sl], full.v[sl], full.cache, full.block_table, cu, seq,
                                 full.slot_mapping[sl], full.head_cls, p)
        start += c
    (bad,), (excused,) = (x.values() for x in differing_rows(full, out))  # [total, Hq], in the prompt's order
    ends = torch.tensor(chunks).cumsum(0).tolist()
    assert_rows_match({f"chunk {a}..{b}": bad[a:b] for a, b in zip([0] + ends[:-1], ends)}, {"prompt": excused})


@pytest.mark.parametrize("tail,scratch_bytes", [(40, None), (1, None), (300, None), (40, 1)])
def test_tail_rows_and_inconsistent_requests_are_zero(tail, scratch_bytes):
    """Token rows past ``cu_seqlens_q[n]`` and rows of a request whose new tokens outnumber its length
    are written as zeros (never NaN, never left stale). The attention programs of the tiles past the last one zero
    the tail, each its share; with a scratch of one tile a wave, those tiles come in waves of their own."""
    p = DashParams(block_size=16, scaling_factor=2.0)
    case = make_prefill_case(8, [(40, 20), (30, 10)], params=p).to(DEV)
    t = case.q.shape[0]
    q = torch.cat([case.q, torch.randn(tail, *case.q.shape[1:]).to(case.q)])
    seq = case.seq_lens.clone()
    seq[1] = 5  # 10 new tokens cannot end at length 5
    out = torch.full_like(q, float("nan"))
    config = PrefillConfig() if scratch_bytes is None else PrefillConfig(scratch_bytes=scratch_bytes)
    pf_launch.paged_dash_prefill_triton(q, None, None, case.cache, case.block_table, case.cu, seq, None,
                                        case.head_cls, p, out=out, config=config)
    out = out.cpu()
    assert torch.equal(out[20:], torch.zeros_like(out[20:]))
    assert_rows_match(*differing_rows(case, out[:t], requests=(0,)))
    assert out.shape[0] == t + tail


def test_validation_errors_before_any_write():
    p = DashParams(block_size=16)
    case = make_prefill_case(1, [(40, 20)], params=p).to(DEV)
    before = case.cache.k_pages.clone()
    good = dict(q=case.q, k=case.k, v=case.v, cache=case.cache, block_table=case.block_table, cu_seqlens_q=case.cu,
                seq_lens=case.seq_lens, slot_mapping=case.slot_mapping, head_cls=case.head_cls, params=p)

    def call(**kw):
        a = dict(good, **kw)
        return kernel_prefill(a["q"], a["k"], a["v"], a["cache"], a["block_table"], a["cu_seqlens_q"],
                              a["seq_lens"], a["slot_mapping"], a["head_cls"], a["params"])

    bad = [
        (dict(q=case.q.float()), "dtype"),
        (dict(cu_seqlens_q=case.cu[:1]), "cu_seqlens_q"),
        (dict(block_table=case.block_table.long()), "block_table"),
        (dict(k=case.k[:3]), "k must be"),
        (dict(slot_mapping=None), "together"),
        (dict(head_cls=case.head_cls[:1]), "head_cls"),
        (dict(params=DashParams(block_size=256)), "block_size"),
        (dict(q=case.q.reshape(case.q.shape[0], -1, 32)), "head_dim"),
        (dict(seq_lens=case.seq_lens.to("meta")), "seq_lens is on meta"),
        (dict(q=case.q.transpose(1, 2).contiguous().transpose(1, 2)), "contiguous in D"),
    ]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            call(**kw)
    assert torch.equal(case.cache.k_pages, before)


@pytest.mark.parametrize("hq,hkv,router,recompute", [
    (8, 2, "kv_head", False), (4, 4, "kv_head", False), (8, 2, "shared", False), (4, 4, "shared", False),
    (8, 2, "kv_head", True), (4, 4, "kv_head", True), (32, 8, "kv_head", True),
])
def test_scratch_bytes_are_the_allocation(hq, hkv, router, recompute):
    """``bytes_per_tile`` (the wave budget's unit) is what ``allocate`` takes: the union tables that live
    in the scores' storage are not counted, those that do not are; the two tables never overlap and lie
    within that storage where it is large enough. Without stored scores (``recompute``) the storage holds no
    more than the two tables."""
    p = DashParams(block_size=16, topk=4, router=router)
    qt, tiles, max_cand = 4, 3, 10
    s = pf_plan.PrefillScratch.allocate(tiles, qt, hq, hkv, max_cand, p, "cpu", recompute)
    assert _allocated(s) == tiles * pf_plan.PrefillScratch.bytes_per_tile(qt, hq, hkv, max_cand, p, recompute)
    storage = s.scores.untyped_storage()
    start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    spans = {name: (t.data_ptr(), t.data_ptr() + 4 * t.numel())
             for name, t in (("pos", s.union_pos), ("prior", s.union_prior))}
    assert spans["pos"][0] == start and spans["pos"][1] <= end
    assert spans["pos"][1] <= spans["prior"][0] or spans["prior"][1] <= spans["pos"][0]
    inside = s.union_prior.untyped_storage().data_ptr() == start
    assert inside == (hq >= 2 * hkv) and (spans["prior"][1] <= end or not inside)
    if recompute:  # no more than the two tables' rows (padded to 16 entries)
        assert storage.nbytes() == tiles * qt * min(hq, 2 * hkv) * 16 * 4


def test_waves_fill_whole_rounds():
    """Waves are sized in whole rounds of resident programs, within the budget; a prompt whose tiles all
    fit runs in one wave."""
    cpu, per, hkv = torch.device("cpu"), 1000, 8
    slots = common.DEFAULT_NUM_SMS * PrefillConfig().resident_ctas

    def budget(nbytes):
        return PrefillConfig(scratch_bytes=nbytes)

    w = pf_plan.wave_tiles(8194, per, hkv, cpu, budget(140 * per))  # the 128k prompt's shape
    assert w <= 140 and (w * hkv) % slots == 0
    assert pf_plan.wave_tiles(500, per, hkv, cpu, budget(1 << 40)) == 500
    assert pf_plan.wave_tiles(10, per, hkv, cpu, budget(3 * per)) == 3  # under one round: the budget


@pytest.mark.parametrize("n, seed", [(1, 0), (5, 1), (1500, 2)])  # 1500: the offsets' running sum crosses chunks
def test_tile_tables_place_the_host_layout(n, seed):
    """``tile_req`` / ``tile_off`` (one launch) against ``tile_layout_host``: every tile's request in tile
    order, each request's first tile, and ``n`` on the tiles past the last; requests with no new token or
    starting mid-tile included."""
    g = torch.Generator().manual_seed(seed)
    qlen = torch.randint(0, 40, (n,), generator=g) * (torch.rand(n, generator=g) > 0.2)
    seq = qlen + torch.randint(0, 70, (n,), generator=g)
    cu = torch.zeros(n + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(qlen, 0)
    t, qt = int(cu[-1]) + 3, 16
    tile_req, tile_off, nt = pf_tiles.tile_tables(cu.to(DEV), seq.to(torch.int32).to(DEV), t, qt)
    layout = pf_tiles.tile_layout_host(cu, seq, qt)
    want = torch.full((nt,), n, dtype=torch.int32)
    want[:len(layout)] = torch.tensor([req for req, *_ in layout], dtype=torch.int32)
    assert torch.equal(tile_req.cpu(), want)
    first = torch.searchsorted(want[:len(layout)], torch.arange(n + 1, dtype=torch.int32))  # first tile of each
    assert torch.equal(tile_off.cpu(), first.to(torch.int32))
