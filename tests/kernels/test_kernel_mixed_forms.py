"""An engine may write a step's K/V itself before the attention (``cache_dash_prefill``, then the ops with ``k = v
= slot_mapping = None``) or let the op write them: on the benchmark's mixed step (decode tokens at a long context and
one prompt chunk in one ``paged_dash_prefill`` call), the two forms attend the same, bit for bit."""

from __future__ import annotations

import pytest
import torch

from dash_core import DashParams, ops
from tests._benchmarks import import_benchmark
from tests.kernels._kernel_env import KERNEL_DEVICE
from tests.kernels._kernel_ops import kernel_prefill

pytest.importorskip("triton")


def test_writing_first_attends_as_the_call_that_writes():
    prefill = import_benchmark("prefill")
    cuda = KERNEL_DEVICE == "cuda"
    nd, dctx, nc, hq, hkv, d, bs, ps = 3, 400, 96, 8, 2, 64, 16, 32
    params = DashParams(block_size=bs, topk=4, scaling_factor=1.0)
    forms = {}
    for form in ("one call", "write first"):  # each on a cache of its own (the step writes the new tokens)
        m = prefill.MixedStep(nd, dctx, nc, hq, hkv, d, bs, ps, torch.bfloat16, torch.device(KERNEL_DEVICE), 0.95,
                              cuda, 1, "sglang")
        out = torch.full_like(m.q[0], float("nan"))
        if form == "write first":
            ops.cache_dash_prefill(m.k[0], m.v[0], m.caches[0], m.slot_mapping, params, head_cls=m.head_cls)
            kernel_prefill(m.q[0], None, None, m.caches[0], m.block_table, m.cu, m.seq, None, m.head_cls, params,
                           out=out)
        else:
            kernel_prefill(m.q[0], m.k[0], m.v[0], m.caches[0], m.block_table, m.cu, m.seq, m.slot_mapping,
                           m.head_cls, params, out=out)
        forms[form] = out
    assert not forms["write first"].isnan().any()  # every row written
    assert torch.equal(forms["write first"], forms["one call"])
