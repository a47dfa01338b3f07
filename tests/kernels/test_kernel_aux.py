"""The Triton path with the auxiliary head (docs/semantics.md section 9): indexer routing (iq over the 1-head
store of ik summaries, router shared) and page mode (page RoPE and the auxiliary rows as tensor ops
before the launches), prefill then decode, against the float64 oracle; under the interpreter on the
CPU (the ops on the kernels' path: ``tests.kernels._kernel_ops``), through the public ops when compiled on a GPU
(``-m gpu``), where decode must not synchronise with the host."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dash_core import DashParams, limits, ops, paged
from dash_core.kernels.decode.buffers import DecodeBuffers
from dash_core.layout import PagedKVCache, alloc_aux_sglang, alloc_summaries, decode_aux
from dash_core.reference import block_summaries, dash_rows, route, routing_scores
from dash_core.rope import PageRopeSettings, RotarySettings, page_coordinates, page_rope
from tests.kernels._kernel_env import KERNEL_DEVICE
from tests.kernels._kernel_ops import kernel_decode, kernel_prefill
from tests.kernels._kernel_scenarios import assert_rows_match, excused_heads, summary_tolerance
from tests.kernels.test_kernel_decode_attention import TOL

DEV = KERNEL_DEVICE
D, HQ, HKV, HI, PS, BS = 64, 4, 2, 3, 32, 16
PR = PageRopeSettings(main=RotarySettings(theta=10000.0), indexer=RotarySettings(theta=1000.0), tok_pairs=8)
# The oracle is fed the kernels' own inputs (the stored summaries, sf * q rounded as the kernels round it), so routing
# can differ only where fp32 and float64 scores decide apart: every row must match but those of a unit with a
# decision docs/semantics.md section 7 excuses (``excused_rows``, ``assert_rows_match``).
# page prompt: text, page 1, text, page 2, question (70 tokens); the other request has no page
ROLES = [0] * 5 + [1] + [2] * 22 + [0] * 3 + [1] + [2] * 20 + [0] * 18
PLAIN = [0] * 41


def step(op, cache, q, k, v, iq, ik, hc, hci, bt, cu, sl, slots, params, roles=None, positions=None, pr=None):
    """One op call on the Triton path: the public op on CUDA, the op on the kernels' path under the interpreter."""
    ind = dict(iq=iq, ik=ik, head_cls_i=hci) if iq is not None else {}
    if op == "decode":
        decode = ops.paged_dash_decode if DEV == "cuda" else kernel_decode
        return decode(q, k, v, cache, bt, sl, slots, hc, params, positions=positions, page_rope=pr, **ind)
    prefill = ops.paged_dash_prefill if DEV == "cuda" else kernel_prefill
    return prefill(q, k, v, cache, bt, cu, sl, slots, hc, params, roles=roles, positions=positions, page_rope=pr,
                   **ind)


def make(dtype, seed, lens, gen, hi=HI):
    g = torch.Generator().manual_seed(seed)

    def r(*s, sc=1.0):
        return (torch.randn(*s, generator=g) * sc).to(dtype).to(DEV)

    data = [(r(n + gen, HQ, D), r(n + gen, HKV, D), r(n + gen, HKV, D), r(n + gen, hi, D, sc=2.0),
             r(n + gen, D, sc=2.0)) for n in lens]
    return data, r(HKV, D), r(D)


@pytest.mark.parametrize("page_mode,indexer,hi", [(False, True, HI), (True, True, HI), (True, False, HI),
                                                  (False, True, 16)])  # 16 heads: a smaller prefill tile
