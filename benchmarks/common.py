"""What the benchmarks share: timing (CUDA events, CUDA graphs), the copy bandwidth behind the floors, the JSON
records, the shape arguments, the dense SDPA peers, the synthetic queries and the published kernels' import.

The benchmarks write JSON records only (``docs/perf/NAME.json``, merged by case); ``benchmarks/report.py`` makes the
tables of ``docs/PERFORMANCE.md`` and the charts from them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from dash_core.model_timing import capture_graph

ROOT = Path(__file__).resolve().parents[1]
L2_BYTES = 50 * 2**20  # the H200's L2: inputs rotate over enough layers that reads come from memory
# Every peer a benchmark knows, in the order they run: the dense kernels, then the authors' DASH kernels.
PEERS = ("cudnn", "sdpa", "flashinfer", "flash-attn", "published")
# The SDPA peers: method name and torch.nn.attention.SDPBackend member.
SDPA_PEERS = {"cudnn": ("dense-cudnn", "CUDNN_ATTENTION"), "sdpa": ("dense-sdpa", "FLASH_ATTENTION")}


def log(msg: str) -> None:
    """A timestamped progress line on stdout (the benchmarks are scripts: their log is the run's record)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_id() -> str:
    """The id of this run (UTC start time), carried by every record: ``report.py`` divides a DASH row by the dense
    peers of its own run where that run measured any."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def host_launch_us(device) -> float:
    """A probe of the machine's CPU, recorded with every row (``host_us``): the host time of one small launch (an
    in-place add on 16 elements, the median of five rounds of 200) in us. Rows bound by the host (one short prompt,
    eager decode, a B 1 graph replay) move with it from machine to machine."""
    x = torch.zeros(16, device=device)
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(200):
            x.add_(1.0)
        rounds.append((time.perf_counter() - t) / 200 * 1e6)
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    return round(statistics.median(rounds), 2)


def run_fields(a) -> dict:
    """The fields every record of a run carries: the command line, the run's id and the host probe (set on ``a`` by
    the benchmark's ``main``)."""
    return dict(command=a.command, run=a.run, host_us=a.host_us)


# ---------------------------------------------------------------------------- timing

def time_calls(fns: list, iters: int, warmup: int, cuda: bool) -> float:
    """Median milliseconds of one call, cycling through ``fns`` (one per rotated layer)."""
    for i in range(warmup):
        fns[i % len(fns)]()
    if not cuda:
        ts = []
        for i in range(iters):
            t = time.perf_counter()
            fns[i % len(fns)]()
            ts.append((time.perf_counter() - t) * 1e3)
        return statistics.median(ts)
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for i in range(iters):
        ev[i][0].record()
        fns[i % len(fns)]()
        ev[i][1].record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev)


def host_ms(fn, iters: int, cuda: bool):
    """Median milliseconds the host takes to issue one call of ``fn`` to an idle GPU (synchronised before each call,
    not after it): launches and everything the host does for them, none of the GPU's time. None off CUDA, where a
    call's time is all host."""
    if not cuda:
        return None
    ts = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(ts)


def device_name(device) -> str:
    """The name a record carries for ``device`` (the CPU runs the kernels under the Triton interpreter)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (triton interpreter)"


def parse_topks(text: str) -> list:
    """``--topk``: ``"16,64,none"`` -> ``[16, 64, None]``."""
    return [None if t.strip().lower() == "none" else int(t) for t in text.split(",")]


def open_device(a, profile) -> tuple:
    """The device of a benchmark run: ``(device, copy bandwidth in bytes/s, None)``, CUDA or (``--smoke``) the CPU,
    after logging it, its bandwidth and the host probe (kept in ``a.host_us``); ``(None, 0, status)`` where the run
    ends here: no CUDA device without ``--smoke``, or ``--profile`` (``profile(a, device)`` gives the status)."""
    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    if device.type != "cuda" and not a.smoke:
        log("no CUDA device: use --smoke (with TRITON_INTERPRET=1) for a CPU check")
        return None, 0, 2
    if a.profile:
        if device.type != "cuda":
            log("--profile needs a CUDA device")
            return None, 0, 2
        return None, 0, profile(a, device)
    a.host_us = host_launch_us(device)
    bw = copy_bandwidth(device)
    log(f"device {device_name(device)}; copy bandwidth {bw / 1e12:.2f} TB/s; host probe {a.host_us} us a launch")
    return device, bw, None


def copy_bandwidth(device) -> float:
    """Device-to-device copy rate in bytes/s, counting read + written bytes (a fixed H200-like figure on the CPU)."""
    if device.type != "cuda":
        return 4.3e12
    n = 1 << 30
    x = torch.empty(n, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    ms = time_calls([lambda: y.copy_(x)], 20, 3, True)
    return 2 * n / (ms * 1e-3)


def capture(fn) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of ``fn``, warmed up once on a side stream first (``dash_core.model_timing.capture_graph``)."""
    return capture_graph(fn, warmup=1)


