"""The prefill benchmark's two forms of a mixed step (decode tokens at a long context and one prompt chunk) compute
the same attention: SGLang's, one ``paged_dash_prefill`` call a layer, and vLLM's (``vllm_mixed_step``), a K/V write,
a ``paged_dash_decode`` call for the decode rows and a ``paged_dash_prefill`` call for the chunk on a block table as
wide as the chunk's pages. The benchmark times both; this checks that the second form is the same step."""

from __future__ import annotations

import pytest
import torch

from dash_core import DashParams
from tests._benchmarks import import_benchmark
from tests.kernels._kernel_env import KERNEL_DEVICE
from tests.kernels._kernel_ops import kernel_prefill

pytest.importorskip("triton")
# Two kernels route the decode rows (the decode launches and the prefill route): a block at the entmax threshold
# may go either way between them, which moves a whole (token, head) row; at most this fraction may differ.
MAX_DIFFERING_ROWS = 0.05


def test_vllm_form_of_the_mixed_step_attends_as_the_one_call_form():
    prefill = import_benchmark("prefill")
    cuda = KERNEL_DEVICE == "cuda"
    nd, dctx, nc, hq, hkv, d, bs, ps = 3, 400, 96, 8, 2, 64, 16, 32
    m = prefill.MixedStep(nd, dctx, nc, hq, hkv, d, bs, ps, torch.bfloat16, torch.device(KERNEL_DEVICE), 0.95, cuda,
                          1, "sglang")
    params = DashParams(block_size=bs, topk=4, scaling_factor=1.0)
    one = torch.full_like(m.q[0], float("nan"))
    kernel_prefill(m.q[0], m.k[0], m.v[0], m.caches[0], m.block_table, m.cu, m.seq, m.slot_mapping, m.head_cls,
                   params, out=one)
    split = torch.full_like(m.q[0], float("nan"))
    prefill.vllm_mixed_step(m, params, split, cuda)()
    assert torch.isfinite(one).all() and torch.isfinite(split).all()  # every row written, by both forms
    err = (split.float() - one.float()).abs().amax(-1)  # [T, Hq]
    differing = (err > 2e-2 + 2e-2 * one.float().abs().amax(-1)).float().mean().item()
    assert differing <= MAX_DIFFERING_ROWS, f"{differing:.1%} of (token, head) rows differ"
    assert err.median().item() < 1e-2  # the rows that route alike agree to bf16 rounding
