"""Registers, spills and shared memory of each kernel a prefill or decode step launches, compiled for sm_90 on any
machine (no GPU needed): what ptxas reports for the kernels of ``ops.paged_dash_prefill`` and ``ops.paged_dash_decode``
on the Hopper paths.

The prefill step is ``host_time.py``'s (``--cases``: requests x tokens; bf16, Hq 32, Hkv 8, D 128, block and page 64,
topk 64; one layer), the decode step ``decode.py``'s (``--decode-cases``: batch x context, the same shape, with the
K/V write), with ``host_time.py``'s stand-ins for a GPU, except that each kernel's first launch compiles it for real
(Triton then ptxas, as on an H100 or H200) instead of standing in. Each case lists the kernel variants it compiled
first. A kernel edit can so be checked for spills, and for compiling at all, before a GPU run; a Gluon kernel cannot
run under ``TRITON_INTERPRET=1``.

    python benchmarks/kernel_resources.py                            # 16 x 1k, 1 x 32k; decode B 1 and 8 at 32k
    python benchmarks/kernel_resources.py --cases 1x131072 --tune gluon_regs=160 --decode-cases ""
    python benchmarks/kernel_resources.py --decode-cases 1x131072 --decode-tune attn_maxnreg=0 --cases ""
    python benchmarks/kernel_resources.py --sass out/sass               # and each kernel's SASS, a file each
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from types import SimpleNamespace

import host_time  # first: it puts the repository on the path, for dash_core and tests
import torch
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton import knobs
from triton.runtime import driver
from triton.runtime.jit import JITFunction

from common import tune_configs
from dash_core import DashParams, ops
from dash_core.kernels.decode.buffers import DecodeBuffers
from dash_core.kernels.decode.config import DecodeConfig
from dash_core.kernels.prefill.config import PrefillConfig
from decode import Layer, step_inputs

SM = 90


class _Hopper:
    """The parts of Triton's active driver that compiling asks for: an sm_90 target on device 0."""

    def get_current_target(self):
        return GPUTarget("cuda", SM, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def ptxas_resources(ptx: str) -> str:
    """What ptxas reports for ``ptx`` compiled as Triton compiles it (its ``.maxnreg`` included): registers, and
    bytes of spill stores and loads."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        out = subprocess.run([get_ptxas(SM).path, "-v", f"--gpu-name=sm_{SM}a", src, "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
    used = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    return (f"{used.group(1) if used else '?'} registers, "
            f"{'{} / {} bytes spilled (stores / loads)'.format(*spill.groups()) if spill else 'no spill line'}")


def write_sass(cubin: bytes, path: str) -> None:
    """The SASS of ``cubin`` (cuobjdump's listing) into ``path``."""
    with tempfile.TemporaryDirectory() as tmp:
        binary = os.path.join(tmp, "kernel.cubin")
        with open(binary, "wb") as f:
            f.write(cubin)
        sass = subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", binary], capture_output=True, text=True,
                              check=True).stdout
    with open(path, "w") as f:
        f.write(sass)


def compile_launches(sass_dir=None) -> dict:
    """Make each kernel's first launch compile it for sm_90 and record its resources (launching nothing): returns
    the record, ``{"name (n)": line}`` for the n-th variant of a kernel compiled, filled as the op launches; with
    ``sass_dir``, each variant's SASS also goes to ``sass_dir/name_n.sass``."""
    seen: dict = {}
    variants: collections.Counter = collections.Counter()  # kernel name -> variants compiled
    compile_run = JITFunction.run

    def first_launch(fn, *args, grid=None, warmup=False, **kwargs):
        kernel = compile_run(fn, *args, grid=grid, warmup=True, **kwargs)
        variants[fn.__name__] += 1
        seen[f"{fn.__name__} ({variants[fn.__name__]})"] = (
            f"{ptxas_resources(kernel.asm['ptx'])}, {kernel.metadata.shared} bytes of shared memory")
        if sass_dir:
            write_sass(kernel.asm["cubin"], os.path.join(sass_dir, f"{fn.__name__}_{variants[fn.__name__]}.sass"))
        return host_time._Compiled(fn.__name__)

    host_time.stand_in_for_a_gpu()
    driver.set_active(_Hopper())
    JITFunction.run = first_launch
    return seen


def decode_step(batch: int, context: int, layout: str, config: DecodeConfig) -> None:
    """One decode step with the K/V write, as ``decode.py`` builds it (its ``Layer``: Hq 32, Hkv 8, D 128, block and
    page 64, topk 64, bf16), on the CPU."""
    hkv, bs, dtype = 8, 64, torch.bfloat16
    layer = Layer(batch, context, hkv, 128, bs, bs, dtype, host_time.CPU, seed=1, layout=layout)
    q, k_new, v_new, seq, sf = step_inputs(SimpleNamespace(hq=32, head_dim=128), batch, context, hkv, layer, 1.0,
                                           host_time.CPU, dtype)
    params = DashParams(block_size=bs, topk=64, scaling_factor=sf)
    bufs = DecodeBuffers.for_step(q, layer.cache, layer.block_table, params, config=config)
    ops.paged_dash_decode(q, k_new, v_new, layer.cache, layer.block_table, seq, layer.slot_mapping, layer.head_cls,
                          params, out=torch.empty_like(q), buffers=bufs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="16x1024,1x32768", help="requests x tokens each, e.g. 1x2048,16x1024")
    ap.add_argument("--layout", choices=["sglang", "vllm"], default="sglang")
    ap.add_argument("--tune", default="", help="PrefillConfig settings, e.g. gluon_regs=160,attn_stages=2")
    ap.add_argument("--decode-cases", default="1x32768,8x32768", help="decode steps, batch x context each")
    ap.add_argument("--decode-tune", default="", help="DecodeConfig settings, e.g. attn_maxnreg=0")
    ap.add_argument("--sass", metavar="DIR", help="also write each kernel's SASS to DIR/NAME_N.sass")
    a = ap.parse_args(argv)
    config = tune_configs([a.tune] if a.tune else [], PrefillConfig())[-1][1]
    decode_config = tune_configs([a.decode_tune] if a.decode_tune else [], DecodeConfig())[-1][1]
    if a.sass:
        os.makedirs(a.sass, exist_ok=True)
    seen = compile_launches(a.sass)
    steps = [(f"prefill {case}, {a.layout}{' ' + a.tune if a.tune else ''}",
              lambda b, n: host_time.step(*host_time.build(b, n, 1, a.layout), config), case)
             for case in filter(None, a.cases.split(","))]
    steps += [(f"decode {case}, {a.layout}{' ' + a.decode_tune if a.decode_tune else ''}",
               lambda b, n: decode_step(b, n, a.layout, decode_config), case)
              for case in filter(None, a.decode_cases.split(","))]
    for title, run, case in steps:
        before = set(seen)
        run(*(int(x) for x in case.split("x")))
        print(f"{title}:")
        for key in sorted(set(seen) - before):
            print(f"  {key}: {seen[key]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