def _graph_of_calls(fns: list, min_calls: int) -> tuple:
    """``(graph, calls)``: a CUDA graph holding every ``fns`` call in turn, repeated up to ``min_calls`` calls."""
    calls = fns * -(-min_calls // len(fns))
    return capture(lambda: [f() for f in calls]), len(calls)


def graph_ms(fns: list, iters: int, warmup: int, min_calls: int = 8) -> float:
    """Median milliseconds of one call replayed from a CUDA graph, as a model's decode graph runs its layers: one graph
    holds every ``fns`` call in turn (one per rotated layer), repeated up to ``min_calls`` calls, and its replay time
    is divided by the calls it holds. A graph of one short call would time the host's launch of the graph instead
    (``min_calls=1`` where a call is already a whole step of several layers)."""
    graph, ncalls = _graph_of_calls(fns, min_calls)
    ms = time_calls([graph.replay], iters, warmup, True) / ncalls
    del graph
    return ms


def graph_timeline(fns: list, min_calls: int = 8) -> list:
    """``launch_timeline`` of one replay, under ``torch.profiler``, of the graph ``graph_ms`` replays (each call a
    step of the same launches)."""
    from torch.profiler import ProfilerActivity, profile

    graph, ncalls = _graph_of_calls(fns, min_calls)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    del graph
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "kernel"]
    return launch_timeline(events, ncalls)


def launch_timeline(events: list, steps: int) -> list:
    """When each launch of a step starts and ends, ``[(kernel name, start, end)]`` in us from the end of the step
    before: the median over ``steps - 1`` steps (all but the first, which has none before it). ``events``: the
    kernels of ``steps`` consecutive steps of the same launches, each a dict with ``name``, ``ts`` (start) and
    ``dur`` in us, and ``tid`` (its stream) where a step's launches run on several streams (a ``torch.profiler``
    trace's kernel events); a step's launches are listed by stream, then start. A launch that is the programmatic
    dependent of the one before it starts while that one runs, and waits: its end is what the step's chain follows."""
    ev = sorted(events, key=lambda e: e["ts"])
    if steps < 2 or not ev or len(ev) % steps:
        raise ValueError(f"{len(ev)} kernels are not {steps} >= 2 steps of the same launches")
    per = len(ev) // steps
    chunks = [sorted(ev[s * per:(s + 1) * per], key=lambda e: (str(e.get("tid", "")), e["ts"])) for s in range(steps)]
    names = [e["name"] for e in chunks[0]]
    if any([e["name"] for e in c] != names for c in chunks[1:]):
        raise ValueError(f"the {steps} steps do not run the same launches in the same order")
    spans = []
    for before, step in zip(chunks, chunks[1:]):
        t0 = max(e["ts"] + e["dur"] for e in before)
        spans.append([(e["ts"] - t0, e["ts"] + e["dur"] - t0) for e in step])
    return [(names[k], statistics.median(sp[k][0] for sp in spans), statistics.median(sp[k][1] for sp in spans))
            for k in range(per)]


