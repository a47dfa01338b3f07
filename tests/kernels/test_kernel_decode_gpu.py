"""Decode kernels on the GPU only: 128k contexts on sampled rows, CUDA-graph capture and replay,
and no host synchronisation. (The engines' recorded batches: test_kernel_engine_batches.py.)

(Every other test in this directory also runs here, compiled, when CUDA is present.)
"""

from __future__ import annotations


import pytest
import torch

from dash_core import DashParams, dash_reference, ops
from dash_core.kernels.decode import launch as decode_launch
from dash_core.kernels.decode.buffers import DecodeBuffers
from dash_core.kernels.decode.config import DecodeConfig
from dash_core.kernels.kv_write import write_kv_and_summaries
from tests.kernels._kernel_scenarios import (assert_few_differ, forget_summaries_from, make_scenario,
                                             summary_tolerance, truncated)
from tests.kernels.test_kernel_decode_attention import TOL, check_attention
from tests.kernels.test_kernel_decode_e2e import row_errors
from tests.kernels.test_kernel_routing import check_routing

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]



def decode_op(sc, **kw):
    return ops.paged_dash_decode(sc.q, sc.k_new, sc.v_new, sc.cache, sc.block_table, sc.seq_lens, sc.slot_mapping,
                                 sc.head_cls, sc.params, **kw)


def resummarise_with_kernel(sc) -> None:
    """Replace the oracle-written summaries by the kernel's (summary-only launch over every slot)."""
    sc.cache.summaries.zero_()
    slots = torch.arange(sc.cache.num_slots, device="cuda")
    write_kv_and_summaries(None, None, sc.cache, slots, sc.head_cls, sc.params.block_size, decode=False)


