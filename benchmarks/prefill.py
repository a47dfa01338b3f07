"""Prefill benchmark: DASH Triton prefill / extend against dense causal prefill.

Timing (``docs/PERFORMANCE.md``, "Method"): CUDA events around every call after warm-up and compilation, the median of
several calls. Per case of the one-prompt presets: one request (B 1) of ``context`` tokens, prefilled at once or in
chunks on the paged history the earlier chunks wrote (as engines do chunked prefill), with and without the K/V +
summary write. ``--preset serving`` measures what an engine step costs a layer instead: ``B`` requests of ``context``
tokens each (``variant: "serving"``), eight layers back to back sharing one ``PrefillWorkspace``, each with its own
cache and inputs, K/V + summary write included, the step's time divided by eight (and ``host_ms``: the host's time
to issue a layer to an idle GPU, which bounds the eager step where it exceeds the GPU's); and mixed steps (``variant:
"mixed"``, ``--mixed-cases``): decode tokens and one 2k prompt chunk in one ``paged_dash_prefill`` call that writes
their K/V too, as vLLM's chunked prefill and SGLang's mixed chunks batch them and both adapters run them: eight
decode tokens at 32k, and a loaded step's 32 at 16k. Dense peers run on
the same prompts, steps and layers (``prefill_peers``: cuDNN SDPA, SDPA's FlashAttention backend, FlashInfer,
FlashAttention 4, each where it imports and runs here); the published DashAttention prefill (its three stages,
uncapped at the same ``scaling_factor``, if ``$DASH_PUBLISHED_DIR`` holds the authors' repository) runs in a child
process, shortest prompts first, so that a crash of its kernels costs only the lengths not yet measured, which are
recorded with the reason.

Queries follow an AR(1) walk over positions (``--query-correlation``, default 0.95): neighbouring queries of trained
models are alike, which is what lets a tile of query tokens share the K/V loads of their routed blocks; the records
carry the measured sharing (``tile_reuse``: routed (token, block) pairs per block loaded by a tile). Peak GPU memory
is measured per case (``peak_mb``: the most allocated during one call above what was allocated before it; DASH calls
get a preallocated output, so theirs is the routing scratch). The floor of a case is the larger of its bytes over the
measured copy bandwidth and its useful FLOPs (attention over the attended tokens, plus scoring every candidate
summary, for DASH; the causal triangle for dense) over the H200's dense bf16 peak (989 TFLOPS).

Writes JSON records to ``docs/perf/prefill.json`` (merged by case); ``benchmarks/report.py`` makes the tables.

    python benchmarks/prefill.py --preset serving     # 16x1k .. 1x128k, per layer of an 8-layer step, + mixed steps
    python benchmarks/prefill.py --preset required    # B 1, 2k..128k, topk 64 and uncapped, 128k in 8k chunks
    python benchmarks/prefill.py --context 32768,131072 --hkv 2 --topk 256,64 --tune attn_stages=2
    python benchmarks/prefill.py --profile ncu --context 131072 --topk 64   # one call for Nsight Compute
    TRITON_INTERPRET=1 python benchmarks/prefill.py --smoke [--preset serving]   # CPU check of the code paths
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import queue
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import (SDPA_PEERS, add_output_args, add_shape_args, ar1_walk, device_name, floor_ms, graph_ms, host_ms,
                    import_published, log, merge_records, open_device, parse_topks, peers_of, run_fields, run_id,
                    shown_command, time_calls, tune_configs)
from decode import calibrate_sf
from prefill_peers import mixed_peer, prompt_peer

from dash_core import DashParams, ops
from dash_core.kernels import kv_write
from dash_core.kernels.decode.buffers import DecodeBuffers
from dash_core.kernels.prefill import launch as pf_launch, plan as pf_plan, route as pf_route
from dash_core.kernels.prefill.config import PrefillConfig
from dash_core.layout import PagedKVCache, alloc_summaries
from dash_core.workspace import PrefillWorkspace
from tests.kernels._kernel_ops import kernel_decode, kernel_prefill

PEAK_FLOPS = 989e12  # H200 dense bf16 tensor cores
WORKSPACE_TAG = " workspace"  # variant suffix of the rows whose calls share a PrefillWorkspace
LAYOUT_TAG = {"vllm": " vllm-layout"}  # variant suffix of DASH rows on a cache other than SGLang's
DENSE = ("cudnn", "sdpa", "flashinfer", "flash-attn")  # the dense peers, in the order they run
# --preset serving: (requests, tokens each) of the serving table; a step of SERVING_LAYERS layers sharing a workspace
SERVING_CASES = ((16, 1024), (1, 2048), (8, 2048), (1, 4096), (4, 4096), (1, 8192), (2, 8192), (1, 16384),
                 (1, 32768), (1, 131072))
SERVING_LAYERS = 8
MIXED_CASES = "8x32768+2048,32x16384+2048"  # mixed steps: decode tokens x their context + the prompt chunk's tokens


def synthetic_kv(n, hkv, d, bs, g: torch.Generator) -> tuple:
    """fp32 ``(k, v [n, Hkv, D])`` drawn from ``g`` on its device: Gaussian, keys with a per-block offset."""
    device = g.device
    k = torch.randn(n, hkv, d, device=device, generator=g)
    # per-block offsets make some blocks stand out, as trained keys do, so routing is not flat
    k += 0.5 * torch.randn(-(-n // bs), hkv, d, device=device, generator=g).repeat_interleave(bs, 0)[:n]
    return k, torch.randn(n, hkv, d, device=device, generator=g)


def synthetic_prompt(n, hq, hkv, d, bs, dtype, g: torch.Generator, q_corr) -> tuple:
    """The benchmark's prompt tensors ``(q [n, Hq, D], k, v [n, Hkv, D], head_cls [Hkv, D])`` in ``dtype``,
    drawn from ``g`` on its device: Gaussian keys with a per-block offset, queries an AR(1) walk of
    correlation ``q_corr`` (0: none)."""
    device = g.device
    k, v = synthetic_kv(n, hkv, d, bs, g)
    q = torch.randn(n, hq, d, device=device, generator=g)
    q = ar1_walk(q, q_corr) if q_corr else q
    head_cls = torch.randn(hkv, d, device=device, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype), head_cls.to(dtype)


def new_cache(num_pages, ps, hkv, d, bs, dtype, device, layout="sglang") -> PagedKVCache:
    """An empty paged cache of ``num_pages`` pages with its summary store. layout ``sglang``: token-major K and V
    buffers ``[slots, Hkv, D]`` viewed as pages; ``vllm``: one head-major ``[pages, Hkv, ps, 2D]`` tensor."""
    slots = num_pages * ps
    summ = alloc_summaries(slots, bs, hkv, d, dtype, device)
    if layout == "vllm":
        return PagedKVCache.from_vllm(torch.zeros(num_pages, hkv, ps, 2 * d, dtype=dtype, device=device), hkv, d, summ)
    return PagedKVCache.from_sglang(torch.zeros(slots, hkv, d, dtype=dtype, device=device),
                                    torch.zeros(slots, hkv, d, dtype=dtype, device=device), ps, summ)


def write_kv(cuda, k, v, cache, slot_mapping, params, head_cls) -> None:
    """K/V + summaries of a step's history (``cache_dash_prefill``; the Triton write itself under the interpreter,
    where ``ops`` would take the PyTorch path)."""
    if cuda:
        ops.cache_dash_prefill(k, v, cache, slot_mapping, params, head_cls=head_cls)
    else:
        kv_write.write_prefill(k, v, cache, slot_mapping, params, head_cls)


class Prompt:
    """``batch`` prompts of ``n`` tokens each, packed: ``q [B n, Hq, D]``, ``k, v [B n, Hkv, D]``, and a paged cache
    (pages shuffled) with its summary store; K/V and summaries written once here."""

    def __init__(self, n, hq, hkv, d, bs, ps, dtype, device, seed, q_corr, cuda, layout="sglang", batch=1):
        self.n, self.batch, self.hq, self.hkv, self.d = n, batch, hq, hkv, d
        g = torch.Generator(device=device).manual_seed(seed)
        self.q, self.k, self.v, self.head_cls = synthetic_prompt(batch * n, hq, hkv, d, bs, dtype, g, q_corr)
        npages = -(-n // ps)
        num_pages = batch * npages + 2
        perm = torch.randperm(num_pages, device=device, generator=g)[: batch * npages]
        self.block_table = perm.view(batch, npages).to(torch.int32).contiguous()
        self.cache = new_cache(num_pages, ps, hkv, d, bs, dtype, device, layout)
        pos = torch.arange(n, device=device)
        self.slot_mapping = (self.block_table[:, pos // ps].to(torch.int64) * ps + pos % ps).flatten()
        self.cu = torch.arange(batch + 1, dtype=torch.int32, device=device) * n
        self.seq = torch.full((batch,), n, dtype=torch.int32, device=device)
        self.cuda = cuda
        self.write(DashParams(block_size=bs))

    def write(self, params, sl=slice(None)):
        """K/V + summaries of tokens ``sl``."""
        write_kv(self.cuda, self.k[sl], self.v[sl], self.cache, self.slot_mapping[sl], params, self.head_cls)


def prompt_sf(pr: Prompt, bs: int, fraction: float) -> float:
    """The ``scaling_factor`` that selects about ``fraction`` of the candidates uncapped, calibrated on the first
    prompt's last queries (as decode steps at its end)."""
    rows = min(8, pr.n)
    tail = type("Tail", (), {"cache": pr.cache, "block_table": pr.block_table[:1].expand(rows, -1).contiguous()})
    return calibrate_sf(tail, pr.q[pr.n - rows: pr.n], pr.n, DashParams(block_size=bs), fraction)


