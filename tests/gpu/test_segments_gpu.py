"""Segment backends on the GPU: TRITON, TORCH, FLASHINFER, FLASH_ATTN against the oracle, against
the Triton backend, under CUDA-graph replay, and the FlashInfer plan cache.

Run one backend at a time (``ci/gpu.sh segments tests BACKEND``); a backend whose library is not
installed is skipped. Scenarios are the CPU tests' (``tests/test_segments.py``): the selection
comes from the oracle's ``route`` or is random, empty segments and local-only rows included,
and ``reference.attend`` is fed the same selection and prior.

Tolerances: bf16/fp16 inputs, fp32 accumulation; the output is rounded to the input dtype
(2^-9 relative for bf16) and the libraries round P to the input dtype before P @ V (another
2^-9 on each weight): 8e-3 absolute for outputs of magnitude <= 2 (bf16), 2e-3 for fp16.
Graph replay runs the same kernels on the same data as the eager call: 1e-3 flags any stale
buffer or plan (which shows as O(1) differences) while allowing library nondeterminism.
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

from dash_core import DashParams
from dash_core import segments as seg, segments_paged as segp
from dash_core.layout import PagedKVCache
from dash_core.plan_cache import PlanCache

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _cpu_tests():
    """The CPU test module (scenarios and oracle glue), loaded by path: ``tests`` is no package."""
    path = pathlib.Path(__file__).resolve().parents[1] / "test_segments.py"
    spec = importlib.util.spec_from_file_location("dash_test_segments_cpu", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


if torch.cuda.is_available():
    _t = _cpu_tests()
    make_case, oracle_out, oracle_routing = _t.make_case, _t.oracle_out, _t.oracle_routing
    random_routing, selection_of = _t.random_routing, _t.selection_of
else:  # collected on CPU machines only to be skipped
    make_case = oracle_out = oracle_routing = random_routing = selection_of = None

TOL = {torch.bfloat16: 8e-3, torch.float16: 2e-3}


def _have(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def backend_param(name: str):
    missing = {"FLASHINFER": not _have("flashinfer"),
               "FLASH_ATTN": not (_have("flash_attn.cute") or _have("vllm.vllm_flash_attn"))}.get(name, False)
    return pytest.param(name, marks=pytest.mark.skipif(missing, reason=f"{name}: library not installed"))


BACKENDS = [backend_param(b) for b in ("TRITON", "TORCH", "FLASHINFER", "FLASH_ATTN")]


def to_cuda(params, q, k, v, pos, cache, bt, routing):
    """Selection and gathered segments on the GPU; the oracle keeps the CPU copies."""
    sel_idx, sel_bias, count = selection_of(routing, params)
    gcache = PagedKVCache(cache.k_pages.cuda(), cache.v_pages.cuda())
    kk, vv, used, bias = segp.gather_segments(gcache, bt.cuda(), (pos + 1).to(torch.int32).cuda(), sel_idx.cuda(),
                                             sel_bias.cuda(), count.cuda(), params)
    return q.permute(1, 0, 2).contiguous().cuda(), kk, vv, used, bias


def scenario(kind, router, dtype, seed=11):
    hkv = 2 if router == "kv_head" else 4
    params, q, k, v, pos, cache, bt = make_case(
        seed, router=router, dtype=dtype, hq=8, hkv=hkv, d=128, bs=64, local=128, topk=4, length=2200,
        page_size=64, positions=(5, 130, 191, 192, 700, 1500, 2199, 64), sf=8.0)
    if kind == "route":
        routing = oracle_routing(params, q, k, pos)
    else:
        routing = random_routing(seed, params, hkv, pos)
    return params, q, k, v, pos, cache, bt, routing


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("router", ["kv_head", "shared"])
@pytest.mark.parametrize("kind", ["route", "random"])
def test_backend_vs_oracle_and_kernel(backend, router, kind):
    dtype = torch.bfloat16
    params, q, k, v, pos, cache, bt, routing = scenario(kind, router, dtype)
    qc, kk, vv, used, bias = to_cuda(params, q, k, v, pos, cache, bt, routing)
    assert bool((used[..., :-1] == 0).any()) and bool((used[..., :-1] > 0).any())
    out = seg.flash_dash_attention(qc, kk, vv, used, bias, backend, params.block_size, params.local)
    assert out.dtype == dtype and not bool(out.isnan().any())
    want = oracle_out(params, q, k, v, pos, routing)
    torch.testing.assert_close(out.double().cpu(), want, atol=TOL[dtype], rtol=0)
    if backend != "TRITON":
        triton_out = seg.flash_dash_attention(qc, kk, vv, used, bias, "TRITON", params.block_size, params.local)
        torch.testing.assert_close(out.float(), triton_out.float(), atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("router,layout", [("kv_head", "hnd"), ("kv_head", "vllm"), ("shared", "nhd")])
def test_zero_copy_matches_oracle(backend, router, layout):
    """Segments read in place through page tables (page size = block size, KV heads folded)."""
    dtype = torch.bfloat16
    hkv = 2 if router == "kv_head" else 4
    params, q, k, v, pos, cache, bt = make_case(
        13, router=router, dtype=dtype, hq=8, hkv=hkv, d=128, bs=64, local=128, topk=4, length=2200,
        page_size=64, positions=(5, 130, 191, 192, 700, 1500, 2199, 64), sf=8.0, layout=layout, device="cuda")
    routing = oracle_routing(params, q, k, pos)
    sel_idx, sel_bias, count = selection_of(routing, params)
    kp, vp, table, used, bias = segp.segment_pages(cache, bt.cuda(), (pos + 1).to(torch.int32).cuda(),
                                                  sel_idx.cuda(), sel_bias.cuda(), count.cuda(), params)
    qc = q.permute(1, 0, 2).contiguous().cuda()
    out = segp.flash_dash_attention_paged(qc, kp, vp, table, used, bias, backend, 64, 128)
    assert not bool(out.isnan().any())
    torch.testing.assert_close(out.double().cpu(), oracle_out(params, q, k, v, pos, routing), atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("backend", ["TRITON", "TORCH"])  # library fp16 modules would double the JIT time
def test_float16(backend):
    params, q, k, v, pos, cache, bt, routing = scenario("route", "kv_head", torch.float16)
    qc, kk, vv, used, bias = to_cuda(params, q, k, v, pos, cache, bt, routing)
    out = seg.flash_dash_attention(qc, kk, vv, used, bias, backend, params.block_size, params.local)
    torch.testing.assert_close(out.double().cpu(), oracle_out(params, q, k, v, pos, routing),
                               atol=TOL[torch.float16], rtol=0)


@pytest.mark.skipif(not _have("flashinfer"), reason="FLASHINFER: library not installed")
def test_flashinfer_plan_cache_keeps_pinned_plans():
    cache = PlanCache(capacity=1, workspace_bytes=64 << 20)
    params, q, k, v, pos, pcache, bt, routing = scenario("route", "kv_head", torch.bfloat16)
    qc, kk, vv, used, bias = to_cuda(params, q, k, v, pos, pcache, bt, routing)
    key = seg.prepare_flash_dash_attention(qc, kk, vv, used, bias, "FLASHINFER", 64, 128, plan_cache=cache)
    pinned = cache.pin(key)
    first = seg.flash_dash_attention(qc, kk, vv, used, bias, "FLASHINFER", 64, 128, plan_cache=cache)
    for n in (1, 2, 3):  # eager calls of other shapes churn through an LRU of one
        s = params.topk * 64 + 128
        q2 = torch.randn(n, 8, 128, device="cuda", dtype=torch.bfloat16)
        k2 = torch.randn(n * 2 * s, 1, 128, device="cuda", dtype=torch.bfloat16)
        used2 = torch.full((n, 2, params.topk + 1), 64, device="cuda", dtype=torch.int32)
        seg.flash_dash_attention(q2, k2, k2, used2, torch.zeros(n, 2, params.topk, device="cuda"),
                                 "FLASHINFER", 64, 128, plan_cache=cache)
    assert cache.pinned_keys == (key,) and len(cache) == 2
    assert cache.pin(key) is pinned
    again = seg.flash_dash_attention(qc, kk, vv, used, bias, "FLASHINFER", 64, 128, plan_cache=cache)
    torch.testing.assert_close(again, first, atol=0, rtol=0)
    torch.testing.assert_close(first.double().cpu(), oracle_out(params, q, k, v, pos, routing),
                               atol=TOL[torch.bfloat16], rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("router", ["kv_head", "shared"])
@pytest.mark.parametrize("variant", ["gathered", "zero-copy"])
def test_decode_graph_replay_equals_eager(backend, router, variant):
    """Segment layout + attention captured once (plans made before capture), replayed over new
    queries, K/V data, lengths, page tables and selections (empty segments, padded rows)."""
    torch.manual_seed(3)
    dev, dtype = "cuda", torch.bfloat16
    n, hq, d, bs, local, topk, ps, max_pages = 6, 8, 128, 64, 128, 4, 64, 40
    hkv = 2 if router == "kv_head" else 4
    hsel = hkv if router == "kv_head" else 1
    params = DashParams(block_size=bs, local=local, topk=topk, router=router, attention_backend="TRITON")
    num_pages = n * max_pages + 4
    cache = PagedKVCache(torch.randn(num_pages, hkv, ps, d, device=dev, dtype=dtype).permute(0, 2, 1, 3),
                         torch.randn(num_pages, hkv, ps, d, device=dev, dtype=dtype).permute(0, 2, 1, 3))
    # static inputs of the captured step
    q = torch.empty(n, hq, d, device=dev, dtype=dtype)
    block_table = torch.empty(n, max_pages, device=dev, dtype=torch.int32)
    seq_lens = torch.empty(n, device=dev, dtype=torch.int32)
    sel_idx = torch.empty(n, hsel, topk, device=dev, dtype=torch.int32)
    sel_bias = torch.empty(n, hsel, topk, device=dev, dtype=torch.float32)
    sel_count = torch.empty(n, hsel, device=dev, dtype=torch.int32)
    plan_cache = PlanCache(capacity=2, workspace_bytes=64 << 20)

    def refill(step):
        g = torch.Generator(device="cpu").manual_seed(100 + step)
        q.copy_(torch.randn(n, hq, d, generator=g).to(dtype))
        cache.k_pages.copy_(torch.randn(cache.k_pages.shape, generator=g).to(dtype))
        cache.v_pages.copy_(torch.randn(cache.v_pages.shape, generator=g).to(dtype))
        block_table.copy_(torch.randperm(num_pages, generator=g)[: n * max_pages].view(n, max_pages).int())
        lens = torch.randint(1, max_pages * ps, (n,), generator=g)
        lens[step % n] = 0  # a padded row
        lens[(step + 1) % n] = 40  # a row with only its local window
        seq_lens.copy_(lens.int())
        ncand = ((lens - 1).clamp(min=0) // bs - params.local_blocks + 1).clamp(min=0)
        idx = torch.stack([torch.randperm(max(int(c), topk), generator=g)[:topk] for c in ncand
                           for _ in range(hsel)]).view(n, hsel, topk)
        sel_idx.copy_(idx.clamp(max=(ncand - 1).clamp(min=0)[:, None, None]).int())
        cnt = torch.randint(0, topk + 1, (n, hsel), generator=g)
        sel_count.copy_(torch.minimum(cnt, ncand[:, None]).int())
        sel_bias.copy_(torch.log(torch.rand(n, hsel, topk, generator=g) * 0.9 + 0.1))

    def step():
        if variant == "zero-copy":
            kp, vp, table, used, bias = segp.segment_pages(cache, block_table, seq_lens, sel_idx, sel_bias, sel_count,
                                                          params)
            return segp.flash_dash_attention_paged(q, kp, vp, table, used, bias, backend, bs, local,
                                                  plan_cache=plan_cache)
        kk, vv, used, bias = segp.gather_segments(cache, block_table, seq_lens, sel_idx, sel_bias, sel_count, params)
        return seg.flash_dash_attention(q, kk, vv, used, bias, backend, bs, local, plan_cache=plan_cache)

    refill(0)
    if variant == "zero-copy":
        kp, vp, table, used, bias = segp.segment_pages(cache, block_table, seq_lens, sel_idx, sel_bias, sel_count,
                                                       params)
        key = segp.prepare_flash_dash_attention_paged(q, kp, vp, table, used, bias, backend, bs, local,
                                                     plan_cache=plan_cache)
    else:
        kk, vv, used, bias = segp.gather_segments(cache, block_table, seq_lens, sel_idx, sel_bias, sel_count, params)
        key = seg.prepare_flash_dash_attention(q, kk, vv, used, bias, backend, bs, local, plan_cache=plan_cache)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: JIT compilation and first-call work happen outside capture
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    for s in range(1, 4):
        refill(s)
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        assert not bool(static_out.isnan().any())
        assert bool((static_out[(s % n)] == 0).all())  # the padded row
        torch.testing.assert_close(static_out.float(), eager.float(), atol=1e-3, rtol=0)
    if key is not None:
        assert key in plan_cache.pinned_keys
        plan_cache.unpin(key)
