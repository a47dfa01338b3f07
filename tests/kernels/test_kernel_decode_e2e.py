"""The whole Triton decode step (write, route, attend) against the float64 oracle."""

from __future__ import annotations

import os

import torch
from hypothesis import given, settings, strategies as st

from dash_core import DashParams
from dash_core.kernels.decode.buffers import DecodeBuffers
from dash_core.kernels.decode.config import DecodeConfig
from dash_core.reference import attend
from tests.kernels._kernel_env import KERNEL_DEVICE
from tests.kernels._kernel_ops import kernel_decode
from tests.kernels._kernel_scenarios import (batch_lens, excused_heads, forget_summaries_from, make_scenario,
                                            oracle_decode_rows, oracle_route, truncated)
from tests.kernels.test_kernel_decode_attention import TOL

EXAMPLES = int(os.environ.get("DASH_KERNEL_EXAMPLES", "10"))
DEV = KERNEL_DEVICE
# Against the pure oracle (summaries from the keys in float64), routing is discontinuous in the summaries' rounding
# (docs/semantics.md sections 7 and 10): a block at the entmax threshold can move when the kernel's bf16 summary is
# one ulp away from the oracle's, changing that row's output by O(0.1); there at most this fraction of (request,
# query head) rows may miss the attention tolerance (the segment backends' test). Against the oracle fed the
# kernels' own inputs (``row_errors(strict=True)``) no row may, but those of a unit with a decision section 7 excuses.
MAX_DIFFERING_ROWS = 0.05


def decode(sc, **kw):
    return kernel_decode(sc.q, sc.k_new, sc.v_new, sc.cache, sc.block_table, sc.seq_lens, sc.slot_mapping,
                         sc.head_cls, sc.params, **kw)


def row_errors(sc, out, strict: bool = False) -> tuple:
    """(rows checked, rows outside the attention tolerance); padded rows must be exactly zero. Against the pure
    oracle (``oracle_decode_rows``); ``strict``: against the oracle's routing of the stored summaries with the
    kernels' ``sf * q`` (``oracle_route``) and its attention, rows of a unit with a near-threshold decision
    (``excused_heads``) not counted."""
    out = out.cpu()
    tol = TOL[sc.q.dtype]
    checked = bad = 0
    for i in range(sc.n):
        L = int(sc.seq_lens[i])
        if L == 0:
            assert torch.equal(out[i], torch.zeros_like(out[i])), "padded row must be zeros"
            continue
        counted = torch.ones(sc.q.shape[1], dtype=torch.bool)
        if strict:
            rt, x, ncand = oracle_route(sc, i)
            counted = ~excused_heads(rt.mp, x[:, None], torch.tensor([ncand]), sc.params.topk, sc.q.shape[1])[0]
            ref = attend(sc.q[i].cpu()[:, None, :], sc.k_full[i], sc.v_full[i], torch.tensor([L - 1]), rt,
                         sc.params)[:, 0]
        else:
            ref = oracle_decode_rows(sc, i)
        err = (out[i].double() - ref).abs() - tol["rtol"] * ref.abs()
        checked += int(counted.sum())
        bad += int(((err.amax(-1) > tol["atol"]) & counted).sum())
    assert torch.isfinite(out).all()
    return checked, bad


@settings(max_examples=EXAMPLES, deadline=None)
@given(seed=st.integers(0, 2**31 - 1),
       lens=batch_lens(st.integers(30, 200), st.one_of(st.integers(0, 30), st.integers(30, 200))),
       local_blocks=st.integers(1, 2), bs=st.sampled_from([16, 32]), ppb=st.integers(1, 4),
       layout=st.sampled_from(["sglang", "vllm"]), dtype=st.sampled_from([torch.bfloat16, torch.float16]))
def test_dense_equivalent_is_causal_attention(seed, lens, local_blocks, bs, ppb, layout, dtype):
    """sf = 0 with estimate_diagonal routes every candidate with prior 1 (docs/semantics.md section 1): the
    kernels' step must equal dense causal attention on every row (no routing discontinuity)."""
    p = DashParams.dense_equivalent(bs, local=bs * local_blocks)
    sc = make_scenario(seed, lens, hq=4, hkv=2, bs=bs, pages_per_block=ppb, layout=layout, dtype=dtype, params=p,
                       shared_prefix_pages=2).to(DEV)
    out = decode(sc).cpu()
    for i, L in enumerate(lens):
        if L == 0:
            assert torch.equal(out[i], torch.zeros_like(out[i]))
            continue
        k = sc.k_full[i].double().repeat_interleave(2, 0)
        v = sc.v_full[i].double().repeat_interleave(2, 0)
        ref = torch.nn.functional.scaled_dot_product_attention(sc.q[i].cpu().double()[:, None], k, v)[:, 0]
        torch.testing.assert_close(out[i].double(), ref, **TOL[dtype])