def floor_ms(nbytes: float, bw: float, flops: float = 0.0, peak_flops: float = float("inf")) -> float:
    """The floor of a call: the larger of its bytes over the copy bandwidth and its useful FLOPs over the peak."""
    return max(nbytes / bw, flops / peak_flops) * 1e3


# ---------------------------------------------------------------------------- records

def merge_records(path: Path, new: list, key: Callable[[dict], tuple], order: Callable[[dict], tuple]) -> list:
    """Records of ``path`` with ``new`` ones replacing those of the same ``key``; written back sorted."""
    old = json.loads(path.read_text()) if path.exists() else []
    keep = {key(r): r for r in old}
    for r in new:
        keep[key(r)] = r
    out = sorted(keep.values(), key=order)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    return out


def add_shape_args(ap, sf_help: str) -> None:
    """The arguments both benchmarks share: heads, head size, block and page size, topk, sf, peers."""
    ap.add_argument("--hkv", default="8")
    ap.add_argument("--topk", default="64,none")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--sf", type=float, default=None, help=sf_help)
    ap.add_argument("--target-fraction", type=float, default=0.05, help="uncapped selection to calibrate sf for")
    ap.add_argument("--peers", default=",".join(PEERS),
                    help=f"comma list of {', '.join(PEERS)} (those that cannot run here are skipped, with the "
                         "reason); none for no peer")


def add_output_args(ap, name: str) -> None:
    """Where a benchmark writes its records: ``docs/perf/NAME.json`` by default; ``--no-write`` keeps them out."""
    ap.add_argument("--json", default=str(ROOT / f"docs/perf/{name}.json"))
    ap.add_argument("--no-write", action="store_true", help="print the records' table only")


def peers_of(spec: str) -> set:
    """``--peers``: the named peers (``none`` or empty: none); unknown names are refused."""
    names = {p.strip() for p in (spec or "").split(",") if p.strip() and p.strip() != "none"}
    unknown = names - set(PEERS)
    if unknown:
        raise ValueError(f"--peers: unknown {sorted(unknown)}; allowed: {', '.join(PEERS)} or none")
    return names


def shown_command(script: str, argv: list, outs: tuple = ("--json",)) -> str:
    """The command as the records carry it: the output options ``outs`` (machine-specific paths) left out."""
    kept = [x for i, x in enumerate(argv) if x not in outs and not (i and argv[i - 1] in outs)]
    return f"python benchmarks/{script} " + " ".join(kept)


# ---------------------------------------------------------------------------- dense SDPA peers

