"""The host side of one ``paged_dash_prefill_triton`` call: its launches, its allocations and its Python time.

Short prompts are bound by the host (``docs/PERFORMANCE.md``: at 2k tokens the call spends longer on the
host than on the GPU). This script runs the call on the CPU with every Triton kernel it launches replaced
by a counter, so what it measures is the Python around the launches: the checks, the plan, the scratch
allocations and the launch arguments. The launches themselves (tens of microseconds each on a GPU host)
and the CUDA caching allocator's cost per allocation are not in the time; the counts say how many of
each a call makes. Run it before and after a host-side change:

    python benchmarks/prefill_host.py --tokens 2048 [--write] [--workspace] [--profile 15]

--workspace passes one ``PrefillWorkspace`` to every call, as the layers of an engine step do: the
counts and times are then those of a layer after the first (no plan, no tile tables, no scratch).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import sys
import time
from dataclasses import dataclass, field
from typing import Optional
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dash_core import DashParams  # noqa: E402
from dash_core.kernels import kv_write  # noqa: E402
from dash_core.kernels import prefill as pf  # noqa: E402
from dash_core.layout import PagedKVCache, alloc_summaries  # noqa: E402
from dash_core.workspace import PrefillWorkspace  # noqa: E402

KERNELS = ((pf, "_tile_tables_kernel"), (pf, "_gather_summaries_kernel"), (pf, "_prefill_route_kernel"),
           (pf, "_prefill_attn_kernel"), (pf, "_zero_tail_kernel"), (kv_write, "_kv_rows_kernel"))


@dataclass
class HostCounts:
    """Launches per kernel name and ``torch.empty`` calls."""

    launches: dict = field(default_factory=dict)
    allocations: int = 0


class _Counter:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` counts a launch and runs nothing."""

    def __init__(self, counts: HostCounts, name: str):
        self.counts, self.name = counts, name

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.counts.launches[self.name] = self.counts.launches.get(self.name, 0) + 1
        return launch


@contextlib.contextmanager
def counted():
    """Kernels replaced by counters and ``torch.empty`` calls counted inside the block (yields the ``HostCounts``)."""
    counts = HostCounts()
    saved = [(mod, name, getattr(mod, name)) for mod, name in KERNELS]
    empty = torch.empty

    def counting_empty(*args, **kwargs):
        counts.allocations += 1
        return empty(*args, **kwargs)

    for mod, name, _ in saved:
        setattr(mod, name, _Counter(counts, name))
    torch.empty = counting_empty
    try:
        yield counts
    finally:
        torch.empty = empty
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def make_call(tokens: int, write: bool, hq: int = 32, hkv: int = 8, d: int = 128, bs: int = 64, topk=64,
              workspace: Optional[PrefillWorkspace] = None):
    """A no-argument callable making the prefill call of one request of ``tokens`` new tokens on empty history,
    on CPU tensors (the benchmark's shape by default); every call passes ``workspace``."""
    params = DashParams(block_size=bs, topk=topk)
    ps = bs
    pages = -(-tokens // ps) + 1
    kb = torch.zeros(pages * ps, hkv, d, dtype=torch.bfloat16)
    cache = PagedKVCache.from_sglang(kb, kb.clone(), ps, alloc_summaries(pages * ps, bs, hkv, d, kb.dtype))
    q = torch.zeros(tokens, hq, d, dtype=kb.dtype)
    kv = torch.zeros(tokens, hkv, d, dtype=kb.dtype) if write else None
    slots = torch.arange(tokens, dtype=torch.int64) if write else None
    bt = torch.arange(pages, dtype=torch.int32)[None]
    cu = torch.tensor([0, tokens], dtype=torch.int32)
    seq_lens = torch.tensor([tokens], dtype=torch.int32)
    head_cls = torch.zeros(hkv, d, dtype=kb.dtype)
    out = torch.empty_like(q)
    return lambda: pf.paged_dash_prefill_triton(q, kv, kv, cache, bt, cu, seq_lens, slots, head_cls, params, out=out,
                                                workspace=workspace)


def host_counts(call) -> HostCounts:
    """Launches per kernel and ``torch.empty`` calls of one ``call()``."""
    with counted() as counts:
        call()
    return counts


def host_time(call, iters: int) -> float:
    """Microseconds of Python per ``call()`` (kernels replaced by counters), after a few warm-up calls."""
    with counted():
        for _ in range(5):
            call()
        start = time.perf_counter()
        for _ in range(iters):
            call()
        return (time.perf_counter() - start) / iters * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--write", action="store_true", help="pass the new K/V (the call writes them first)")
    ap.add_argument("--workspace", action="store_true",
                    help="share one PrefillWorkspace across calls (a layer after the first of an engine step)")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="print the N costliest functions")
    args = ap.parse_args(argv)
    call = make_call(args.tokens, args.write, workspace=PrefillWorkspace() if args.workspace else None)
    if args.workspace:
        host_counts(call)  # the first layer's call makes the plan and scratch
    counts = host_counts(call)
    print(f"tokens {args.tokens}, write {args.write}, workspace {args.workspace}: {sum(counts.launches.values())} launches "
          f"({', '.join(f'{k} {v}' for k, v in counts.launches.items())}), {counts.allocations} torch.empty calls")
    print(f"Python per call, launches not included: {host_time(call, args.iters):.1f} us")
    if args.profile:
        prof = cProfile.Profile()
        with counted():
            prof.enable()
            for _ in range(min(args.iters, 500)):
                call()
            prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