CASES = [  # (lens, DashParams kwargs, scenario kwargs)
    ([200, 0, 17, 131], dict(scaling_factor=2.0), dict()),
    ([260, 48, 1], dict(scaling_factor=4.0, topk=3), dict(layout="vllm", pages_per_block=2)),
    ([190, 190], dict(scaling_factor=1.0, estimate_diagonal=True, router="shared"), dict(shared_prefix_pages=3)),
    ([240, 65, 0, 100], dict(scaling_factor=3.0, topk=5, local=32), dict(hq=8, pages_per_block=4)),
    ([150, 220], dict(scaling_factor=2.0, estimate_diagonal=True, sigma=1.0, topk=4),
     dict(dtype=torch.float16, layout="vllm")),
]


def _assert_every_counted_row_matches(rows: int, checked: int, bad: int) -> None:
    assert checked >= 0.9 * rows, f"only {checked} of {rows} rows were clear of a near-threshold decision"
    assert bad == 0, f"{bad} of {checked} rows differ from the oracle"


def test_sparse_decode_matches_oracle():
    rows = checked = bad = 0
    for n, (lens, pk, sk) in enumerate(CASES):
        p = DashParams(block_size=16, **pk)
        sc = make_scenario(100 + n, lens, params=p, **sk).to(DEV)
        c, b = row_errors(sc, decode(sc, buffers=DecodeBuffers.for_step(
            sc.q, sc.cache, sc.block_table, p, splits=(2, 3))), strict=True)
        rows, checked, bad = rows + sum(1 for x in lens if x) * sc.q.shape[1], checked + c, bad + b
    _assert_every_counted_row_matches(rows, checked, bad)


def test_decode_steps_cross_block_boundaries():
    """Consecutive steps through the op: the decode kernel writes K/V and the summaries of the
    blocks it completes, later steps route over those summaries (they start zeroed)."""
    p = DashParams(block_size=16, scaling_factor=2.0, topk=4)
    steps = 20
    start = [60, 45, 0]
    full = make_scenario(7, [s + steps if s else 0 for s in start], params=p, shared_prefix_pages=2).to(DEV)
    forget_summaries_from(full, start)
    bufs = DecodeBuffers.for_step(full.q, full.cache, full.block_table, p, splits=(2, 2))
    rows = checked = bad = 0
    for t in range(steps + 1):  # row 0 crosses 64 and 80, row 1 crosses 48 and 64
        sc = truncated(full, [s + t if s else 0 for s in start], seed=t)
        c, b = row_errors(sc, decode(sc, buffers=bufs), strict=True)
        rows, checked, bad = rows + 2 * sc.q.shape[1], checked + c, bad + b
    _assert_every_counted_row_matches(rows, checked, bad)


def test_halved_step_equals_the_whole_batch():
    """A wide batch as two halves (``DecodeConfig.overlap_halves``; wide forced by buffers sized for one
    multiprocessor): at fixed splits each row equals the whole batch's step bit for bit (rows are independent; the
    second half's partial outputs sit after the first half's), odd batches too; at the halves' own splits the rows
    match the oracle."""
    halves, whole_batch = DecodeConfig(overlap_halves=True), DecodeConfig(overlap_halves=False)
    rows = checked = bad = 0
    for n, (lens, pk, sk) in enumerate(CASES):
        p = DashParams(block_size=16, **pk)
        sc = make_scenario(200 + n, lens, params=p, **sk).to(DEV)
        whole = DecodeBuffers.for_step(sc.q, sc.cache, sc.block_table, p, splits=(2, 3), num_sms=1,
                                       config=whole_batch)
        split = DecodeBuffers.for_step(sc.q, sc.cache, sc.block_table, p, splits=(2, 3), num_sms=1, config=halves)
        own = DecodeBuffers.for_step(sc.q, sc.cache, sc.block_table, p, num_sms=1, config=halves)
        assert not whole.halved(sc.n) and split.halved(sc.n) == (sc.n >= 2)
        if sc.n >= 2:  # the halves' views are disjoint: the second half's rows and partials after the first's
            h, (a, b) = sc.n // 2, own.halves(sc.n)
            for f in ("scores", "pmax", "mp", "mp_cand", "sel_idx", "sel_blk", "sel_bias", "sel_count"):
                assert getattr(b, f).data_ptr() == getattr(own, f)[h].data_ptr() and getattr(a, f).shape[0] == h
            parts = [m * own.splits(m)[1] for m in (h, sc.n - h)]
            assert b.o_part.data_ptr() == own.o_part[parts[0]].data_ptr() and b.o_part.shape[0] >= parts[1]
            assert b.lse_part.data_ptr() == own.lse_part[parts[0]].data_ptr() and b.lse_part.shape[0] >= parts[1]
        expect = decode(sc, buffers=whole)
        assert torch.equal(decode(sc, buffers=split), expect)  # (each call writes the same K/V again)
        c, b = row_errors(sc, decode(sc, buffers=own), strict=True)
        rows, checked, bad = rows + sum(1 for x in lens if x) * sc.q.shape[1], checked + c, bad + b
    _assert_every_counted_row_matches(rows, checked, bad)
