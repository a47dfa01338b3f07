"""Host time of an eager prefill layer, on any machine (no GPU): the CPU side of ``ops.paged_dash_prefill`` on the
kernels' path, every launch a no-op (``--cuda``: on a GPU, the launches real).

An eager prefill layer (vLLM's piecewise graphs leave attention eager; SGLang runs prefill eagerly) costs the host its
validation, the step's plan at the first layer, and three or four kernel launches; for short prompts that can exceed
the GPU's time. This runs the op as ``prefill.py --preset serving`` does (``--layers`` layers, each with its own
inputs and cache, sharing one ``PrefillWorkspace``; bf16, Hq 32, Hkv 8, D 128, block and page 64, topk 64) with
stand-ins below the launch: Triton's JIT launch returns a stand-in compiled kernel whose launch does nothing, and the
CPU device answers as an NVIDIA Hopper GPU, so that the op takes the kernel paths it takes on an H100 or H200 (TMA
descriptors, programmatic dependent launches, the Gluon attention where a wave is long enough).

Left out: what a compiled kernel's launcher does with its arguments (parsing them, encoding each TMA descriptor) and
the CUDA driver's launch, a few us a launch together; the CUDA allocator; the slot guard's reduction (CUDA only),
where the CPU reads the slots on the host once a step instead. A launch through Triton's JIT after the warm-up (a
kernel without ``@cached_launch``, or a variant not kept) is listed as ``name (jit)``: the stand-in makes it cheap
where a GPU pays Triton's whole binding. The figures compare revisions on one machine; the GPU run's ``host`` column
(``prefill.py --preset serving``) is the figure to quote.

    python benchmarks/host_time.py                             # 1 x 256, 1 x 2k, 16 x 1k: host time a layer
    python benchmarks/host_time.py --cases 1x2048 --profile    # where it goes (cProfile, cumulative)
    python benchmarks/host_time.py --layout vllm               # vLLM's head-major cache
    python benchmarks/host_time.py --tune gluon_min_tiles=0    # a kernel setting beside the defaults
    python benchmarks/host_time.py --cuda [--profile]          # on a GPU: the real launches (synchronised before
                                                               #   each step, not after), what the stand-ins leave out
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import gc
import os
import pstats
import statistics
import sys
import time
import warnings
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("host_time.py measures the compiled kernels' launch path: run it without TRITON_INTERPRET=1")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import CUDABackend  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dash_core import DashParams, ops  # noqa: E402
from dash_core.kernels.launcher import CachedLaunch  # noqa: E402
from dash_core.kernels.prefill.config import PrefillConfig  # noqa: E402
from dash_core.workspace import PrefillWorkspace  # noqa: E402
from common import tune_configs  # noqa: E402
from prefill import Layers, Prompt  # noqa: E402

CPU = torch.device("cpu")
LAUNCHES: collections.Counter = collections.Counter()  # kernel name -> launches


class _Compiled:
    """What a compiled kernel's launch needs (``launcher._run``), launching nothing."""

    function = 0
    packed_metadata = None

    def __init__(self, name: str) -> None:
        self.name = name

    def run(self, *args) -> None:
        LAUNCHES[self.name] += 1


def _first_launch(fn, *args, grid=None, warmup=False, **kwargs):
    """``JITFunction.run``'s stand-in: a launch through Triton's JIT (where Triton compiles, and launches)."""
    LAUNCHES[fn.__name__ + " (jit)"] += 1
    return _Compiled(fn.__name__)


def stand_in_for_a_gpu() -> None:
    """Make the CPU take the op's Hopper kernel path with launches that do nothing."""
    backend = CUDABackend(GPUTarget("cuda", 90, 32))
    triton.runtime.jit.JITFunction.run = _first_launch
    with warnings.catch_warnings():  # (gc meets deprecated module attributes)
        warnings.simplefilter("ignore")
        kernels = [o for o in gc.get_objects() if isinstance(o, CachedLaunch)]
    for kernel in kernels:  # what Triton's binder would specialise with on an sm_90 device
        kernel._backends[0] = backend
    torch.cuda.current_device = lambda: 0
    torch._C._cuda_getCurrentRawStream = lambda device: 0
    answers = {"nvidia_capability": lambda device: (9, 0), "uses_kernels": lambda device, dtype: True}
    for module in [m for name, m in sys.modules.items() if name.split(".")[0] == "dash_core"]:
        for name, answer in answers.items():  # wherever the name was imported
            if hasattr(module, name):
                setattr(module, name, answer)


