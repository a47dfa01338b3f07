"""Where one DASH prefill call spends its GPU time, kernel by kernel (``torch.profiler``), for each setting given.

The prefill benchmark's prompt (``benchmarks/prefill.py``: same generator, calibrated ``scaling_factor``), K/V
already written; one warm-up call, then ``--iters`` profiled calls. Prints each kernel's total time per call, its
launches per call, their sum, the time of a call by CUDA events, how long the host takes to issue it, and how long the
GPU waits for the host (before the first kernel, and between kernels, from a trace that records the host's side too,
which slows it: upper bounds).

    python benchmarks/prefill_kernels.py --context 131072 --hkv 8 --topk 64 --tune ATTN_WS=0
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from prefill import Prompt, dash_fn, prompt_sf, tuned, tunings  # noqa: E402

from dash_core import DashParams  # noqa: E402


def call_times(fn, iters: int) -> tuple:
    """``(ms per call by CUDA events, ms the host takes to issue one call)``, medians over ``iters`` calls."""
    ev, host = [], []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        end.record()
        torch.cuda.synchronize()
        ev.append(start.elapsed_time(end))
    return sorted(ev)[iters // 2], sorted(host)[iters // 2]


def kernel_times(fn, iters: int) -> dict:
    """``{kernel name: (ms per call, launches per call)}`` over ``iters`` profiled calls of ``fn``."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    total, count = defaultdict(float), defaultdict(int)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            total[ev.name] += ev.device_time_total / 1e3
            count[ev.name] += 1
    return {k: (total[k] / iters, count[k] / iters) for k in total}


def idle_ms(call_start: float, kernels: list) -> tuple:
    """``(ms from the call's start to its first kernel, ms between its kernels)``: what a call's GPU waits, from
    the call's start on the host and its kernels' ``(start, end)`` on the GPU (microseconds, one clock; kernels that
    overlap leave no gap)."""
    if not kernels:
        return 0.0, 0.0
    kernels = sorted(kernels)
    gaps, end = 0.0, kernels[0][1]
    for a, b in kernels[1:]:
        gaps += max(0.0, a - end)
        end = max(end, b)
    return (kernels[0][0] - call_start) / 1e3, gaps / 1e3


def idle_times(fn, iters: int) -> tuple:
    """Medians over ``iters`` calls of ``idle_ms`` (each call profiled alone, the GPU idle before and after it)."""
    first, between = [], []
    for _ in range(iters):
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            with torch.profiler.record_function("dash call"):
                fn()
            torch.cuda.synchronize()
        evs = prof.events()
        call = next(e for e in evs if e.name == "dash call" and e.device_type == torch.autograd.DeviceType.CPU)
        kernels = [(e.time_range.start, e.time_range.end) for e in evs
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.name != "dash call"]
        a, b = idle_ms(call.time_range.start, kernels)
        first.append(a)
        between.append(b)
    return sorted(first)[iters // 2], sorted(between)[iters // 2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--topk", default="64")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--tune", action="append", default=[],
                    help="NAME=VALUE,... of dash_core.kernels.prefill or prefill_ws")
    a = ap.parse_args(argv)
    n, d, bs = a.context, 128, 64
    pr = Prompt(n, a.hq, a.hkv, d, bs, bs, torch.bfloat16, torch.device("cuda"), seed=11, q_corr=0.95, cuda=True)
    sf = prompt_sf(pr, bs, 0.05)
    params = DashParams(block_size=bs, topk=None if a.topk == "none" else int(a.topk), scaling_factor=sf)
    out = torch.empty_like(pr.q)
    for tune in tunings(ap, a.tune):
        with tuned(tune):
            fn = dash_fn(pr, params, False, None, out)
            times = kernel_times(fn, a.iters)
            call_ms, host_ms = call_times(fn, a.iters)
            first_ms, gaps_ms = idle_times(fn, a.iters)
        shown = ",".join(f"{k}={v}" for k, v in tune.items()) or "(defaults)"
        print(f"== {n} tokens, Hq {a.hq}, Hkv {a.hkv}, topk {a.topk}, sf {sf:.4g} {shown}")
        for name, (ms, launches) in sorted(times.items(), key=lambda x: -x[1][0]):
            print(f"  {ms:9.2f} ms  {launches:6.0f} launches  {name[:90]}")
        kernels_ms = sum(ms for ms, _ in times.values())
        print(f"  {kernels_ms:9.2f} ms  in all kernels; a call takes {call_ms:.2f} ms "
              f"(CUDA events), of which the host issues it in {host_ms:.2f} ms")
        print(f"  the GPU waits {first_ms:.2f} ms from the call's start to its first kernel and {gaps_ms:.2f} ms "
              f"between its kernels (upper bounds: recording the host's side slows it); by CUDA events the call "
              f"takes {call_ms - kernels_ms:.2f} ms more than its kernels")
    return 0


if __name__ == "__main__":
    sys.exit(main())
