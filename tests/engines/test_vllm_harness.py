"""Engine-free vLLM harness: a real ``Attention`` layer on the DASH backend, vLLM's metadata
objects and cache layout, driven through the builder and the impl, compared with the oracle.

One step mixes two decodes (one of which completes a block, so its summary is written in the
same step), a chunked-prefill continuation, a prefix-cache hit (a request whose first pages are
another request's pages: their summaries were written by that request) and a fresh prefill, on
non-contiguous block ids with block 0 unused (vLLM's null block).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from dash_core import DashParams, dash_reference  # noqa: E402
from dash_core.reference import block_summaries  # noqa: E402

from tests.engines._vllm_support import (allocate_kv_cache, budget, common_metadata, dash_layer,  # noqa: E402
                                         engine_config, slots)
from tests.tiny_dash_llama import write_checkpoint  # noqa: E402

pytestmark = pytest.mark.engine_vllm
_budget = budget("harness", 60)

BS, HQ, HKV, D = 16, 4, 2, 32
NUM_BLOCKS = 48
# (full length L, new tokens this step, history source): history is written in earlier steps, except
# for "shared", whose first pages are request 2's.
REQUESTS = [(37, 1), (48, 1), (69, 29), (52, 20), (70, 70)]
SHARED_PAGES = 2  # request 3 reuses request 2's first two pages

# The paged path evaluates the oracle's float64 math on the same fp32 K/V it stored, and its summaries
# are the oracle's rounded to fp32, so outputs agree to float32 rounding of the result.
ATOL = 2e-6


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny"))
    write_checkpoint(path, chunk_size=BS)
    return engine_config(path, block_size=BS)


def _requests(seed: int):
    """Random q/k/v per request; request 3's first pages hold request 2's keys and values."""
    g = torch.Generator().manual_seed(seed)
    data = []
    for length, _ in REQUESTS:
        data.append([torch.randn(length, h, D, generator=g) * 2 for h in (HQ, HKV, HKV)])
    shared = SHARED_PAGES * BS
    for x in (1, 2):
        data[3][x][:shared] = data[2][x][:shared]
    return data


def _block_tables(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    free = (torch.randperm(NUM_BLOCKS - 1, generator=g) + 1).tolist()  # block 0 stays unused
    width = max(-(-length // BS) for length, _ in REQUESTS)
    table = torch.zeros(len(REQUESTS), width, dtype=torch.int32)
    for i, (length, _) in enumerate(REQUESTS):
        for j in range(-(-length // BS)):
            table[i, j] = table[2, j] if (i == 3 and j < SHARED_PAGES) else free.pop()
    return table


def _run_step(layer, builder, kv, table, data, requests):
    """One engine step over ``requests`` (index, first position, last position + 1)."""
    q, k, v, sm = [], [], [], []
    for i, lo, hi in requests:
        q.append(data[i][0][lo:hi])
        k.append(data[i][1][lo:hi])
        v.append(data[i][2][lo:hi])
        sm.append(slots(table[i], range(lo, hi), BS))
    q, k, v, sm = (torch.cat(x) for x in (q, k, v, sm))
    rows = [table[i] for i, _, _ in requests]
    meta = common_metadata([hi - lo for _, lo, hi in requests], [hi for _, _, hi in requests],
                           torch.stack(rows), sm)
    md = builder.build(0, meta)
    layer.impl.do_kv_cache_update(layer, k, v, kv, sm)
    out = torch.full_like(q, float("nan"))
    layer.impl.forward(layer, q, k, v, kv, md, output=out)
    return md, out


PARAMS = {
    "sparse-kv_head": DashParams(block_size=BS, topk=2, scaling_factor=2.0),
    "sparse-shared-local32": DashParams(block_size=BS, topk=1, local=32, scaling_factor=3.0, router="shared"),
    "uncapped-diag": DashParams(block_size=BS, scaling_factor=1.5, estimate_diagonal=True, sigma=4.0),
    "dense-equivalent": DashParams.dense_equivalent(BS),
}


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
@pytest.mark.parametrize("name", list(PARAMS))
def test_mixed_batch_matches_oracle(vllm_config, name, layout):
    params = PARAMS[name]
    head_cls = torch.randn(HKV, D, generator=torch.Generator().manual_seed(7)) * 2
    layer, spec, builder = dash_layer(vllm_config, params, head_cls)
    _, kv = allocate_kv_cache(spec, NUM_BLOCKS, layout)
    data, table = _requests(1), _block_tables(2)

    # Earlier steps: the histories (request 2's in two chunks; request 3 has none of its own).
    _run_step(layer, builder, kv, table, data, [(0, 0, 36), (1, 0, 47), (2, 0, 24)])
    _run_step(layer, builder, kv, table, data, [(2, 24, 40)])
    # This step, ordered as vLLM orders it: decodes, then extends and prefills.
    step = [(i, length - new, length) for i, (length, new) in enumerate(REQUESTS)]
    md, out = _run_step(layer, builder, kv, table, data, step)
    assert (md.num_decodes, md.num_prefills) == (2, 3)

    row, far_from_dense = 0, 0.0
    for i, (length, new) in enumerate(REQUESTS):
        q, k, v = (x.permute(1, 0, 2)[None] for x in data[i])
        rows = list(range(length - new, length))
        ref, _ = dash_reference(q, k, v, head_cls, params, rows=rows)
        got = out[row: row + new].permute(1, 0, 2)
        torch.testing.assert_close(got, ref[0].to(got.dtype), atol=ATOL, rtol=0, msg=f"request {i} ({name})")
        dense, _ = dash_reference(q, k, v, head_cls, DashParams.dense_equivalent(BS), rows=rows)
        far_from_dense = max(far_from_dense, (dense[0] - ref[0]).abs().max().item())
        row += new
    # The sparse configurations really route (this batch would expose a dense fallback).
    assert (far_from_dense < 1e-5) == (name == "dense-equivalent"), far_from_dense

    # Every complete block's summary is in its page's padding, equal to the oracle's (exactly: both
    # round the same float64 value to fp32).
    from adapters.vllm.backend import summary_view

    store = summary_view(kv, HKV, D)
    for i, (length, _) in enumerate(REQUESTS):
        k = data[i][1].permute(1, 0, 2)
        ref = block_summaries(k, head_cls, BS)  # [Hkv, nblk, D]
        for j in range(length // BS):
            torch.testing.assert_close(store[table[i, j]].double(), ref[:, j], atol=0, rtol=0)
    assert layer.impl.stats["forwards"] == 3


def test_padded_decode_batch_uses_persistent_buffers(vllm_config):
    """The CUDA-graph contract on the CPU: decode metadata lives at fixed addresses, and a
    padding request (query length 0, seq_len 0) gets a zero row, not NaN."""
    params = DashParams(block_size=BS, topk=2, scaling_factor=2.0)
    head_cls = torch.randn(HKV, D)
    layer, spec, builder = dash_layer(vllm_config, params, head_cls)
    _, kv = allocate_kv_cache(spec, NUM_BLOCKS)
    data, table = _requests(3), _block_tables(4)
    _run_step(layer, builder, kv, table, data, [(0, 0, 36), (1, 0, 47), (2, 0, 68)])

    ptrs = None
    for step in range(2):
        lens = [37 + step * 0, 48, 69]
        q = torch.cat([data[i][0][n - 1: n] for i, n in enumerate(lens)] + [torch.zeros(1, HQ, D)])
        k = torch.cat([data[i][1][n - 1: n] for i, n in enumerate(lens)] + [torch.zeros(1, HKV, D)])
        v = torch.cat([data[i][2][n - 1: n] for i, n in enumerate(lens)] + [torch.zeros(1, HKV, D)])
        sm = torch.cat([slots(table[i], range(n - 1, n), BS) for i, n in enumerate(lens)] + [torch.tensor([-1])])
        bt = torch.cat([table[:3], torch.zeros(1, table.shape[1], dtype=torch.int32)])
        meta = common_metadata([1, 1, 1, 0], lens + [0], bt, sm)
        meta.num_actual_tokens = 4
        md = builder.build(0, meta)
        assert md.num_decodes == 4 and md.num_prefills == 0
        now = (md.decode_seq_lens.data_ptr(), md.decode_block_table.data_ptr())
        assert ptrs is None or now == ptrs
        ptrs = now
        layer.impl.do_kv_cache_update(layer, k, v, kv, sm)
        out = torch.full_like(q, float("nan"))
        layer.impl.forward(layer, q, k, v, kv, md, output=out)
        assert torch.equal(out[3], torch.zeros_like(out[3]))
        for i, n in enumerate(lens):
            qi, ki, vi = (x[:n].permute(1, 0, 2)[None] for x in data[i])
            ref, _ = dash_reference(qi, ki, vi, head_cls, params, rows=[n - 1])
            torch.testing.assert_close(out[i], ref[0, :, 0].to(out.dtype), atol=ATOL, rtol=0)