def sdpa_fn(peer: str, q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, cuda: bool, **kwargs) -> tuple:
    """``(call, note)``: ``scaled_dot_product_attention(q4, k4, v4, **kwargs)`` on the backend of ``peer`` (``cudnn``
    or ``sdpa``: FlashAttention inside PyTorch; the math backend on the CPU). q4 ``[B, Hq, Tq, D]``, k4, v4
    ``[B, Hkv, Tk, D]``. Grouped heads are passed as they are (``enable_gqa``) where the backend takes them; else
    K/V heads are repeated to Hq here, before any timed call, and ``note`` says so. Raises where the backend cannot
    run the shape at all."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    backend = getattr(SDPBackend, SDPA_PEERS[peer][1]) if cuda else SDPBackend.MATH

    def call(q, k, v, **kw):
        def run():
            with sdpa_kernel([backend]):
                return sdpa(q, k, v, **kw)
        return run

    if q4.shape[1] == k4.shape[1]:
        fn = call(q4, k4, v4, **kwargs)
        fn()
        return fn, None
    try:
        fn = call(q4, k4, v4, enable_gqa=True, **kwargs)
        fn()
        return fn, None
    except RuntimeError as e:
        g = q4.shape[1] // k4.shape[1]
        kr, vr = k4.repeat_interleave(g, 1).contiguous(), v4.repeat_interleave(g, 1).contiguous()
        fn = call(q4, kr, vr, **kwargs)
        fn()
        return fn, f"K/V heads repeated to Hq before the timed calls (enable_gqa: {str(e).splitlines()[0][:120]})"


def flash_attn_varlen():
    """FlashAttention's ``flash_attn_varlen_func`` (FlashAttention 4, ``flash_attn.cute``), for the
    ``dense-flash-attn`` peer; raises where it is not installed."""
    from flash_attn.cute import flash_attn_varlen_func

    return flash_attn_varlen_func


# ---------------------------------------------------------------------------- inputs and the published kernels

def ar1_walk(x: torch.Tensor, rho: float, chunk: int = 256) -> torch.Tensor:
    """``y_t = rho y_{t-1} + sqrt(1 - rho^2) x_t`` along dim 0 (unit variance kept for unit-variance
    ``x``): synthetic queries whose neighbours are alike. Computed in chunks on ``x``'s device: inside a
    chunk ``y_j = rho^(j+1) (y_prev + c sum_{i<=j} x_i / rho^(i+1))``, ``c = sqrt(1 - rho^2)``."""
    out = torch.empty_like(x)
    out[0] = x[0]
    c = math.sqrt(1 - rho * rho)
    shape = (-1,) + (1,) * (x.dim() - 1)
    prev = x[0].double()
    for t0 in range(1, x.shape[0], chunk):
        e = x[t0: t0 + chunk].double()
        powers = (rho ** torch.arange(1, e.shape[0] + 1, device=x.device, dtype=torch.float64)).view(shape)
        y = powers * (prev + c * torch.cumsum(e / powers, 0))
        out[t0: t0 + e.shape[0]] = y.to(x.dtype)
        prev = y[-1]
    return out


def import_published(module: str):
    """``dash_attn.<module>`` of the authors' DashAttention copy at ``$DASH_PUBLISHED_DIR`` (their package
    sets the fp32 matmul precision globally on import: it is restored here)."""
    import importlib
    import os
    import sys

    pub = os.environ.get("DASH_PUBLISHED_DIR")
    if not pub or not Path(pub, "dash_attn").is_dir():
        raise RuntimeError("set DASH_PUBLISHED_DIR to a copy of the authors' DashAttention repository")
    prec = torch.get_float32_matmul_precision()
    if pub not in sys.path:
        sys.path.insert(0, pub)
    try:
        return importlib.import_module(f"dash_attn.{module}")
    finally:
        torch.set_float32_matmul_precision(prec)


def tune_configs(specs: list, default) -> list:
    """``--tune``: ``[(tag, config)]``, the ``default`` frozen configuration first (tag ``""``), then one per spec
    (``name=value,...``; fields of the configuration, a field of a nested one as ``<field>_<name>``, e.g.
    ``gluon_regs=160`` for ``PrefillConfig.gluon.regs``). ``tag`` is the suffix the settings add to a row's variant.
    Raises ValueError naming an unknown setting."""
    nested = {f.name for f in dataclasses.fields(default) if dataclasses.is_dataclass(getattr(default, f.name))}
    out = [("", default)]
    for spec in specs:
        top: dict = {}
        inner: dict = {n: {} for n in nested}
        for item in filter(None, (x.strip() for x in spec.split(","))):
            if "=" not in item:
                raise ValueError(f"--tune: expected name=value, got {item!r}")
            name, value = (x.strip().lower() for x in item.split("=", 1))
            owner, where, field = default, top, name
            for n in nested:
                if name.startswith(n + "_"):
                    owner, where, field = getattr(default, n), inner[n], name[len(n) + 1:]
            if field in nested or not hasattr(owner, field):
                raise ValueError(f"--tune: {name!r} is not a setting of {type(default).__name__} (its fields, or "
                                 f"<field>_<name> for {sorted(nested) or 'no'} nested ones)")
            where[field] = type(getattr(owner, field))(int(value))
        config = dataclasses.replace(default, **top, **{n: dataclasses.replace(getattr(default, n), **inner[n])
                                                        for n in nested})
        tag = "".join(f" {k}={int(v)}" for k, v in top.items())
        tag += "".join(f" {n}_{k}={int(v)}" for n in sorted(nested) for k, v in inner[n].items())
        out.append((tag, config))
    return out
