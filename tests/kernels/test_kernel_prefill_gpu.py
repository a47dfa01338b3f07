"""Prefill kernels on the GPU only: prompts up to 128k tokens checked on sampled rows, the engines' recorded
extend batches replayed, no host synchronisation, the routing scratch bound, and a configuration
matrix (dtypes, head sizes, GQA groups, block and page sizes). Every CPU test of
``test_kernel_prefill.py`` also runs here, compiled (``pytest -m gpu tests/kernels``).

Two references end to end: the oracle fed the summaries the kernel stored (only fp32-vs-float64
routing rounding can move a block: docs/semantics.md section 7, at most ``MAX_DIFFERING_ROWS`` of the rows), and
the pure float64 ``dash_reference`` (its own summaries, one bf16 ulp apart, move more near-threshold
blocks at long context: at most ``MAX_DIFFERING_ROWS_PURE``, as the decode 128k test).
"""

from __future__ import annotations

import dataclasses

import glob
import os
import pathlib

import pytest
import torch

from benchmarks.common import ar1_walk
from dash_core import DashParams, dash_reference, ops, paged
from dash_core.kernels.common import pow2
from dash_core.kernels.prefill import gluon, tiles as pf_tiles
from dash_core.kernels.prefill.config import GluonConfig, PrefillConfig
from dash_core.kernels.kv_write import write_kv_and_summaries
from dash_core.layout import PagedKVCache, alloc_summaries
from dash_core.recorder import load_batches
from dash_core.standalone import DashKVCache, dash_attention
from dash_core.ops import prefill_scratch_bytes
from dash_core.workspace import PrefillWorkspace, release_prefill_scratch, reserve_prefill_scratch
from dash_core.reference import block_summaries, dash_rows
from tests.kernels._kernel_scenarios import assert_few_differ, summary_tolerance
from tests.kernels.test_kernel_decode_attention import TOL

# "cpu" dry-runs the test logic (ops then take the PyTorch paths; kernels run in the interpreter)
DEVICE = os.environ.get("DASH_PREFILL_GPU_TEST_DEVICE", "cuda")
CUDA = DEVICE == "cuda"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(CUDA and not torch.cuda.is_available(), reason="needs a CUDA GPU")]
cuda_only = pytest.mark.skipif(not CUDA, reason="measures the CUDA device")


def sync():
    if CUDA:
        torch.cuda.synchronize()

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "engine_batches"
MAX_DIFFERING_ROWS = 0.05
MAX_DIFFERING_ROWS_PURE = 0.25
ORACLE_OUT = 4e-3  # dash_reference returns bf16: one more rounding of |o| <= ~2