# ---------------------------------------------------------------------------- DASH calls

def prefill_op(cuda):
    """The op (on the CPU, the op on the kernels' path under the interpreter)."""
    return ops.paged_dash_prefill if cuda else kernel_prefill


def dash_fn(pr: Prompt, params, write: bool, chunk, out, workspace: bool = False,
            config: PrefillConfig = None):
    """One DASH prefill of the prompts (at once, or one prompt chunk by chunk on its history), with the kernels'
    ``config`` (default: the device's defaults). workspace: each piece's calls share a ``PrefillWorkspace`` (made
    by the first call): the time of a layer after the first of an engine step, whose plan and scratch the step's
    first layer made; else each call makes its own."""
    op = prefill_op(pr.cuda)
    dev = pr.q.device
    pieces = []
    if chunk is None:
        pieces.append((slice(None), pr.cu, pr.seq, PrefillWorkspace(config) if workspace else None))
    else:
        assert pr.batch == 1, "chunks are run for one prompt only"
        for s in range(0, pr.n, chunk):
            e = min(pr.n, s + chunk)
            pieces.append((slice(s, e), torch.tensor([0, e - s], dtype=torch.int32, device=dev),
                           torch.tensor([e], dtype=torch.int32, device=dev),
                           PrefillWorkspace(config) if workspace else None))

    def run():
        for sl, cu, seq, shared in pieces:
            ws = shared if shared is not None else PrefillWorkspace(config)
            if write:
                op(pr.q[sl], pr.k[sl], pr.v[sl], pr.cache, pr.block_table, cu, seq, pr.slot_mapping[sl],
                   pr.head_cls, params, out=out[sl], workspace=ws)
            else:
                op(pr.q[sl], None, None, pr.cache, pr.block_table, cu, seq, None, pr.head_cls, params, out=out[sl],
                   workspace=ws)
    return run


def route_only_fn(pr: Prompt, params, config: PrefillConfig):
    """The op's routing waves alone (plan, scratch, the summary copy and every route launch, no attention, no
    write)."""
    def run():
        plan, scratch = pf_launch.plan_and_scratch(pr.q, pr.cache, pr.block_table, pr.cu, pr.seq, params, config)
        pf_route.gather_summaries(pr.cache, pr.block_table, pr.seq, params, scratch)
        for tile0, tiles in plan.waves():
            pf_route.route_wave(pr.q, pr.cache, pr.block_table, pr.cu, pr.seq, params, plan, scratch, tile0, tiles)
    return run


