"""Compile every decode kernel for sm_90 (H200) on a machine without a GPU, as the launchers call them (Triton or
Gluon).

The interpreter runs kernels as Python, so it cannot catch what only the compiler rejects (loop-
carried type changes, non-constexpr globals, ...) or what only a GPU pays for (shared memory,
register spills). This script records the launches the host code makes for a set of supported
configurations (the kernels are replaced by recorders), compiles each distinct one with
``triton.compile`` for ``cuda:90`` (bundled ptxas) and prints one JSON line per variant with its
shared memory, ptxas register/spill report and SASS instruction count. Run without ``TRITON_INTERPRET``:

    python -m tests.kernels._kernel_compile_check
    python -m tests.kernels._kernel_compile_check --lines _decode_select_kernel   # each variant's SASS
                                                                                  # instructions per source line
"""

from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from functools import partial

import torch

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
from triton.tools.tensor_descriptor import TensorDescriptor

from dash_core import DashParams
from dash_core.kernels import kv_write
from dash_core.kernels.decode import attention as decode_attention, route as decode_route
from dash_core.kernels.decode.buffers import DecodeBuffers
from dash_core.kernels.decode.launch import paged_dash_decode_triton
from dash_core.layout import PagedKVCache, alloc_aux_sglang, alloc_summaries
from tests.kernels._ptxas import ptxas_usage, sass_lines

TARGET = GPUTarget("cuda", 90, 32)
MAX_SHARED = 227 * 1024  # H200: dynamic shared memory per block
DT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32", torch.int64: "i64"}
KERNELS = {  # module, attribute
    "_kv_write_kernel": kv_write, "_kv_rows_kernel": kv_write, "_decode_scores_kernel": decode_route,
    "_decode_select_kernel": decode_route,
    "_decode_attn_split_kernel": decode_attention, "_merge_kernel": decode_attention,
}


class _Recorder:
    def __init__(self, name, fn, calls):
        self.name, self.fn, self.calls = name, fn, calls

    def __getitem__(self, grid):
        def launch(*args, **kw):
            opts = {k: kw.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in kw}
            sig, attrs = {}, {}
            names = self.fn.arg_names
            nospec = set(getattr(self.fn, "do_not_specialize", ()))  # names or indices
            for i, (n, a) in enumerate(zip(names, args)):
                if isinstance(a, torch.Tensor):
                    sig[n] = "*" + DT[a.dtype]
                    attrs[(i,)] = [["tt.divisibility", 16]]
                elif isinstance(a, bool):
                    sig[n] = "i1"
                elif isinstance(a, int):
                    sig[n] = "i64" if abs(a) >= 2**31 else "i32"
                    if a % 16 == 0 and n not in nospec and i not in nospec:  # as Triton's launcher specializes
                        attrs[(i,)] = [["tt.divisibility", 16]]
                elif isinstance(a, float):
                    sig[n] = "fp32"
                elif isinstance(a, TensorDescriptor):
                    sig[n] = f"tensordesc<{DT[a.base.dtype]}{list(a.block_shape)}>"
                elif isinstance(a, GluonDescriptor):
                    sig[n] = f"tensordesc<{DT[a.base.dtype]}{list(a.block_shape)},{a.layout!r}>"
                else:
                    raise TypeError(f"{self.name}: argument {n} = {a!r}")
            for n in names[len(args):]:
                sig[n] = "constexpr"
            key = json.dumps([self.name, sig, kw, opts], sort_keys=True, default=str)
            self.calls[key] = (self.name, sig, kw, opts, {str(k): v for k, v in attrs.items()})
        return launch


