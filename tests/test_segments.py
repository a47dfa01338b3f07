"""Segmented DASH attention (dash_core.segments) against the float64 oracle, on the CPU.

The selection comes from the oracle's own ``route`` (or is drawn at random), is laid out as
routed + local segments through ``gather_segments`` from a shuffled paged cache, and the merged
result of ``flash_dash_attention`` is compared with ``reference.attend`` fed the same selection
and prior (docs/design.md: attention is compared stage by stage, with the selection held fixed).

Tolerances: float32 inputs are computed in fp32 against float64; logits are O(1) and segments
hold <= 64 tokens, so the softmax and merge lose a few fp32 ulps: 1e-5 absolute is ~100 ulps of
headroom on outputs of magnitude <= 3. bfloat16 inputs are the same bf16 numbers in the oracle;
the difference is the output's bf16 rounding (half an ulp: 2^-9 relative, <= 4e-3 at |o| <= 2)
plus fp32 arithmetic: 5e-3 (8e-3 where the Triton kernel also rounds P to bf16 before P @ V,
as FlashAttention does: another 2^-9 relative on each weight).
"""

from __future__ import annotations

import functools
import math
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():  # the Triton kernel test runs in the interpreter (set before triton loads it)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dash_core import DashParams
from dash_core import reference as ref
from dash_core import segments as seg, segments_paged as segp
from dash_core.layout import PagedKVCache

TOL = {torch.float32: 1e-5, torch.bfloat16: 5e-3}


# ------------------------------------------------------------------------------------------------
# scenario: one sequence, R decode-style query rows at chosen positions, a shuffled paged cache


