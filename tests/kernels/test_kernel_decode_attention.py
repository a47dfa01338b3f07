"""Sparse decode attention (stage 3) of the Triton kernels against the oracle, fed the oracle's
own selection and prior (docs/semantics.md section 6)."""

from __future__ import annotations

import os

import torch
from hypothesis import given, settings, strategies as st

from dash_core import DashParams
from dash_core.kernels.decode import launch as decode_launch
from dash_core.kernels.decode.buffers import DecodeBuffers
from dash_core.kernels.decode.config import DecodeConfig
from dash_core.reference import attend
from tests.kernels._kernel_env import KERNEL_DEVICE
from tests.kernels._kernel_scenarios import batch_lens, make_scenario, oracle_route, write_decode_token_torch

EXAMPLES = int(os.environ.get("DASH_KERNEL_EXAMPLES", "10"))
DEV = KERNEL_DEVICE

# The kernel reads bf16/fp16 K/V, accumulates in fp32, rounds the softmax weights to the KV dtype
# before P @ V (as FlashAttention does) and returns the query dtype: for |o| <= ~3 that is within
# 5e-3 + 1e-2 |o| for bf16 (2^-9 relative per rounding) and 1e-3 + 2e-3 |o| for fp16 (2^-12).
TOL = {torch.bfloat16: {"atol": 5e-3, "rtol": 1e-2}, torch.float16: {"atol": 1e-3, "rtol": 2e-3}}


def fill_selection(sc, bufs) -> list:
    """Write the oracle's routing (stored summaries, kernels' sf*q) into ``bufs.sel_*``."""
    p = sc.params
    hsel = bufs.sel_count.shape[1]
    routings = []
    bufs.sel_count.zero_()
    for i in range(sc.n):
        L = int(sc.seq_lens[i])
        rt = oracle_route(sc, i)[0]
        routings.append(rt)
        if L == 0:
            continue
        slots = sc.slots(i)
        for u in range(hsel):
            js = torch.nonzero(rt.kept[u, 0]).flatten()
            c = js.numel()
            bufs.sel_count[i, u] = c
            if c:
                bufs.sel_blk[i, u, :c] = (slots[js * p.block_size] // p.block_size).to(torch.int32).to(DEV)
                bufs.sel_bias[i, u, :c] = rt.prior[u, 0, js].log().float().to(DEV)
    return routings


def check_attention(sc, splits, config=None) -> None:
    """The split launch and merge against the oracle's attention, from scratch holding NaN (every split writes its
    partial, an empty one too)."""
    write_decode_token_torch(sc)
    bufs = DecodeBuffers.for_step(sc.q, sc.cache, sc.block_table, sc.params, splits=(1, splits), config=config)
    routings = fill_selection(sc, bufs)
    for t in (bufs.o_part, bufs.lse_part):
        t.fill_(float("nan"))
    out = torch.full_like(sc.q, float("nan"))
    decode_launch.attend(sc.q, sc.cache, sc.block_table, sc.seq_lens, sc.params, bufs, out)
    out = out.cpu()
    for i in range(sc.n):
        L = int(sc.seq_lens[i])
        if L == 0:
            assert torch.equal(out[i], torch.zeros_like(out[i])), "padded row must be zeros"
            continue
        ref = attend(sc.q[i].cpu()[:, None, :], sc.k_full[i], sc.v_full[i], torch.tensor([L - 1]), routings[i],
                     sc.params)[:, 0]
        torch.testing.assert_close(out[i].double(), ref, **TOL[sc.q.dtype])


@settings(max_examples=EXAMPLES, deadline=None)
@given(seed=st.integers(0, 2**31 - 1),
       # one request with a candidate at every block size and local window drawn
       lens=batch_lens(st.integers(140, 260), st.one_of(st.integers(0, 40), st.integers(40, 200))),
       router=st.sampled_from(["kv_head", "shared"]), topk=st.one_of(st.none(), st.integers(1, 6)),
       est=st.booleans(), sigma=st.sampled_from([1.0, 1e6]), local_blocks=st.integers(1, 3),
       bs=st.sampled_from([16, 32]), ppb=st.integers(1, 3), layout=st.sampled_from(["sglang", "vllm"]),
       group=st.sampled_from([1, 3, 4]), dtype=st.sampled_from([torch.bfloat16, torch.float16]),
       splits=st.integers(1, 4))
def test_attention_matches_oracle(seed, lens, router, topk, est, sigma, local_blocks, bs, ppb, layout, group, dtype,
                                  splits):
    p = DashParams(block_size=bs, topk=topk, local=bs * local_blocks, scaling_factor=2.0, estimate_diagonal=est,
                   sigma=sigma, router=router)
    sc = make_scenario(seed, lens, hq=2 * group, hkv=2, bs=bs, pages_per_block=ppb, layout=layout, dtype=dtype,
                       params=p, shared_prefix_pages=1).to(DEV)
    check_attention(sc, splits)


def test_attention_head_dims_block_sizes_and_tiles():
    """Head sizes 128 and 256, block size 64 and 32, G = 8; a block in one K/V tile, and in 2 or 4
    (``DecodeConfig.attn_tile_elements``), the causal limit inside a later tile of the local block."""
    for d, bs in ((128, 64), (256, 32)):
        p = DashParams(block_size=bs, topk=2, scaling_factor=1.0)
        sc = make_scenario(5, [5 * bs + 3, bs, 0, 3 * bs + bs // 2 + 5], hq=16, hkv=2, d=d, bs=bs, params=p).to(DEV)
        for keys in (bs, bs // 2, 16):
            check_attention(sc, 2, DecodeConfig(attn_tile_elements=keys * d))


def test_wide_batches_take_the_deeper_attention_pipeline():
    """``DecodeBuffers.attn_stages``: ``attn_stages_wide`` once a batch's (request, KV head) rows outnumber the
    multiprocessors (2 KV heads, 4 multiprocessors: 2 requests fill them, 3 do not fit), ``attn_stages`` below;
    ``DecodeBuffers.attn_maxnreg``: the register cap with the narrow pipeline only, at head dim 128 only."""
    bufs = DecodeBuffers.allocate(3, 4, 2, 64, 16, 4, DashParams(block_size=16, topk=4), "cpu", num_sms=4)
    narrow, wide = bufs.config.attn_stages, bufs.config.attn_stages_wide
    assert narrow != wide
    assert [bufs.attn_stages(n) for n in (1, 2, 3)] == [narrow, narrow, wide]
    assert bufs.attn_maxnreg(1) == 0  # head dim 64
    bufs = DecodeBuffers.allocate(3, 4, 2, 128, 16, 4, DashParams(block_size=16, topk=4), "cpu", num_sms=4)
    assert bufs.config.attn_maxnreg > 0
    assert [bufs.attn_maxnreg(n) for n in (1, 2, 3)] == [bufs.config.attn_maxnreg] * 2 + [0]
