"""Decode benchmark: DASH Triton decode against dense decode peers at long context.

Timing (``docs/PERFORMANCE.md``, "Method"): CUDA events around every call after warm-up and compilation, the median
of many calls, inputs rotated over several layers' caches so that L2 (50 MB on the H200) does not flatter sparse
reads, and a floor = bytes that must move / measured device-to-device copy bandwidth. Graph rows replay one CUDA
graph of at least eight steps, each rotated layer's in turn, and divide by the steps (``common.graph_ms``), as a
model's decode graph runs its layers. Dense peers measured in the same run: cuDNN SDPA and SDPA's FlashAttention
backend on contiguous K/V (``dense-cudnn``, ``dense-sdpa``; eager and captured in a CUDA graph), FlashInfer's paged
decode (``dense-flashinfer``) and FlashAttention 4's paged varlen kernel (``dense-flash-attn``), each where it imports
and runs here; the published DashAttention decode kernels
(if a copy of the authors' repository is at ``$DASH_PUBLISHED_DIR``; compared uncapped at the same
``scaling_factor``, compiled and autotuned before timing). DASH's attention stage on the segment backends
(``dash-flashinfer``, ``dash-flash-attn``: the same Triton routing, then ``dash_core.segments``) is timed for every
capped ``topk`` where the library imports, gathered and, on a head-major cache (``--layout vllm``), zero-copy.

Writes JSON records to ``docs/perf/decode.json`` (merged by case); ``benchmarks/report.py`` makes the tables.

    python benchmarks/decode.py --preset serving           # B 1, 8 at 4k, B 1-64 at 32k, B 1-32 at 128k, topk 64
    python benchmarks/decode.py --preset required          # B 1 and 8 at 128k, topk 64 and uncapped
    python benchmarks/decode.py --preset required --layout vllm --peers flashinfer  # + zero-copy rows
    python benchmarks/decode.py --batch 1,8,32 --context 8192,32768 --hkv 8,2 --topk 16,64,256,none
    python benchmarks/decode.py --profile ncu --batch 1 --context 131072   # one step for Nsight Compute
    python benchmarks/decode.py --batch 32 --context 131072 --timeline --tune score_stages=5 --peers none
    TRITON_INTERPRET=1 python benchmarks/decode.py --smoke  # CPU check of the code paths (tiny shapes)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if "--smoke" in sys.argv:  # the interpreter fixes of the kernel tests, applied before triton is imported
    import tests.kernels._kernel_env  # noqa: F401

sys.path.insert(0, str(ROOT / "benchmarks"))
from common import (L2_BYTES, SDPA_PEERS, add_output_args, add_shape_args, device_name, flash_attn_varlen, graph_ms,
                    graph_timeline, import_published, log, merge_records, open_device, parse_topks, peers_of,
                    run_fields, run_id, sdpa_fn, shown_command, time_calls, tune_configs)
from dash_core import DashParams, ops, segments_paged
from dash_core.kernels.decode import launch as decode_launch
from dash_core.kernels.decode.buffers import DecodeBuffers
from dash_core.kernels.decode.config import DecodeConfig
from dash_core.kernels.kv_write import write_kv_and_summaries
from dash_core.layout import PagedKVCache, alloc_summaries
from tests.kernels._kernel_ops import kernel_decode

# --preset serving: (B, context) of the serving table, topk 64, graph-captured with the K/V write
SERVING_CASES = ((1, 4096), (8, 4096), (1, 32768), (8, 32768), (32, 32768), (64, 32768), (1, 131072), (8, 131072),
                 (32, 131072))


# ---------------------------------------------------------------------------- the case

class Layer:
    """One layer's paged cache, shuffled page table. layout ``sglang``: token-major K and V buffers
    ``[slots, Hkv, D]`` viewed as pages; ``vllm``: one head-major ``[pages, Hkv, ps, 2D]`` tensor."""

    def __init__(self, b, ctx, hkv, d, bs, ps, dtype, device, seed, layout="sglang"):
        g = torch.Generator(device=device).manual_seed(seed)
        self.max_pages = -(-ctx // ps)
        num_pages = b * self.max_pages + 2
        slots = num_pages * ps
        self.k = torch.randn(slots, hkv, d, device=device, dtype=dtype, generator=g)
        # per-block offsets make some blocks stand out, as trained keys do, so routing is not flat
        self.k.view(-1, bs, hkv, d).add_(
            (0.5 * torch.randn(slots // bs, 1, hkv, d, device=device, generator=g)).to(dtype))
        self.v = torch.randn(slots, hkv, d, device=device, dtype=dtype, generator=g)
        self.head_cls = torch.randn(hkv, d, device=device, generator=g).to(dtype)
        perm = torch.randperm(num_pages, device=device, generator=g)[: b * self.max_pages]
        self.block_table = perm.view(b, self.max_pages).to(torch.int32).contiguous()
        summ = alloc_summaries(slots, bs, hkv, d, dtype, device)
        if layout == "vllm":  # the same keys and values, head-major
            kv = torch.empty(num_pages, hkv, ps, 2 * d, device=device, dtype=dtype)
            kv[..., :d].copy_(self.k.view(num_pages, ps, hkv, d).transpose(1, 2))
            kv[..., d:].copy_(self.v.view(num_pages, ps, hkv, d).transpose(1, 2))
            self.k = self.v = None
            self.cache = PagedKVCache.from_vllm(kv, hkv, d, summ)
        else:
            self.cache = PagedKVCache.from_sglang(self.k, self.v, ps, summ)
        write_kv_and_summaries(None, None, self.cache, torch.arange(slots, device=device), self.head_cls, bs,
                               decode=False)  # summaries of every block, by the kernel
        pos = torch.full((b,), ctx - 1, device=device)
        self.slot_mapping = (self.block_table.gather(1, (pos // ps)[:, None]).squeeze(1).to(torch.int64) * ps
                             + pos % ps)

    def contiguous_kv(self, ctx):
        """``[B, Hkv, ctx, D]`` K and V gathered through the page table (for the dense SDPA peer)."""
        ps = self.cache.page_size
        pos = torch.arange(ctx, device=self.block_table.device)
        pages, rows = self.block_table[:, pos // ps].to(torch.int64), pos % ps  # [B, ctx]
        return (self.cache.k_pages[pages, rows].permute(0, 2, 1, 3).contiguous(),
                self.cache.v_pages[pages, rows].permute(0, 2, 1, 3).contiguous())


def dash_bytes(b, ctx, hq, hkv, d, bs, local_blocks, sel_count, esize) -> tuple:
    """(bytes that must move, fraction of the context's K/V read) of one DASH decode step."""
    p = ctx - 1
    cur = p // bs
    first_local = max(cur - local_blocks + 1, 0)
    ncand = first_local
    local_tokens = ctx - first_local * bs
    routed_tokens = float(sel_count.double().sum()) * bs * (hkv if sel_count.shape[1] == 1 else 1)
    kv_tokens = b * hkv * local_tokens + routed_tokens
    kv = kv_tokens * d * 2 * esize
    summaries = b * hkv * ncand * d * esize
    qo = 2 * b * hq * d * esize
    meta = b * (-(-ctx // bs)) * 4 + b * 4
    return kv + summaries + qo + meta, kv_tokens / (b * hkv * ctx)


def dense_bytes(b, ctx, hq, hkv, d, esize) -> float:
    return b * ctx * hkv * d * 2 * esize + 2 * b * hq * d * esize


# ---------------------------------------------------------------------------- peers

def flashinfer_decode(layer: Layer, q, ctx, hq, hkv, d, ps):
    import flashinfer  # optional peer

    b = q.shape[0]
    ws = torch.zeros(128 * 2**20, dtype=torch.uint8, device=q.device)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, kv_layout="NHD")
    npages = layer.max_pages
    indptr = torch.arange(b + 1, dtype=torch.int32, device=q.device) * npages
    indices = layer.block_table.flatten().contiguous()
    last = torch.full((b,), ctx - (npages - 1) * ps, dtype=torch.int32, device=q.device)
    w.plan(indptr, indices, last, hq, hkv, d, ps, q_data_type=q.dtype, kv_data_type=q.dtype)
    kv = (layer.cache.k_pages, layer.cache.v_pages)
    out = torch.empty_like(q)
    return lambda: w.run(q, kv, out=out)


def flash_attn_decode(layer: Layer, q, ctx):
    """FlashAttention 4's varlen kernel on the paged cache: one query a request, its pages through the block table."""
    fn = flash_attn_varlen()
    b = q.shape[0]
    dev = q.device
    cu_q = torch.arange(b + 1, dtype=torch.int32, device=dev)
    used = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    table = layer.block_table.contiguous()
    scale = 1.0 / math.sqrt(q.shape[-1])
    k_pages, v_pages = layer.cache.k_pages, layer.cache.v_pages
    return lambda: fn(q, k_pages, v_pages, cu_seqlens_q=cu_q, max_seqlen_q=1, max_seqlen_k=ctx, seqused_k=used,
                      page_table=table, softmax_scale=scale, causal=False)


def published_decode(layer: Layer, q, ctx, params: DashParams, kc, vc):
    """The authors' decode (stage 2 + stage 3) on contiguous K/V and contiguous summaries."""
    decoding = import_published("decoding")
    bs = params.block_size
    nc = (ctx - 1) // bs
    ps = layer.cache.page_size
    blk = torch.arange(nc, device=q.device)
    idx = layer.block_table[:, (blk * bs) // ps].to(torch.int64) * (ps // bs) + (blk % (ps // bs))  # [B, nc]
    kblk = layer.cache.summaries[idx].permute(0, 2, 1, 3).contiguous()  # [B, Hkv, nc, D]
    q4 = q[:, :, None, :].contiguous()
    qs = (q4 * params.scaling_factor).to(q.dtype)

    def run():
        bm, pr = decoding.score_blocks(qs, kblk, bs, estimate_diag=params.estimate_diagonal, sigma=params.sigma)
        return decoding.full_attn(q4, kc, vc, bm, bs, chunk_prior=pr)

    return run


# ---------------------------------------------------------------------------- one case

def calibrate_sf(layer: Layer, q, ctx: int, params: DashParams, target: float, lo=0.25, hi=256.0) -> float:
    """A scaling_factor whose uncapped selection reads about ``target`` of the candidate blocks."""
    b = q.shape[0]
    seq = torch.full((b,), ctx, dtype=torch.int32, device=q.device)

    def frac(sf):
        p = DashParams(block_size=params.block_size, scaling_factor=sf, local=params.local)
        bufs = DecodeBuffers.for_step(q, layer.cache, layer.block_table, p)
        decode_launch.route(q, layer.cache, layer.block_table, seq, p, bufs)
        ncand = max(1, (ctx - 1) // params.block_size - p.local_blocks + 1)
        return float(bufs.sel_count[:b].double().mean()) / ncand

    sf = math.sqrt(lo * hi)
    for _ in range(10):
        sf = math.sqrt(lo * hi)
        f = frac(sf)
        if 0.8 * target <= f <= 1.25 * target:
            break
        lo, hi = (sf, hi) if f > target else (lo, sf)
    return sf


def segment_backends(spec: str) -> list:
    """``--segment-backends``: "auto" = the libraries that import here, "none", or a comma list."""
    if spec == "none":
        return []
    if spec != "auto":
        return [x.strip() for x in spec.split(",") if x.strip()]
    found = []
    for backend, module in (("FLASHINFER", "flashinfer"), ("FLASH_ATTN", "flash_attn.cute")):
        try:
            __import__(module)
            found.append(backend)
        except Exception as e:  # optional peer
            log(f"  segment backend {backend} unavailable: {type(e).__name__}: {e}")
    return found


def segment_rows(a, layers, q, seq, params, bufs, out, common, add, floor, kv_frac, nbytes, it, wu, cuda,
                 graphs_on) -> None:
    """DASH decode (no K/V write) with the attention stage on each segment backend, gathered and zero-copy."""
    b = q.shape[0]
    for backend in a.seg_backends:
        method = "dash-" + backend.lower().replace("_", "-")
        variants = [True, False] if segments_paged.zero_copy_possible(layers[0].cache, params) else [False]
        for zc in variants:
            variant = "zero-copy" if zc else "gathered"

            def fn(layer, zc=zc, backend=backend):
                def run():
                    decode_launch.route(q, layer.cache, layer.block_table, seq, params, bufs)
                    out.copy_(segments_paged.decode_segment_attention(
                        q, layer.cache, layer.block_table, seq, bufs.sel_idx[:b], bufs.sel_bias[:b],
                        bufs.sel_count[:b], params, backend, zero_copy=zc))
                return run

            try:
                fns = [fn(layer) for layer in layers]
                t0 = time.time()
                fns[0]()  # JIT build / plan outside the timed region
                if cuda:
                    torch.cuda.synchronize()
                log(f"  {method} {variant}: first call {time.time() - t0:.0f} s")
                add(common, method, variant, time_calls(fns, it, wu, cuda), floor, kv_frac, nbytes)
                if graphs_on:
                    add(common, method, variant, graph_ms(fns, it, wu), floor, kv_frac, nbytes, graph=True)
            except Exception as e:  # an optional library: report, do not fail the run
                log(f"  {method} {variant} skipped: {type(e).__name__}: {e}")


def dense_rows(add, common, method, variant, fn, floor, nbytes, it, wu, cuda, graphs_on, note) -> None:
    """A dense peer's rows: eager, and replayed from a CUDA graph where it captures (engines capture decode)."""
    add(common, method, variant, time_calls([fn], it, wu, cuda), floor, 1.0, nbytes, note=note)
    if not graphs_on:
        return
    try:
        ms = graph_ms([fn], it, wu)
    except Exception as e:  # some peers cannot be captured as called here: their eager row stands
        log(f"  {method} not captured: {type(e).__name__}: {str(e)[:200]}")
        torch.cuda.synchronize()
        return
    add(common, method, variant, ms, floor, 1.0, nbytes, graph=True, note=note)


def log_timeline(a, fns: list, tag: str) -> None:
    """With ``--timeline``: when each launch of the captured step starts and ends inside it
    (``common.graph_timeline``), logged."""
    if a.timeline:
        spans = graph_timeline(fns)
        log(f"  timeline{tag or ' (defaults)'}, us into the step: "
            + "  ".join(f"{n.strip('_').removesuffix('_kernel')} {t0:.1f}-{t1:.1f}" for n, t0, t1 in spans))


def step_inputs(a, b, ctx, hkv, layer, sf, device, dtype) -> tuple:
    """``(q [B, Hq, D], k_new, v_new [B, Hkv, D], seq_lens [B], sf)`` of a decode step at ``ctx`` tokens (the same
    draws for every shape of a run); ``sf`` None: calibrated on ``layer`` to ``--target-fraction``."""
    g = torch.Generator(device=device).manual_seed(7)
    q, k_new, v_new = (torch.randn(b, h, a.head_dim, device=device, generator=g).to(dtype) for h in (a.hq, hkv, hkv))
    seq = torch.full((b,), ctx, dtype=torch.int32, device=device)
    if sf is None:
        sf = calibrate_sf(layer, q, ctx, DashParams(block_size=a.block_size), a.target_fraction)
        log(f"  scaling_factor {sf:.3g} selects about {a.target_fraction:.0%} of the blocks uncapped")
    return q, k_new, v_new, seq, sf


def run_shape(a, b, ctx, hkv, topks, sf, device, bw, records, dtype=torch.bfloat16):
    """Every ``topk`` of one shape on the same rotated caches, then the dense peers once."""
    hq, d, bs, ps = a.hq, a.head_dim, a.block_size, a.page_size
    cuda = device.type == "cuda"
    esize = torch.empty((), dtype=dtype).element_size()
    log(f"shape B={b} ctx={ctx} Hq={hq} Hkv={hkv} D={d} bs={bs}: building caches")
    small_topk = min([t for t in topks if t is not None], default=128)
    est_step = b * hkv * (small_topk * bs * d * 2 * esize + (ctx // bs) * d * esize)
    nlayers = max(2, min(a.max_layers, math.ceil(4 * L2_BYTES / max(est_step, 1))))
    if cuda:
        free = torch.cuda.mem_get_info(device)[0]
        per_layer = (b * ctx + 4 * ps) * hkv * d * 2 * esize * (1 + 1 / (2 * bs))
        nlayers = max(1, min(nlayers, int(0.4 * free // per_layer)))
    layers = [Layer(b, ctx, hkv, d, bs, ps, dtype, device, seed=1000 + i, layout=a.layout) for i in range(nlayers)]
    q, k_new, v_new, seq, sf = step_inputs(a, b, ctx, hkv, layers[0], sf, device, dtype)
    dev_name = device_name(device)
    it, wu = (a.iters, a.warmup) if cuda else (2, 1)
    out = torch.empty_like(q)
    graphs_on = cuda and not a.no_graph

    def add(common, method, variant, ms, fl, frac, by, *, write=False, graph=False, note=None):
        rec = dict(common, method=method, variant=variant, includes_write=write, graph=graph, ms=round(ms, 5),
                   kv_fraction=round(frac, 5), floor_ms=round(fl, 5), floor_fraction=round(fl / ms, 4),
                   achieved_tbps=round(by / (ms * 1e-3) / 1e12, 3))
        if note:
            rec["note"] = note
        records.append(rec)
        log(f"  {method:16s} {variant:12s} topk={str(common['topk']):5s} write={int(write)} graph={int(graph)}  "
            f"{ms * 1e3:9.1f} us  ({fl / ms:.0%} of floor)")

    base = dict(phase="decode", batch=b, context=ctx, hq=hq, hkv=hkv, head_dim=d, bs=bs, scaling_factor=round(sf, 4),
                device=dev_name, **run_fields(a), page_size=ps, layers_rotated=nlayers, layout=a.layout)
    for topk in topks:
        params = DashParams(block_size=bs, topk=topk, scaling_factor=sf)
        common = dict(base, topk=topk)
        bufs = DecodeBuffers.for_step(q, layers[0].cache, layers[0].block_table, params)

        decode = ops.paged_dash_decode if cuda else kernel_decode  # the op; on the CPU on the kernels' path

        def dash_fn(layer, write, params=params, bufs=bufs):
            if write:
                return lambda: decode(
                    q, k_new, v_new, layer.cache, layer.block_table, seq, layer.slot_mapping, layer.head_cls, params,
                    out=out, buffers=bufs)
            return lambda: decode(
                q, None, None, layer.cache, layer.block_table, seq, None, layer.head_cls, params, out=out,
                buffers=bufs)

        dash_fn(layers[0], False)()
        sel = bufs.sel_count[:b].clone()
        nbytes, kv_frac = dash_bytes(b, ctx, hq, hkv, d, bs, params.local_blocks, sel, esize)
        floor = nbytes / bw * 1e3
        log(f"  topk {topk}: mean routed blocks per (request, KV head) {float(sel.double().mean()):.1f} of "
            f"{(ctx - 1) // bs}; KV fraction {kv_frac:.3%}; floor {floor * 1e3:.1f} us; {nlayers} layers rotated")
        for write in (False, True):
            ms = time_calls([dash_fn(layer, write) for layer in layers], it, wu, cuda)
            add(common, "dash-triton", "zero-copy", ms, floor, kv_frac, nbytes, write=write)
        if graphs_on:
            for write in (False, True):
                steps = [dash_fn(layer, write) for layer in layers]
                ms = graph_ms(steps, it, wu)
                add(common, "dash-triton", "zero-copy", ms, floor, kv_frac, nbytes, write=write, graph=True)
                if write:  # the timeline of the steps with the write
                    log_timeline(a, steps, "")
            for tag, config in a.tunings[1:]:  # --tune: the captured step with the K/V write, and its routing
                tuned = DecodeBuffers.for_step(q, layers[0].cache, layers[0].block_table, params, config=config)
                steps = [dash_fn(layer, True, bufs=tuned) for layer in layers]
                ms = graph_ms(steps, it, wu)
                add(common, "dash-triton", "zero-copy" + tag, ms, floor, kv_frac, nbytes, write=True, graph=True)
                log_timeline(a, steps, tag)
                ms = graph_ms([lambda lay=lay: decode_launch.route(q, lay.cache, lay.block_table, seq, params, tuned)
                               for lay in layers], it, wu)
                add(common, "dash-triton", "route-only" + tag, ms, floor, kv_frac, nbytes, graph=True)
                del tuned
            # where the time goes: each stage alone, replayed from a graph
            sb = b * hkv * ((ctx - 1) // bs) * d * esize + b * hq * d * esize
            ms = graph_ms([lambda lay=lay: decode_launch.route(q, lay.cache, lay.block_table, seq, params, bufs)
                           for lay in layers], it, wu)
            add(common, "dash-triton", "route-only", ms, sb / bw * 1e3, kv_frac, sb, graph=True)
            for only in ("scores", "select"):  # the two routing launches apart
                ms = graph_ms([lambda lay=lay, only=only: decode_launch.route(q, lay.cache, lay.block_table, seq,
                                                                               params, bufs, only=only)
                               for lay in layers], it, wu)
                add(common, "dash-triton", f"{only}-only", ms, (sb if only == "scores" else 0.0) / bw * 1e3, kv_frac,
                    sb if only == "scores" else 0.0, graph=True)
            kvb = nbytes - sb
            ms = graph_ms([lambda lay=lay: decode_launch.attend(q, lay.cache, lay.block_table, seq, params, bufs, out)
                           for lay in layers], it, wu)
            add(common, "dash-triton", "attend-only", ms, kvb / bw * 1e3, kv_frac, kvb, graph=True,
                note="attends the selection left in the buffers by the last routing")
        if topk is not None:
            segment_rows(a, layers, q, seq, params, bufs, out, common, add, floor, kv_frac, nbytes, it, wu,
                         cuda, graphs_on)

    peers = peers_of(a.peers)
    dbytes = dense_bytes(b, ctx, hq, hkv, d, esize)
    dfloor = dbytes / bw * 1e3
    dense = dict(base, topk=None)
    kc = vc = None
    if peers & set(SDPA_PEERS) or ("published" in peers and None in topks):
        kc, vc = layers[0].contiguous_kv(ctx)
    q4 = q[:, :, None, :]
    for peer in [p for p in ("cudnn", "sdpa", "flashinfer", "flash-attn") if p in peers]:
        method = SDPA_PEERS[peer][0] if peer in SDPA_PEERS else "dense-" + peer
        try:
            note = None
            if peer in SDPA_PEERS:
                fn, note = sdpa_fn(peer, q4, kc, vc, cuda)
                variant = "contiguous"
            elif peer == "flashinfer":
                fn, variant = flashinfer_decode(layers[0], q, ctx, hq, hkv, d, ps), "paged"
            else:
                fn, variant = flash_attn_decode(layers[0], q, ctx), "paged"
            fn()  # JIT build, plan, autotune: outside the timed calls
            # the SDPA peers are plain launches, captured as the engines capture dense decode; the library peers'
            # wrappers need their own graph-mode buffers, so they are timed eager
            dense_rows(add, dense, method, variant, fn, dfloor, dbytes, it, wu, cuda, graphs_on and peer in SDPA_PEERS,
                       note)
        except Exception as e:  # an optional peer: report, do not fail the run
            log(f"  {method} skipped: {type(e).__name__}: {str(e)[:300]}")
    if "published" in peers and None in topks:
        try:
            params = DashParams(block_size=bs, scaling_factor=sf)
            fn = published_decode(layers[0], q, ctx, params, kc, vc)
            t0 = time.time()
            fn()  # compile + autotune at the timed shapes, outside the timed region
            if cuda:
                torch.cuda.synchronize()
            log(f"  published-dash compiled and autotuned in {time.time() - t0:.0f} s")
            bufs = DecodeBuffers.for_step(q, layers[0].cache, layers[0].block_table, params)
            decode_launch.route(q, layers[0].cache, layers[0].block_table, seq, params, bufs)
            nbytes, kv_frac = dash_bytes(b, ctx, hq, hkv, d, bs, 1, bufs.sel_count[:b].clone(), esize)
            add(dict(base, topk=None), "published-dash", "contiguous", time_calls([fn], it, wu, cuda),
                nbytes / bw * 1e3, kv_frac, nbytes,
                note="stages 2+3 on contiguous K/V and summaries; sf*q formed outside the timed call")
        except Exception as e:
            log(f"  published-dash skipped: {type(e).__name__}: {e}")
    del layers, kc, vc
    if cuda:
        torch.cuda.empty_cache()
    return sf


# ---------------------------------------------------------------------------- a profiler's call

def profile(a, device) -> int:
    """One decode step with its K/V write (the first ``--batch``, ``--context``, ``--hkv`` and ``--topk``; the last
    ``--tune`` setting): warm-up steps, then one step between ``cudaProfilerStart`` and ``cudaProfilerStop``
    (``ncu --profile-from-start off`` sees that step's launches only: ``ci/gpu.sh decode profile``)."""
    b, ctx, hkv = cases(a)[0]
    topk = parse_topks(a.topk)[0]
    layer = Layer(b, ctx, hkv, a.head_dim, a.block_size, a.page_size, torch.bfloat16, device, seed=1000,
                  layout=a.layout)
    q, k_new, v_new, seq, sf = step_inputs(a, b, ctx, hkv, layer, a.sf, device, torch.bfloat16)
    params = DashParams(block_size=a.block_size, topk=topk, scaling_factor=sf)
    tag, config = a.tunings[-1]
    bufs = DecodeBuffers.for_step(q, layer.cache, layer.block_table, params, config=config)

    def step():
        ops.paged_dash_decode(q, k_new, v_new, layer.cache, layer.block_table, seq, layer.slot_mapping,
                              layer.head_cls, params, buffers=bufs)

    log(f"profiling a decode step: B {b}, context {ctx}, Hkv {hkv}, topk {topk}, sf {sf:.4g}{tag}")
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return 0


# ---------------------------------------------------------------------------- records and main

def record_key(r: dict) -> tuple:
    """What a decode record measures: a later record of the same key replaces it."""
    return (r["batch"], r["context"], r["hq"], r["hkv"], r["head_dim"], r["bs"], r["topk"], r["method"], r["variant"],
            r["includes_write"], r["graph"], r["device"], r.get("layout", "sglang"))


def record_order(r: dict) -> tuple:
    return (r["device"], r["hkv"], r["context"], r["batch"], str(r["topk"]), r["method"], r["graph"],
            r["includes_write"])


def cases(a) -> list:
    """``[(B, context, Hkv)]`` to run: the serving preset's pairs, else every combination of the lists."""
    if a.preset == "serving":
        return [(b, ctx, hkv) for hkv in map(int, a.hkv.split(",")) for b, ctx in SERVING_CASES]
    return [(b, ctx, hkv) for hkv in map(int, a.hkv.split(",")) for ctx in map(int, a.context.split(","))
            for b in map(int, a.batch.split(","))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=["serving", "required", "matrix"],
                    help="serving: B 1 and 8 at 4k, B 1, 8, 32, 64 at 32k and B 1, 8, 32 at 128k, topk 64; required: "
                         "B 1 and 8 at 128k, topk 64 and none; matrix: B 1-64, 8k-128k, Hkv 8 and 2, topk 16-256 and "
                         "none")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--context", default="131072")
    add_shape_args(ap, "scaling_factor (default: calibrated per case)")
    ap.add_argument("--layout", choices=["sglang", "vllm"], default="sglang",
                    help="cache layout: token-major (SGLang) or head-major (vLLM; allows zero-copy segment rows)")
    ap.add_argument("--segment-backends", default=None,
                    help="FLASHINFER,FLASH_ATTN for the dash-<library> rows; auto = those that import; none "
                         "(default: auto, none for --preset serving)")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--max-layers", type=int, default=16)
    ap.add_argument("--no-graph", action="store_true")
    ap.add_argument("--tune", action="append", default=[],
                    help="DecodeConfig settings to time beside the defaults, e.g. --tune score_split_min_candidates=32 "
                         "(repeatable; captured steps with the write, and their routing)")
    ap.add_argument("--timeline", action="store_true",
                    help="log when each launch of the captured step (with the write; each --tune's too) starts and "
                         "ends inside the step, from torch.profiler")
    ap.add_argument("--profile", choices=["ncu"],
                    help="one step of the first shape between cudaProfilerStart and Stop, timing nothing "
                         "(ci/gpu.sh decode profile runs ncu)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    add_output_args(ap, "decode")
    a = ap.parse_args(argv)
    a.command = shown_command("decode.py", list(argv if argv is not None else sys.argv[1:]))
    a.run = run_id()
    if a.preset == "matrix":
        a.batch, a.context, a.hkv, a.topk = "1,8,32,64", "8192,32768,131072", "8,2", "16,64,256,none"
    elif a.preset == "required":
        a.batch, a.context, a.hkv, a.topk = "1,8", "131072", "8", "64,none"
    elif a.preset == "serving":
        a.hkv, a.topk = "8", "64"
    if a.segment_backends is None:
        a.segment_backends = "none" if a.preset == "serving" else "auto"
    if a.smoke:
        a.batch, a.context, a.hkv, a.topk = "2", "300", "2", "4,none"
        a.hq, a.head_dim, a.block_size, a.page_size, a.peers, a.max_layers = 4, 64, 16, 32, "cudnn,sdpa", 2
        a.segment_backends = "TORCH"  # the segment path's code on the CPU
        a.preset = None
        if a.json == str(ROOT / "docs/perf/decode.json"):
            a.json = str(Path(os.environ.get("TMPDIR", "/tmp")) / "dash_decode_smoke" / "decode.json")
    try:
        peers_of(a.peers)  # refuses unknown names before any work
        a.tunings = tune_configs(a.tune, DecodeConfig())
    except ValueError as e:
        ap.error(str(e))
    device, bw, status = open_device(a, profile)
    if device is None:
        return status
    a.seg_backends = segment_backends(a.segment_backends)
    records: list = []
    topks = parse_topks(a.topk)
    t0 = time.time()
    for b, ctx, hkv in cases(a):
        try:
            run_shape(a, b, ctx, hkv, topks, a.sf, device, bw, records)
        except torch.cuda.OutOfMemoryError as e:
            log(f"  out of memory, shape skipped: {e}")
            torch.cuda.empty_cache()
        log(f"elapsed {time.time() - t0:.0f} s")
        if not a.no_write and records:  # after every shape, so that a run cut short keeps what it measured
            merge_records(Path(a.json), records, record_key, record_order)
    import report  # the tables of docs/PERFORMANCE.md, here for this run's records

    print("\n" + report.run_table(records, "us") + "\n", flush=True)
    if not a.no_write:
        log(f"wrote {a.json}; python benchmarks/report.py makes the docs' tables and charts from it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
