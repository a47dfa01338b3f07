"""One DASH prefill of the benchmark's prompt for a profiler: a warm-up call (compiles), then one call
between ``cudaProfilerStart`` and ``cudaProfilerStop``, so that ``ncu --profile-from-start off`` sees the
kernels of that call only (``ci/gpu_profile_prefill.sh`` picks one wave of them).

    python benchmarks/prefill_profile.py --context 131072 --topk 64 --tune ATTN_STAGES=2

The prompt is ``benchmarks/prefill.py``'s (B 1, Hq 32, Hkv 8, D 128, block and page size 64, query
correlation 0.95); the K/V are written once, before the timed calls, which do not write.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prefill import Prompt, dash_fn  # noqa: E402

from dash_core import DashParams  # noqa: E402
from dash_core.kernels import prefill as pf  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--topk", default="64", help="an integer or none")
    ap.add_argument("--sf", type=float, default=1.4142, help="scaling_factor (the benchmark's at 128k)")
    ap.add_argument("--tune", default="", help="kernel constants, e.g. ATTN_STAGES=2,UNION_CHUNK=8")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    for kv in filter(None, a.tune.split(",")):
        k, v = kv.split("=")
        if not hasattr(pf, k):
            ap.error(f"--tune: {k} is not a constant of dash_core.kernels.prefill")
        setattr(pf, k, int(v))
    pr = Prompt(a.context, 32, 8, 128, 64, 64, torch.bfloat16, torch.device("cuda"), 11, 0.95, True)
    topk = None if a.topk.lower() == "none" else int(a.topk)
    fn = dash_fn(pr, DashParams(block_size=64, topk=topk, scaling_factor=a.sf), False, None, torch.empty_like(pr.q))
    fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
