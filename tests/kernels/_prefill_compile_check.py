"""Compile every prefill kernel launch for sm_90 (H200) on a machine without a GPU.

The prefill counterpart of ``_kernel_compile_check`` (whose recorder and compiler it reuses): records
the launches ``paged_dash_prefill_triton`` (K/V already written; the Gluon attention of ``prefill/gluon.py`` where it
serves on the H200) and the prefill K/V write make for a set of supported configurations (kernels replaced by
recorders), compiles each distinct one for ``cuda:90`` and prints one JSON line per variant (shared memory, ptxas
registers and spills).
Run without ``TRITON_INTERPRET``:

    python -m tests.kernels._prefill_compile_check [--lines _prefill_route_kernel]
"""

from __future__ import annotations

import sys

import torch

from dash_core import DashParams
from dash_core.kernels import kv_write
from dash_core.kernels.prefill import attention as pf_attention, gluon, route as pf_route, tiles as pf_tiles
from dash_core.kernels.prefill.config import PrefillConfig
from dash_core.kernels.prefill.launch import paged_dash_prefill_triton
from dash_core.layout import PagedKVCache, alloc_aux_sglang, alloc_summaries
from tests.kernels import _kernel_compile_check as kc

PREFILL_KERNELS = {"_prefill_route_kernel": pf_route, "_prefill_attn_kernel": pf_attention,
                   "_gather_summaries_kernel": pf_route,
                   "_tile_tables_kernel": pf_tiles, "_kv_rows_kernel": kv_write, "prefill_attn_ws": gluon}
# The device queries the launches make, answered as on the H200 while recording (module attribute -> stand-in).
AS_ON_H200 = {"tma_supported": lambda device: True, "sm90": lambda device: True, "sm_count": lambda device: 132}
kc.KERNELS.update(PREFILL_KERNELS)  # the shared compiler looks kernels up here

CONFIGS = [  # (dtype, Hq, Hkv, D, bs, page_size, max_pages, DashParams kwargs)
    (torch.bfloat16, 32, 8, 128, 64, 64, 2048, dict(topk=64)),  # the benchmark's shape
    (torch.bfloat16, 32, 8, 128, 64, 64, 16, dict(topk=64)),  # 1k, 4k and 8k tables: the scores in registers
    (torch.bfloat16, 32, 8, 128, 64, 64, 64, dict(topk=64)),
    (torch.bfloat16, 32, 8, 128, 64, 64, 128, dict(topk=64)),
    (torch.bfloat16, 32, 8, 128, 64, 64, 2048, dict(estimate_diagonal=True)),
    (torch.bfloat16, 32, 2, 128, 64, 128, 1024, dict(topk=256)),  # G = 16
    (torch.float16, 16, 1, 64, 16, 256, 64, dict(topk=16, router="shared")),
    (torch.bfloat16, 32, 2, 256, 128, 256, 40, dict(local=256)),  # D 256: 8 warps
    (torch.bfloat16, 24, 24, 64, 32, 32, 100, dict(topk=1, estimate_diagonal=True)),  # G = 1, 32 tokens a tile
    (torch.float16, 16, 4, 64, 64, 128, 64, dict(topk=8)),  # TMA boxes of D 64 in fp16, two blocks a page
    (torch.bfloat16, 16, 2, 256, 32, 64, 64, dict(topk=4)),  # TMA boxes of D 256 (8 warps)
    # tables of recompute_min_cand(G) blocks or more: routing from the summary copy
    (torch.bfloat16, 8, 8, 64, 32, 32, 1100, dict(topk=2)),  # G 1 (rows are units), [64, 64] copy boxes
    (torch.bfloat16, 32, 2, 256, 64, 64, 1100, dict(topk=8)),  # D 256: [32, 256] copy boxes, G 16
]
# Indexer models (docs/semantics.md section 9): routing runs on iq [T, Hi, D] over the 1-head ik store, router shared,
# with the attention heads' tile of QT tokens: QT * pow2(Hi) score rows per program.
INDEXER_CONFIGS = [  # (dtype, Hq, Hkv, D, bs, page_size, max_pages, DashParams kwargs, Hi)
    (torch.bfloat16, 32, 8, 128, 64, 64, 2048, dict(topk=64), 4),
    (torch.bfloat16, 32, 8, 128, 64, 64, 2048, dict(topk=64), 16),
    (torch.bfloat16, 32, 8, 128, 64, 64, 2048, dict(topk=64), 64),
]


def record_launches() -> dict:
    calls: dict = {}
    saved = {name: getattr(mod, name) for name, mod in PREFILL_KERNELS.items()}
    for name, mod in PREFILL_KERNELS.items():
        setattr(mod, name, kc._Recorder(name, saved[name], calls))
    # compiled for sm_90: as on the H200 (where the Gluon attention serves the configurations it supports); every
    # kernel module that took one of these names answers as there
    patched = [(mod, name, getattr(mod, name)) for mod in list(sys.modules.values())
               if getattr(mod, "__name__", "").startswith("dash_core.kernels") for name in AS_ON_H200
               if hasattr(mod, name)]
    for mod, name, _ in patched:
        setattr(mod, name, AS_ON_H200[name])
    try:
        configs = [c + (None,) for c in CONFIGS] + INDEXER_CONFIGS
        for dtype, hq, hkv, d, bs, ps, max_pages, pk, hi in configs:
            p = DashParams(block_size=bs, **pk)
            num_pages = 4
            kb = torch.zeros(num_pages * ps, hkv, d, dtype=dtype)
            summ = alloc_summaries(num_pages * ps, bs, 1 if hi else hkv, d, dtype)
            aux = alloc_aux_sglang(num_pages * ps, d, dtype) if hi else None
            cache = PagedKVCache.from_sglang(kb, kb.clone(), ps, summ, aux=aux)
            for t, n in ((40, 2),):
                q = torch.zeros(t, hq, d, dtype=dtype)
                bt = torch.zeros(n, max_pages, dtype=torch.int32)
                cu = torch.linspace(0, t, n + 1).to(torch.int32)
                seq = torch.full((n,), t, dtype=torch.int32)
                hc = None if hi else torch.zeros(hkv, d, dtype=dtype)
                iq = torch.zeros(t, hi, d, dtype=dtype) if hi else None
                for fuse in (True, False):  # short tables: routed by the attention launch, or a route launch
                    paged_dash_prefill_triton(q, None, None, cache, bt, cu, seq, None, hc, p, iq=iq,
                                              config=PrefillConfig(scratch_bytes=1 << 24, fuse_route=fuse))
                if not hi:  # cache_dash_prefill's write and summary launches, the prefill op's one launch
                    kv = torch.zeros(t, hkv, d, dtype=dtype)
                    for consecutive in (False, True):
                        kv_write.write_kv_and_summaries(kv, kv, cache, torch.arange(t), hc, bs, decode=False,
                                                        consecutive=consecutive)
    finally:
        for mod, name, value in patched:
            setattr(mod, name, value)
        for name, mod in PREFILL_KERNELS.items():
            setattr(mod, name, saved[name])
    return calls


def compile_one(item, lines_of=None):
    """``kc._compile`` in a worker that imported this module (so the prefill kernels are registered)."""
    return kc._compile(item, lines_of)


def main() -> int:
    return kc.compile_all(record_launches, compile_one, sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
