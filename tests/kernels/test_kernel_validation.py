"""Unsupported configurations are rejected with a ValueError before any kernel runs."""

from __future__ import annotations

import pytest
import torch

from dash_core import DashParams
from dash_core.kernels.decode.buffers import DecodeBuffers
from dash_core.layout import PagedKVCache, alloc_summaries
from tests.kernels._kernel_env import KERNEL_DEVICE
from tests.kernels._kernel_ops import kernel_decode

DEV = KERNEL_DEVICE


def make(hq=4, hkv=2, d=64, ps=16, bs=16, dtype=torch.bfloat16, summaries=True, n=2, pages=8):
    slots = pages * ps
    kb = torch.zeros(slots, hkv, d, dtype=dtype, device=DEV)
    vb = torch.zeros(slots, hkv, d, dtype=dtype, device=DEV)
    summ = alloc_summaries(slots, bs, hkv, d, dtype, DEV) if summaries and ps % bs == 0 else None
    cache = PagedKVCache.from_sglang(kb, vb, ps, summ)
    q = torch.zeros(n, hq, d, dtype=dtype, device=DEV)
    k = torch.zeros(n, hkv, d, dtype=dtype, device=DEV)
    bt = torch.zeros(n, 3, dtype=torch.int32, device=DEV)
    seq = torch.ones(n, dtype=torch.int32, device=DEV)
    slots_ = torch.zeros(n, dtype=torch.int64, device=DEV)
    hc = torch.zeros(hkv, d, dtype=dtype, device=DEV)
    return dict(q=q, k=k, v=k.clone(), cache=cache, block_table=bt, seq_lens=seq, slot_mapping=slots_, head_cls=hc)


def run(a, params, **kw):
    before = a["cache"].k_pages.clone()
    with pytest.raises(ValueError) as e:
        kernel_decode(a["q"], a["k"], a["v"], a["cache"], a["block_table"], a["seq_lens"],
                                          a["slot_mapping"], a["head_cls"], params, **kw)
    assert torch.equal(a["cache"].k_pages, before), "nothing may be written before the error"
    return str(e.value)


@pytest.mark.parametrize("case, needle", [
    (dict(dtype=torch.float32), "dtype"),
    (dict(d=96), "head_dim = 96"),
    (dict(d=32), "head_dim = 32"),
    (dict(hq=34, hkv=2), "GQA group"),
    (dict(ps=512, bs=16), "page size = 512"),
    (dict(ps=24, bs=16), "multiple of the DASH block size"),
    (dict(summaries=False), "summary store"),
])
def test_rejects_unsupported_shapes(case, needle):
    bs = case.get("bs", 16)
    assert needle in run(make(**case), DashParams(block_size=bs))


def test_rejects_block_size_256():
    assert "block_size = 256" in run(make(ps=256, bs=256), DashParams(block_size=256))


def test_rejects_bad_metadata_and_buffers():
    p = DashParams(block_size=16)
    a = make()
    a["block_table"] = a["block_table"].to(torch.int64)
    assert "block_table" in run(a, p)
    a = make()
    a["seq_lens"] = a["seq_lens"][:1]
    assert "seq_lens" in run(a, p)
    a = make()
    a["v"] = None
    assert "together" in run(a, p)
    a = make()
    small = DecodeBuffers.allocate(1, 4, 2, 64, 16, 3, p, DEV)
    assert "batch 2 > max_batch 1" in run(a, p, buffers=small)
    wide = make()
    wide["block_table"] = torch.zeros(2, 9, dtype=torch.int32, device=DEV)
    narrow = DecodeBuffers.allocate(2, 4, 2, 64, 16, 3, p, DEV)
    assert "addresses 9 blocks > 3" in run(wide, p, buffers=narrow)
    capped = DecodeBuffers.allocate(2, 4, 2, 64, 16, 3, DashParams(block_size=16, topk=2), DEV)
    assert "selection" in run(make(), p, buffers=capped)
    odd = DecodeBuffers.allocate(2, 4, 2, 64, 16, 3, p, DEV)
    odd.mp = torch.zeros(2, 2, 7, device=DEV)[:, :, :3]  # rows of 7: a unit's list not in whole groups of 4
    assert "mp and mp_cand" in run(make(), p, buffers=odd)