def make_case(seed, *, router="kv_head", dtype=torch.float32, hq=4, hkv=2, d=16, bs=16, local=32, topk=3,
              length=200, page_size=32, positions=(3, 20, 47, 48, 95, 150, 199), sf=4.0, layout="nhd",
              device="cpu"):
    """layout: the cache's storage, ``nhd`` (token-major, SGLang-like), ``hnd`` (head-major) or
    ``vllm`` (``[blocks, Hkv + 1 head slots, page, 2D + 8]`` viewed through ``from_vllm``); the
    cache lives on ``device``, everything else on the CPU."""
    g = torch.Generator().manual_seed(seed)
    params = DashParams(block_size=bs, local=local, topk=topk, router=router, scaling_factor=sf)
    q = torch.randn(hq, len(positions), d, generator=g).to(dtype)
    k = torch.randn(hkv, length, d, generator=g).to(dtype)
    v = torch.randn(hkv, length, d, generator=g).to(dtype)
    pos = torch.tensor(positions)
    # the paged cache: pages of `page_size` tokens in a shuffled order
    npages = -(-length // page_size)
    perm = torch.randperm(npages + 3, generator=g)[:npages]
    if layout == "nhd":
        cache = PagedKVCache(torch.zeros(npages + 3, page_size, hkv, d, dtype=dtype, device=device),
                             torch.zeros(npages + 3, page_size, hkv, d, dtype=dtype, device=device))
    elif layout == "hnd":
        cache = PagedKVCache(torch.zeros(npages + 3, hkv, page_size, d, dtype=dtype, device=device).permute(0, 2, 1, 3),
                             torch.zeros(npages + 3, hkv, page_size, d, dtype=dtype, device=device).permute(0, 2, 1, 3))
    else:
        kv = torch.zeros(npages + 3, hkv + 1, page_size, 2 * d + 8, dtype=dtype, device=device)
        cache = PagedKVCache.from_vllm(kv, hkv, d)
    pad = npages * page_size - length
    kf = torch.cat([k, k.new_zeros(hkv, pad, d)], 1).permute(1, 0, 2).reshape(npages, page_size, hkv, d)
    vf = torch.cat([v, v.new_zeros(hkv, pad, d)], 1).permute(1, 0, 2).reshape(npages, page_size, hkv, d)
    cache.k_pages[perm.to(device)], cache.v_pages[perm.to(device)] = kf.to(device), vf.to(device)  # through the views
    block_table = perm.to(torch.int32)[None].expand(len(positions), npages).contiguous()
    return params, q, k, v, pos, cache, block_table


def oracle_routing(params, q, k, pos):
    """The oracle's selection for the rows (docs/semantics.md sections 4-5)."""
    bs = params.block_size
    summ = ref.block_summaries(k, torch.randn(k.shape[0], k.shape[2], generator=torch.Generator().manual_seed(7)), bs)
    ncand = (pos // bs - params.local_blocks + 1).clamp(min=0)
    nblk = max(int(ncand.max()), 1)
    q_scaled = (q * params.scaling_factor).to(q.dtype)
    return ref.route(q_scaled, summ[:, :nblk], ncand, params)


def random_routing(seed, params, hkv, pos, p_keep=0.5, limit=None):
    """Random kept blocks among each row's candidates (at most ``limit`` or topk, some rows none),
    priors in (0.01, 1]."""
    g = torch.Generator().manual_seed(seed)
    bs = params.block_size
    ncand = (pos // bs - params.local_blocks + 1).clamp(min=0)
    nblk = max(int(ncand.max()), 1)
    hsel = hkv if params.router == "kv_head" else 1
    r = len(pos)
    score = torch.rand(hsel, r, nblk, generator=g, dtype=torch.float64)
    cand = torch.arange(nblk)[None, None] < ncand[None, :, None]
    kept = cand & (score < p_keep)
    kept[:, 1] = False  # one row with only its local window
    rank = torch.argsort(torch.argsort(-score.masked_fill(~kept, -1), dim=-1), dim=-1)
    kept &= rank < (limit or params.topk)
    prior = torch.where(kept, torch.rand(hsel, r, nblk, generator=g, dtype=torch.float64) * 0.99 + 0.01, 0.0)
    return ref.Routing(mp=prior, kept=kept, prior=prior)


def selection_of(routing, params, cap=None, garbage=True):
    """Routing -> the kernels' selection format: sel_idx, sel_bias [n, Hsel, cap], sel_count [n, Hsel]."""
    kept, prior = routing.kept.permute(1, 0, 2), routing.prior.permute(1, 0, 2)  # [R, Hsel, nblk]
    r, hsel, nblk = kept.shape
    cap = cap or params.topk
    sel_idx = torch.full((r, hsel, cap), 10 ** 6 if garbage else 0, dtype=torch.int32)
    sel_bias = torch.full((r, hsel, cap), float("nan") if garbage else 0.0)
    count = kept.sum(-1).to(torch.int32)
    for i in range(r):
        for s in range(hsel):
            idx = kept[i, s].nonzero().flatten()
            idx = idx[torch.randperm(len(idx))]  # any order
            sel_idx[i, s, : len(idx)] = idx.to(torch.int32)
            sel_bias[i, s, : len(idx)] = torch.log(prior[i, s, idx]).float()
    return sel_idx, sel_bias, count


def run_segments(params, q, pos, cache, block_table, routing, backend="TORCH", cap=None):
    sel_idx, sel_bias, count = selection_of(routing, params, cap)
    k, v, used, bias = segp.gather_segments(cache, block_table, (pos + 1).to(torch.int32), sel_idx, sel_bias,
                                           count, params)
    qr = q.permute(1, 0, 2).contiguous()  # [R, Hq, D]
    return seg.flash_dash_attention(qr, k, v, used, bias, backend, params.block_size, params.local), (k, v, used, bias)


def oracle_out(params, q, k, v, pos, routing):
    return ref.attend(q, k, v, pos, routing, params).permute(1, 0, 2)  # [R, Hq, D] float64


# ------------------------------------------------------------------------------------------------
# the merge with the PyTorch segment attention against the oracle


@pytest.mark.parametrize("router", ["kv_head", "shared"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])  # TRITON on CPU tensors = the PyTorch path
def test_oracle_routing(router, dtype, backend):
    params, q, k, v, pos, cache, bt = make_case(1, router=router, dtype=dtype)
    routing = oracle_routing(params, q, k, pos)
    assert routing.kept.any() and (routing.kept.sum(-1) < params.topk).any()  # routed and empty segments
    out, (_, _, used, _) = run_segments(params, q, pos, cache, bt, routing, backend)
    assert (used[..., :-1] == 0).any() and (used[..., :-1] > 0).any()
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.double(), oracle_out(params, q, k, v, pos, routing), atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("seed", [2, 3, 4])
@pytest.mark.parametrize("router", ["kv_head", "shared"])
def test_random_selections(seed, router):
    hkv = 3 if router == "kv_head" else 2
    params, q, k, v, pos, cache, bt = make_case(seed, router=router, local=16, hq=6, hkv=hkv,
                                                positions=(0, 70, 15, 16, 31, 120, 199, 64))
    routing = random_routing(seed, params, k.shape[0], pos, limit=2)
    out, (_, _, used, _) = run_segments(params, q, pos, cache, bt, routing, cap=2)  # cap < topk: padded
    assert (used[1, :, :-1] == 0).all() and (used[0, :, -1] == 1).all()  # row 1: local only; row 0: one token
    torch.testing.assert_close(out.double(), oracle_out(params, q, k, v, pos, routing), atol=1e-5, rtol=0)


def test_dense_equivalent_is_causal_attention():
    """Every candidate routed with prior 1 (and topk >= candidates): plain causal attention."""
    params0, q, k, v, pos, cache, bt = make_case(5, topk=16, length=150, positions=(149, 100, 7))
    params = DashParams(block_size=16, local=32, topk=16, scaling_factor=0.0, estimate_diagonal=True)
    routing = oracle_routing(params, q, k, pos)
    out, _ = run_segments(params, q, pos, cache, bt, routing)
    for r, p in enumerate(pos.tolist()):
        dense = torch.softmax(torch.einsum("hd,htd->ht", q[:, r].double().reshape(2, 2, -1).flatten(0, 1),
                                           k[:, : p + 1].double().repeat_interleave(2, 0)) / 4.0, -1)
        o = torch.einsum("ht,htd->hd", dense, v[:, : p + 1].double().repeat_interleave(2, 0))
        torch.testing.assert_close(out[r].double(), o, atol=1e-5, rtol=0)


def test_padded_rows_give_zeros():
    params, q, k, v, pos, cache, bt = make_case(6)
    routing = oracle_routing(params, q, k, pos)
    sel_idx, sel_bias, count = selection_of(routing, params)
    seq_lens = (pos + 1).to(torch.int32)
    seq_lens[2] = 0
    kk, vv, used, bias = segp.gather_segments(cache, bt, seq_lens, sel_idx, sel_bias, count, params)
    assert (used[2] == 0).all()
    out = seg.flash_dash_attention(q.permute(1, 0, 2).contiguous(), kk, vv, used, bias, "TORCH", 16, 32)
    assert (out[2] == 0).all()
    keep = [0, 1, 3, 4, 5, 6]
    torch.testing.assert_close(out[keep].double(), oracle_out(params, q, k, v, pos, routing)[keep], atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------------
# zero-copy variant: segments addressed through page tables


@pytest.mark.parametrize("router,layout", [("kv_head", "hnd"), ("kv_head", "vllm"), ("shared", "nhd"),
                                           ("shared", "vllm")])
def test_zero_copy_pages_match_oracle(router, layout):
    params, q, k, v, pos, cache, bt = make_case(9, router=router, layout=layout, page_size=16)
    routing = oracle_routing(params, q, k, pos)
    sel_idx, sel_bias, count = selection_of(routing, params)
    seq_lens = (pos + 1).to(torch.int32)
    kp, vp, table, used, bias = segp.segment_pages(cache, bt, seq_lens, sel_idx, sel_bias, count, params)
    if router == "kv_head":  # folded in place: a view of the engine's storage, no copy
        assert kp.shape[2] == 1 and kp.untyped_storage().data_ptr() == cache.k_pages.untyped_storage().data_ptr()
    qr = q.permute(1, 0, 2).contiguous()
    out = segp.flash_dash_attention_paged(qr, kp, vp, table, used, bias, "TORCH", 16, 32)
    torch.testing.assert_close(out.double(), oracle_out(params, q, k, v, pos, routing), atol=1e-5, rtol=0)
    kg, vg, used_g, bias_g = segp.gather_segments(cache, bt, seq_lens, sel_idx, sel_bias, count, params)
    assert torch.equal(used, used_g) and torch.equal(bias, bias_g)
    # the pages hold exactly the gathered tokens wherever a segment is valid
    geo = seg.check_segments(qr, kg, vg, used, bias, "TORCH", 16, 32)
    kc, _ = segp._pages_to_gathered(kp, vp, table, geo)
    starts = seg.segment_starts(geo, "cpu").long()
    lens = seg.segment_lengths(used, geo).long()
    row = torch.arange(kg.shape[0])
    req = torch.searchsorted(starts, row, right=True) - 1
    valid = row - starts[req] < lens[req]
    assert valid.any() and torch.equal(kc[valid], kg[valid])


def test_zero_copy_refuses_what_it_cannot_address():
    params, q, k, v, pos, cache, bt = make_case(9, layout="nhd", page_size=16)
    routing = oracle_routing(params, q, k, pos)
    args = (bt, (pos + 1).to(torch.int32), *selection_of(routing, params), params)
    with pytest.raises(ValueError, match="token-major"):
        segp.segment_pages(cache, *args)  # per-KV-head selections over a token-major cache
    params32, *_, cache32, bt32 = make_case(9, layout="hnd", page_size=32)
    with pytest.raises(ValueError, match="page size equals the block size"):
        segp.segment_pages(cache32, *args)


# ------------------------------------------------------------------------------------------------
# the merge itself


def test_merge_ignores_whatever_empty_segments_hold():
    g = torch.Generator().manual_seed(0)
    o = torch.randn(3, 4, 2, 8, generator=g)
    lse = torch.randn(3, 4, 2, generator=g)
    log_prior = torch.log(torch.rand(3, 4, generator=g))
    valid = torch.tensor([[True, False, True, False], [False] * 4, [True, True, True, False]])
    log_prior[2, 1] = -math.inf  # a zero prior is an empty segment too
    garbage_o, garbage_lse = o.clone(), lse.clone()
    garbage_o[~valid] = float("nan")
    garbage_lse[0, 1] = float("inf")  # FA2 writes +inf for empty rows
    garbage_lse[0, 3] = float("nan")
    out = seg.merge_segments(garbage_o, garbage_lse, log_prior, valid)
    assert not out.isnan().any() and (out[1] == 0).all()
    for i in (0, 2):
        sel = valid[i] & (log_prior[i] > -math.inf)
        w = torch.softmax(lse[i][sel] + log_prior[i][sel][:, None], dim=0)
        torch.testing.assert_close(out[i], (w[..., None] * o[i][sel]).sum(0), atol=1e-6, rtol=0)


def test_used_above_capacity_is_clamped_and_matches_dense():
    g = torch.Generator().manual_seed(1)
    n, hq, d, bs, local, topk = 2, 2, 16, 8, 16, 1
    q = torch.randn(n, hq, d, generator=g)
    k = torch.randn(n * (topk * bs + local), 1, d, generator=g)
    v = torch.randn_like(k)
    used = torch.tensor([[[100, 100]], [[-3, 5]]])
    out = seg.flash_dash_attention(q, k, v, used, torch.zeros(n, 1, topk), "TORCH", bs, local)
    for i, rows in enumerate([torch.arange(24), torch.arange(8, 13)]):
        kk, vv = k[i * 24 + rows, 0].double(), v[i * 24 + rows, 0].double()
        w = torch.softmax(q[i].double() @ kk.T / 4.0, -1)
        torch.testing.assert_close(out[i].double(), w @ vv, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------------
# the Triton segment kernel (interpreter on CPU)


@functools.lru_cache(maxsize=None)
def _interpreted_run() -> str:
    """Run this file's Triton kernel tests once in a subprocess with TRITON_INTERPRET=1; its report."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    node = f"{os.path.abspath(__file__)}::test_triton_segment_kernel"
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", node],
                         env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         capture_output=True, text=True, timeout=900)
    return res.stdout + res.stderr


def _interpreter_active() -> bool:
    """True when triton was imported with TRITON_INTERPRET=1 (its own jit helpers interpreted)."""
    import triton.language.standard as std
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(std.max, InterpretedFunction)


@pytest.mark.parametrize("router,dtype", [("kv_head", torch.float32), ("shared", torch.float32),
                                          ("kv_head", torch.bfloat16)])
def test_triton_segment_kernel(router, dtype, request):
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and not _interpreter_active():
        # triton was imported before TRITON_INTERPRET was set (e.g. by --doctest-modules over
        # dash_core): the interpreter cannot run in this process, so these cases run in a fresh one.
        out = _interpreted_run()
        assert f"PASSED {request.node.name}" in out.replace("tests/test_segments.py::", "").replace(
            os.path.abspath(__file__) + "::", ""), out[-6000:]
        return
    from dash_core.kernels import segment_attention as mod

    params, q, k, v, pos, cache, bt = make_case(8, router=router, dtype=dtype, positions=(5, 40, 47, 130, 199),
                                                topk=2, hkv=2, hq=4)
    routing = oracle_routing(params, q, k, pos)
    sel_idx, sel_bias, count = selection_of(routing, params)
    kk, vv, used, bias = segp.gather_segments(cache, bt, (pos + 1).to(torch.int32), sel_idx, sel_bias, count, params)
    qr = q.permute(1, 0, 2).contiguous()
    geo = seg.check_segments(qr, kk, vv, used, bias, "TRITON", 16, 32)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU machine, interpreted here
    o, lse = (t.cpu() for t in mod.segment_attention_triton(qr.to(dev), kk.to(dev), vv.to(dev), used.to(dev), geo))
    o_t, lse_t = seg.segment_attention_torch(qr, kk, vv, used, geo)
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_t))
    fin = torch.isfinite(lse_t)
    torch.testing.assert_close(lse[fin], lse_t[fin], atol=1e-5, rtol=1e-5)
    out = seg.combine_segments(o, lse, used, bias, geo, dtype)
    tol = TOL[dtype] if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(out.double(), oracle_out(params, q, k, v, pos, routing), atol=tol, rtol=0)


# ------------------------------------------------------------------------------------------------
# layout helpers used by the library backends


def test_segment_starts_and_mask_bytes():
    geo = seg.SegmentGeometry(n=2, hsel=3, topk=2, bs=16, local=24, hq=6, hk=1, d=16)
    starts = seg.segment_starts(geo, "cpu").tolist()
    expect, off = [], 0
    for _ in range(geo.n * geo.hsel):
        for c in range(geo.num_segments):
            expect.append(off)
            off += geo.local if c == geo.topk else geo.bs
    assert starts == expect + [off] and off == geo.n * geo.hsel * geo.unit_tokens
    lengths = torch.randint(0, 30, (geo.requests,), generator=torch.Generator().manual_seed(0))
    req, pos = seg.mask_byte_index(geo, "cpu")
    packed = seg.length_mask_bytes(lengths, req, pos)
    bits = ((packed[:, None].to(torch.int32) >> torch.arange(8)) & 1).flatten().bool()  # little bit order
    want = torch.cat([torch.arange(e - s) < lengths[r] for r, (s, e) in enumerate(zip(starts[:-1], starts[1:]))])
    assert torch.equal(bits, want)


# ------------------------------------------------------------------------------------------------
# clear errors


def _call(backend="TORCH", bs=16, local=32, dtype=torch.float32, **over):
    n, hsel, topk, d = 2, 2, 2, 16
    s = topk * bs + local
    t = dict(q=torch.zeros(n, 4, d, dtype=dtype), k=torch.zeros(n * hsel * s, 1, d, dtype=dtype),
             v=torch.zeros(n * hsel * s, 1, d, dtype=dtype), used=torch.zeros(n, hsel, topk + 1, dtype=torch.int32),
             bias=torch.zeros(n, hsel, topk))
    t.update(over)
    return seg.flash_dash_attention(t["q"], t["k"], t["v"], t["used"], t["bias"], backend, bs, local)


def test_errors():
    with pytest.raises(ValueError, match=r"DashParams.topk = None .*dash_topk"):
        seg.segment_count(DashParams(block_size=16))
    params, q, k, v, pos, cache, bt = make_case(0)
    with pytest.raises(ValueError, match="topk"):
        segp.gather_segments(cache, bt, pos.int(), torch.zeros(7, 2, 1, dtype=torch.int32), torch.zeros(7, 2, 1),
                            torch.zeros(7, 2, dtype=torch.int32), DashParams(block_size=16, local=32))
    with pytest.raises(ValueError, match=r"bs = 12 .*multiple of 8"):
        _call(bs=12)
    with pytest.raises(ValueError, match=r"local = 20 .*multiple of 8"):
        _call(local=20)
    with pytest.raises(ValueError, match=r"backend = 'flashinfer'"):
        _call(backend="flashinfer")
    for backend in ("FLASHINFER", "FLASH_ATTN"):
        with pytest.raises(ValueError, match=rf"backend {backend} takes float16 or bfloat16 .*float32"):
            _call(backend=backend)
        with pytest.raises(ValueError, match=rf"backend {backend} needs CUDA"):
            _call(backend=backend, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="used must be"):
        _call(used=torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="fold KV heads"):
        _call(k=torch.zeros(2 * 2 * 64, 2, 16), v=torch.zeros(2 * 2 * 64, 2, 16))
    with pytest.raises(ValueError, match="k and v must be"):
        _call(k=torch.zeros(10, 1, 16))


def test_missing_libraries_name_the_extra(monkeypatch):
    for name in ("flashinfer", "flash_attn", "flash_attn.cute", "vllm", "vllm.vllm_flash_attn"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails as if not installed
    seg.import_flashinfer.cache_clear()
    seg.import_flash_attn.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"pip install dash-serve\[flashinfer\]"):
            seg.import_flashinfer()
        with pytest.raises(RuntimeError, match=r"pip install dash-serve\[flash-attn\]"):
            seg.import_flash_attn()
    finally:
        seg.import_flashinfer.cache_clear()
        seg.import_flash_attn.cache_clear()