def record_launches() -> dict:
    calls: dict = {}
    saved = {}
    for name, mod in KERNELS.items():
        saved[name] = getattr(mod, name)
        setattr(mod, name, _Recorder(name, saved[name], calls))
    try:
        configs = [  # (dtype, Hq, Hkv, D, bs, page_size, max_pages, DashParams kwargs)
            (torch.bfloat16, 32, 8, 128, 64, 64, 2048, dict(topk=64)),
            (torch.bfloat16, 32, 8, 128, 64, 64, 2048, dict(estimate_diagonal=True)),
            (torch.float16, 16, 1, 64, 16, 256, 64, dict(topk=16, router="shared")),
            (torch.bfloat16, 32, 2, 256, 128, 256, 40, dict(local=256)),
            (torch.bfloat16, 64, 64, 64, 32, 32, 100, dict(router="shared", topk=8)),
            (torch.bfloat16, 8, 2, 128, 16, 16, 10000, dict(topk=32, estimate_diagonal=True)),  # cap over tiles
        ]
        for dtype, hq, hkv, d, bs, ps, max_pages, pk in configs:
            p = DashParams(block_size=bs, **pk)
            num_pages = 4
            kb = torch.zeros(num_pages * ps, hkv, d, dtype=dtype)
            cache = PagedKVCache.from_sglang(kb, kb.clone(), ps, alloc_summaries(num_pages * ps, bs, hkv, d, dtype))
            for n in (1, 8, 32):  # 32: a wide batch (more (request, KV head) rows than multiprocessors at Hkv 8)
                q = torch.zeros(n, hq, d, dtype=dtype)
                k = torch.zeros(n, hkv, d, dtype=dtype)
                bt = torch.zeros(n, max_pages, dtype=torch.int32)
                seq = torch.ones(n, dtype=torch.int32)
                slots = torch.zeros(n, dtype=torch.int64)
                hc = torch.zeros(hkv, d, dtype=dtype)
                bufs = DecodeBuffers.for_step(q, cache, bt, p, num_sms=132)
                paged_dash_decode_triton(q, k, k, cache, bt, seq, slots, hc, p, buffers=bufs)
            kv_write.write_prefill(k, k, cache, slots, p, hc)
        for hi in (4, 16, 64):  # indexer models: iq [n, Hi, D] routes over the 1-head ik store (router shared)
            p = DashParams(block_size=64, topk=64)
            num_pages, ps, d = 4, 64, 128
            kb = torch.zeros(num_pages * ps, 8, d, dtype=torch.bfloat16)
            cache = PagedKVCache.from_sglang(kb, kb.clone(), ps, alloc_summaries(num_pages * ps, 64, 1, d, kb.dtype),
                                             aux=alloc_aux_sglang(num_pages * ps, d, kb.dtype))
            for n in (1, 8):
                q = torch.zeros(n, 32, d, dtype=kb.dtype)
                iq = torch.zeros(n, hi, d, dtype=kb.dtype)
                bt = torch.zeros(n, 2048, dtype=torch.int32)
                seq = torch.ones(n, dtype=torch.int32)
                bufs = DecodeBuffers.for_step(q, cache, bt, p, num_sms=132, indexer_heads=hi)
                paged_dash_decode_triton(q, None, None, cache, bt, seq, None, None, p, buffers=bufs, iq=iq)
    finally:
        for name, mod in KERNELS.items():
            setattr(mod, name, saved[name])
    return calls


def compile_variant(item):
    """The compiled kernel of one recorded launch ``(name, signature, constexprs, options, attributes)``, for
    ``TARGET``."""
    name, sig, consts, opts, attrs = item
    fn = getattr(KERNELS[name], name).fn  # the JITFunction inside the CachedLaunch
    source = GluonASTSource if isinstance(fn, GluonJITFunction) else ASTSource
    src = source(fn, sig, consts, {eval(k): v for k, v in attrs.items()})
    return triton.compile(src, target=TARGET, options=opts)


def _compile(item, lines_of=None):
    """The JSON record of one recorded launch; ``lines_of``: the kernel whose records also list their source lines
    with the most SASS instructions."""
    name, _, consts, opts, _ = item
    rec = {"kernel": name, "constexprs": consts, "options": opts}
    try:
        kern = compile_variant(item)
    except Exception as e:
        rec["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
        return rec
    rec["shared"] = kern.metadata.shared
    rec["registers"], rec["spill_bytes"] = ptxas_usage(kern.asm["ptx"])
    lines = sass_lines(kern.asm["cubin"])
    rec["instructions"] = sum(lines.values()) or None
    if name == lines_of:
        rec["lines"] = [f"{n} {f}:{line}" for (f, line), n in lines.most_common(25) if f is not None]
    return rec


def compile_all(record, compile_one, argv: list) -> int:
    """Record the launches (``record()``), compile each in a worker (``compile_one(item, lines_of)``), print one JSON
    line each. ``argv``: the command line (``--lines KERNEL``: that kernel's records list their busiest lines)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("run without TRITON_INTERPRET (the interpreter replaces the kernels)", file=sys.stderr)
        return 2
    lines_of = argv[argv.index("--lines") + 1] if "--lines" in argv[:-1] else None
    calls = record()
    with ProcessPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as ex:
        for rec in ex.map(partial(compile_one, lines_of=lines_of), calls.values()):
            print(json.dumps(rec), flush=True)
    return 0


def main() -> int:
    return compile_all(record_launches, _compile, sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
