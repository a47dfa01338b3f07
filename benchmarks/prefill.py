"""Prefill benchmark: DASH Triton prefill / extend against dense causal prefill on long prompts.

Follows docs/design.md "Performance protocol" with ``benchmarks/decode.py``'s timing helpers: CUDA events
around every call after warm-up and compilation, the median of several calls (prompts of 2k tokens
and more are far larger than L2). Per case: one request (B 1) of ``context`` tokens, prefilled at once
or in chunks on the paged history the earlier chunks wrote (as engines do chunked prefill), with and
without the K/V + summary write. Peers in the same run: PyTorch SDPA (flash backend, causal; K/V heads
repeated to Hq outside the timed call), FlashInfer dense causal prefill (if ``import flashinfer``
works) and the published DashAttention prefill (its three stages, uncapped at the same
``scaling_factor``, if ``$DASH_PUBLISHED_DIR`` holds the authors' repository: it materialises
``[B, Hq, N, nblk]`` fp32 scores, so it is skipped, with the reason, where that cannot fit; it runs in a
child process, shortest prompts first, so that a crash of its kernels, such as an illegal memory access,
costs only the lengths not yet measured, which are recorded with the reason).

Queries follow an AR(1) walk over positions (``--query-correlation``, default 0.95): neighbouring
queries of trained models are alike, which is what lets a tile of query tokens share the K/V loads of
their routed blocks; the records carry the measured sharing (``tile_reuse``: routed (token, block)
pairs per block loaded by a tile) so runs with other data can be compared. Peak GPU memory is
measured per case (``peak_mb``: the most allocated during one call above what was allocated before
it; DASH calls get a preallocated output, so theirs is the routing scratch).

The floor of a case is the larger of its bytes over the measured copy bandwidth and its useful FLOPs
(attention over the attended tokens, plus scoring every candidate summary, for DASH; the causal
triangle for dense) over the H200's dense bf16 peak (989 TFLOPS).

Writes JSON records to ``docs/perf/prefill.json`` (merged by case), the table with its command to
``docs/PERFORMANCE.md`` (between prefill markers; the decode section is left alone) and a bar chart
to ``docs/perf/prefill.svg``.

    python benchmarks/prefill.py --preset required    # B 1, 2k..128k, topk 64 and uncapped, 128k in 8k chunks
    python benchmarks/prefill.py --context 32768,131072 --hkv 2 --topk 256,64
    TRITON_INTERPRET=1 python benchmarks/prefill.py --smoke   # CPU check of the code paths (tiny shapes)
"""

from __future__ import annotations

import argparse
import contextlib
import math
import multiprocessing
import os
import queue
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import (add_output_args, add_shape_args, ar1_walk, crossover, import_published, merge_records,  # noqa: E402
                    replace_section, shown_command, svg_bars)
from decode import calibrate_sf, copy_bandwidth, log, time_calls  # noqa: E402

from dash_core import DashParams, ops  # noqa: E402
from dash_core.kernels import launcher  # noqa: E402
from dash_core.kernels import prefill as pf  # noqa: E402
from dash_core.layout import PagedKVCache, alloc_summaries  # noqa: E402
from dash_core.workspace import PrefillWorkspace  # noqa: E402

PEAK_FLOPS = 989e12  # H200 dense bf16 tensor cores
MARK_BEGIN, MARK_END = "<!-- prefill-benchmark:begin -->", "<!-- prefill-benchmark:end -->"
WORKSPACE_TAG = " workspace"  # variant suffix of the rows whose calls share a PrefillWorkspace
LAYOUT_TAG = {"vllm": " vllm-layout"}  # variant suffix of DASH rows on a cache other than SGLang's


