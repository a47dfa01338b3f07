"""Time a whole model step, DASH against dense peers: TTFT (one prefill) and TPOT (one decode step).

``measure_point`` is what ``benchmarks/model.py`` runs for each row of its table and what
``python -m dash_core.demo`` runs for its closing line. For one point (phase, batch, context) it builds
the KV cache (``dash_core.llama.KVStore``), calibrates DASH's ``scaling_factor`` on the first layer,
then times the step with DASH, with each dense peer and with no attention at all, one after another in
the same process:

- TTFT: the prefill of every request's whole prompt in one eager step (as engines run prefill: the
  host launches, the DASH workspace and FlashInfer's plan are part of the step), hidden states that are
  an AR(1) walk over positions (neighbouring tokens alike). One warm-up call compiles and plans; then the
  median of up to ``iters`` timed calls (fewer where one call exceeds ``budget_s / iters``; at least one).
- TPOT: one decode step per request at the end of a context of random keys (with per-block offsets)
  written through ``ops.cache_dash_prefill``, the whole step (every layer, MLP and the LM head) captured
  in one CUDA graph as engines capture decode (warm-up calls compile before capture); the median of
  ``replays`` timed replays. Each layer has its own KV, so reads come from HBM.

CUDA events time the GPU; on the CPU (``--smoke``) wall-clock time of eager calls, for checks only.
The attention's share of a step is its time minus the no-attention step's (``attention_ms``): the K/V
write and the attention (for DASH also the summaries and routing).

The ``scaling_factor`` is calibrated as the kernel benchmarks do: the value whose uncapped selection
keeps about ``target_fraction`` of the candidate blocks (a log-scale bisection), measured with decode
routing of layer 0's queries over layer 0's summaries (TTFT: the prompt's last 8 queries of the first
request after layer 0's K/V and summaries are written; TPOT: the step's queries).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import dataclass, replace
from typing import Callable, List, Optional, Sequence

import torch

from .limits import HAVE_TRITON
from .llama import (PEERS, DashAttention, DenseAttention, KVStore, LlamaModel, LlamaShape, NoAttention, Step,
                    correlated_rows)
from .ops import cache_dash_prefill
from .params import DashParams
from .reference import route

if HAVE_TRITON:  # the decode routing measures the selected fraction on CUDA
    from .kernels.decode.buffers import DecodeBuffers
    from .kernels.decode.launch import route as route_decode_step

logger = logging.getLogger(__name__)

PHASES = ("ttft", "tpot")
CALIBRATION_ROWS = 8  # prompt queries that calibrate a TTFT point's scaling_factor (the kernel benchmarks' count)
QUERY_CORRELATION = 0.95  # AR(1) correlation of neighbouring prompt tokens' hidden states
ACTIVATION_SLACK_BYTES = 4 << 30  # memory kept free beyond the estimated activations and scratch


@dataclass(frozen=True)
class DashSettings:
    """DASH's settings at every point: block, topk, local window, and either a fixed ``scaling_factor`` or
    ``None`` to calibrate it per point to select about ``target_fraction`` of the candidates uncapped."""

    block_size: int = 64
    topk: Optional[int] = 64
    local: int = 64
    page_size: int = 64
    scaling_factor: Optional[float] = None
    target_fraction: float = 0.05

    def params(self, scaling_factor: float) -> DashParams:
        return DashParams(block_size=self.block_size, topk=self.topk, local=self.local,
                          scaling_factor=scaling_factor)


# ---------------------------------------------------------------------------------------------- timing

def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def time_calls(fn: Callable[[], object], iters: int, warmup: int, cuda: bool,
               budget_s: Optional[float] = None) -> tuple:
    """``(median ms, timed calls)`` of ``fn`` after ``warmup`` untimed calls: CUDA events around each call on
    the GPU, wall-clock time on the CPU. With ``budget_s`` the calls after the first timed one stop once their
    estimated total would exceed it (at least one timed call)."""
    for _ in range(warmup):
        fn()
    _sync(cuda)
    times: List[float] = []
    for i in range(max(1, iters)):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        if budget_s is not None and (i + 2) * times[0] > budget_s * 1e3:
            break
    return statistics.median(times), len(times)


def capture_graph(fn: Callable[[], object], warmup: int = 2) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of ``fn``, after ``warmup`` calls on a side stream (compilation and autotuning happen
    there, outside the graph and outside any timing)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


# ---------------------------------------------------------------------------------------------- calibration

def selected_fraction(q: torch.Tensor, store: KVStore, layer: int, block_table: torch.Tensor, context: int,
                      params: DashParams) -> float:
    """Mean fraction of the candidate blocks that decode routing keeps for queries ``q [R, Hq, D]`` at
    position ``context - 1`` of the requests whose pages are ``block_table [R, pages]`` (layer ``layer``'s
    summaries): the Triton routing on CUDA, the oracle's ``route`` elsewhere."""
    cache = store.cache(layer)
    r = q.shape[0]
    ncand = max(1, (context - 1) // params.block_size - params.local_blocks + 1)
    if q.is_cuda:
        seq = torch.full((r,), context, dtype=torch.int32, device=q.device)
        bufs = DecodeBuffers.for_step(q, cache, block_table, params)
        route_decode_step(q, cache, block_table, seq, params, bufs)
        return float(bufs.sel_count[:r].double().mean()) / ncand
    bs, ps = params.block_size, store.page_size
    blk = torch.arange(ncand)
    kept = 0.0
    for i in range(r):
        idx = block_table[i, (blk * bs) // ps].long() * (ps // bs) + blk % (ps // bs)
        summ = cache.summaries[idx].permute(1, 0, 2).double()  # [Hkv, ncand, D]
        qs = (q[i] * params.scaling_factor).to(q.dtype).double()[:, None]  # [Hq, 1, D]
        rt = route(qs, summ, torch.tensor([ncand]), params)
        kept += rt.kept.double().sum(-1).mean().item()
    return kept / r / ncand


def calibrate_scaling_factor(q: torch.Tensor, store: KVStore, block_table: torch.Tensor, context: int,
                             settings: DashSettings, lo: float = 0.25, hi: float = 256.0) -> tuple:
    """``(scaling_factor, fraction, met)``: a log-scale bisection over ``[lo, hi]`` for the value whose uncapped
    selection keeps ``settings.target_fraction`` of the candidates (within a factor 1.25), on layer 0; ``met``:
    whether it found one (a context of few candidate blocks may have no such value)."""
    target = settings.target_fraction
    sf = f = math.sqrt(lo * hi)
    for _ in range(10):
        sf = math.sqrt(lo * hi)
        p = replace(settings.params(sf), topk=None)
        f = selected_fraction(q, store, 0, block_table, context, p)
        if 0.8 * target <= f <= 1.25 * target:
            return sf, f, True
        lo, hi = (sf, hi) if f > target else (lo, sf)
    return sf, f, False


# ---------------------------------------------------------------------------------------------- memory

def activation_bytes(shape: LlamaShape, phase: str, tokens: int, esize: int) -> int:
    """An upper estimate of a step's transient memory: the largest per-layer activations (MLP in and out,
    projections) and the attention scratch (DASH's routing scratch, FlashInfer's workspace)."""
    per_token = (2 * shape.mlp + shape.mlp + 6 * shape.hidden + 3 * (shape.q_heads + 2 * shape.kv_heads)
                 * shape.head_dim) * esize
    scratch = (1 << 30) + (256 << 20) if phase == "ttft" else 256 << 20
    return tokens * per_token + scratch


def fit_layers(shape: LlamaShape, want: int, phase: str, batch: int, context: int, free_bytes: int, esize: int,
               block_size: int, with_weights: bool = False) -> int:
    """The most layers up to ``want`` whose KV cache (and weights, ``with_weights``) fit in ``free_bytes`` with a
    step's activations and ``ACTIVATION_SLACK_BYTES`` to spare; 0 when not even one does."""
    stride_tokens = batch * context
    per_layer = stride_tokens * shape.kv_bytes_per_token(esize, block_size)
    if with_weights:
        per_layer += shape.weight_bytes_per_layer(esize)
    tokens = batch * (context if phase == "ttft" else 1)
    room = free_bytes - activation_bytes(shape, phase, tokens, esize) - ACTIVATION_SLACK_BYTES
    return max(0, min(want, int(room // per_layer)))


# ---------------------------------------------------------------------------------------------- a point

def available_peers(peers: Sequence[str], device: torch.device) -> tuple:
    """``(peers to run, {peer: why not})``: "auto" means every peer that can run on ``device`` (the SDPA math
    backend only on the CPU, where it is the only one)."""
    want = []
    for p in peers:
        auto = [x for x in PEERS if x != "sdpa-math"] if device.type == "cuda" else ["sdpa-math"]
        want += [x for x in (auto if p == "auto" else [p]) if x not in want]
    run, skipped = [], {}
    for p in want:
        if p not in PEERS:
            raise ValueError(f"peer {p!r} is unknown: expected 'auto' or some of {PEERS}")
        why = None
        if p != "sdpa-math" and device.type != "cuda":
            why = "needs a CUDA device"
        elif p == "cudnn" and not torch.backends.cudnn.is_available():
            why = "cuDNN is not available to torch"
        elif p == "sdpa" and not torch.backends.cuda.is_flash_attention_available():
            why = "torch was built without flash attention"
        elif p in ("flashinfer", "flash-attn"):
            module = "flashinfer" if p == "flashinfer" else "flash_attn.cute"
            try:
                __import__(module)
            except Exception as e:  # an optional library: skipped with its reason
                why = f"import {module} failed: {type(e).__name__}: {e}"
        if why is None:
            run.append(p)
        else:
            skipped[p] = why
    return run, skipped


def measure_point(model: LlamaModel, phase: str, batch: int, context: int, peers: Sequence[str],
                  settings: DashSettings = DashSettings(), *, iters: int = 3, replays: int = 30,
                  budget_s: float = 8.0, layers: Optional[int] = None, seed: int = 0,
                  log: Callable[[str], None] = logger.info) -> List[dict]:
    """Time one point with DASH, every dense peer of ``peers`` (``"auto"``: all that can run) and no attention.

    phase: ``"ttft"`` (prefill of ``batch`` prompts of ``context`` tokens) or ``"tpot"`` (one decode step of
    ``batch`` requests at context ``context``); layers: the model's layers to run (default all), lowered
    where the KV cache would not fit on the GPU. Returns one record per method (``"dash"``,
    ``"dense-<peer>"``): phase, batch, context, layers, layers_lowered, method, ms, attention_ms,
    no_attention_ms, graph, timed calls, and for DASH its settings (block_size, topk, local, scaling_factor,
    calibrated: whether a calibration met ``target_fraction``, selected_fraction, target_fraction); a peer that
    failed has ``ms`` None and a ``note``.
    seed: the inputs are drawn from ``seed + 1`` and the synthetic KV cache from ``seed + 2``, never from the
    weights' stream (``LlamaWeights`` seeded with ``seed``: inputs equal to weight rows would be outliers).
    """
    if phase not in PHASES:
        raise ValueError(f"phase = {phase!r}: expected one of {PHASES}")
    w, shape = model.weights, model.shape
    dev, dtype = w.device, w.dtype
    cuda = dev.type == "cuda"
    esize = torch.empty((), dtype=dtype).element_size()
    want = w.layers if layers is None else min(layers, w.layers)
    n_layers = want
    if cuda:
        torch.cuda.empty_cache()
        n_layers = fit_layers(shape, want, phase, batch, context, torch.cuda.mem_get_info(dev)[0], esize,
                              settings.block_size)
        if n_layers == 0:
            raise RuntimeError(f"{phase} B {batch} at {context}: not one layer's KV cache fits in GPU memory")
    base = dict(phase=phase, batch=batch, context=context, layers=n_layers, layers_lowered=n_layers < want,
                graph=phase == "tpot" and cuda)
    if n_layers < want:
        base["note"] = f"layers lowered from {want} to {n_layers}: the KV cache of {want} would not fit"
        log(f"  {base['note']}")
    store = KVStore(shape, n_layers, batch, context, settings.page_size, settings.block_size, dtype, dev)
    g = torch.Generator(device=dev).manual_seed(seed + 1)  # not the weights' stream (seeded with seed)
    decode = phase == "tpot"
    step = Step.decode_step(store) if decode else Step.prefill(store)
    cos, sin = model.rope(context)
    cos, sin = cos[step.positions], sin[step.positions]
    if decode:
        x = torch.randn(batch, shape.hidden, generator=g, device=dev, dtype=torch.float32).to(dtype)
        store.fill_synthetic(w.head_cls, DashParams(block_size=settings.block_size), seed=seed + 2)
        q0 = model.qkv(0, x, cos, sin)[0]
        cal_rows, cal_table = q0, step.block_table
    else:
        x = correlated_rows(batch, context, shape.hidden, QUERY_CORRELATION, g, dtype)
        q0, k0, v0 = model.qkv(0, x, cos, sin)
        cache_dash_prefill(k0, v0, store.cache(0), step.slot_mapping, DashParams(block_size=settings.block_size),
                           head_cls=w.head_cls[0])
        rows = min(CALIBRATION_ROWS, context)
        cal_rows = q0[context - rows: context]
        cal_table = step.block_table[:1].expand(rows, -1).contiguous()
        del k0, v0
    met = False
    if settings.scaling_factor is None:
        sf, frac, met = calibrate_scaling_factor(cal_rows, store, cal_table, context, settings)
        if not met:
            log(f"  calibration missed: no scaling_factor in its range routes {settings.target_fraction:.0%} of "
                f"the candidate blocks uncapped (the nearest routes {frac:.0%})")
    else:
        sf = settings.scaling_factor
        frac = selected_fraction(cal_rows, store, 0, cal_table, context, replace(settings.params(sf), topk=None))
    del q0, cal_rows
    params = settings.params(sf)
    log(f"  scaling_factor {sf:.4g}: {frac:.2%} of the candidate blocks routed uncapped on layer 0 "
        f"({n_layers} layers, KV {store.nbytes() / 2**30:.2f} GiB)")
    dash_fields = dict(block_size=settings.block_size, topk=settings.topk, local=settings.local,
                       scaling_factor=round(sf, 4), calibrated=met,
                       selected_fraction=round(frac, 4), target_fraction=settings.target_fraction)

    run, skipped = available_peers(peers, dev)
    methods = [DashAttention(params, w.head_cls)] + [DenseAttention(p) for p in run] + [NoAttention()]
    records, noop_ms = [], None
    for attn in methods:
        rec = dict(base, method=attn.method)
        if attn.method == "dash":
            rec.update(dash_fields)
        t0 = time.time()
        try:
            if decode:
                ms, n = _time_decode(model, x, step, attn, n_layers, replays, cuda)
            else:
                ms, n = _time_prefill(model, x, step, attn, n_layers, iters, budget_s, cuda)
            rec.update(ms=round(ms, 4), timed_calls=n)
            log(f"  {attn.method:18s} {ms:10.3f} ms  ({n} timed, {time.time() - t0:.0f} s with warm-up)")
        except Exception as e:  # a peer that cannot run here: recorded with its reason, the others go on
            why = f"{type(e).__name__}: {str(e)[:300]}"
            rec.update(ms=None, note=f"{base['note']}; {why}" if "note" in base else why)
            log(f"  {attn.method:18s} failed: {rec['note']}")
            if cuda:
                try:
                    torch.cuda.empty_cache()
                except RuntimeError:  # the failure left the CUDA context unusable: the caller sees the next error
                    pass
        if isinstance(attn, NoAttention):
            noop_ms = rec["ms"]
        else:
            records.append(rec)
    for p, why in skipped.items():
        log(f"  dense-{p:13s} skipped: {why}")
        records.append(dict(base, method=f"dense-{p}", ms=None, note=f"not run: {why}"))
    for rec in records:
        rec["no_attention_ms"] = noop_ms
        rec["attention_ms"] = (round(rec["ms"] - noop_ms, 4)
                               if rec.get("ms") is not None and noop_ms is not None else None)
    del store, methods
    if cuda:
        torch.cuda.empty_cache()
    return records


def _time_prefill(model, x, step, attn, layers, iters, budget_s, cuda) -> tuple:
    def run():
        attn.prepare(step)  # per step, as engines plan a prefill batch
        return model.forward(x, step, attn, layers)
    return time_calls(run, iters, 1, cuda, budget_s)


def _time_decode(model, x, step, attn, layers, replays, cuda) -> tuple:
    attn.prepare(step)  # before capture, as engines fill their graph buffers
    if not cuda:
        return time_calls(lambda: model.forward(x, step, attn, layers), 1, 1, False)
    graph = capture_graph(lambda: model.forward(x, step, attn, layers))
    try:
        return time_calls(graph.replay, replays, 3, True)
    finally:
        del graph


# ---------------------------------------------------------------------------------------------- summaries

def fastest_dense(records: Sequence[dict]) -> Optional[dict]:
    """The measured dense record with the smallest ``ms`` (None if none was measured)."""
    dense = [r for r in records if r["method"].startswith("dense-") and r.get("ms") is not None]
    return min(dense, key=lambda r: r["ms"]) if dense else None


def speedups(records: Sequence[dict]) -> Optional[dict]:
    """For one point's records: ``{"dash", "dense"}`` (the records) and ``"step"`` / ``"attention"``: the fastest
    dense peer's time over DASH's (> 1: DASH faster), None where a time is missing."""
    dash = next((r for r in records if r["method"] == "dash" and r.get("ms") is not None), None)
    dense = fastest_dense(records)
    if dash is None or dense is None:
        return None
    att = None
    if dash.get("attention_ms") and dense.get("attention_ms") and dash["attention_ms"] > 0:
        att = dense["attention_ms"] / dash["attention_ms"]
    return dict(dash=dash, dense=dense, step=dense["ms"] / dash["ms"], attention=att)


def speedup_sentence(records: Sequence[dict]) -> str:
    """One line for a point: DASH's whole-step time against the fastest dense peer's, and the attention alone."""
    s = speedups(records)
    if s is None:
        return "no speed-up: DASH or every dense peer failed to run (see above)"
    d, n = s["dash"], s["dense"]
    what = "time to first token (prefill)" if d["phase"] == "ttft" else "decode step (time per output token)"
    verdict = "faster" if s["step"] >= 1 else "SLOWER"
    att = ("" if s["attention"] is None else
           f"; attention alone {d['attention_ms']:.2f} against {n['attention_ms']:.2f} ms ({s['attention']:.2f}x)")
    return (f"whole model, {what}, B {d['batch']} at {d['context']} tokens, {d['layers']} layers: DASH "
            f"{d['ms']:.2f} ms against the fastest dense peer ({n['method']}) {n['ms']:.2f} ms: {s['step']:.2f}x, "
            f"DASH {verdict}{att}")