def build(batch: int, n: int, layers: int, layout: str, device: torch.device = CPU):
    """``(layers, tables, params)`` as ``prefill.py --preset serving`` builds a step (its ``Prompt`` and ``Layers``,
    the shape of the serving rows): each layer's ``(q, k, v, cache, head_cls, out)`` and the step's tables
    ``(block_table, cu_seqlens_q, seq_lens, slot_mapping)`` for ``batch`` prompts of ``n`` tokens."""
    hq, hkv, d, bs = 32, 8, 128, 64
    pr = Prompt(n, hq, hkv, d, bs, bs, torch.bfloat16, device, seed=11, q_corr=0.0, cuda=device.type == "cuda",
                layout=layout, batch=batch)
    out = torch.empty_like(pr.q)
    items = [(q, k, v, cache, pr.head_cls, out) for q, k, v, cache in Layers(pr, layers, layout, bs).items]
    return items, (pr.block_table, pr.cu, pr.seq, pr.slot_mapping), DashParams(block_size=bs, topk=64,
                                                                                scaling_factor=1.0)


def step(layers, tables, params, config=None) -> None:
    """One engine step: every layer's call, sharing one workspace (of ``config``: the default when None)."""
    bt, cu, seq, slots = tables
    ws = PrefillWorkspace(config)
    for q, k, v, cache, head_cls, out in layers:
        ops.paged_dash_prefill(q, k, v, cache, bt, cu, seq, slots, head_cls, params, out=out, workspace=ws)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="1x256,1x2048,16x1024", help="requests x tokens each, e.g. 1x2048,16x1024")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30, help="timed steps a case (the minimum is reported)")
    ap.add_argument("--layout", choices=["sglang", "vllm"], default="sglang")
    ap.add_argument("--profile", action="store_true", help="cProfile of the first case's steps instead")
    ap.add_argument("--sort", default="cumulative", help="the profile's order (pstats: cumulative, tottime, ...)")
    ap.add_argument("--cuda", action="store_true",
                    help="launch for real on the GPU (synchronised before each step, so each issues to an idle GPU)")
    ap.add_argument("--tune", action="append", default=[],
                    help="PrefillConfig settings timed after the defaults, e.g. --tune gluon_min_tiles=0 (the profile "
                         "takes the last)")
    a = ap.parse_args(argv)
    tunings = tune_configs(a.tune, PrefillConfig())
    cases = [tuple(int(x) for x in c.split("x")) for c in a.cases.split(",")]
    device = torch.device("cuda") if a.cuda else CPU
    if a.cuda and not torch.cuda.is_available():
        ap.error("--cuda needs a CUDA device")
    if not a.cuda:
        stand_in_for_a_gpu()
    sync = torch.cuda.synchronize if a.cuda else (lambda: None)
    for batch, n in cases:
        built = build(batch, n, a.layers, a.layout, device)
        for tag, config in tunings[-1:] if a.profile else tunings:
            for _ in range(3):  # variants "compiled", plans and kept cache arguments made
                step(*built, config)
            LAUNCHES.clear()
            if a.profile:
                prof = cProfile.Profile()
                for _ in range(a.steps):
                    sync()
                    prof.enable()
                    step(*built, config)
                    prof.disable()
                pstats.Stats(prof, stream=sys.stdout).sort_stats(a.sort).print_stats(30)
                return 0
            per_layer = []
            for _ in range(a.steps):
                sync()
                t0 = time.perf_counter()
                step(*built, config)
                per_layer.append((time.perf_counter() - t0) / a.layers * 1e6)
            launches = {name: count // a.steps if count % a.steps == 0 else count / a.steps
                        for name, count in sorted(LAUNCHES.items())}
            sync()
            where = "cuda" if a.cuda else f"launches a step: {launches}"
            print(f"{batch} x {n}, {a.layers} layers, {a.layout}{tag}: {min(per_layer):.1f} us a layer (min of "
                  f"{a.steps} steps; median {statistics.median(per_layer):.1f}); {where}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
