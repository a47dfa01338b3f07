"""The Triton path with the auxiliary head (SPEC.md section 9): indexer routing (iq over the 1-head
store of ik summaries, router shared) and page mode (page RoPE and the auxiliary rows as tensor ops
before the launches), prefill then decode, against the float64 oracle; under the interpreter on the
CPU (the op's CUDA branch spelled out: ``paged.prepare_aux``, ``launcher.write_new_triton``, then the
launches with ``iq``), through the public ops when compiled on a GPU (``-m gpu``), where decode must
not synchronise with the host."""

from __future__ import annotations

import pytest
import torch

from dash_core import DashParams, ops, paged
from dash_core.kernels import launcher
from dash_core.kernels import prefill as pf
from dash_core.layout import PagedKVCache, alloc_aux_sglang, alloc_summaries, decode_aux
from dash_core.reference import block_summaries, dash_rows
from dash_core.rope import PageRopeSettings, RotarySettings, page_coordinates, page_rope
from tests.kernels._kernel_env import KERNEL_DEVICE
from tests.kernels._kernel_scenarios import summary_tolerance
from tests.kernels.test_kernel_decode_attention import TOL

DEV = KERNEL_DEVICE
D, HQ, HKV, HI, PS, BS = 64, 4, 2, 3, 32, 16
PR = PageRopeSettings(main=RotarySettings(theta=10000.0), indexer=RotarySettings(theta=1000.0), tok_pairs=8)
# Routing is discontinuous: fp32 scores against the oracle's float64 ones (fed the very same stored
# summaries) may move a block sitting at the entmax threshold or at the topk boundary; at most this
# fraction of (token, query head) rows may then miss the attention tolerance (as the other
# end-to-end kernel tests).
MAX_DIFFERING_ROWS = 0.05
# page prompt: text, page 1, text, page 2, question (70 tokens); the other request has no page
ROLES = [0] * 5 + [1] + [2] * 22 + [0] * 3 + [1] + [2] * 20 + [0] * 18
PLAIN = [0] * 41


def step(op, cache, q, k, v, iq, ik, hc, hci, bt, cu, sl, slots, params, roles=None, positions=None, pr=None):
    """One op call on the Triton path: the public op on CUDA, its CUDA branch spelled out otherwise."""
    ind = dict(iq=iq, ik=ik, head_cls_i=hci) if iq is not None else {}
    if DEV == "cuda":
        if op == "decode":
            return ops.paged_dash_decode(q, k, v, cache, bt, sl, slots, hc, params, positions=positions,
                                         page_rope=pr, **ind)
        return ops.paged_dash_prefill(q, k, v, cache, bt, cu, sl, slots, hc, params, roles=roles,
                                      positions=positions, page_rope=pr, **ind)
    if positions is None:
        positions = paged.token_positions(cu, sl, q.shape[0], q.device)
    q, k, iq, ik, rows = paged.prepare_aux(cache, q, k, iq, ik, roles, positions, pr, bt, cu)
    launcher.write_new_triton(cache, k, v, slots, params, hc, hci, rows)
    if op == "decode":
        return launcher.paged_dash_decode_triton(q, None, None, cache, bt, sl, None, hc, params, iq=iq)
    return pf.paged_dash_prefill_triton(q, None, None, cache, bt, cu, sl, None, hc, params, iq=iq)


def make(dtype, seed, lens, gen):
    g = torch.Generator().manual_seed(seed)

    def r(*s, sc=1.0):
        return (torch.randn(*s, generator=g) * sc).to(dtype).to(DEV)

    data = [(r(n + gen, HQ, D), r(n + gen, HKV, D), r(n + gen, HKV, D), r(n + gen, HI, D, sc=2.0),
             r(n + gen, D, sc=2.0)) for n in lens]
    return data, r(HKV, D), r(D)


@pytest.mark.parametrize("page_mode,indexer", [(False, True), (True, True), (True, False)])
def test_aux_prefill_then_decode(page_mode, indexer):
    dtype = torch.bfloat16
    p = DashParams(block_size=BS, scaling_factor=3.0, topk=2)
    roles = [ROLES, PLAIN]
    lens, gen = [len(x) for x in roles], 2
    data, hc, hci = make(dtype, 3 + page_mode + 2 * indexer, lens, gen)
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
    checked = bad = 0
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
        for lo, hi, cu, o in outs:
            pos = torch.arange(lo[i], hi[i])
            ref, _ = dash_rows(q[pos].permute(1, 0, 2), k.permute(1, 0, 2)[:, :hi[i]], v.permute(1, 0, 2)[:, :hi[i]],
                               stored.double(), pos, p, iq=iq[pos].permute(1, 0, 2) if indexer else None)
            got = o[cu[i]:cu[i + 1]].double()
            err = (got - ref.permute(1, 0, 2)).abs() - tol["rtol"] * ref.permute(1, 0, 2).abs()
            checked += err.shape[0] * err.shape[1]
            bad += int((err.amax(-1) > tol["atol"]).sum())
    assert bad <= MAX_DIFFERING_ROWS * checked, (bad, checked)


def test_indexer_launch_checks():
    dtype = torch.bfloat16
    p = DashParams(block_size=BS)
    cache = PagedKVCache.from_sglang(torch.zeros(128, HKV, D, dtype=dtype, device=DEV),
                                     torch.zeros(128, HKV, D, dtype=dtype, device=DEV), PS,
                                     alloc_summaries(128, BS, 1, D, dtype, DEV), aux=alloc_aux_sglang(128, D, dtype, DEV))
    q = torch.zeros(1, HQ, D, dtype=dtype, device=DEV)
    bt = torch.zeros(1, 4, dtype=torch.int32, device=DEV)
    sl = torch.ones(1, dtype=torch.int32, device=DEV)
    iq = torch.zeros(1, HI, D, dtype=dtype, device=DEV)
    with pytest.raises(ValueError, match="k = v = slot_mapping = None"):
        launcher.paged_dash_decode_triton(q, q[:, :HKV], q[:, :HKV], cache, bt, sl, torch.zeros(1, dtype=torch.long,
                                          device=DEV), None, p, iq=iq)
    with pytest.raises(ValueError, match="iq must be"):
        launcher.paged_dash_decode_triton(q, None, None, cache, bt, sl, None, None, p, iq=iq.float())
    bufs = launcher.DecodeBuffers.for_step(q, cache, bt, p)
    with pytest.raises(ValueError, match="indexer_heads"):
        launcher.paged_dash_decode_triton(q, None, None, cache, bt, sl, None, None, p, iq=iq, buffers=bufs)
