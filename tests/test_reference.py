"""Properties of the float64 oracle (docs/semantics.md sections 2-7)."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from dash_core import DashParams, dash_reference
from dash_core.reference import block_summaries, entmax15_threshold, route

F64 = torch.float64


def rand(b, hq, hkv, n, d, seed, dtype=F64, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, hq, n, d, generator=g) * scale).to(dtype)
    k = (torch.randn(b, hkv, n, d, generator=g) * scale).to(dtype)
    v = torch.randn(b, hkv, n, d, generator=g).to(dtype)
    hc = torch.randn(hkv, d, generator=g).to(dtype)
    return q, k, v, hc


def dense_causal(q, k, v):
    rep = q.shape[1] // k.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(
        q.to(F64), k.to(F64).repeat_interleave(rep, 1), v.to(F64).repeat_interleave(rep, 1), is_causal=True)


@pytest.mark.parametrize("bs,local,router,hq,hkv", [(16, None, "kv_head", 4, 2), (16, 48, "shared", 8, 2),
                                                    (32, None, "kv_head", 3, 3), (16, 32, "kv_head", 8, 1)])
def test_dense_equivalent_configuration_is_dense_causal(bs, local, router, hq, hkv):
    q, k, v, hc = rand(2, hq, hkv, 150, 16, seed=bs + hq)
    p = DashParams(block_size=bs, local=local, router=router, scaling_factor=0.0, estimate_diagonal=True)
    out, active = dash_reference(q, k, v, hc, p)
    assert torch.allclose(out, dense_causal(q, k, v), atol=1e-12, rtol=0)
    # every block up to the query's own is active
    assert torch.equal(active[0, 0], (torch.arange(150) // bs + 1).to(torch.int32))


def test_local_covering_everything_is_dense_whatever_the_routing():
    q, k, v, hc = rand(1, 4, 2, 100, 16, seed=3)
    out, _ = dash_reference(q, k, v, hc, DashParams(block_size=16, local=112, scaling_factor=8.0))
    assert torch.allclose(out, dense_causal(q, k, v), atol=1e-12, rtol=0)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), topk=st.integers(1, 6), bs=st.sampled_from([16, 32]),
       local_blocks=st.integers(1, 3), router=st.sampled_from(["kv_head", "shared"]),
       sf=st.sampled_from([0.5, 2.0, 8.0]))
def test_topk_caps_routed_blocks_exactly(seed, topk, bs, local_blocks, router, sf):
    q, k, v, hc = rand(1, 4, 2, 9 * bs + 5, 16, seed=seed)
    base = dict(block_size=bs, local=local_blocks * bs, router=router, scaling_factor=sf)
    _, free = dash_reference(q, k, v, hc, DashParams(**base))
    _, capped = dash_reference(q, k, v, hc, DashParams(**base, topk=topk))
    pos = torch.arange(q.shape[2])
    nlocal = torch.minimum(pos // bs + 1, torch.tensor(local_blocks)).to(torch.int32)
    routed = free - nlocal  # without estimate_diagonal every block with mp > 0 is kept
    assert torch.equal(capped - nlocal, torch.minimum(routed, torch.tensor(topk, dtype=torch.int32)))
    if router == "shared":
        assert torch.equal(capped[:, 0], capped[:, 1])


def test_topk_keeps_the_largest_and_breaks_ties_to_the_lower_block():
    # Four candidates with mp = 0.25 each (equal scores); a cap of 2 keeps blocks 0 and 1.
    summaries = torch.zeros(1, 4, 8, dtype=F64)
    q = torch.ones(2, 1, 8, dtype=F64)
    rt = route(q, summaries, torch.tensor([4]), DashParams(block_size=16, topk=2))
    assert rt.kept[0, 0].tolist() == [True, True, False, False]
    # Distinct scores: the cap keeps the two largest mp, wherever they are.
    summaries = torch.tensor([0.1, 0.9, 0.2, 0.8], dtype=F64).reshape(1, 4, 1).repeat(1, 1, 8)
    rt = route(q, summaries * 0.5, torch.tensor([4]), DashParams(block_size=16, topk=2))
    assert rt.kept[0, 0].tolist() == [False, True, False, True]


def test_local_window_follows_section_3():
    bs, lb = 16, 3
    q, k, v, hc = rand(1, 2, 1, 8 * bs, 16, seed=5)
    p = DashParams(block_size=bs, local=lb * bs, scaling_factor=30.0)
    row = 7 * bs + 3  # block 7; window = blocks 5, 6, 7; candidates 0..4
    out, act = dash_reference(q, k, v, hc, p, rows=[row])
    summ = block_summaries(k[0], hc, bs)
    rt = route((q[0][:, [row]] * p.scaling_factor), summ[:, :5], torch.tensor([5]), p)
    assert act.item() == lb + int(rt.kept.sum())
    unrouted = [j for j in range(5) if not rt.kept[0, 0, j]]
    assert unrouted, "the test needs a candidate that is not routed"

    def perturbed(block, future=False):
        v2 = v.clone()
        sl = slice(row + 1, 8 * bs) if future else slice(block * bs, (block + 1) * bs)
        v2[..., sl, :] += 10.0
        return dash_reference(q, k, v2, hc, p, rows=[row])[0]

    assert not torch.allclose(perturbed(5), out)  # first block of the window is attended
    assert torch.allclose(perturbed(unrouted[0]), out, atol=0, rtol=0)  # an unrouted candidate is not
    assert torch.allclose(perturbed(None, future=True), out, atol=0, rtol=0)  # causal inside the window


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 1000), router=st.sampled_from(["kv_head", "shared"]), est=st.booleans())
def test_rows_equal_full_evaluation(seed, router, est):
    q, k, v, hc = rand(2, 4, 2, 200, 16, seed=seed, dtype=torch.bfloat16)
    p = DashParams(block_size=16, local=32, topk=4, router=router, estimate_diagonal=est, scaling_factor=3.0)
    full, act = dash_reference(q, k, v, hc, p)
    rows = torch.randperm(200, generator=torch.Generator().manual_seed(seed))[:17]
    part, act_part = dash_reference(q, k, v, hc, p, rows=rows)
    assert torch.equal(part, full[:, :, rows]) and torch.equal(act_part, act[:, :, rows])


@pytest.mark.parametrize("case", ["first_block", "single_token", "equal_scores", "zero_query"])
def test_no_nan(case):
    p = DashParams(block_size=16, scaling_factor=2.0, estimate_diagonal=True, topk=3)
    n = {"first_block": 10, "single_token": 1}.get(case, 100)
    q, k, v, hc = rand(1, 4, 2, n, 16, seed=1, dtype=torch.bfloat16)
    if case == "equal_scores":
        k = torch.ones_like(k)
    if case == "zero_query":
        q = torch.zeros_like(q)
    out, act = dash_reference(q, k, v, hc, p)
    assert not out.isnan().any()
    if case in ("first_block", "single_token"):  # only the own block: plain causal attention
        assert torch.allclose(out.double(), dense_causal(q, k, v), atol=1e-2)
    if case == "equal_scores":  # all candidates tie: the cap keeps topk of them, prior ~1
        pos = torch.arange(n)
        assert torch.equal(act[0, 0], (1 + torch.minimum(pos // 16, torch.tensor(3))).to(torch.int32))
    if case == "zero_query":  # every logit and routing score 0: the cap keeps the first 3 candidate blocks with equal
        # priors (bias 0 after the geometric-mean normalisation), so each row is the plain mean of V over its own
        # block's tokens up to it and those 3 blocks
        pos = torch.arange(n)
        assert torch.equal(act[0, 0], (1 + torch.minimum(pos // 16, torch.tensor(3))).to(torch.int32))
        vd = v.double()
        want = torch.stack([vd[:, :, [j for j in range(t + 1) if j // 16 == t // 16 or j // 16 < min(t // 16, 3)]]
                            .mean(2) for t in range(n)], 2)
        torch.testing.assert_close(out.double(), want.repeat_interleave(2, 1), atol=1e-2, rtol=0)


def halley_scalar(xs):
    """docs/semantics.md section 4 for one row, in plain Python floats."""
    m = max(xs)
    lo, hi = m - 1, m
    tau = (lo + hi) / 2
    for _ in range(3):
        a = [x for x in xs if x > tau]
        f = sum((x - tau) ** 2 for x in a) - 1
        df = -2 * sum(x - tau for x in a)
        ddf = 2 * len(a)
        den = 2 * df * df - f * ddf
        new = tau - 2 * f * df / den if den != 0 else math.nan
        if f > 0:
            lo = tau
        if f < 0:
            hi = tau
        tau = new if (lo - 1e-5 < new < hi + 1e-5) else (lo + hi) / 2
    return tau


@settings(max_examples=40, deadline=None)
@given(xs=st.lists(st.floats(-5, 5), min_size=1, max_size=40), spread=st.sampled_from([0.01, 0.1, 1.0, 3.0]))
def test_entmax_threshold_is_three_safeguarded_halley_steps(xs, spread):
    x = torch.tensor(xs, dtype=F64) * spread
    tau = entmax15_threshold(x[None], torch.ones(1, len(xs), dtype=torch.bool))
    assert tau.item() == pytest.approx(halley_scalar(x.tolist()), abs=1e-12)


def test_entmax_converges_to_exact_for_well_separated_scores():
    x = torch.tensor([[2.0, 1.2, 0.1, -3.0, 1.9]], dtype=F64)
    tau = entmax15_threshold(x, torch.ones_like(x, dtype=torch.bool))
    p = (x - tau[:, None]).clamp(min=0) ** 2
    assert p.sum().item() == pytest.approx(1.0, abs=1e-6)


def test_summaries_are_stored_in_the_kv_dtype():
    _, k, _, hc = rand(1, 2, 2, 64, 16, seed=2, dtype=torch.bfloat16)
    s = block_summaries(k[0], hc, 16)
    assert s.shape == (2, 4, 16) and torch.equal(s, s.to(torch.bfloat16).to(F64))
    w = torch.softmax((k[0, 0, :16].double() @ hc[0].double()) / 4.0, 0)
    assert torch.allclose(s[0, 0], (w[:, None] * k[0, 0, :16].double()).sum(0), atol=1e-2)


def test_bad_shapes_are_rejected():
    q, k, v, hc = rand(1, 3, 2, 10, 16, seed=0)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        dash_reference(q, k, v, hc, DashParams(block_size=16))
    q, k, v, hc = rand(1, 4, 2, 10, 16, seed=0)
    with pytest.raises(ValueError, match="head_cls"):
        dash_reference(q, k, v, hc[:1], DashParams(block_size=16))
    with pytest.raises(ValueError, match="rows"):
        dash_reference(q, k, v, hc, DashParams(block_size=16), rows=[10])
