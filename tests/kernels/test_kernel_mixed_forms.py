"""The prefill benchmark's two forms of a mixed step (decode tokens at a long context and one prompt chunk) compute
the same attention: SGLang's, one ``paged_dash_prefill`` call a layer that writes K/V too, and vLLM's
(``vllm_mixed_step``), the K/V write (``cache_dash_prefill``) and then the same call without it. The benchmark times
both; this checks that the second form is the same step, bit for bit."""

from __future__ import annotations

import pytest
import torch

from dash_core import DashParams
from tests._benchmarks import import_benchmark
from tests.kernels._kernel_env import KERNEL_DEVICE
from tests.kernels._kernel_ops import kernel_prefill

pytest.importorskip("triton")


def test_vllm_form_of_the_mixed_step_attends_as_the_one_call_form():
    prefill = import_benchmark("prefill")
    cuda = KERNEL_DEVICE == "cuda"
    nd, dctx, nc, hq, hkv, d, bs, ps = 3, 400, 96, 8, 2, 64, 16, 32
    params = DashParams(block_size=bs, topk=4, scaling_factor=1.0)
    forms = {}
    for form in ("one call", "vllm"):  # each on a cache of its own (the step writes the new tokens)
        m = prefill.MixedStep(nd, dctx, nc, hq, hkv, d, bs, ps, torch.bfloat16, torch.device(KERNEL_DEVICE), 0.95,
                              cuda, 1, "sglang")
        out = torch.full_like(m.q[0], float("nan"))
        if form == "vllm":
            prefill.vllm_mixed_step(m, params, out, cuda)()
        else:
            kernel_prefill(m.q[0], m.k[0], m.v[0], m.caches[0], m.block_table, m.cu, m.seq, m.slot_mapping,
                           m.head_cls, params, out=out)
        forms[form] = out
    assert not forms["vllm"].isnan().any()  # every row written
    assert torch.equal(forms["vllm"], forms["one call"])