def test_aux_prefill_then_decode(page_mode, indexer, hi):
    dtype = torch.bfloat16
    p = DashParams(block_size=BS, scaling_factor=3.0, topk=2)
    roles = [ROLES, PLAIN]
    lens, gen = [len(x) for x in roles], 2
    data, hc, hci = make(dtype, 3 + page_mode + 2 * indexer, lens, gen, hi)
    slots_n = 8 * 4 * PS
    summ = alloc_summaries(slots_n, BS, 1 if indexer else HKV, D, dtype, DEV)
    cache = PagedKVCache.from_sglang(torch.zeros(slots_n, HKV, D, dtype=dtype, device=DEV),
                                     torch.zeros(slots_n, HKV, D, dtype=dtype, device=DEV), PS, summ,
                                     aux=alloc_aux_sglang(slots_n, D, dtype, DEV))
    bt = torch.tensor([[5, 2, 7, 9], [8, 1, 13, 20]], dtype=torch.int32, device=DEV)

    def slots_of(i, lo, hi):
        pos = torch.arange(lo, hi, device=DEV)
        return bt[i, pos // PS].long() * PS + pos % PS

    def cat(j, lo, hi):
        return torch.cat([d[j][a:b] for d, a, b in zip(data, lo, hi)])

    pm = dict(pr=PR) if page_mode else {}
    outs = []
    for s in range(gen + 1):
        lo = [0, 0] if s == 0 else [n + s - 1 for n in lens]
        hi = [n + s for n in lens]
        cu = torch.tensor([0, hi[0] - lo[0], hi[0] - lo[0] + hi[1] - lo[1]], dtype=torch.int32, device=DEV)
        sl = torch.tensor(hi, dtype=torch.int32, device=DEV)
        slots = torch.cat([slots_of(i, lo[i], hi[i]) for i in range(2)])
        if page_mode:
            pm["positions"] = torch.cat([torch.arange(a, b) for a, b in zip(lo, hi)]).to(DEV)
            if s == 0:
                pm["roles"] = torch.tensor(ROLES + PLAIN, device=DEV)
            else:
                pm.pop("roles", None)
        args = [cat(j, lo, hi) for j in range(5)]
        iq, ik = (args[3], args[4]) if indexer else (None, None)
        if s > 0 and DEV == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")  # decode: no host synchronisation anywhere
        try:
            o = step("prefill" if s == 0 else "decode", cache, args[0], args[1], args[2], iq, ik, hc,
                     hci if indexer else None, bt, cu, sl, slots, p, **pm)
        finally:
            if DEV == "cuda":
                torch.cuda.set_sync_debug_mode(0)
        outs.append((lo, hi, cu.cpu(), o.cpu()))
    # the oracle on the stored (kernel-made) summaries and the inputs rotated by page_rope
    bad = {"prefill": [], "decode": []}  # [rows, heads] bool masks: outside the attention tolerance, not excused
    ex = {"prefill": [], "decode": []}  # [rows, heads] bool masks: excused
    tol = TOL[dtype]
    for i in range(2):
        n = lens[i] + gen
        q, k, v, iq, ik = (x.cpu() for x in data[i])
        if page_mode:
            tok, page = page_coordinates(torch.tensor(roles[i]), generated=gen)
            q, k = page_rope(q, tok, page, PR), page_rope(k, tok, page, PR)
            iq, ik = page_rope(iq, tok, page, PR, main=False), page_rope(ik, tok, page, PR, main=False)
            st = decode_aux(cache.aux_rows(slots_of(i, 0, n)).cpu(), D)
            assert torch.equal(st.tok, tok) and torch.equal(st.page, page)  # decode-derived == prefill-derived
            assert torch.equal(cache.keys(slots_of(i, 0, n)).cpu(), k)
        nblk = n // BS
        stored = cache.summaries[(slots_of(i, 0, nblk * BS)[::BS] // BS)].cpu().permute(1, 0, 2)
        keys = ik[None, :nblk * BS] if indexer else k.permute(1, 0, 2)[:, :nblk * BS]
        expect = block_summaries(keys, hci.cpu()[None] if indexer else hc.cpu(), BS)
        assert torch.allclose(stored.double(), expect, **summary_tolerance(dtype))
        for s, (lo, hi, cu, o) in enumerate(outs):
            phase = "decode" if s else "prefill"
            pos = torch.arange(lo[i], hi[i])
            ref, _ = dash_rows(q[pos].permute(1, 0, 2), k.permute(1, 0, 2)[:, :hi[i]], v.permute(1, 0, 2)[:, :hi[i]],
                               stored.double(), pos, p, iq=iq[pos].permute(1, 0, 2) if indexer else None)
            got = o[cu[i]:cu[i + 1]].double()
            err = (got - ref.permute(1, 0, 2)).abs() - tol["rtol"] * ref.permute(1, 0, 2).abs()
            excused = excused_rows(iq if indexer else q, stored.double(), pos, p, indexer)  # [R, Hq]
            bad[phase].append(((err.amax(-1) > tol["atol"]) & ~excused).flatten())
            ex[phase].append(excused.flatten())
    for phase in bad:  # prefill and decode counted apart, so that neither phase's excused rows hide in the other's
        assert_rows_match({phase: torch.cat(bad[phase])}, {phase: torch.cat(ex[phase])})


def excused_rows(qr: torch.Tensor, summaries: torch.Tensor, pos: torch.Tensor, params: DashParams,
                 indexer: bool) -> torch.Tensor:
    """``[R, Hq]`` bool: the rows at ``pos`` whose selection unit has a decision docs/semantics.md section 7 lets
    two implementations take apart (``excused_heads``), routed as ``dash_rows`` routes them: ``qr [T, Hr, D]`` (the
    queries, or the indexer's) scaled and rounded as the kernels do, over ``summaries [Hs, nblk, D]``; with the
    ``indexer``, one selection shared by every head."""
    if indexer:
        params = replace(params, router="shared")
    qs = (qr[pos] * params.scaling_factor).to(qr.dtype).permute(1, 0, 2)  # [Hr, R, D]
    ncand = (pos // params.block_size - params.local_blocks + 1).clamp(min=0)
    nblk = int(ncand.max())
    if nblk == 0:
        return torch.zeros(len(pos), HQ, dtype=torch.bool)
    rt, x = route(qs, summaries[:, :nblk], ncand, params), routing_scores(qs, summaries[:, :nblk])
    return excused_heads(rt.mp, x, ncand, params.topk, HQ)


def test_indexer_launch_checks():
    dtype = torch.bfloat16
    p = DashParams(block_size=BS)
    cache = PagedKVCache.from_sglang(torch.zeros(128, HKV, D, dtype=dtype, device=DEV),
                                     torch.zeros(128, HKV, D, dtype=dtype, device=DEV), PS,
                                     alloc_summaries(128, BS, 1, D, dtype, DEV),
                                     aux=alloc_aux_sglang(128, D, dtype, DEV))
    q = torch.zeros(1, HQ, D, dtype=dtype, device=DEV)
    bt = torch.zeros(1, 4, dtype=torch.int32, device=DEV)
    sl = torch.ones(1, dtype=torch.int32, device=DEV)
    iq = torch.zeros(1, HI, D, dtype=dtype, device=DEV)
    hci = torch.zeros(D, dtype=dtype, device=DEV)
    with pytest.raises(ValueError, match="go together"):  # new K/V need their ik
        kernel_decode(q, q[:, :HKV], q[:, :HKV], cache, bt, sl, torch.zeros(1, dtype=torch.long, device=DEV),
                      None, p, iq=iq, head_cls_i=hci)
    with pytest.raises(ValueError, match="iq must be"):
        kernel_decode(q, None, None, cache, bt, sl, None, None, p, iq=iq.float(), head_cls_i=hci)
    bufs = DecodeBuffers.for_step(q, cache, bt, p)
    with pytest.raises(ValueError, match="indexer_heads"):
        kernel_decode(q, None, None, cache, bt, sl, None, None, p, iq=iq, head_cls_i=hci, buffers=bufs)


def test_indexer_write_checks_the_summary_launch_before_writing(monkeypatch):
    """``cache_dash_prefill`` with an indexer on the kernels' path: a block size the Triton summary kernel does not
    support is refused before K/V or rows are written (the K/V write itself has no summaries to check, the ik
    summaries into the 1-head store do). Under the interpreter the op is made to take the kernels' path, which it
    takes on CUDA."""
    dtype = torch.bfloat16
    p = DashParams(block_size=256)
    assert p.block_size not in limits.KERNEL_BLOCK_SIZES
    slots_n = 512
    cache = PagedKVCache.from_sglang(torch.zeros(slots_n, HKV, D, dtype=dtype, device=DEV),
                                     torch.zeros(slots_n, HKV, D, dtype=dtype, device=DEV), 256,
                                     alloc_summaries(slots_n, 256, 1, D, dtype, DEV),
                                     aux=alloc_aux_sglang(slots_n, D, dtype, DEV))
    k = torch.ones(256, HKV, D, dtype=dtype, device=DEV)
    rows = torch.ones(256, 2 * D, dtype=dtype, device=DEV)
    if DEV != "cuda":
        monkeypatch.setattr(ops, "uses_kernels", lambda device, dtype: True)
    with pytest.raises(ValueError, match="block_size = 256"):
        ops.cache_dash_prefill(k, k, cache, torch.arange(256, device=DEV), p, ik=rows[:, :D],
                               head_cls_i=torch.ones(D, dtype=dtype, device=DEV))
    assert not cache.k_pages.any() and not cache.aux.any() and not cache.summaries.any()


def test_graph_buffers_serve_an_indexer_decode():
    """The engines' captured decode takes its Triton scratch from ``graphs.DecodeGraphBuffers``:
    allocated with ``indexer_heads`` it fits an indexer step, which then equals the same step with
    scratch sized for it by the launcher, bit for bit (same kernels, same inputs)."""
    from graphs import DecodeGraphBuffers

    dtype = torch.bfloat16
    p = DashParams(block_size=BS, scaling_factor=3.0, topk=2)
    lens = [70, 41]
    data, hc, hci = make(dtype, 23, lens, 1)
    slots_n = 8 * 4 * PS
    cache = PagedKVCache.from_sglang(torch.zeros(slots_n, HKV, D, dtype=dtype, device=DEV),
                                     torch.zeros(slots_n, HKV, D, dtype=dtype, device=DEV), PS,
                                     alloc_summaries(slots_n, BS, 1, D, dtype, DEV),
                                     aux=alloc_aux_sglang(slots_n, D, dtype, DEV))
    bt = torch.tensor([[5, 2, 7, 9], [8, 1, 13, 20]], dtype=torch.int32, device=DEV)
    pos = torch.cat([torch.arange(n + 1) for n in lens]).to(DEV)
    req = torch.cat([torch.full((n + 1,), i) for i, n in enumerate(lens)]).to(DEV)
    slots = bt[req, pos // PS].long() * PS + pos % PS
    cu = torch.tensor([0, lens[0] + 1, lens[0] + lens[1] + 2], dtype=torch.int32, device=DEV)
    sl = torch.tensor([n + 1 for n in lens], dtype=torch.int32, device=DEV)
    q, k, v, iq, ik = (torch.cat([d[j] for d in data]) for j in range(5))
    _, _, _, _, rows = paged.prepare_aux(cache, None, k, None, ik, None, pos, None, bt, cu)  # ik into the rows
    ops._write(cache, k, v, slots, p, hc, hci, rows, kernels=True)
    last = cu[1:].long() - 1
    gb = DecodeGraphBuffers.allocate(4, bt.shape[1], HQ, HKV, D, PS, p, dtype, DEV, io=False, indexer_heads=HI)
    outs = [kernel_decode(q[last], None, None, cache, bt, sl, None, hc, p, iq=iq[last], head_cls_i=hci, buffers=b)
            for b in (None, gb.kernel)]
    assert torch.equal(outs[0], outs[1]) and outs[0].abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="CUDA-graph capture needs a CUDA device")
def test_captured_decode_with_indexer_and_page_mode():
    """``ops.paged_dash_decode`` with an indexer and page mode captured in a CUDA graph over static
    inputs: two replays (new inputs copied in place, positions and seq_lens advanced on the device
    side by copies) equal eager steps on a copy of the cache, bit for bit (same kernels, same inputs)."""
    dtype = torch.bfloat16
    p = DashParams(block_size=BS, scaling_factor=3.0, topk=2)
    lens, gen = [len(ROLES), len(PLAIN)], 2
    data, hc, hci = make(dtype, 11, lens, gen)
    slots_n = 8 * 4 * PS
    bt = torch.tensor([[5, 2, 7, 9], [8, 1, 13, 20]], dtype=torch.int32, device=DEV)

    def new_cache():
        return PagedKVCache.from_sglang(torch.zeros(slots_n, HKV, D, dtype=dtype, device=DEV),
                                        torch.zeros(slots_n, HKV, D, dtype=dtype, device=DEV), PS,
                                        alloc_summaries(slots_n, BS, 1, D, dtype, DEV),
                                        aux=alloc_aux_sglang(slots_n, D, dtype, DEV))

    def cat(j, lo, hi):
        return torch.cat([d[j][a:b] for d, a, b in zip(data, lo, hi)])

    def slots_at(pos):  # the slot of request i at pos[i]
        return bt[torch.arange(len(pos), device=DEV), pos // PS].long() * PS + pos % PS

    caches = [new_cache(), new_cache()]
    cu = torch.tensor([0, lens[0], lens[0] + lens[1]], dtype=torch.int32, device=DEV)
    prompt_pos = torch.cat([torch.arange(n) for n in lens]).to(DEV)
    prompt_req = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)]).to(DEV)
    prompt_slots = bt[prompt_req, prompt_pos // PS].long() * PS + prompt_pos % PS
    for c in caches:
        ops.paged_dash_prefill(cat(0, [0, 0], lens), cat(1, [0, 0], lens), cat(2, [0, 0], lens), c, bt, cu,
                               torch.tensor(lens, dtype=torch.int32, device=DEV), prompt_slots, hc, p,
                               iq=cat(3, [0, 0], lens), ik=cat(4, [0, 0], lens), head_cls_i=hci,
                               roles=torch.tensor(ROLES + PLAIN, device=DEV), positions=prompt_pos, page_rope=PR)
    bufs = DecodeBuffers.allocate(2, HQ, HKV, D, PS, bt.shape[1], p, DEV, indexer_heads=HI)
    static = {}
    graph = None
    for s in range(gen):
        lo = [n + s for n in lens]
        pos = torch.tensor(lo, device=DEV)
        step = dict(q=cat(0, lo, [x + 1 for x in lo]), k=cat(1, lo, [x + 1 for x in lo]),
                    v=cat(2, lo, [x + 1 for x in lo]), iq=cat(3, lo, [x + 1 for x in lo]),
                    ik=cat(4, lo, [x + 1 for x in lo]), seq_lens=(pos + 1).to(torch.int32), slots=slots_at(pos),
                    positions=pos)
        eager = ops.paged_dash_decode(step["q"], step["k"], step["v"], caches[1], bt, step["seq_lens"],
                                      step["slots"], hc, p, iq=step["iq"], ik=step["ik"], head_cls_i=hci,
                                      positions=step["positions"], page_rope=PR)

        def run():
            return ops.paged_dash_decode(static["q"], static["k"], static["v"], caches[0], bt, static["seq_lens"],
                                         static["slots"], hc, p, iq=static["iq"], ik=static["ik"], head_cls_i=hci,
                                         positions=static["positions"], page_rope=PR, buffers=bufs)
        if graph is None:
            static = {name: x.clone() for name, x in step.items()}
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up (idempotent: the same writes as the replay)
                run()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static["out"] = run()
        else:
            for name, x in step.items():
                static[name].copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static["out"], eager), s
    for a, b in ((caches[0].k_pages, caches[1].k_pages), (caches[0].aux, caches[1].aux),
                 (caches[0].summaries, caches[1].summaries)):
        assert torch.equal(a, b)