class Prompt:
    """One or more requests on a shuffled paged cache (SGLang's layout, or vLLM's with one head slot more than the
    KV heads, as with an auxiliary head), data generated on the GPU with CPU copies for the oracle. Request i has
    ``totals[i]`` tokens of which the last ``news[i]`` are new."""

    def __init__(self, seed, totals, news, *, hq, hkv, d, bs, ps, dtype=torch.bfloat16, params, q_corr=0.0,
                 spare_pages=3, layout="sglang"):
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        self.params, self.totals, self.news = params, list(totals), list(news)
        self.dtype = dtype
        npages = [-(-t // ps) for t in totals]
        num_pages = sum(npages) + spare_pages
        perm = torch.randperm(num_pages, device=DEVICE, generator=g).to(torch.int32)
        self.block_table = torch.zeros(len(totals), max(npages) + 1, dtype=torch.int32, device=DEVICE)
        off = 0
        for i, n in enumerate(npages):
            self.block_table[i, :n] = perm[off: off + n]
            off += n
        slots = num_pages * ps
        summ = alloc_summaries(slots, bs, hkv, d, dtype, DEVICE)
        if layout == "vllm":
            kv = torch.zeros(num_pages, hkv + 1, ps, 2 * d, dtype=dtype, device=DEVICE)
            self.cache = PagedKVCache.from_vllm(kv, hkv, d, summ)
        else:
            k_buf = torch.zeros(slots, hkv, d, dtype=dtype, device=DEVICE)
            self.cache = PagedKVCache.from_sglang(k_buf, torch.zeros_like(k_buf), ps, summ)
        self.head_cls = torch.randn(hkv, d, device=DEVICE, generator=g).to(dtype)
        self.k, self.v, self.q, self.slots = [], [], [], []
        for i, total in enumerate(totals):
            k = torch.randn(total, hkv, d, device=DEVICE, generator=g)
            k += 0.5 * torch.randn(-(-total // bs), hkv, d, device=DEVICE, generator=g).repeat_interleave(bs, 0)[:total]
            v = torch.randn(total, hkv, d, device=DEVICE, generator=g)
            q = torch.randn(total, hq, d, device=DEVICE, generator=g)
            if q_corr:  # neighbouring queries alike (an AR(1) walk over positions), as in trained models
                q = ar1_walk(q, q_corr)
            pos = torch.arange(total, device=DEVICE)
            self.slots.append(self.block_table[i, pos // ps].long() * ps + pos % ps)
            self.k.append(k.to(dtype))
            self.v.append(v.to(dtype))
            self.q.append(q.to(dtype))
        # history (everything before the new tokens) written with its summaries, by the kernels
        for i, (total, new) in enumerate(zip(totals, news)):
            if total - new:
                sl = self.slots[i][: total - new]
                write_kv_and_summaries(self.k[i][: total - new], self.v[i][: total - new], self.cache, sl,
                                       self.head_cls, bs, decode=False)
        cu = [0]
        for new in news:
            cu.append(cu[-1] + new)
        self.cu = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
        self.seq_lens = torch.tensor(totals, dtype=torch.int32, device=DEVICE)
        self.q_new = torch.cat([q[t - n:] for q, t, n in zip(self.q, totals, news)])
        self.k_new = torch.cat([k[t - n:] for k, t, n in zip(self.k, totals, news)])
        self.v_new = torch.cat([v[t - n:] for v, t, n in zip(self.v, totals, news)])
        self.slot_mapping = torch.cat([s[t - n:] for s, t, n in zip(self.slots, totals, news)])

    def run(self, **kw):
        return ops.paged_dash_prefill(self.q_new, self.k_new, self.v_new, self.cache, self.block_table, self.cu,
                                      self.seq_lens, self.slot_mapping, self.head_cls, self.params, **kw)

    def stored_summaries(self, i):
        bs = self.params.block_size
        nblk = self.totals[i] // bs
        return self.cache.summaries[self.slots[i][: nblk * bs: bs] // bs].permute(1, 0, 2).double().cpu()


def sampled_rows(total, new, bs, extra=24, seed=0):
    """New positions to check: the first and last, both sides of block boundaries, random others."""
    start = total - new
    g = torch.Generator().manual_seed(seed)
    picks = {start, total - 1, min(total - 1, start + 1)}
    for b in (start // bs + 1, (start + total) // (2 * bs), total // bs - 1):
        for p in (b * bs - 1, b * bs):
            if start <= p < total:
                picks.add(p)
    picks |= set((start + torch.randint(0, new, (extra,), generator=g)).tolist())
    return sorted(picks)


def bad_rows(out_rows, ref_rows, dtype, extra_atol=0.0):
    """Which rows (all but the last axis) are outside the attention tolerance: ``out, ref [..., D]``."""
    tol = TOL[dtype]
    err = (out_rows.double() - ref_rows.double()).abs() - tol["rtol"] * ref_rows.double().abs()
    return err.amax(-1) > tol["atol"] + extra_atol


def row_errors(out_rows, ref_rows, dtype, extra_atol=0.0):
    """(rows outside the attention tolerance, rows): ``out, ref [R, Hq, D]``, a row a (token, head)."""
    bad = bad_rows(out_rows, ref_rows, dtype, extra_atol)
    return int(bad.sum()), bad.numel()


def check_against_oracles(pr: Prompt, out: torch.Tensor, rows_per_request: dict):
    """Sampled rows against the oracle fed the stored summaries and against ``dash_reference``."""
    bad = checked = bad_pure = 0
    p = pr.params
    for i, rows in rows_per_request.items():
        total, new = pr.totals[i], pr.news[i]
        k, v, q = pr.k[i].cpu(), pr.v[i].cpu(), pr.q[i].cpu()
        pos = torch.tensor(rows)
        o_rows = out[int(pr.cu[i]) + pos - (total - new)].cpu()  # [R, Hq, D]
        ref, _ = dash_rows(q[pos].permute(1, 0, 2), k.permute(1, 0, 2), v.permute(1, 0, 2), pr.stored_summaries(i),
                           pos, p)
        b, c = row_errors(o_rows, ref.permute(1, 0, 2), pr.dtype)
        bad, checked = bad + b, checked + c
        ref2, _ = dash_reference(q.permute(1, 0, 2)[None], k.permute(1, 0, 2)[None], v.permute(1, 0, 2)[None],
                                 pr.head_cls.cpu(), p, rows=rows)
        b2, _ = row_errors(o_rows, ref2[0].permute(1, 0, 2), pr.dtype, extra_atol=ORACLE_OUT)
        bad_pure += b2
    assert bad <= MAX_DIFFERING_ROWS * checked, f"{bad} of {checked} rows differ from the oracle (stored summaries)"
    assert bad_pure <= MAX_DIFFERING_ROWS_PURE * checked, f"{bad_pure} of {checked} rows differ from dash_reference"


# --- long prompts ------------------------------------------------------------------------------------


@pytest.mark.parametrize("topk, est, chunk", [(64, False, None), (None, False, None), (16, True, 8192)])
def test_128k_prompt_sampled_rows(topk, est, chunk):
    """A 128k-token prompt (Hq 8, Hkv 2, D 128, bs 64, pages of 128, shuffled), prefilled at once or in
    8k chunks on the history the earlier chunks wrote; summaries against the oracle's, sampled rows
    end to end."""
    total = 131072
    p = DashParams(block_size=64, topk=topk, scaling_factor=4.0, estimate_diagonal=est)
    pr = Prompt(128, [total], [total], hq=8, hkv=2, d=128, bs=64, ps=128, params=p, q_corr=0.9)
    if chunk is None:
        out = pr.run()
    else:
        out = torch.empty_like(pr.q_new)
        for s in range(0, total, chunk):
            sl = slice(s, s + chunk)
            cu = torch.tensor([0, chunk], dtype=torch.int32, device=DEVICE)
            seq = torch.tensor([s + chunk], dtype=torch.int32, device=DEVICE)
            out[sl] = ops.paged_dash_prefill(pr.q_new[sl], pr.k_new[sl], pr.v_new[sl], pr.cache, pr.block_table, cu,
                                             seq, pr.slot_mapping[sl], pr.head_cls, p)
    sync()
    ref_summ = block_summaries(pr.k[0].cpu().permute(1, 0, 2), pr.head_cls.cpu(), 64)
    torch.testing.assert_close(pr.stored_summaries(0), ref_summ, **summary_tolerance(torch.bfloat16))
    rows = sampled_rows(total, total, 64, extra=40 if chunk is None else 24)
    if chunk:
        rows = sorted(set(rows) | {c * chunk + d for c in (1, 7, 15) for d in (-1, 0, 1)})
    check_against_oracles(pr, out, {0: rows})


def test_long_extend_on_long_history_varlen():
    """A batch mixing a 24k-token extend over 40k of history, a short prompt, a one-token extend and a
    request without new tokens (G 4, D 64, bs 32, pages of 256)."""
    p = DashParams(block_size=32, topk=32, scaling_factor=3.0, local=64)
    totals, news = [65536, 300, 5000, 700], [24576, 300, 1, 0]
    pr = Prompt(7, totals, news, hq=16, hkv=4, d=64, bs=32, ps=256, params=p, q_corr=0.8)
    out = pr.run()
    rows = {i: sampled_rows(t, n, 32, extra=12, seed=i) for i, (t, n) in enumerate(zip(totals, news)) if n}
    check_against_oracles(pr, out, rows)


# --- the Gluon attention launch (Hopper) against the Triton one ------------------------------------------

_MIXED = (torch.bfloat16, 12, 4, 64, [9000, 1500, 257, 70], [2500, 1500, 100, 1], dict(topk=16, scaling_factor=3.0))
WS_CASES = [  # (dtype, Hq, Hkv, page_size, totals, news, DashParams kwargs, routing scratch bytes a wave, layout)
    (*_MIXED, None, "sglang"),
    (*_MIXED, 3 << 20, "sglang"),  # many waves
    (torch.float16, 16, 2, 128, [6000, 800], [6000, 333], dict(scaling_factor=2.0, router="shared", local=128), None,
     "sglang"),
    (torch.bfloat16, 8, 8, 256, [20000], [4133], dict(topk=32, scaling_factor=2.0, estimate_diagonal=True), None,
     "sglang"),
    # vLLM's head-major pages, two blocks a page, a head slot more than the KV heads
    (torch.bfloat16, 12, 4, 128, [9000, 1500, 257], [2500, 1500, 100], dict(topk=16, scaling_factor=3.0), None,
     "vllm"),
    # tables of at most 64 candidates the cap cannot cut (the route launch's registers path, no cap), in one wave or
    # several; the estimated-diagonal prior on vLLM's pages
    (torch.bfloat16, 32, 8, 64, [4000, 2000, 1030, 300], [4000, 1500, 1030, 300], dict(topk=64, scaling_factor=3.0),
     None, "sglang"),
    (torch.bfloat16, 32, 8, 64, [4000, 2000, 1030, 300], [4000, 1500, 1030, 300], dict(topk=64, scaling_factor=3.0),
     2 << 20, "sglang"),
    (torch.bfloat16, 12, 4, 128, [3000, 1000, 90], [1000, 1000, 90], dict(scaling_factor=2.0, estimate_diagonal=True),
     None, "vllm"),
]


@cuda_only
@pytest.mark.parametrize("case", range(len(WS_CASES)))
def test_gluon_attention_matches_triton(case, monkeypatch):
    """On Hopper, the warp-specialized Gluon attention (``gluon.py``: G 3 padded to 4, G 8 with router
    ``shared``, G 1; extends starting and ending mid-block, a one-token extend; one wave, or many, whose launches
    share the work counter's memory; SGLang's pages and vLLM's), a wave's last tiles first, against the Triton
    kernel taking the tiles in launch order on the same routing, with NaN in every cache row no token wrote (the
    local window must not read them), and against the oracle on sampled rows."""
    dtype, hq, hkv, ps, totals, news, pk, scratch, layout = WS_CASES[case]
    p = DashParams(block_size=64, **pk)
    pr = Prompt(70 + case, totals, news, hq=hq, hkv=hkv, d=128, bs=64, ps=ps, dtype=dtype, params=p, q_corr=0.8,
                layout=layout)
    config = PrefillConfig()
    if not gluon.ws_supported(pr.q_new, pr.cache, p, pow2(hq // hkv), pf_tiles.tile_tokens(hq, hkv, 64,
                                                                                        config.attn_rows)):
        pytest.skip("the Gluon attention runs on sm_90 only")
    config = PrefillConfig(gluon=GluonConfig(min_candidates=0),  # on these short tables too
                           **({"scratch_bytes": scratch} if scratch else {}))
    launches = []
    descriptors = gluon.kv_block_descriptors
    monkeypatch.setattr(gluon, "kv_block_descriptors", lambda *a: launches.append(1) or descriptors(*a))
    pages, ps = pr.cache.k_pages.shape[:2]
    written = torch.zeros(pages * ps, dtype=torch.bool, device=DEVICE)
    for sl in pr.slots:
        written[sl] = True
    pr.cache.k_pages[~written.view(pages, ps)] = float("nan")
    pr.cache.v_pages[~written.view(pages, ps)] = float("nan")
    out_ws = pr.run(workspace=PrefillWorkspace(config))
    assert len(launches) > (4 if scratch else 0), "the Gluon attention did not run (or not in several waves)"
    # the Triton kernel in launch order: neither the kernel nor the order of the tiles changes a row
    out_tr = pr.run(workspace=PrefillWorkspace(dataclasses.replace(config, gluon=GluonConfig(enabled=False),
                                                                   last_tiles_first=False)))
    sync()
    assert torch.isfinite(out_ws).all()
    b, c = row_errors(out_ws, out_tr, dtype)
    assert b == 0, f"{b} of {c} rows differ from the Triton kernel"
    rows = {i: sampled_rows(t, n, 64, extra=10, seed=i) for i, (t, n) in enumerate(zip(totals, news))}
    check_against_oracles(pr, out_ws, rows)


@cuda_only
def test_peak_scratch_under_1gb_at_128k():
    """The routing scratch of a 128k-token prompt (Hq 32, Hkv 8, D 128, bs 64, uncapped: the largest
    selection buffers) stays under 1 GB: memory is linear in the prompt (measured, not timed)."""
    p = DashParams(block_size=64, scaling_factor=2.0)
    total, hq, hkv, d = 131072, 32, 8, 128
    pr = Prompt(3, [total], [total], hq=hq, hkv=hkv, d=d, bs=64, ps=64, params=p)
    ops.cache_dash_prefill(pr.k_new, pr.v_new, pr.cache, pr.slot_mapping, p, head_cls=pr.head_cls)
    out = torch.empty_like(pr.q_new)
    args = (pr.q_new, None, None, pr.cache, pr.block_table, pr.cu, pr.seq_lens, None, pr.head_cls, p)
    ops.paged_dash_prefill(*args, out=out)  # compile
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ops.paged_dash_prefill(*args, out=out)
    torch.cuda.synchronize()
    scratch = torch.cuda.max_memory_allocated() - base
    assert scratch < 1 << 30, f"prefill scratch {scratch / 2**20:.0f} MiB at 128k tokens"
    # what the vLLM adapter reserves while vLLM profiles memory covers it (the allocator rounds each tensor up)
    bound = prefill_scratch_bytes(total, 1, pr.block_table.shape[1] * 64, hq, hkv, p)
    assert scratch <= bound + (64 << 10), f"{scratch} bytes allocated, {bound} reserved"
    assert torch.isfinite(out).all()


@cuda_only
def test_reserving_the_scratch_holds_it_until_released():
    """``reserve_prefill_scratch`` (the vLLM adapter's, while vLLM profiles memory) holds the bytes until
    ``release_prefill_scratch``: the allocated memory grows by them, then returns to where it was."""
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    reserve_prefill_scratch(100 << 20, dev)
    reserve_prefill_scratch(10 << 20, dev)  # a smaller request keeps the larger reservation
    assert torch.cuda.memory_allocated() - base >= 100 << 20
    release_prefill_scratch()
    assert torch.cuda.memory_allocated() == base


@cuda_only
def test_prefill_never_synchronises():
    """Neither a call nor the calls that share a workspace (its first, which makes the plan, and a later one)."""
    p = DashParams(block_size=64, topk=16, scaling_factor=2.0)
    pr = Prompt(9, [5000, 300, 0], [1000, 300, 0], hq=8, hkv=2, d=128, bs=64, ps=64, params=p)
    pr.run()  # compiles
    torch.cuda.synchronize()
    ws = PrefillWorkspace()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = pr.run()
        first, later = pr.run(workspace=ws), pr.run(workspace=ws)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isfinite(out).all() and ws.builds == 1
    assert torch.equal(first, out) and torch.equal(later, out)


@cuda_only
def test_prefill_step_replays_from_a_cuda_graph():
    """A prefill step of fixed shape (its token count, requests and page-table width) captured in one CUDA graph with
    a fresh workspace, so that the plan's device tables are made inside it, as a graph of a fixed token count holds
    it: replayed on new queries, keys and values, and after one request got shorter (the rows past it then belong to
    no request), it equals the eager call on the same inputs bit for bit."""
    p = DashParams(block_size=64, topk=16, scaling_factor=2.0)
    pr = Prompt(9, [5000, 300, 0], [1000, 300, 0], hq=8, hkv=2, d=128, bs=64, ps=64, params=p)
    static = [t.clone() for t in (pr.q_new, pr.k_new, pr.v_new, pr.cu, pr.seq_lens, pr.slot_mapping)]
    q_s, k_s, v_s, cu_s, sl_s, slot_s = static
    out_s = torch.empty_like(q_s)

    def step(workspace):
        ops.paged_dash_prefill(q_s, k_s, v_s, pr.cache, pr.block_table, cu_s, sl_s, slot_s, pr.head_cls, p,
                               out=out_s, workspace=workspace)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile outside the capture
        step(PrefillWorkspace())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    ws = PrefillWorkspace()
    with torch.cuda.graph(graph):
        step(ws)
    g = torch.Generator(device=DEVICE).manual_seed(3)
    for case in range(3):
        if case >= 1:  # new contents at the same slots
            for t in (q_s, k_s, v_s):
                t.copy_(torch.randn(t.shape, device=DEVICE, generator=g).to(t.dtype))
        if case == 2:  # request 1 ends 100 tokens early: the last 100 rows belong to no request (zero output)
            cu_s.copy_(torch.tensor([0, 1000, 1200, 1200], dtype=torch.int32, device=DEVICE))
            sl_s.copy_(torch.tensor([5000, 200, 0], dtype=torch.int32, device=DEVICE))
            slot_s[1200:] = -1
        graph.replay()
        replayed = out_s.clone()
        eager = ops.paged_dash_prefill(q_s, k_s, v_s, pr.cache, pr.block_table, cu_s, sl_s, slot_s, pr.head_cls,
                                       p, workspace=PrefillWorkspace())
        assert torch.equal(replayed, eager), f"case {case}: the replay differs from the eager call"
        assert bool(replayed.abs().sum(-1).gt(0).all()) if case < 2 else not bool(replayed[1200:].any())
    assert ws.builds == 1


def test_standalone_layers_share_a_step_plan():
    """``standalone.dash_attention`` on the GPU (bf16, the Triton kernels): two layers, a prompt in two chunks then
    decode steps; every row against the float64 ``dash_reference``; each prefill step makes one plan for both
    layers."""
    g = torch.Generator(device=DEVICE).manual_seed(5)
    p = DashParams(block_size=64, scaling_factor=2.0, topk=8)
    n, dt = 1300, torch.bfloat16
    q = torch.randn(2, 8, n, 64, generator=g, device=DEVICE).to(dt)
    k, v = (torch.randn(2, 2, n, 64, generator=g, device=DEVICE).to(dt) for _ in range(2))
    hcs = [torch.randn(2, 64, generator=g, device=DEVICE).to(dt) for _ in range(2)]
    cache = DashKVCache(2, 2, n, 2, 64, p, dtype=dt, device=DEVICE, page_size=128)
    outs = [[], []]
    for lo, hi in [(0, 700), (700, 1290)] + [(t, t + 1) for t in range(1290, n)]:
        for layer in range(2):
            outs[layer].append(dash_attention(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], hcs[layer], cache,
                                              layer))
        if hi - lo > 1:
            assert cache.step_inputs(lo, hi - lo, DEVICE)[2].builds == int(CUDA)  # the PyTorch path makes none
    groups = {}
    for layer in range(2):
        ref, _ = dash_reference(q.cpu(), k.cpu(), v.cpu(), hcs[layer].cpu(), p)
        bad = bad_rows(torch.cat(outs[layer], dim=2).cpu(), ref, dt, extra_atol=ORACLE_OUT)  # [B, Hq, n]
        for phase, (lo, hi) in {"chunk 1": (0, 700), "chunk 2": (700, 1290), "decode": (1290, n)}.items():
            groups[f"layer {layer}, {phase}"] = bad[:, :, lo:hi]
    assert_few_differ(groups, MAX_DIFFERING_ROWS)


MATRIX = [  # (dtype, Hq, Hkv, D, bs, page_size, DashParams kwargs)
    (torch.float16, 8, 8, 64, 16, 256, dict(topk=8, scaling_factor=2.0)),  # G 1, pages of 16 blocks
    (torch.bfloat16, 12, 4, 128, 32, 64, dict(scaling_factor=3.0, estimate_diagonal=True)),  # G 3
    (torch.bfloat16, 32, 2, 256, 128, 256, dict(topk=4, scaling_factor=2.0, local=256)),  # G 16, D 256
    (torch.float16, 16, 2, 128, 64, 128, dict(topk=16, scaling_factor=4.0, router="shared")),  # G 8
    (torch.bfloat16, 8, 4, 64, 16, 16, dict(scaling_factor=2.0, estimate_diagonal=True, sigma=1.0)),  # G 2
]


@pytest.mark.parametrize("case,min_cand", [(c, None) for c in range(len(MATRIX))] + [(0, 1), (2, 1)])
def test_configuration_matrix(case, min_cand):
    """min_cand 1: routing from the summary copy on these short tables too (G 1, whose group mean once
    miscompiled there, and D 256)."""
    config = PrefillConfig() if min_cand is None else PrefillConfig(recompute_min_candidates=min_cand)
    dtype, hq, hkv, d, bs, ps, pk = MATRIX[case]
    p = DashParams(block_size=bs, **pk)
    totals, news = [6000, 1500, 257], [2500, 1500, 100]
    pr = Prompt(50 + case, totals, news, hq=hq, hkv=hkv, d=d, bs=bs, ps=ps, dtype=dtype, params=p, q_corr=0.7)
    out = pr.run(workspace=PrefillWorkspace(config))
    rows = {i: sampled_rows(t, n, bs, extra=10, seed=i) for i, (t, n) in enumerate(zip(totals, news))}
    check_against_oracles(pr, out, rows)


# --- the engines' recorded batches ---------------------------------------------------------------------

BATCHES = sorted(glob.glob(str(FIXTURES / "*" / "*prefill*.pt")))


@pytest.mark.skipif(not BATCHES, reason="no recorded engine batches under tests/fixtures/engine_batches")
@pytest.mark.parametrize("path", BATCHES, ids=lambda s: "/".join(pathlib.Path(s).parts[-2:])[:-3])
def test_recorded_engine_batch_replay(path):
    """An engine's extend batch (page table, lengths, slot mapping as recorded) through the CUDA op, on
    random K/V at a kernel head size (the recording's 32 is not one), against the PyTorch paged path
    on the same cache: at most 5% of rows apart (same stored summaries; routing rounding only)."""
    rec = load_batches(path)[0]
    prm = {k: v for k, v in rec["params"].items() if k in DashParams.__dataclass_fields__}
    p = DashParams(**prm)
    ps, hkv, hq = rec["page_size"], rec["num_kv_heads"], rec["num_heads"]
    d = 64
    if ps % p.block_size or ps > 256 or p.block_size not in (16, 32, 64, 128):
        pytest.skip(f"page size {ps} / block size {p.block_size} outside the kernels' range")
    g = torch.Generator(device=DEVICE).manual_seed(0)
    slots = rec["num_pages"] * ps
    kb = torch.randn(slots, hkv, d, device=DEVICE, generator=g).to(torch.bfloat16)
    vb = torch.randn(slots, hkv, d, device=DEVICE, generator=g).to(torch.bfloat16)
    hc = torch.randn(hkv, d, device=DEVICE, generator=g).to(torch.bfloat16)
    cache = PagedKVCache.from_sglang(kb, vb, ps, alloc_summaries(slots, p.block_size, hkv, d, torch.bfloat16, DEVICE))
    write_kv_and_summaries(None, None, cache, torch.arange(slots, device=DEVICE), hc, p.block_size, decode=False)
    bt = rec["block_table"].to(DEVICE)
    cu, seq = rec["cu_seqlens_q"].to(DEVICE), rec["seq_lens"].to(DEVICE)
    t = int(rec["cu_seqlens_q"][-1])
    q = torch.randn(t, hq, d, device=DEVICE, generator=g).to(torch.bfloat16)
    sm = rec["slot_mapping"]
    if sm is not None:  # rewrite the new tokens' K/V (the same values) through the op's write path
        sm = sm.to(DEVICE)
        keep = sm >= 0
        k_new = torch.zeros(t, hkv, d, dtype=torch.bfloat16, device=DEVICE)
        v_new = torch.zeros_like(k_new)
        k_new[keep] = kb[sm[keep]]
        v_new[keep] = vb[sm[keep]]
        out = ops.paged_dash_prefill(q, k_new, v_new, cache, bt, cu, seq, sm, hc, p)
    else:
        out = ops.paged_dash_prefill(q, None, None, cache, bt, cu, seq, None, hc, p)
    cpu_cache = PagedKVCache.from_sglang(kb.cpu(), vb.cpu(), ps, cache.summaries.cpu())
    ref = paged.paged_dash_torch(q.cpu(), cpu_cache, bt.cpu(), cu.cpu(), seq.cpu(), hc.cpu(), p,
                                 torch.empty(q.shape, dtype=torch.bfloat16))
    bad, checked = row_errors(out.cpu(), ref, torch.bfloat16)
    assert bad <= MAX_DIFFERING_ROWS * checked, f"{bad} of {checked} rows differ from the PyTorch paged path"
    for i in range(seq.shape[0]):  # padded requests
        if int(rec["seq_lens"][i]) == 0:
            lo, hi = int(rec["cu_seqlens_q"][i]), int(rec["cu_seqlens_q"][i + 1])
            assert torch.equal(out[lo:hi].cpu(), torch.zeros_like(out[lo:hi].cpu()))
