"""Prefill routing with recomputed scores (``dash_core.kernels.prefill_route``) against the oracle,
with the same checks as the stored-score kernel (``test_kernel_prefill.check_routing``), and the whole
prefill op with it switched on (``prefill.ROUTE_RECOMPUTE``)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings, strategies as st

from dash_core import DashParams
from dash_core.kernels import prefill as pf
from dash_core.kernels.prefill_route import route_wave_recompute
from tests.kernels._kernel_env import KERNEL_DEVICE
from tests.kernels._prefill_scenarios import make_prefill_case, plan_and_scratch, token_slots
from tests.kernels.test_kernel_prefill import REQS, check_routing, count_differing_rows, prefill

EXAMPLES = int(os.environ.get("DASH_PREFILL_EXAMPLES", os.environ.get("DASH_KERNEL_EXAMPLES", "8")))
DEV = KERNEL_DEVICE


def route_both(case):
    """(stored-score scratch, recomputed-score scratch) of one case, each routed over every tile."""
    p = case.params
    out = []
    for fn in (pf.route_wave, route_wave_recompute):
        plan, scratch = plan_and_scratch(case)
        fn(case.q, case.cache, case.block_table, case.cu, case.seq_lens, p, plan, scratch, 0, plan.num_tiles)
        out.append((plan, scratch))
    return out


@settings(max_examples=EXAMPLES, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), reqs=REQS, router=st.sampled_from(["kv_head", "shared"]),
       topk=st.one_of(st.none(), st.integers(1, 6)), est=st.booleans(), sf=st.sampled_from([0.7, 2.0, 4.0]),
       local_blocks=st.integers(1, 2), ppb=st.integers(1, 3), layout=st.sampled_from(["sglang", "vllm"]),
       group=st.sampled_from([1, 2, 3]), dtype=st.sampled_from([torch.bfloat16, torch.float16]))
def test_recomputed_routing_matches_oracle(seed, reqs, router, topk, est, sf, local_blocks, ppb, layout, group,
                                           dtype):
    """The kept blocks, physical ids and log priors of every new token equal the oracle's (blocks at
    the entmax threshold exempt, as for the stored-score kernel); the counts equal that kernel's on
    all but threshold-edge units (the fp32 sums differ only in order)."""
    p = DashParams(block_size=16, topk=topk, local=16 * local_blocks, scaling_factor=sf, estimate_diagonal=est,
                   router=router)
    case = make_prefill_case(seed, reqs, hq=2 * group, hkv=2, bs=16, pages_per_block=ppb, layout=layout,
                             dtype=dtype, params=p, shared_prefix_pages=1).to(DEV)
    (plan, stored), (_, recomputed) = route_both(case)
    check_routing(case, plan, recomputed)
    slots = sorted(token_slots(case, plan).values())
    if slots:
        same = (stored.sel_count[slots] == recomputed.sel_count[slots]).float().mean().item()
        assert same >= 0.95, f"only {same:.0%} of the units keep as many blocks as with stored scores"


def test_recomputed_routing_wide_rows_and_caps():
    """Several BLOCK_N chunks per pass, a GQA group of 4, topk below and above the support."""
    for topk in (None, 3, 30):
        p = DashParams(block_size=16, topk=topk, scaling_factor=3.0)
        case = make_prefill_case(21, [(16 * 45 + 5, 20), (40, 40)], hq=8, hkv=2, params=p, q_scale=1.5).to(DEV)
        plan, scratch = plan_and_scratch(case)
        route_wave_recompute(case.q, case.cache, case.block_table, case.cu, case.seq_lens, p, plan, scratch, 0,
                             plan.num_tiles)
        check_routing(case, plan, scratch)


@pytest.mark.parametrize("router", ["kv_head", "shared"])
def test_prefill_op_with_recomputed_routing(router, monkeypatch):
    """The whole prefill (write, route, attend) with ``ROUTE_RECOMPUTE`` on: most rows within the
    attention tolerance of the oracle, as the stored-score path is held to."""
    monkeypatch.setattr(pf, "ROUTE_RECOMPUTE", 1)  # raises if the switch is renamed (else this tests nothing new)
    p = DashParams(block_size=16, topk=4, scaling_factor=2.0, router=router)
    case = make_prefill_case(5, [(150, 150), (90, 33), (17, 17)], hq=4, hkv=2, params=p).to(DEV)
    checked, bad = count_differing_rows(case, prefill(case))
    assert bad <= 0.05 * checked, f"{bad} of {checked} rows differ from the oracle"
