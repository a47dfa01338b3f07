"""A decode step whose attention stage runs on a segment backend (``backend=``) after the Triton
routing: equal to the fused Triton attention of the same step and to the oracle.

On the CPU the interpreter runs the routing kernels and the PyTorch segment attention (``"TORCH"``);
on a GPU the same test also runs FlashInfer and FlashAttention where they are installed.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from dash_core import DashParams
from dash_core import segments_paged
from dash_core.ops import paged_dash_decode
from tests.kernels._kernel_env import CUDA, KERNEL_DEVICE
from tests.kernels._kernel_ops import kernel_decode
from tests.kernels._kernel_scenarios import make_scenario
from tests.kernels.test_kernel_decode_e2e import MAX_DIFFERING_ROWS, row_errors

DEV = KERNEL_DEVICE
LIBRARIES = {"FLASHINFER": "flashinfer", "FLASH_ATTN": "flash_attn"}


def _backends():
    out = ["TORCH"]
    for name, module in LIBRARIES.items():
        have = CUDA and importlib.util.find_spec(module) is not None
        out.append(pytest.param(name, marks=[pytest.mark.gpu] + ([] if have else [pytest.mark.skip(
            reason=f"{name} needs CUDA and the {module} package")])))
    return out


CASES = [  # (lens, DashParams kwargs, scenario kwargs): both layouts, gathered and zero-copy, both routers
    ([200, 0, 17, 131], dict(scaling_factor=2.0, topk=4, local=32), dict(layout="sglang")),
    ([260, 48, 1], dict(scaling_factor=4.0, topk=3), dict(layout="vllm")),  # page = block: zero-copy
    ([190, 190], dict(scaling_factor=1.0, topk=5, router="shared"), dict(shared_prefix_pages=3)),
    ([240, 65, 0, 100], dict(scaling_factor=3.0, topk=2, local=32), dict(layout="vllm", pages_per_block=2)),
]


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("case", range(len(CASES)))
def test_segment_backend_equals_fused_kernel_and_oracle(backend, case):
    """Same routing, two attention stages: the outputs agree to the attention tolerance on every row
    (the selection is identical, only the summation order differs), and both match the oracle on all
    but the routing-discontinuity rows that the fused kernel's own test allows."""
    lens, pk, sk = CASES[case]
    p = DashParams(block_size=16, **pk)
    if CUDA:
        sk = dict(sk, device=DEV)
    fused = make_scenario(300 + case, lens, params=p, **sk).to(DEV)
    seg = make_scenario(300 + case, lens, params=p, **sk).to(DEV)
    out_fused = kernel_decode(fused.q, fused.k_new, fused.v_new, fused.cache, fused.block_table,
                                                  fused.seq_lens, fused.slot_mapping, fused.head_cls, p)
    out_seg = kernel_decode(seg.q, seg.k_new, seg.v_new, seg.cache, seg.block_table,
                                                seg.seq_lens, seg.slot_mapping, seg.head_cls, p, backend=backend)
    # bf16 outputs of two fp32-accumulated summations of the same terms: a few bf16 ulps apart
    torch.testing.assert_close(out_seg.float().cpu(), out_fused.float().cpu(), atol=2e-2, rtol=2e-2)
    checked, bad = row_errors(seg, out_seg)
    assert bad <= MAX_DIFFERING_ROWS * checked, f"{bad} of {checked} rows differ from the oracle"


def test_zero_copy_choice_follows_the_layout():
    """vLLM-style head-major pages of one block fold per KV head; SGLang's token-major buffers do not."""
    p = DashParams(block_size=16, topk=2)
    assert segments_paged.zero_copy_possible(make_scenario(1, [40], params=p, layout="vllm").cache, p)
    assert not segments_paged.zero_copy_possible(make_scenario(1, [40], params=p, layout="sglang").cache, p)
    shared = DashParams(block_size=16, topk=2, router="shared")
    assert segments_paged.zero_copy_possible(make_scenario(1, [40], params=shared, layout="sglang").cache, shared)
    assert not segments_paged.zero_copy_possible(make_scenario(1, [40], params=p, layout="vllm",
                                                               pages_per_block=2).cache,
                                           p)


def test_bad_backend_config_fails_before_writing():
    """A segment backend without a cap (no static segment count), or an unknown backend, is refused
    by the op before the new K/V are written. (Block sizes and local windows are multiples of 16 by
    ``DashParams``' own rules, so the libraries' multiple-of-8 capacities always hold.)"""
    p = DashParams(block_size=16)
    sc = make_scenario(5, [40, 20], params=p)
    before = sc.cache.k_pages.clone()
    for backend, match in (("FLASHINFER", "topk = None is not allowed"), ("FLASH", "backend = 'FLASH'")):
        with pytest.raises(ValueError, match=match):
            paged_dash_decode(sc.q, sc.k_new, sc.v_new, sc.cache, sc.block_table, sc.seq_lens, sc.slot_mapping,
                              sc.head_cls, p, backend=backend)
        assert torch.equal(sc.cache.k_pages, before)