@pytest.mark.parametrize("topk, est", [(64, False), (None, False), (16, True)])
def test_128k_context_sampled_rows(topk, est):
    """Requests of 128k, 100k and 65k tokens (Hq 8, Hkv 2, D 128, bs 64, pages of 128, shuffled):
    summaries written by the kernel, routing and attention stage by stage on the decode rows, and
    the op end to end against ``dash_reference(..., rows=[L - 1])``."""
    p = DashParams(block_size=64, topk=topk, scaling_factor=4.0, estimate_diagonal=est)
    lens = [131072, 100003, 65537]
    sc = make_scenario(2024, lens, hq=8, hkv=2, d=128, bs=64, pages_per_block=2, params=p, q_scale=1.0).to("cuda")
    oracle_summ = sc.cache.summaries.clone()
    resummarise_with_kernel(sc)
    for i, L in enumerate(lens):  # every block complete before the decode token
        idx = sc.slots(i)[: (L - 1) // 64 * 64: 64] // 64
        torch.testing.assert_close(sc.cache.summaries[idx.cuda()].double(), oracle_summ[idx.cuda()].double(),
                                   **summary_tolerance(torch.bfloat16))
    bufs = DecodeBuffers.for_step(sc.q, sc.cache, sc.block_table, p)
    decode_launch.route(sc.q, sc.cache, sc.block_table, sc.seq_lens, p, bufs)
    check_routing(sc, bufs)
    check_attention(sc, bufs.splits(sc.n)[1])
    out = decode_op(sc).cpu()
    bad = {}
    for i, L in enumerate(lens):
        hq, d = sc.q.shape[1], sc.q.shape[2]
        qf = torch.zeros(1, hq, L, d, dtype=sc.q.dtype)
        qf[0, :, -1] = sc.q[i].cpu()
        ref, _ = dash_reference(qf, sc.k_full[i][None], sc.v_full[i][None], sc.head_cls.cpu(), p, rows=[L - 1])
        err = (out[i].double() - ref[0, :, 0].double()).abs() - TOL[torch.bfloat16]["rtol"] * ref[0, :, 0].abs()
        bad[f"request {i}"] = err.amax(-1) > TOL[torch.bfloat16]["atol"] + 4e-3  # + the oracle's bf16 rounding
    # routing fed the oracle's own float64 summaries may move near-threshold blocks (docs/semantics.md 7)
    assert_few_differ(bad, 0.25)


def _spare_pages(sc) -> list:
    used = set()
    for i in range(sc.n):
        L = int(sc.seq_lens[i])
        used |= set(sc.block_table[i, : -(-L // sc.cache.page_size)].tolist())
    return sorted(set(range(sc.cache.k_pages.shape[0])) - used)


def test_wide_batch_attention_launch_equals_the_narrow_one():
    """Where a batch has more (request, KV head) rows than multiprocessors the split attention runs with
    ``DecodeConfig.attn_stages_wide`` (forced here by buffers sized for one multiprocessor, at the same splits): the
    output equals the narrow launch's bit for bit, and matches the oracle."""
    p = DashParams(block_size=64, topk=8, scaling_factor=3.0)
    sc = make_scenario(9, [3000, 0, 1500, 700], hq=8, hkv=2, d=128, bs=64, params=p).to("cuda")
    narrow, wide = (DecodeBuffers.for_step(sc.q, sc.cache, sc.block_table, p, splits=(2, 3), num_sms=sms)
                    for sms in (None, 1))
    assert sc.n * 2 <= narrow.num_sms and sc.n * 2 > wide.num_sms
    assert narrow.config.attn_stages != narrow.config.attn_stages_wide
    assert (narrow.attn_stages(sc.n), wide.attn_stages(sc.n)) == (narrow.config.attn_stages,
                                                                  narrow.config.attn_stages_wide)
    out_n = decode_op(sc, buffers=narrow)
    out_w = decode_op(sc, buffers=wide)  # (writes the same K/V again)
    assert torch.equal(out_n, out_w)
    checked, bad = row_errors(sc, out_w)
    assert bad <= 0.05 * checked, f"{bad} of {checked} rows differ from the oracle"


@pytest.mark.parametrize("steps, halves", [(70, False), (1000, False), (70, True)])
def test_cuda_graph_replay_equals_eager(steps, halves):
    """One captured decode step (its launches programmatic dependents on sm_90+) replayed over ``steps`` steps whose
    lengths cross block boundaries, a page table entry that moves mid-way and a padded row: every replay equals the
    eager op bit for bit, and sampled steps match the oracle. ``halves``: the batch as two halves on two streams
    (``DecodeConfig.overlap_halves``, wide forced by buffers sized for one multiprocessor), captured and eager."""
    p = DashParams(block_size=64, topk=8, scaling_factor=3.0)
    start = [1000, 0, 3000, 63]
    full = make_scenario(5, [s + steps if s else 0 for s in start], hq=8, hkv=2, d=128, bs=64, pages_per_block=2,
                         params=p, extra_pages=6).to("cuda")
    forget_summaries_from(full, start)
    spare = _spare_pages(full)
    sized = dict(num_sms=1, config=DecodeConfig(overlap_halves=True)) if halves else {}
    bufs = DecodeBuffers.for_step(full.q, full.cache, full.block_table, p, **sized)
    assert bufs.halved(full.n) == halves
    static = truncated(full, start, seed=0)
    q_s, k_s, v_s = static.q.clone(), static.k_new.clone(), static.v_new.clone()
    sl_s, slot_s = static.seq_lens.clone(), static.slot_mapping.clone()
    bt_s = full.block_table  # mutated in place below
    out_s = torch.empty_like(q_s)

    def step():
        ops.paged_dash_decode(q_s, k_s, v_s, full.cache, bt_s, sl_s, slot_s, full.head_cls, p, out=out_s,
                              buffers=bufs)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture (this step is redone below)
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    checked = bad = 0
    for t in range(steps + 1):
        if t == steps // 2:  # move request 2's second page: copy its K/V and summaries, repoint the table
            old, new = int(bt_s[2, 1]), spare[0]
            full.cache.k_pages[new] = full.cache.k_pages[old]
            full.cache.v_pages[new] = full.cache.v_pages[old]
            ppb = full.cache.page_size // p.block_size
            full.cache.summaries[new * ppb:(new + 1) * ppb] = full.cache.summaries[old * ppb:(old + 1) * ppb]
            full.cache.k_pages[old] = float("nan")  # a stale read would poison the output
            full.cache.v_pages[old] = float("nan")
            bt_s[2, 1] = new
        sc = truncated(full, [s + t if s else 0 for s in start], seed=t)
        for dst, src in ((q_s, sc.q), (k_s, sc.k_new), (v_s, sc.v_new), (sl_s, sc.seq_lens), (slot_s, sc.slot_mapping)):
            dst.copy_(src)
        graph.replay()
        replayed = out_s.clone()
        eager = decode_op(sc, buffers=DecodeBuffers.for_step(sc.q, sc.cache, sc.block_table, p, **sized))
        assert torch.equal(replayed, eager), f"step {t}: replay differs from eager"
        assert torch.equal(replayed[1], torch.zeros_like(replayed[1])), "padded row must be zeros"
        if t % (steps // 7) == 0 or t == steps:
            c, b = row_errors(sc, replayed)
            checked, bad = checked + c, bad + b
    assert bad <= 0.05 * checked, f"{bad} of {checked} rows differ from the oracle"


@pytest.mark.parametrize("with_buffers", [True, False])
def test_decode_step_never_synchronises(with_buffers):
    """A decode step (its buffers given or allocated by the op) runs under ``set_sync_debug_mode("error")``, and
    its rows match the oracle."""
    p = DashParams(block_size=64, topk=16, scaling_factor=2.0)
    sc = make_scenario(9, [5000, 0, 700], hq=8, hkv=2, d=128, bs=64, params=p).to("cuda")
    bufs = DecodeBuffers.for_step(sc.q, sc.cache, sc.block_table, p) if with_buffers else None
    decode_op(sc, buffers=bufs)  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = decode_op(sc, buffers=bufs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    checked, bad = row_errors(sc, out)  # (the padded row: zeros)
    assert bad <= 0.05 * checked, f"{bad} of {checked} rows differ from the oracle"