def selection_stats(pr: Prompt, params, config: PrefillConfig = None) -> dict:
    """Routing statistics of the prompts (outside any timing): routed (token, unit) blocks, the union per (tile,
    unit) a tile loads, and the useful / executed attention work."""
    q, cache, bt = pr.q, pr.cache, pr.block_table
    bs, lb = params.block_size, params.local_blocks
    config = PrefillConfig() if config is None else config
    plan, scratch = pf_launch.plan_and_scratch(q, cache, bt, pr.cu, pr.seq, params, config)
    pf_route.gather_summaries(cache, bt, pr.seq, params, scratch)
    hsel = scratch.sel_count.shape[1]
    routed = union = 0
    for tile0, tiles in plan.waves():
        scratch.sel_count.zero_()
        pf_route.route_wave(q, cache, bt, pr.cu, pr.seq, params, plan, scratch, tile0, tiles)
        slots = tiles * plan.qt
        cnt = scratch.sel_count[:slots].long()
        routed += int(cnt.sum())
        cap = scratch.sel_idx.shape[2]
        idx = scratch.sel_idx[:slots].long()
        idx = torch.where(torch.arange(cap, device=q.device) < cnt[..., None], idx, plan.max_cand)
        mark = torch.zeros(tiles, hsel, plan.max_cand + 1, dtype=torch.bool, device=q.device)
        tile_of = (torch.arange(slots, device=q.device) // plan.qt)[:, None, None].expand_as(idx)
        unit_of = torch.arange(hsel, device=q.device)[None, :, None].expand_as(idx)
        mark[tile_of, unit_of, idx] = True
        union += int(mark[..., : plan.max_cand].sum())
    pos = torch.arange(pr.n, dtype=torch.float64).repeat(pr.batch)  # every token's position in its prompt
    cur = torch.div(pos, bs, rounding_mode="floor")
    first_local = (cur - lb + 1).clamp(min=0)
    local_tokens = float((pos - first_local * bs + 1).sum())
    ncand = float(first_local.sum())
    heads_per_unit = pr.hkv if hsel == 1 else 1  # a shared selection is attended by every KV head
    routed_tokens = routed * bs * heads_per_unit  # (token, KV head) pairs x tokens
    g = pr.hq // pr.hkv
    attended = pr.hkv * local_tokens + routed_tokens  # (token, KV head, key) triples
    causal = pr.hkv * float((pos + 1).sum())
    useful_flops = 4 * pr.d * g * attended + 2 * pr.d * pr.hq * ncand
    ntiles = pr.batch * -(-pr.n // plan.qt)
    rows = plan.qt * (1 << max(0, g - 1).bit_length())
    executed = 4 * pr.d * rows * bs * (pr.hkv * ntiles * lb + union * heads_per_unit) + 2 * pr.d * pr.hq * ncand
    return dict(kv_fraction=attended / causal, useful_flops=useful_flops, executed_flops=executed,
                routed_per_token=routed / (pr.batch * pr.n * hsel), tile_reuse=routed / max(union, 1), qt=plan.qt,
                waves=-(-plan.num_tiles // plan.wave), scratch_mb=pf_plan.PrefillScratch.bytes_per_tile(
                    plan.qt, pr.hq, pr.hkv, plan.max_cand, params, plan.recompute) * plan.wave / 2**20)


def layer_host_ms(step, layers: int, cuda: bool):
    """The host's time to issue one layer of ``step`` (``common.host_ms`` of the step over its layers, rounded),
    None off CUDA."""
    host = host_ms(step, 5, cuda)
    return None if host is None else round(host / layers, 4)


def peak_mb(fn, cuda) -> float:
    """Most memory allocated during one call above what was allocated before it (MiB)."""
    if not cuda:
        return float("nan")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def timed(fn, a, cuda) -> float:
    """Median ms of ``fn`` after one warm-up call (also the compile), iterations fitted to ~1.5 s."""
    t = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    first = (time.perf_counter() - t) * 1e3
    if not cuda:
        return first
    one = time_calls([fn], 1, 0, cuda)
    iters = max(3, min(a.iters, int(1500 / max(one, 1e-3))))
    return time_calls([fn], iters, 1, cuda)


def published_fn(pr: Prompt, params: DashParams):
    """The authors' prefill, all three stages, on contiguous ``[1, H, N, D]`` tensors."""
    prefill = import_published("prefill")
    qh = pr.q.permute(1, 0, 2)[None].contiguous()
    kh = pr.k.permute(1, 0, 2)[None].contiguous()
    vh = pr.v.permute(1, 0, 2)[None].contiguous()
    bs = params.block_size

    def run():
        kc = prefill.summarize_chunk(kh, pr.head_cls, bs, None)
        bm, prior = prefill.score_blocks((qh * params.scaling_factor).to(qh.dtype), kc, bs, None,
                                         estimate_diag=params.estimate_diagonal, sigma=params.sigma)
        return prefill.full_attn(qh, kh, vh, bm, bs, None, prior)
    return run


def published_bytes(n, hq, hkv, bs) -> float:
    """The published stage 2's fp32 scores ``[1, Hq, N, nblk]`` and prior ``[1, Hkv, N, nblk]``."""
    nblk = -(-n // bs)
    return 4.0 * n * nblk * (hq + hkv)


def io_and_dense(n, batch, hq, hkv, d, esize, bw) -> tuple:
    """``(bytes of q, out and one K/V read, the dense causal floor in ms)`` of ``batch`` prompts of ``n`` tokens."""
    io_bytes = batch * (2 * n * hq * d * esize + 2 * n * hkv * d * esize)
    return io_bytes, floor_ms(io_bytes, bw, batch * 4.0 * d * hq * n * (n + 1) / 2, PEAK_FLOPS)


# ---------------------------------------------------------------------------- one prompt length (B 1)

def run_context(a, n, hkv, topks, chunks, sf, device, bw, records, dtype=torch.bfloat16):
    hq, d, bs, ps = a.hq, a.head_dim, a.block_size, a.page_size
    cuda = device.type == "cuda"
    esize = torch.empty((), dtype=dtype).element_size()
    log(f"prompt {n} tokens, Hq={hq} Hkv={hkv} D={d} bs={bs}: building")
    pr = Prompt(n, hq, hkv, d, bs, ps, dtype, device, seed=11, q_corr=a.query_correlation, cuda=cuda,
                layout=a.layout)
    if sf is None:
        sf = prompt_sf(pr, bs, a.target_fraction)
        log(f"  scaling_factor {sf:.3g} selects about {a.target_fraction:.0%} of the candidates at the prompt's end")
    common = dict(phase="prefill", batch=1, context=n, hq=hq, hkv=hkv, head_dim=d, bs=bs, scaling_factor=round(sf, 4),
                  device=device_name(device), **run_fields(a), page_size=ps, graph=False,
                  query_correlation=a.query_correlation)
    out = torch.empty_like(pr.q)
    io_bytes, dense_floor = io_and_dense(n, 1, hq, hkv, d, esize, bw)
    add = adder(records, common, dense_floor)

    for topk in topks:
        params = DashParams(block_size=bs, topk=topk, scaling_factor=sf)
        st = selection_stats(pr, params)
        floor = floor_ms(io_bytes + 2 * n * hkv * d * esize, bw, st["useful_flops"], PEAK_FLOPS)
        extra = stats_fields(st)
        log(f"  topk={topk}: {st['routed_per_token']:.1f} routed blocks per (token, unit), KV read "
            f"{st['kv_fraction']:.2%} of causal, tile reuse {st['tile_reuse']:.1f} of {st['qt']}, "
            f"{st['waves']} waves")
        for tag, config in a.tunings:
            tag = tag + LAYOUT_TAG.get(a.layout, "")
            ex = extra
            if tag.strip():  # tile sizes may change with the settings: their own sharing statistics
                st_t = selection_stats(pr, params, config)
                ex = dict(extra, tile_reuse=round(st_t["tile_reuse"], 2), tile_tokens=st_t["qt"],
                          executed_tflop=round(st_t["executed_flops"] / 1e12, 3), waves=st_t["waves"])
            for chunk in chunks:
                variant = ("one-shot" if chunk is None else f"chunks-{chunk}") + tag
                for write in (True, False):
                    fn = dash_fn(pr, params, write, chunk, out, config=config)
                    ms = timed(fn, a, cuda)
                    mem = peak_mb(fn, cuda)
                    add("dash-triton", variant, ms, topk=topk, write=write, chunk=chunk, frac=st["kv_fraction"],
                        floor=floor, mem=mem, extra=ex)
                    if n <= a.workspace_max_context:  # a later layer of the step: plan and scratch reused
                        fn = dash_fn(pr, params, write, chunk, out, workspace=True, config=config)
                        ms = timed(fn, a, cuda)
                        add("dash-triton", variant + WORKSPACE_TAG, ms, topk=topk, write=write, chunk=chunk,
                            frac=st["kv_fraction"], floor=floor, mem=mem, extra=ex,
                            note="calls share a PrefillWorkspace: plan and scratch made by the first; peak mem "
                                 "is the scratch the workspace holds (a call allocates none)")
            if cuda:  # where the time goes: the routing waves alone (attention = the rest)
                ms = timed(route_only_fn(pr, params, config), a, cuda)
                add("dash-triton", "route-only" + tag, ms, topk=topk, frac=st["kv_fraction"],
                    floor=floor_ms(2 * n * hq * d * esize, bw), extra=ex,
                    note="plan, scratch and every routing wave of the one-shot op; no attention, no write")
        if cuda:
            torch.cuda.empty_cache()

    peers = peers_of(a.peers)
    for chunk in chunks:
        for peer in [p for p in DENSE if p in peers]:
            try:
                fn, variant, note = prompt_peer(peer, pr.q, pr.k, pr.v, 1, chunk, cuda)
                ms = timed(fn, a, cuda)
                add("dense-" + peer, variant, ms, chunk=chunk, mem=peak_mb(fn, cuda), note=note)
            except Exception as e:  # a peer must not stop the run
                log(f"  dense-{peer} {'one-shot' if chunk is None else f'chunks-{chunk}'} skipped: "
                    f"{type(e).__name__}: {str(e)[:200]}")
            if cuda:
                torch.cuda.empty_cache()
    del pr, out
    if cuda:
        torch.cuda.empty_cache()
    return sf


def stats_fields(st: dict) -> dict:
    """The routing statistics a DASH record carries."""
    return dict(tile_reuse=round(st["tile_reuse"], 2), routed_per_token=round(st["routed_per_token"], 2),
                executed_tflop=round(st["executed_flops"] / 1e12, 3), useful_tflop=round(st["useful_flops"] / 1e12, 3),
                tile_tokens=st["qt"], waves=st["waves"], scratch_alloc_mb=round(st["scratch_mb"], 1))


def adder(records: list, common: dict, dense_floor):
    """``add(method, variant, ms, ...)``: appends one record of this case and logs it."""
    def add(method, variant, ms, *, topk=None, write=False, chunk=None, frac=1.0, floor=dense_floor, mem=None,
            extra=None, note=None, graph=False):
        rec = dict(common, method=method, variant=variant, topk=topk, includes_write=write, chunk=chunk, graph=graph,
                   ms=round(ms, 4), kv_fraction=None if frac is None else round(frac, 5),
                   floor_ms=None if floor is None else round(floor, 4),
                   floor_fraction=None if floor is None else round(floor / ms, 4),
                   peak_mb=None if mem is None or math.isnan(mem) else round(mem, 1))
        if extra:
            rec.update(extra)
        if note:
            rec["note"] = note
        records.append(rec)
        log(f"  {method:16s} {variant:14s} topk={str(topk):4s} write={int(write)}  {ms:10.3f} ms"
            + ("" if floor is None else f"  ({floor / ms:.0%} of floor)") + f"  peak {rec['peak_mb']} MiB"
            + ("" if rec.get("host_ms") is None else f"  host {rec['host_ms']:.3f} ms"))
    return add


# ---------------------------------------------------------------------------- an engine step: the serving rows

class Layers:
    """``count`` layers of one step over the same prompts: each its own inputs (copies) and cache, as an engine's
    layers are, so that no layer reads what the one before left in L2; layer 0 is the prompt's own."""

    def __init__(self, pr: Prompt, count: int, layout: str, bs: int):
        self.items = [(pr.q, pr.k, pr.v, pr.cache)]
        for _ in range(count - 1):
            cache = new_cache(pr.cache.k_pages.shape[0], pr.cache.page_size, pr.hkv, pr.d, bs, pr.q.dtype, pr.q.device,
                              layout)
            self.items.append((pr.q.clone(), pr.k.clone(), pr.v.clone(), cache))


def step_fn(calls: list):
    """One call that runs every layer's call in turn."""
    def run():
        for c in calls:
            c()
    return run


def run_serving(a, batch, n, hkv, topk, device, bw, records, dense=True, dtype=torch.bfloat16) -> None:
    """``batch`` prompts of ``n`` tokens in one step of ``a.layers`` layers sharing a ``PrefillWorkspace``, K/V +
    summary write included; with ``dense``, the dense peers over the same layers. Records the time per layer."""
    hq, d, bs, ps, nl = a.hq, a.head_dim, a.block_size, a.page_size, a.layers
    cuda = device.type == "cuda"
    esize = torch.empty((), dtype=dtype).element_size()
    log(f"serving step: {batch} x {n} tokens, {nl} layers, Hq={hq} Hkv={hkv} D={d} bs={bs}: building")
    pr = Prompt(n, hq, hkv, d, bs, ps, dtype, device, seed=11, q_corr=a.query_correlation, cuda=cuda,
                layout=a.layout, batch=batch)
    sf = a.sf if a.sf is not None else prompt_sf(pr, bs, a.target_fraction)
    params = DashParams(block_size=bs, topk=topk, scaling_factor=sf)
    st = selection_stats(pr, params)
    layers = Layers(pr, nl, a.layout, bs)
    common = dict(phase="prefill", batch=batch, context=n, hq=hq, hkv=hkv, head_dim=d, bs=bs,
                  scaling_factor=round(sf, 4), device=device_name(device), **run_fields(a),
                  page_size=ps, graph=False, query_correlation=a.query_correlation, layers=nl, layout=a.layout)
    io_bytes, dense_floor = io_and_dense(n, batch, hq, hkv, d, esize, bw)
    add = adder(records, common, dense_floor)
    out = torch.empty_like(pr.q)
    op = prefill_op(cuda)

    floor = floor_ms(io_bytes + batch * 2 * n * hkv * d * esize, bw, st["useful_flops"], PEAK_FLOPS)
    for tag, config in a.tunings:  # the defaults, then each --tune setting
        def dash_step(config=config):
            ws = PrefillWorkspace(config)  # one per step, as the adapters make it
            for q, k, v, cache in layers.items:
                op(q, k, v, cache, pr.block_table, pr.cu, pr.seq, pr.slot_mapping, pr.head_cls, params, out=out,
                   workspace=ws)

        ms = timed(dash_step, a, cuda) / nl
        add("dash-triton", "serving" + tag, ms, topk=topk, write=True, frac=st["kv_fraction"], floor=floor,
            mem=peak_mb(dash_step, cuda), extra=dict(stats_fields(st), host_ms=layer_host_ms(dash_step, nl, cuda)),
            note=f"per layer of a step of {nl} layers sharing one PrefillWorkspace (the first makes the plan and "
                 "scratch)")
        if a.graph and cuda:
            add("dash-triton", "serving-graph" + tag, graph_ms([dash_step], a.iters, 2, min_calls=1) / nl, topk=topk,
                write=True, frac=st["kv_fraction"], floor=floor, extra=stats_fields(st), graph=True,
                note=f"the same step of {nl} layers replayed from one CUDA graph (its plan made inside): no host time")
    if cuda:
        torch.cuda.empty_cache()
    for peer in [p for p in DENSE if p in peers_of(a.peers) and dense]:
        try:
            built = [prompt_peer(peer, q, k, v, batch, None, cuda) for q, k, v, _ in layers.items]
            fn = step_fn([b[0] for b in built])
            add("dense-" + peer, "serving", timed(fn, a, cuda) / nl, mem=peak_mb(fn, cuda),
                extra=dict(host_ms=layer_host_ms(fn, nl, cuda)),
                note="; ".join(x for x in (f"per layer of {nl} layers", built[0][2]) if x))
            if a.graph and cuda and peer in SDPA_PEERS:
                add("dense-" + peer, "serving-graph", graph_ms([fn], a.iters, 2, min_calls=1) / nl, graph=True,
                    note=f"per layer of {nl} layers replayed from one CUDA graph")
            del built, fn
        except Exception as e:  # a peer must not stop the run
            log(f"  dense-{peer} serving skipped: {type(e).__name__}: {str(e)[:200]}")
        if cuda:
            torch.cuda.empty_cache()


class MixedStep:
    """One engine step that mixes ``nd`` decode tokens (requests with ``dctx`` tokens of context, the last one new)
    and one prompt chunk of ``nc`` tokens (no history), in that order, over ``count`` layers (each its own cache,
    histories written, and its own copy of the step's inputs)."""

    def __init__(self, nd, dctx, nc, hq, hkv, d, bs, ps, dtype, device, q_corr, cuda, count, layout):
        self.nd, self.dctx, self.nc, self.page_size = nd, dctx, nc, ps
        g = torch.Generator(device=device).manual_seed(13)
        dpages, cpages = -(-dctx // ps), -(-nc // ps)
        num_pages = nd * dpages + cpages + 2
        perm = torch.randperm(num_pages, device=device, generator=g).to(torch.int32)
        bt = torch.zeros(nd + 1, max(dpages, cpages), dtype=torch.int32, device=device)
        bt[:nd, :dpages] = perm[: nd * dpages].view(nd, dpages)
        bt[nd, :cpages] = perm[nd * dpages: nd * dpages + cpages]
        self.block_table = bt
        hk, hv = synthetic_kv(nd * dctx, hkv, d, bs, g)
        hk, hv = hk.to(dtype), hv.to(dtype)
        qc, kc, vc, self.head_cls = synthetic_prompt(nc, hq, hkv, d, bs, dtype, g, q_corr)
        qd = torch.randn(nd, hq, d, device=device, generator=g).to(dtype)

        def slots(req, pos):
            return bt[req, pos // ps].to(torch.int64) * ps + pos % ps

        dpos = torch.arange(dctx, device=device)
        hist_slots = torch.cat([slots(i, dpos) for i in range(nd)])
        last = torch.tensor([i * dctx + dctx - 1 for i in range(nd)], device=device)
        self.slot_mapping = torch.cat([hist_slots[last], slots(nd, torch.arange(nc, device=device))])
        self.cu = torch.tensor(list(range(nd + 1)) + [nd + nc], dtype=torch.int32, device=device)
        self.seq = torch.tensor([dctx] * nd + [nc], dtype=torch.int32, device=device)
        q = torch.cat([qd, qc])
        k, v = torch.cat([hk[last], kc]), torch.cat([hv[last], vc])
        self.q, self.k, self.v, self.caches = [], [], [], []
        params = DashParams(block_size=bs)
        for i in range(count):
            cache = new_cache(num_pages, ps, hkv, d, bs, dtype, device, layout)
            write_kv(cuda, hk, hv, cache, hist_slots, params, self.head_cls)  # the histories, the new tokens too
            self.caches.append(cache)
            self.q.append(q if i == 0 else q.clone())
            self.k.append(k if i == 0 else k.clone())
            self.v.append(v if i == 0 else v.clone())
        self._contiguous = {}

    def contiguous_history(self, layer: int) -> tuple:
        """``[nd, Hkv, dctx, D]`` K and V of the decode requests in ``layer``'s cache (for the SDPA peers)."""
        if layer not in self._contiguous:
            cache, ps = self.caches[layer], self.page_size
            pos = torch.arange(self.dctx, device=self.block_table.device)
            pages, rows = self.block_table[: self.nd, pos // ps].to(torch.int64), pos % ps
            self._contiguous[layer] = (cache.k_pages[pages, rows].permute(0, 2, 1, 3).contiguous(),
                                       cache.v_pages[pages, rows].permute(0, 2, 1, 3).contiguous())
        return self._contiguous[layer]


def run_mixed(a, mixed, hkv, topk, device, bw, records, dense=True, dtype=torch.bfloat16) -> None:
    """The mixed step ``mixed`` (decode tokens, their context, the chunk's tokens) in one ``paged_dash_prefill``
    call per layer, the layers sharing a workspace; with ``dense``, the dense peers on the same step. Records the
    time per layer."""
    nd, dctx, nc = mixed
    hq, d, bs, ps, nl = a.hq, a.head_dim, a.block_size, a.page_size, a.layers
    cuda = device.type == "cuda"
    log(f"mixed step: {nd} decode tokens at {dctx} + a {nc}-token prompt chunk, {nl} layers: building")
    m = MixedStep(nd, dctx, nc, hq, hkv, d, bs, ps, dtype, device, a.query_correlation, cuda, nl, a.layout)
    sf = a.sf
    if sf is None:  # calibrated on the decode requests, at their context
        tail = type("Tail", (), {"cache": m.caches[0], "block_table": m.block_table[:nd].contiguous()})
        sf = calibrate_sf(tail, m.q[0][:nd], dctx, DashParams(block_size=bs), a.target_fraction)
    params = DashParams(block_size=bs, topk=topk, scaling_factor=sf)
    common = dict(phase="prefill", batch=nd + 1, context=dctx, hq=hq, hkv=hkv, head_dim=d, bs=bs,
                  scaling_factor=round(sf, 4), device=device_name(device), **run_fields(a),
                  page_size=ps, graph=False, query_correlation=a.query_correlation, layers=nl, layout=a.layout,
                  decode_tokens=nd, prompt_tokens=nc)
    add = adder(records, common, None)
    out = torch.empty_like(m.q[0])
    op = prefill_op(cuda)

    # the other form: the decode rows through the decode op, the chunk through the prefill op (vLLM's, where it
    # does not join the decode rows to the prefill call)
    decode = ops.paged_dash_decode if cuda else kernel_decode
    d_table, d_lens, d_slots = m.block_table[:nd].contiguous(), m.seq[:nd].contiguous(), m.slot_mapping[:nd]
    c_table, c_cu, c_lens, c_slots = (m.block_table[nd:].contiguous(), (m.cu[nd:] - nd).contiguous(),
                                      m.seq[nd:].contiguous(), m.slot_mapping[nd:])
    buffers = DecodeBuffers.for_step(m.q[0][:nd], m.caches[0], d_table, params)

    for tag, config in a.tunings:  # the defaults, then each --tune setting (of the prefill op)
        def dash_step(config=config):
            ws = PrefillWorkspace(config)
            for i in range(nl):
                op(m.q[i], m.k[i], m.v[i], m.caches[i], m.block_table, m.cu, m.seq, m.slot_mapping, m.head_cls,
                   params, out=out, workspace=ws)

        def split_step(config=config):
            ws = PrefillWorkspace(config)
            for i in range(nl):
                q, k, v = m.q[i], m.k[i], m.v[i]
                decode(q[:nd], k[:nd], v[:nd], m.caches[i], d_table, d_lens, d_slots, m.head_cls, params,
                       out=out[:nd], buffers=buffers)
                op(q[nd:], k[nd:], v[nd:], m.caches[i], c_table, c_cu, c_lens, c_slots, m.head_cls, params,
                   out=out[nd:], workspace=ws)

        for variant, step, note in (("mixed", dash_step, "one paged_dash_prefill call per layer"),
                                    ("mixed-split", split_step, "a paged_dash_decode call for the decode tokens and "
                                                                "a paged_dash_prefill call for the chunk, per layer")):
            add("dash-triton", variant + tag, timed(step, a, cuda) / nl, topk=topk, write=True, frac=None,
                mem=peak_mb(step, cuda), extra=dict(host_ms=layer_host_ms(step, nl, cuda)),
                note=f"{note}, {nl} layers sharing a workspace")
            if a.graph and cuda:
                add("dash-triton", variant + "-graph" + tag, graph_ms([step], a.iters, 2, min_calls=1) / nl,
                    topk=topk, write=True, frac=None, graph=True,
                    note=f"the same step of {nl} layers replayed from one CUDA graph: no host time")
    for peer in [p for p in DENSE if p in peers_of(a.peers) and dense]:
        try:
            built = [mixed_peer(peer, m, i, cuda) for i in range(nl)]
            fn = step_fn([b[0] for b in built])
            add("dense-" + peer, "mixed", timed(fn, a, cuda) / nl, frac=None, mem=peak_mb(fn, cuda),
                extra=dict(host_ms=layer_host_ms(fn, nl, cuda)), note=built[0][1])
            if a.graph and cuda and peer in SDPA_PEERS:
                add("dense-" + peer, "mixed-graph", graph_ms([fn], a.iters, 2, min_calls=1) / nl, frac=None,
                    graph=True, note=f"per layer of {nl} layers replayed from one CUDA graph")
            del built, fn
        except Exception as e:  # a peer must not stop the run
            log(f"  dense-{peer} mixed skipped: {type(e).__name__}: {str(e)[:200]}")
        if cuda:
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- the published kernels

def run_published(a, n, hkv, sf, device, bw, records, dtype=torch.bfloat16):
    """The published prefill, uncapped at the same scaling_factor (run after the other cases, shortest
    prompts first: its kernels autotune once, at the first shape)."""
    hq, d, bs, ps = a.hq, a.head_dim, a.block_size, a.page_size
    cuda = device.type == "cuda"
    esize = torch.empty((), dtype=dtype).element_size()
    dev_name = device_name(device)
    common = dict(phase="prefill", batch=1, context=n, hq=hq, hkv=hkv, head_dim=d, bs=bs, scaling_factor=round(sf, 4),
                  device=dev_name, **run_fields(a), page_size=ps, graph=False,
                  query_correlation=a.query_correlation)
    params = DashParams(block_size=bs, scaling_factor=sf)
    need = published_bytes(n, hq, hkv, bs)
    io_bytes = 2 * n * hq * d * esize + 2 * n * hkv * d * esize

    def skipped(why):
        log(f"  published-dash at {n} tokens not run: {why}")
        records.append(dict(common, method="published-dash", variant="one-shot", topk=None, includes_write=True,
                            chunk=None, ms=None, note=why))

    if n > a.published_max_context:
        return skipped(f"past --published-max-context {a.published_max_context}; its stage 2 would hold "
                       f"{need / 2**30:.1f} GiB of fp32 scores and prior")
    free = torch.cuda.mem_get_info(device)[0] if cuda else float("inf")
    if need > 0.9 * free:
        return skipped(f"out of memory by construction: [1, Hq, N, nblk] fp32 scores + prior = "
                       f"{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")
    log(f"prompt {n} tokens: published DashAttention prefill")
    pr = Prompt(n, hq, hkv, d, bs, ps, dtype, device, seed=11, q_corr=a.query_correlation, cuda=cuda)
    try:
        fn = published_fn(pr, params)
        t0 = time.time()
        fn()  # compile + autotune at the timed shapes, outside the timed region
        if cuda:
            torch.cuda.synchronize()
        log(f"  published-dash compiled (and autotuned) in {time.time() - t0:.0f} s")
        ms = time_calls([fn], 2, 0, cuda) if cuda else (time.time() - t0) * 1e3
        st = selection_stats(pr, params)
        floor = max(io_bytes / bw, st["useful_flops"] / PEAK_FLOPS) * 1e3
        rec = dict(common, method="published-dash", variant="one-shot", topk=None, includes_write=True, chunk=None,
                   ms=round(ms, 4), kv_fraction=round(st["kv_fraction"], 5), floor_ms=round(floor, 4),
                   floor_fraction=round(floor / ms, 4), peak_mb=None,
                   note="stages 1-3 on contiguous [1, H, N, D] tensors, summaries included; no paged K/V write")
        mem = peak_mb(fn, cuda)
        rec["peak_mb"] = None if math.isnan(mem) else round(mem, 1)
        records.append(rec)
        log(f"  published-dash   one-shot       {ms:10.2f} ms  peak {rec['peak_mb']} MiB")
    except torch.cuda.OutOfMemoryError as e:
        skipped(f"out of memory ({need / 2**30:.1f} GiB of stage-2 scores + prior): {str(e)[:160]}")
    except Exception as e:  # an optional peer must not stop the run
        skipped(f"failed: {type(e).__name__}: {str(e)[:300]}")
    del pr
    if cuda:
        torch.cuda.empty_cache()


def _published_child(a, cases, device: str, bw: float, results) -> None:
    """Child process: every published case in order, each record sent as soon as it is measured."""
    for n, hkv, sf in cases:
        recs: list = []
        try:
            run_published(a, n, hkv, sf, torch.device(device), bw, recs)
        finally:  # sent even when the cleanup after a crash raises (a dead CUDA context), with the crash's reason
            for r in recs:
                results.put(r)
    results.put(None)


def run_published_isolated(a, cases, device, bw, records) -> None:
    """``run_published`` for ``cases [(n, hkv, sf)]`` in a spawned child process; the cases it did not
    report (its CUDA context died, or it crashed) are recorded as not measured, with the exit code."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=_published_child, args=(a, cases, str(device), bw, results))
    child.start()
    seen, finished = set(), False
    while not finished:
        try:
            r = results.get(timeout=5)
        except queue.Empty:
            if not child.is_alive():
                break
            continue
        if r is None:
            finished = True
            break
        records.append(r)
        seen.add((r["context"], r["hkv"]))
        flush_records(a, records)
    child.join(30)
    for n, hkv, sf in cases:
        if (n, hkv) in seen:
            continue
        why = (f"not measured: the published kernels' process ended (exit code {child.exitcode}) before this "
               "length, after a crash at this or a shorter length (see the log)")
        log(f"  published-dash at {n} tokens: {why}")
        records.append(dict(phase="prefill", batch=1, context=n, hq=a.hq, hkv=hkv, head_dim=a.head_dim,
                            bs=a.block_size, scaling_factor=round(sf, 4), device=records[0]["device"] if records
                            else str(device), **run_fields(a), page_size=a.page_size, graph=False,
                            query_correlation=a.query_correlation, method="published-dash", variant="one-shot",
                            topk=None, includes_write=True, chunk=None, ms=None, note=why))
    flush_records(a, records)


# ---------------------------------------------------------------------------- records

def record_key(r: dict) -> tuple:
    """What a prefill record measures: a later record of the same key replaces it."""
    return (r["device"], r["batch"], r["context"], r["hq"], r["hkv"], r["head_dim"], r["bs"], str(r["topk"]),
            r["method"], r["variant"], r["includes_write"])


def record_order(r: dict) -> tuple:
    return (r["device"], r["hkv"], r["context"], r["batch"], str(r.get("chunk")), str(r["topk"]), r["method"],
            r["variant"], not r["includes_write"])


def flush_records(a, records: list) -> None:
    """Merge this run's records into the JSON (after every case, so that a run cut short by a time limit still
    leaves what it measured)."""
    if a.no_write or not records:
        return
    merge_records(Path(a.json), records, record_key, record_order)


# ---------------------------------------------------------------------------- a profiler's call

def profile(a, device) -> int:
    """One prompt (the first ``--context``, ``--hkv`` and ``--topk``; the last ``--tune`` setting), or with
    ``--preset serving`` the prompts of the first ``--serving-cases`` entry in one call, no write: a warm-up call,
    then for ``ncu`` one call between ``cudaProfilerStart`` and ``cudaProfilerStop`` (``ncu --profile-from-start
    off`` sees that call's kernels only; ``ci/gpu.sh prefill profile`` picks a wave of them), for ``torch``
    ``--iters`` calls under ``torch.profiler``, printed as a table of kernels."""
    batch, n = (parse_serving_cases(a.serving_cases)[0] if a.preset == "serving"
                else (1, int(a.context.split(",")[0])))
    hkv = int(a.hkv.split(",")[0])
    t = a.topk.split(",")[0].strip().lower()
    topk = None if t == "none" else int(t)
    pr = Prompt(n, a.hq, hkv, a.head_dim, a.block_size, a.page_size, torch.bfloat16, device, 11,
                a.query_correlation, True, layout=a.layout, batch=batch)
    sf = a.sf if a.sf is not None else prompt_sf(pr, a.block_size, a.target_fraction)
    tag, config = a.tunings[-1]
    fn = dash_fn(pr, DashParams(block_size=a.block_size, topk=topk, scaling_factor=sf), False, None,
                 torch.empty_like(pr.q), config=config)
    log(f"profiling {batch} x {n}-token prompts, Hkv {hkv}, topk {topk}, sf {sf:.4g}{tag}")
    fn()
    torch.cuda.synchronize()
    if a.profile == "ncu":
        torch.cuda.cudart().cudaProfilerStart()
        fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        return 0
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.iters):
            fn()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25), flush=True)
    return 0


# ---------------------------------------------------------------------------- main

def parse_serving_cases(spec: str) -> list:
    """``--serving-cases``: ``BxN,...`` (requests x tokens each), or ``all`` for the serving table's."""
    if spec == "all":
        return list(SERVING_CASES)
    out = []
    for item in filter(None, (x.strip() for x in spec.split(","))):
        b, _, n = item.lower().partition("x")
        if not (b.isdigit() and n.isdigit()):
            raise ValueError(f"--serving-cases: expected requests x tokens such as 8x2048, got {item!r}")
        out.append((int(b), int(n)))
    return out


def parse_mixed_cases(spec: str) -> list:
    """``"8x32768+2048,..."`` -> ``[(decode tokens, their context, chunk tokens), ...]``."""
    out = []
    for item in filter(None, (x.strip() for x in spec.split(","))):
        m = re.fullmatch(r"(\d+)x(\d+)\+(\d+)", item.lower())
        if m is None or int(m[1]) < 1 or int(m[2]) < 1 or int(m[3]) < 1:
            raise ValueError(f"--mixed-cases: expected decode tokens x their context + chunk tokens, each >= 1, "
                             f"such as 8x32768+2048, got {item!r}")
        out.append((int(m[1]), int(m[2]), int(m[3])))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=["serving", "required", "matrix"],
                    help="serving: the engine-step rows (--serving-cases) and the mixed steps (--mixed-cases), topk "
                         "64; required: B 1, 2k..128k, topk 64 and none, 128k also in 8k chunks; matrix: 4k..128k, "
                         "Hkv 8 and 2")
    ap.add_argument("--context", default="8192,32768,131072")
    ap.add_argument("--chunk-contexts", default="131072", help="prompt lengths also run in chunks")
    ap.add_argument("--chunk", type=int, default=8192)
    add_shape_args(ap, "scaling_factor (default: calibrated per prompt length)")
    ap.add_argument("--query-correlation", type=float, default=0.95,
                    help="AR(1) coefficient of queries over positions (0: independent queries, the worst case)")
    ap.add_argument("--layout", choices=["sglang", "vllm"], default="sglang",
                    help="DASH's cache layout: token-major (SGLang) or head-major (vLLM); dense peers read K/V as "
                         "they are")
    ap.add_argument("--serving-cases", default="all", help="--preset serving: requests x tokens, e.g. 16x1024,8x2048")
    ap.add_argument("--mixed-cases", default=MIXED_CASES,
                    help="--preset serving: mixed steps, decode tokens x their context + prompt chunk tokens")
    ap.add_argument("--no-mixed", action="store_true", help="--preset serving: leave the mixed steps out")
    ap.add_argument("--layers", type=int, default=SERVING_LAYERS, help="layers of a serving or mixed step")
    ap.add_argument("--graph", action="store_true",
                    help="serving: also replay each step (DASH and the SDPA peers) from a CUDA graph: the GPU time")
    ap.add_argument("--published-max-context", type=int, default=131072)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--workspace-max-context", type=int, default=32768,
                    help="also time calls sharing a PrefillWorkspace (later layers of a step) up to this length")
    ap.add_argument("--tune", action="append", default=[],
                    help="extra DASH kernel settings to time, e.g. --tune attn_stages=2,route_tile_budget=2048 "
                         "(repeatable; the prefill kernels' settings, lower case)")
    ap.add_argument("--profile", choices=["ncu", "torch"],
                    help="no records: one prompt's calls (--preset serving: the first --serving-cases step's) for a "
                         "profiler (ci/gpu.sh prefill profile runs ncu)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    add_output_args(ap, "prefill")
    a = ap.parse_args(argv)
    a.command = shown_command("prefill.py", list(argv if argv is not None else sys.argv[1:]))
    a.run = run_id()
    try:
        a.tunings = tune_configs(a.tune, PrefillConfig())
        peers_of(a.peers)
        serving = parse_serving_cases(a.serving_cases)
        mixed = [] if a.no_mixed else parse_mixed_cases(a.mixed_cases)
    except ValueError as e:
        ap.error(str(e))
    if a.preset == "required":
        a.context, a.chunk_contexts, a.hkv, a.topk = "2048,4096,8192,32768,131072", "131072", "8", "64,none"
    elif a.preset == "matrix":
        a.context, a.chunk_contexts, a.hkv, a.topk = "4096,16384,65536,131072", "65536,131072", "8,2", "16,64,256,none"
    elif a.preset == "serving":
        a.hkv, a.topk = "8", "64"
    if a.smoke:
        a.context, a.chunk_contexts, a.chunk, a.hkv = "200", "200", 96, "2"
        a.topk = "4" if a.preset == "serving" else "4,none"
        a.hq, a.head_dim, a.block_size, a.page_size, a.peers = 4, 64, 16, 32, "cudnn,sdpa,published"
        a.published_max_context, a.layers, serving = 0, 2, [(2, 96)]
        mixed = mixed and [(2, 300, 96)]
        if a.json == str(ROOT / "docs/perf/prefill.json"):
            a.json = str(Path(os.environ.get("TMPDIR", "/tmp")) / "dash_prefill_smoke" / "prefill.json")
        if os.environ.get("TRITON_INTERPRET") == "1":
            import tests.kernels._kernel_env  # noqa: F401  (the interpreter shims the kernel tests use)
    device, bw, status = open_device(a, profile)
    if device is None:
        return status
    records: list = []
    topks = sorted(parse_topks(a.topk), key=lambda t: -1 if t is None else t)
    t0 = time.time()
    if a.preset == "serving":
        for hkv in [int(x) for x in a.hkv.split(",")]:
            for topk in topks:
                dense = topk == topks[0]  # the dense peers once a shape
                for batch, n in serving:
                    try:
                        run_serving(a, batch, n, hkv, topk, device, bw, records, dense)
                    except torch.cuda.OutOfMemoryError as e:
                        log(f"  out of memory, {batch} x {n} skipped: {e}")
                    if device.type == "cuda":  # the step's layers are gone: give their memory back
                        torch.cuda.empty_cache()
                    flush_records(a, records)
                    log(f"elapsed {time.time() - t0:.0f} s")
                for step in mixed:
                    try:
                        run_mixed(a, step, hkv, topk, device, bw, records, dense)
                    except torch.cuda.OutOfMemoryError as e:
                        log(f"  out of memory, the mixed step {step} skipped: {e}")
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    flush_records(a, records)
                    log(f"elapsed {time.time() - t0:.0f} s")
        return finish(a, records)
    chunked = {int(x) for x in a.chunk_contexts.split(",") if x}
    sfs = {}
    for hkv in [int(x) for x in a.hkv.split(",")]:
        # longest prompts first: they carry the targets, and the records are written after every length
        for n in sorted((int(x) for x in a.context.split(",")), reverse=True):
            chunks = [None] + ([a.chunk] if n in chunked and a.chunk < n else [])
            sf_n = None
            try:
                sf_n = run_context(a, n, hkv, topks, chunks, a.sf, device, bw, records)
            except torch.cuda.OutOfMemoryError as e:
                log(f"  out of memory, prompt length {n} skipped: {e}")
                torch.cuda.empty_cache()
            sfs[(hkv, n)] = sf_n
            flush_records(a, records)
            log(f"elapsed {time.time() - t0:.0f} s")
    if "published" in peers_of(a.peers) and None in topks:
        cases = [(n, hkv, sf_n) for (hkv, n), sf_n in sorted(sfs.items(), key=lambda kv: (kv[0][0], kv[0][1]))
                 if sf_n is not None]
        if device.type == "cuda":
            run_published_isolated(a, cases, device, bw, records)
        else:  # the smoke run: in process
            for n, hkv, sf_n in cases:
                run_published(a, n, hkv, sf_n, device, bw, records)
        log(f"elapsed {time.time() - t0:.0f} s")
    return finish(a, records)


def finish(a, records: list) -> int:
    """Write the records and print this run's tables."""
    flush_records(a, records)
    import report  # the tables of docs/PERFORMANCE.md, here for this run's records

    print("\n" + report.run_table(records) + "\n\n" + report.crossover_lines(records) + "\n", flush=True)
    if not a.no_write:
        log(f"wrote {a.json}; python benchmarks/report.py makes the docs' tables and charts from it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