def synthetic_prompt(n, hq, hkv, d, bs, dtype, g: torch.Generator, q_corr) -> tuple:
    """The benchmark's prompt tensors ``(q [n, Hq, D], k, v [n, Hkv, D], head_cls [Hkv, D])`` in ``dtype``,
    drawn from ``g`` on its device: Gaussian keys with a per-block offset, queries an AR(1) walk of
    correlation ``q_corr`` (0: none)."""
    device = g.device
    k = torch.randn(n, hkv, d, device=device, generator=g)
    # per-block offsets make some blocks stand out, as trained keys do, so routing is not flat
    k += 0.5 * torch.randn(-(-n // bs), hkv, d, device=device, generator=g).repeat_interleave(bs, 0)[:n]
    v = torch.randn(n, hkv, d, device=device, generator=g)
    q = torch.randn(n, hq, d, device=device, generator=g)
    q = ar1_walk(q, q_corr) if q_corr else q
    head_cls = torch.randn(hkv, d, device=device, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype), head_cls.to(dtype)


class Prompt:
    """One prompt of ``n`` tokens: ``q [n, Hq, D]``, ``k, v [n, Hkv, D]`` and a paged cache (pages shuffled)
    with its summary store; K/V and summaries written once here. layout ``sglang``: token-major K and V
    buffers ``[slots, Hkv, D]`` viewed as pages; ``vllm``: one head-major ``[pages, Hkv, ps, 2D]`` tensor."""

    def __init__(self, n, hq, hkv, d, bs, ps, dtype, device, seed, q_corr, cuda, layout="sglang"):
        self.n, self.hq, self.hkv, self.d = n, hq, hkv, d
        g = torch.Generator(device=device).manual_seed(seed)
        self.q, self.k, self.v, self.head_cls = synthetic_prompt(n, hq, hkv, d, bs, dtype, g, q_corr)
        npages = -(-n // ps)
        num_pages = npages + 2
        slots = num_pages * ps
        perm = torch.randperm(num_pages, device=device, generator=g)[:npages]
        self.block_table = perm.view(1, npages).to(torch.int32).contiguous()
        summ = alloc_summaries(slots, bs, hkv, d, dtype, device)
        if layout == "vllm":
            kv = torch.zeros(num_pages, hkv, ps, 2 * d, dtype=dtype, device=device)
            self.cache = PagedKVCache.from_vllm(kv, hkv, d, summ)
        else:
            self.cache = PagedKVCache.from_sglang(torch.zeros(slots, hkv, d, dtype=dtype, device=device),
                                                  torch.zeros(slots, hkv, d, dtype=dtype, device=device), ps, summ)
        pos = torch.arange(n, device=device)
        self.slot_mapping = self.block_table[0, pos // ps].to(torch.int64) * ps + pos % ps
        self.cu = torch.tensor([0, n], dtype=torch.int32, device=device)
        self.seq = torch.tensor([n], dtype=torch.int32, device=device)
        self.cuda = cuda
        self.write(DashParams(block_size=bs))

    def write(self, params, sl=slice(None)):
        """K/V + summaries of tokens ``sl`` (the op the engine calls before attention)."""
        if self.cuda:
            ops.cache_dash_prefill(self.k[sl], self.v[sl], self.cache, self.slot_mapping[sl], params,
                                   head_cls=self.head_cls)
        else:  # the interpreter: the Triton write directly (ops would take the PyTorch path on the CPU)
            launcher.cache_dash_prefill_triton(self.k[sl], self.v[sl], self.cache, self.slot_mapping[sl], params,
                                               self.head_cls)


def prompt_sf(pr: Prompt, bs: int, fraction: float) -> float:
    """The ``scaling_factor`` that selects about ``fraction`` of the candidates uncapped, calibrated on the prompt's
    last queries (as decode steps at its end)."""
    rows = min(8, pr.n)
    tail = type("Tail", (), {"cache": pr.cache, "block_table": pr.block_table.expand(rows, -1).contiguous()})
    return calibrate_sf(tail, pr.q[pr.n - rows:], pr.n, DashParams(block_size=bs), fraction)


def _owner(name: str):
    """The kernel module holding constant ``name``: ``dash_core.kernels.prefill``, else its Gluon ``prefill_ws``."""
    return pf if hasattr(pf, name) else pf.prefill_ws


def tunings(ap, texts: list) -> list:
    """The settings ``--tune`` names (``NAME=VALUE,...`` each, constants of ``dash_core.kernels.prefill``
    or ``prefill_ws``), after the defaults (``{}``)."""
    out = [{}]
    for t in texts:
        kv = dict(x.split("=", 1) for x in t.split(","))
        unknown = [k for k in kv if not hasattr(_owner(k), k)]
        if unknown:
            ap.error(f"--tune: {unknown} are not constants of dash_core.kernels.prefill or prefill_ws")
        out.append({k: int(v) for k, v in kv.items()})
    return out


@contextlib.contextmanager
def tuned(settings: dict):
    """The kernels' constants set to ``settings`` (one of ``tunings``) inside the block, restored after it."""
    saved = {k: getattr(_owner(k), k) for k in settings}
    for k, v in settings.items():
        setattr(_owner(k), k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(_owner(k), k, v)


def prefill_op(cuda):
    return ops.paged_dash_prefill if cuda else pf.paged_dash_prefill_triton


def dash_fn(pr: Prompt, params, write: bool, chunk, out, workspace: bool = False):
    """One DASH prefill of the whole prompt (at once, or chunk by chunk on the history). workspace: each
    piece's calls share a ``PrefillWorkspace`` (made by the first call): the time of a layer after the
    first of an engine step, whose plan and scratch the step's first layer made."""
    op = prefill_op(pr.cuda)
    dev = pr.q.device
    pieces = []
    for s in range(0, pr.n, chunk or pr.n):
        e = min(pr.n, s + (chunk or pr.n))
        pieces.append((slice(s, e), torch.tensor([0, e - s], dtype=torch.int32, device=dev),
                       torch.tensor([e], dtype=torch.int32, device=dev), PrefillWorkspace() if workspace else None))

    def run():
        for sl, cu, seq, ws in pieces:
            if write:
                op(pr.q[sl], pr.k[sl], pr.v[sl], pr.cache, pr.block_table, cu, seq, pr.slot_mapping[sl],
                   pr.head_cls, params, out=out[sl], workspace=ws)
            else:
                op(pr.q[sl], None, None, pr.cache, pr.block_table, cu, seq, None, pr.head_cls, params, out=out[sl],
                   workspace=ws)
    return run


def route_only_fn(pr: Prompt, params):
    """The op's routing waves alone (plan, scratch, the summary copy and every route launch, no attention, no
    write)."""
    def run():
        plan, scratch = pf.plan_and_scratch(pr.q, pr.cache, pr.block_table, pr.cu, pr.seq, params)
        pf.gather_summaries(pr.cache, pr.block_table, pr.seq, params, scratch)
        for tile0, tiles in plan.waves():
            pf.route_wave(pr.q, pr.cache, pr.block_table, pr.cu, pr.seq, params, plan, scratch, tile0, tiles)
    return run


def selection_stats(pr: Prompt, params) -> dict:
    """Routing statistics of the whole prompt (outside any timing): routed (token, unit) blocks, the
    union per (tile, unit) a tile loads, and the useful / executed attention work."""
    q, cache, bt = pr.q, pr.cache, pr.block_table
    bs, lb = params.block_size, params.local_blocks
    plan, scratch = pf.plan_and_scratch(q, cache, bt, pr.cu, pr.seq, params)
    pf.gather_summaries(cache, bt, pr.seq, params, scratch)
    hsel = scratch.sel_count.shape[1]
    routed = union = 0
    for tile0, tiles in plan.waves():
        scratch.sel_count.zero_()
        pf.route_wave(q, cache, bt, pr.cu, pr.seq, params, plan, scratch, tile0, tiles)
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
    pos = torch.arange(pr.n, dtype=torch.float64)
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
    ntiles = -(-pr.n // plan.qt)
    rows = plan.qt * (1 << max(0, g - 1).bit_length())
    executed = 4 * pr.d * rows * bs * (pr.hkv * ntiles * lb + union * heads_per_unit) + 2 * pr.d * pr.hq * ncand
    return dict(kv_fraction=attended / causal, useful_flops=useful_flops, executed_flops=executed,
                routed_per_token=routed / (pr.n * hsel), tile_reuse=routed / max(union, 1), qt=plan.qt,
                waves=-(-plan.num_tiles // plan.wave), scratch_mb=pf.PrefillScratch.bytes_per_tile(
                    plan.qt, pr.hq, pr.hkv, plan.max_cand, params, plan.recompute) * plan.wave / 2**20)


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


# ---------------------------------------------------------------------------- peers

def sdpa_fn(pr: Prompt, chunk):
    """PyTorch SDPA causal (flash backend where it applies), K/V heads repeated to Hq beforehand."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    g = pr.hq // pr.hkv
    qh = pr.q.permute(1, 0, 2)[None].contiguous()
    kh = pr.k.permute(1, 0, 2)[None].repeat_interleave(g, 1).contiguous()
    vh = pr.v.permute(1, 0, 2)[None].repeat_interleave(g, 1).contiguous()
    backends = [SDPBackend.FLASH_ATTENTION] if pr.cuda else [SDPBackend.MATH]
    if chunk is None:
        def run():
            with sdpa_kernel(backends):
                return sdpa(qh, kh, vh, is_causal=True)
        return run
    from torch.nn.attention.bias import causal_lower_right

    pieces = [(s, min(pr.n, s + chunk)) for s in range(0, pr.n, chunk)]

    def run_chunks():
        with sdpa_kernel(backends):
            for s, e in pieces:
                sdpa(qh[:, :, s:e], kh[:, :, :e], vh[:, :, :e], attn_mask=causal_lower_right(e - s, e))
    return run_chunks


def flashinfer_fn(pr: Prompt, chunk):
    import flashinfer  # optional peer

    if chunk is None:
        return lambda: flashinfer.single_prefill_with_kv_cache(pr.q, pr.k, pr.v, causal=True)
    pieces = [(s, min(pr.n, s + chunk)) for s in range(0, pr.n, chunk)]

    def run():  # causal aligned bottom-right: chunk tokens see the whole history
        for s, e in pieces:
            flashinfer.single_prefill_with_kv_cache(pr.q[s:e], pr.k[:e], pr.v[:e], causal=True)
    return run


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


# ---------------------------------------------------------------------------- one prompt length

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
    dev_name = torch.cuda.get_device_name(device) if cuda else "cpu (triton interpreter)"
    common = dict(phase="prefill", batch=1, context=n, hq=hq, hkv=hkv, head_dim=d, bs=bs, scaling_factor=round(sf, 4),
                  device=dev_name, command=a.command, page_size=ps, graph=False,
                  query_correlation=a.query_correlation)
    out = torch.empty_like(pr.q)
    io_bytes = 2 * n * hq * d * esize + 2 * n * hkv * d * esize  # q, out; K and V read once
    dense_flops = 4.0 * d * hq * n * (n + 1) / 2
    dense_floor = max(io_bytes / bw, dense_flops / PEAK_FLOPS) * 1e3

    def add(method, variant, ms, *, topk=None, write=False, chunk=None, frac=1.0, floor=dense_floor, mem=None,
            extra=None, note=None):
        rec = dict(common, method=method, variant=variant, topk=topk, includes_write=write, chunk=chunk,
                   ms=round(ms, 4), kv_fraction=round(frac, 5), floor_ms=round(floor, 4),
                   floor_fraction=round(floor / ms, 4), peak_mb=None if mem is None or math.isnan(mem) else round(mem, 1))
        if extra:
            rec.update(extra)
        if note:
            rec["note"] = note
        records.append(rec)
        log(f"  {method:16s} {variant:14s} topk={str(topk):4s} write={int(write)}  {ms:10.2f} ms  "
            f"({floor / ms:.0%} of floor)  peak {rec['peak_mb']} MiB")

    for topk in topks:
        params = DashParams(block_size=bs, topk=topk, scaling_factor=sf)
        st = selection_stats(pr, params)
        floor = max((io_bytes + (2 * n * hkv * d * esize)) / bw, st["useful_flops"] / PEAK_FLOPS) * 1e3
        extra = dict(tile_reuse=round(st["tile_reuse"], 2), routed_per_token=round(st["routed_per_token"], 2),
                     executed_tflop=round(st["executed_flops"] / 1e12, 3), useful_tflop=round(st["useful_flops"] / 1e12, 3),
                     tile_tokens=st["qt"], waves=st["waves"], scratch_alloc_mb=round(st["scratch_mb"], 1))
        log(f"  topk={topk}: {st['routed_per_token']:.1f} routed blocks per (token, unit), KV read "
            f"{st['kv_fraction']:.2%} of causal, tile reuse {st['tile_reuse']:.1f} of {st['qt']}, "
            f"{st['waves']} waves")
        for tune in a.tunings:
            with tuned(tune):
                tag = "".join(f" {k.lower()}={v}" for k, v in tune.items()) + LAYOUT_TAG.get(a.layout, "")
                ex = extra
                if tune:  # tile sizes may change with the settings: their own sharing statistics
                    st_t = selection_stats(pr, params)
                    ex = dict(extra, tile_reuse=round(st_t["tile_reuse"], 2), tile_tokens=st_t["qt"],
                              executed_tflop=round(st_t["executed_flops"] / 1e12, 3), waves=st_t["waves"])
                for chunk in chunks:
                    variant = ("one-shot" if chunk is None else f"chunks-{chunk}") + tag
                    for write in (True, False):
                        fn = dash_fn(pr, params, write, chunk, out)
                        ms = timed(fn, a, cuda)
                        mem = peak_mb(fn, cuda)
                        add("dash-triton", variant, ms, topk=topk, write=write, chunk=chunk, frac=st["kv_fraction"],
                            floor=floor, mem=mem, extra=ex)
                        if n <= a.workspace_max_context:  # a later layer of the step: plan and scratch reused
                            fn = dash_fn(pr, params, write, chunk, out, workspace=True)
                            ms = timed(fn, a, cuda)
                            add("dash-triton", variant + WORKSPACE_TAG, ms, topk=topk, write=write, chunk=chunk,
                                frac=st["kv_fraction"], floor=floor, mem=mem, extra=ex,
                                note="calls share a PrefillWorkspace: plan and scratch made by the first; peak mem "
                                     "is the scratch the workspace holds (a call allocates none)")
                if cuda:  # where the time goes: the routing waves alone (attention = the rest)
                    ms = timed(route_only_fn(pr, params), a, cuda)
                    add("dash-triton", "route-only" + tag, ms, topk=topk, frac=st["kv_fraction"],
                        floor=2 * n * hq * d * esize / bw * 1e3, extra=ex,
                        note="plan, scratch and every routing wave of the one-shot op; no attention, no write")
        if cuda:
            torch.cuda.empty_cache()

    peers = set(a.peers.split(",")) if a.peers else set()
    for chunk in chunks:
        variant = "one-shot" if chunk is None else f"chunks-{chunk}"
        if "sdpa" in peers:
            try:
                fn = sdpa_fn(pr, chunk)
                ms = timed(fn, a, cuda)
                add("dense-sdpa", variant + (" flash" if cuda else " math"), ms, chunk=chunk, mem=peak_mb(fn, cuda),
                    note="K/V heads repeated to Hq before the timed calls")
            except Exception as e:  # a peer must not stop the run
                log(f"  dense-sdpa {variant} skipped: {type(e).__name__}: {str(e)[:200]}")
            if cuda:
                torch.cuda.empty_cache()
        if "flashinfer" in peers:
            try:
                fn = flashinfer_fn(pr, chunk)
                ms = timed(fn, a, cuda)
                add("dense-flashinfer", variant, ms, chunk=chunk, mem=peak_mb(fn, cuda))
            except Exception as e:
                log(f"  dense-flashinfer {variant} skipped: {type(e).__name__}: {str(e)[:200]}")
    del pr, out
    if cuda:
        torch.cuda.empty_cache()
    return sf


def run_published(a, n, hkv, sf, device, bw, records, dtype=torch.bfloat16):
    """The published prefill, uncapped at the same scaling_factor (run after the other cases, shortest
    prompts first: its kernels autotune once, at the first shape)."""
    hq, d, bs, ps = a.hq, a.head_dim, a.block_size, a.page_size
    cuda = device.type == "cuda"
    esize = torch.empty((), dtype=dtype).element_size()
    dev_name = torch.cuda.get_device_name(device) if cuda else "cpu (triton interpreter)"
    common = dict(phase="prefill", batch=1, context=n, hq=hq, hkv=hkv, head_dim=d, bs=bs, scaling_factor=round(sf, 4),
                  device=dev_name, command=a.command, page_size=ps, graph=False,
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
        flush_docs(a, records, bw)
    child.join(30)
    for n, hkv, sf in cases:
        if (n, hkv) in seen:
            continue
        why = (f"not measured: the published kernels' process ended (exit code {child.exitcode}) before this "
               "length, after a crash at this or a shorter length (see the log)")
        log(f"  published-dash at {n} tokens: {why}")
        records.append(dict(phase="prefill", batch=1, context=n, hq=a.hq, hkv=hkv, head_dim=a.head_dim,
                            bs=a.block_size, scaling_factor=round(sf, 4), device=records[0]["device"] if records
                            else str(device), command=a.command, page_size=a.page_size, graph=False,
                            query_correlation=a.query_correlation, method="published-dash", variant="one-shot",
                            topk=None, includes_write=True, chunk=None, ms=None, note=why))
    flush_docs(a, records, bw)


# ---------------------------------------------------------------------------- outputs

def _key(r):
    return (r["device"], r["batch"], r["context"], r["hq"], r["hkv"], r["head_dim"], r["bs"], str(r["topk"]),
            r["method"], r["variant"], r["includes_write"])


def _order(r):
    return (r["device"], r["hkv"], r["context"], str(r.get("chunk")), str(r["topk"]), r["method"], r["variant"],
            not r["includes_write"])


def table(records: list) -> str:
    head = ("| prompt | variant | Hq/Hkv | D | bs | topk | sf | method | write | time (ms) | KV read | floor (ms) | "
            "of floor | peak mem (MiB) | tile reuse | vs best dense |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    dense = {}
    for r in records:
        if r["method"].startswith("dense") and r.get("ms"):
            k = (r["device"], r["context"], r["hq"], r["hkv"], r["head_dim"], r.get("chunk"))
            dense[k] = min(dense.get(k, float("inf")), r["ms"])
    rows = [head]
    for r in records:
        k = (r["device"], r["context"], r["hq"], r["hkv"], r["head_dim"], r.get("chunk"))
        if r.get("ms") is None:
            rows.append(f"| {r['context']} | {r['variant']} | {r['hq']}/{r['hkv']} | {r['head_dim']} | {r['bs']} | none | "
                        f"{r['scaling_factor']} | {r['method']} | - | not run: {r.get('note', '')} | | | | | | |")
            continue
        sp = f"{dense[k] / r['ms']:.2f}x" if k in dense else "-"
        mem = "-" if r.get("peak_mb") is None else f"{r['peak_mb']:.0f}"
        reuse = "-" if r.get("tile_reuse") is None else f"{r['tile_reuse']:.1f}/{r['tile_tokens']}"
        rows.append(f"| {r['context']} | {r['variant']} | {r['hq']}/{r['hkv']} | {r['head_dim']} | {r['bs']} | "
                    f"{r['topk'] if r['topk'] is not None else 'none'} | {r['scaling_factor']} | {r['method']} | "
                    f"{'yes' if r['includes_write'] else 'no'} | {r['ms']:.2f} | {_fmt(r.get('kv_fraction'), '.2%')} | "
                    f"{_fmt(r.get('floor_ms'), '.2f')} | {_fmt(r.get('floor_fraction'), '.0%')} | {mem} | {reuse} | {sp} |")
    return "\n".join(rows)


def _fmt(v, spec: str) -> str:
    """A table cell: ``v`` formatted, or ``-`` where a record has no value (route-only rows, old records)."""
    return "-" if v is None else format(v, spec)


def summary(records: list) -> str:
    """Where sparse prefill (with its write, default settings on SGLang's layout: rows of ``--tune`` settings,
    whose variant names a setting, of a shared workspace and of another layout are left out) loses to the faster
    dense peer, and the crossover length, per (device, Hkv, topk, chunking)."""
    ours, dense = {}, {}
    for r in records:
        if not r.get("ms"):
            continue
        where = (r["device"], r["hkv"], r.get("chunk"))
        if (r["method"] == "dash-triton" and r["includes_write"] and "=" not in r["variant"]
                and WORKSPACE_TAG not in r["variant"] and not any(t in r["variant"] for t in LAYOUT_TAG.values())):
            o = ours.setdefault(where + (r["topk"],), {})
            o[r["context"]] = min(o.get(r["context"], float("inf")), r["ms"])
        elif r["method"].startswith("dense"):
            d = dense.setdefault(where, {})
            d[r["context"]] = min(d.get(r["context"], float("inf")), r["ms"])
    lines = []
    for (dev, hkv, chunk, topk), series in sorted(ours.items(), key=str):
        cx, losing = crossover(series, dense.get((dev, hkv, chunk), {}))
        what = f"Hkv {hkv}, topk {topk if topk is not None else 'none'}, " + (
            "one shot" if chunk is None else f"in chunks of {chunk}")
        if cx is not None:
            line = f"- {what}: faster than the faster dense peer from {cx} tokens on"
        else:
            line = f"- {what}: not faster than the faster dense peer at the longest measured prompt"
        if losing:
            line += f"; slower at {', '.join(str(s) for s in losing)} tokens"
        lines.append(line)
    return "\n".join(lines) if lines else "- no DASH and dense rows to compare"


def write_outputs(a, all_recs: list, bw: float, device: str) -> None:
    recs = [r for r in all_recs if r["device"] == device]
    body = (f"## Prefill (`benchmarks/prefill.py`)\n\nCommand: `{a.command}`\n\n"
            f"Device: {device}; measured copy bandwidth {bw / 1e12:.2f} TB/s. One request (B 1) per row: the whole "
            "prompt at once, or in chunks on the paged history the earlier chunks wrote; `write` = the time includes "
            "the K/V + summary write. Times are medians of CUDA-event-timed calls after warm-up. The floor is the "
            "larger of bytes over that bandwidth and useful FLOPs (attended tokens + candidate scoring for DASH, the "
            "causal triangle for dense) over 989 TFLOPS. `peak mem`: most memory allocated during one call beyond "
            "its inputs (DASH: the routing scratch; dense SDPA/FlashInfer: their output and workspace). `tile "
            "reuse`: routed (token, block) pairs per block a tile of query tokens loads, out of the tile's tokens "
            f"(queries follow an AR(1) walk, correlation {a.query_correlation}). JSON: `docs/perf/prefill.json`; "
            "chart: `docs/perf/prefill.svg`.\n\n" + table(recs) + "\n\nCrossover (DASH with its write against the "
            "faster dense peer):\n\n" + summary(recs) + "\n")
    replace_section(Path(a.markdown), MARK_BEGIN, MARK_END, body)
    groups = {}
    for r in recs:
        if r.get("ms") is None:
            continue
        k = (f"{r['context']} tokens{'' if not r.get('chunk') else ' in chunks of ' + str(r['chunk'])}, Hkv {r['hkv']}")
        lab = (f"{r['method']}{' topk ' + str(r['topk']) if r['method'] == 'dash-triton' else ''}"
               f"{' +write' if r['includes_write'] and r['method'] == 'dash-triton' else ''}")
        if r["method"] == "dash-triton":  # what else sets the row apart: route-only, settings, layout, workspace
            words = r["variant"].split()
            lab += "".join(" " + w for w in (words[1:] if words[0] == "one-shot" or words[0].startswith("chunks-")
                                             else words))
        groups.setdefault(k, []).append((lab, r["ms"]))
    svg_bars(Path(a.svg), groups, "DASH prefill time per layer, B 1 (log scale)", "ms",
             {"dash-triton": "#1f77b4", "dense-sdpa": "#7f7f7f", "dense-flashinfer": "#2ca02c",
              "published-dash": "#d62728"})


# ---------------------------------------------------------------------------- main

def flush_docs(a, records: list, bw: float) -> None:
    """Merge this run's records into the JSON and rewrite the prefill section and chart (after every
    prompt length, so that a run cut short by a time limit still leaves its results)."""
    if a.no_write_docs or not records:
        return
    all_recs = merge_records(Path(a.json), records, _key, _order)
    write_outputs(a, all_recs, bw, records[0]["device"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=["required", "matrix"],
                    help="required: 2k..128k, topk 64 and none, 128k also in 8k chunks")
    ap.add_argument("--context", default="8192,32768,131072")
    ap.add_argument("--chunk-contexts", default="131072", help="prompt lengths also run in chunks")
    ap.add_argument("--chunk", type=int, default=8192)
    add_shape_args(ap, "scaling_factor (default: calibrated per prompt length)")
    ap.add_argument("--query-correlation", type=float, default=0.95,
                    help="AR(1) coefficient of queries over positions (0: independent queries, the worst case)")
    ap.add_argument("--layout", choices=["sglang", "vllm"], default="sglang",
                    help="DASH's cache layout: token-major (SGLang) or head-major (vLLM); dense peers read K/V as "
                         "they are")
    ap.add_argument("--published-max-context", type=int, default=131072)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--workspace-max-context", type=int, default=32768,
                    help="also time calls sharing a PrefillWorkspace (later layers of a step) up to this length")
    ap.add_argument("--tune", action="append", default=[],
                    help="extra DASH kernel settings to time, e.g. --tune ATTN_ROWS=128,ATTN_WARPS=8 (repeatable; "
                         "names of constants of dash_core.kernels.prefill or prefill_ws)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    add_output_args(ap, "prefill")
    a = ap.parse_args(argv)
    a.command = shown_command("prefill.py", list(argv if argv is not None else sys.argv[1:]))
    a.tunings = tunings(ap, a.tune)
    if a.preset == "required":
        a.context, a.chunk_contexts, a.hkv, a.topk = "2048,4096,8192,32768,131072", "131072", "8", "64,none"
    elif a.preset == "matrix":
        a.context, a.chunk_contexts, a.hkv, a.topk = "4096,16384,65536,131072", "65536,131072", "8,2", "16,64,256,none"
    if a.smoke:
        a.context, a.chunk_contexts, a.chunk, a.hkv, a.topk = "200", "200", 96, "2", "4,none"
        a.hq, a.head_dim, a.block_size, a.page_size, a.peers = 4, 64, 16, 32, "sdpa,published"
        a.published_max_context = 0
    if a.smoke and os.environ.get("TRITON_INTERPRET") == "1":
        import tests.kernels._kernel_env  # noqa: F401  (the interpreter shims the kernel tests use)
    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    if device.type != "cuda" and not a.smoke:
        log("no CUDA device: use --smoke (with TRITON_INTERPRET=1) for a CPU check")
        return 2
    bw = copy_bandwidth(device)
    log(f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; copy bandwidth "
        f"{bw / 1e12:.2f} TB/s")
    records: list = []
    topks = sorted([None if t.strip().lower() == "none" else int(t) for t in a.topk.split(",")],
                   key=lambda t: -1 if t is None else t)
    chunked = {int(x) for x in a.chunk_contexts.split(",") if x}
    if a.smoke:
        tmp = Path(os.environ.get("TMPDIR", "/tmp")) / "dash_prefill_smoke"
        a.json, a.markdown, a.svg = str(tmp / "prefill.json"), str(tmp / "PERFORMANCE.md"), str(tmp / "prefill.svg")
    t0 = time.time()
    sfs = {}
    for hkv in [int(x) for x in a.hkv.split(",")]:
        # longest prompts first: they carry the targets, and the docs are rewritten after every length
        for n in sorted((int(x) for x in a.context.split(",")), reverse=True):
            chunks = [None] + ([a.chunk] if n in chunked and a.chunk < n else [])
            sf_n = None
            try:
                sf_n = run_context(a, n, hkv, topks, chunks, a.sf, device, bw, records)
            except torch.cuda.OutOfMemoryError as e:
                log(f"  out of memory, prompt length {n} skipped: {e}")
                torch.cuda.empty_cache()
            sfs[(hkv, n)] = sf_n
            flush_docs(a, records, bw)
            log(f"elapsed {time.time() - t0:.0f} s")
    peers = set(a.peers.split(",")) if a.peers else set()
    if "published" in peers and None in topks:
        cases = [(n, hkv, sf_n) for (hkv, n), sf_n in sorted(sfs.items(), key=lambda kv: (kv[0][0], kv[0][1]))
                 if sf_n is not None]
        if device.type == "cuda":
            run_published_isolated(a, cases, device, bw, records)
        else:  # the smoke run: in process
            for n, hkv, sf_n in cases:
                run_published(a, n, hkv, sf_n, device, bw, records)
        log(f"elapsed {time.time() - t0:.0f} s")
    print("\n" + table(records) + "\n\n" + summary(records) + "\n", flush=True)
    if not a.no_write_docs:
        log(f"wrote {a.json}, {a.markdown}, {a.svg}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
