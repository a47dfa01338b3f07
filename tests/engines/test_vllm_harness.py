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

import torch

from dash_core import DashParams, dash_reference
from dash_core.reference import block_summaries

from tests.engines._vllm_support import (allocate_kv_cache, budget, common_metadata, dash_layer,
                                         engine_config, slots)
from tests.tiny_dash_llama import write_checkpoint

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
    # This step, ordered as vLLM orders it: decodes, then extends and prefills; the table as wide as vLLM makes it
    # (max_model_len), the prefill's only as wide as the step's longest sequence.
    step = [(i, length - new, length) for i, (length, new) in enumerate(REQUESTS)]
    wide = torch.cat([table, torch.zeros(len(REQUESTS), 5, dtype=table.dtype)], 1)
    md, out = _run_step(layer, builder, kv, wide, data, step)
    assert (md.num_decodes, md.num_prefills) == (2, 3)
    # The decode rows ride in the prefill call as one-token extends; its table only as wide as the longest sequence.
    assert md.decodes_joined and md.prefill_seq_lens.tolist() == [n for n, _ in REQUESTS]
    assert md.prefill_block_table.shape == (len(REQUESTS), table.shape[1])
    assert table.shape[1] == -(-max(n for n, _ in REQUESTS) // BS)

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


def test_the_layers_of_a_step_share_its_prefill_workspace(vllm_config, monkeypatch):
    """Every prefill call of one step (two layers here) gets the step's ``PrefillWorkspace`` (on CUDA the first
    makes the plan and scratch, the second reuses them) and the very same table tensors (block table, lengths, slot
    mapping: the workspace checks them once); the next step's metadata brings a new one."""
    import adapters.vllm.backend as backend
    from dash_core.workspace import PrefillWorkspace

    seen = []
    real = backend.paged_dash_prefill

    tables = []

    def spy(*args, **kwargs):
        seen.append(kwargs.get("workspace"))
        tables.append(args[4:8])
        return real(*args, **kwargs)

    monkeypatch.setattr(backend, "paged_dash_prefill", spy)
    params = PARAMS["sparse-kv_head"]
    layer, spec, builder = dash_layer(vllm_config, params, torch.randn(HKV, D))
    _, kv = allocate_kv_cache(spec, NUM_BLOCKS, "LBHNC")
    data, table = _requests(3), _block_tables(4)
    md, out = _run_step(layer, builder, kv, table, data, [(0, 0, 36), (2, 0, 24)])
    again = torch.empty_like(out)
    q, k, v = (torch.cat([data[0][j][:36], data[2][j][:24]]) for j in range(3))
    layer.impl.forward(layer, q, k, v, kv, md, output=again)  # a second layer of the same step (writes the same)
    torch.testing.assert_close(again, out, atol=0, rtol=0)
    _run_step(layer, builder, kv, table, data, [(2, 24, 40)])
    assert len(seen) == 3 and all(isinstance(w, PrefillWorkspace) for w in seen)
    assert seen[0] is seen[1] is md.prefill_workspace and seen[2] is not seen[0]
    assert all(a is b for a, b in zip(tables[0], tables[1])) and tables[0][3] is md.prefill_slot_mapping
    assert torch.equal(md.prefill_slot_mapping, md.slot_mapping[:60])


def test_a_forward_without_metadata_reserves_the_prefill_scratch(tmp_path, monkeypatch):
    """vLLM sizes the KV cache from the memory peak of a forward without metadata (``profile_run``, with the
    most tokens a step schedules) and of the sampler run after it. There the impl reserves (on CUDA: holds)
    the most routing scratch a prefill of that many tokens takes, for the scheduler's ``max_num_seqs`` requests
    on block tables of ``max_model_len`` rounded up to whole pages, until the next forward with metadata
    releases it."""
    import adapters.vllm.backend as backend
    from dash_core.ops import prefill_scratch_bytes

    calls = []
    monkeypatch.setattr(backend, "reserve_prefill_scratch", lambda nbytes, device: calls.append((nbytes, device)))
    monkeypatch.setattr(backend, "release_prefill_scratch", lambda: calls.append("release"))
    write_checkpoint(str(tmp_path), chunk_size=BS)
    cfg = engine_config(str(tmp_path), block_size=BS, max_model_len=500, max_num_seqs=5)  # 500: 31.25 pages
    params = PARAMS["sparse-kv_head"]
    layer, spec, builder = dash_layer(cfg, params, torch.randn(HKV, D))
    _, kv = allocate_kv_cache(spec, NUM_BLOCKS, "LBHNC")
    t = cfg.scheduler_config.max_num_batched_tokens
    q = torch.randn(t, HQ, D)
    out = torch.zeros_like(q)
    layer.impl.forward(layer, q, q[:, :HKV], q[:, :HKV], kv, None, output=out)
    want = prefill_scratch_bytes(t, 5, 32 * BS, HQ, HKV, params)
    assert calls == [(want, q.device)] and want != prefill_scratch_bytes(t, 5, 500, HQ, HKV, params)
    assert not out.any()
    data, table = _requests(5), _block_tables(6)
    _run_step(layer, builder, kv, table, data, [(0, 0, 36)])
    assert calls[1:] == ["release"]


def test_forward_writes_the_cache_and_needs_key_and_value(vllm_config):
    """vLLM runs no cache-update op for the DASH backend (``forward_includes_kv_cache_update``): ``forward``
    writes K/V and summaries itself, so a call without key and value is refused before anything is written. The
    layer keeps its ``PagedKVCache`` views while vLLM passes the same cache tensor."""
    from adapters.vllm.backend import DashAttentionBackend

    assert DashAttentionBackend.forward_includes_kv_cache_update
    params = PARAMS["sparse-kv_head"]
    layer, spec, builder = dash_layer(vllm_config, params, torch.randn(HKV, D))
    _, kv = allocate_kv_cache(spec, NUM_BLOCKS)
    data, table = _requests(3), _block_tables(4)
    q = data[0][0][:20]
    meta = common_metadata([20], [20], table[:1], slots(table[0], range(20), BS))
    md = builder.build(0, meta)
    before = kv.clone()
    with pytest.raises(ValueError, match="needs the step's key and value"):
        layer.impl.forward(layer, q, None, None, kv, md, output=torch.empty_like(q))
    assert torch.equal(kv, before)
    _run_step(layer, builder, kv, table, data, [(0, 0, 20)])
    assert not torch.equal(kv, before)
    # the layer's PagedKVCache (with what the kernels derive from it) is kept while vLLM passes the same tensor
    assert layer.impl._cache(kv) is layer.impl._cache(kv)
    _, other = allocate_kv_cache(spec, NUM_BLOCKS)
    assert layer.impl._cache(other) is not layer.impl._cache(kv)


def test_padded_decode_batch_uses_persistent_buffers(vllm_config):
    """The CUDA-graph contract on the CPU: decode metadata lives at fixed addresses, and a
    padding request (query length 0, seq_len 0) gets a zero row, not NaN."""
    params = DashParams(block_size=BS, topk=2, scaling_factor=2.0)
    head_cls = torch.randn(HKV, D)
    layer, spec, builder = dash_layer(vllm_config, params, head_cls)
    _, kv = allocate_kv_cache(spec, NUM_BLOCKS)
    data, table = _requests(3), _block_tables(4)
    _run_step(layer, builder, kv, table, data, [(0, 0, 35), (1, 0, 46), (2, 0, 67)])

    ptrs = None
    for step in range(2):  # two steps of new lengths: the buffers are refilled in place, not only kept
        lens = [36 + step, 47 + step, 68 + step]
        q = torch.cat([data[i][0][n - 1: n] for i, n in enumerate(lens)] + [torch.zeros(1, HQ, D)])
        k = torch.cat([data[i][1][n - 1: n] for i, n in enumerate(lens)] + [torch.zeros(1, HKV, D)])
        v = torch.cat([data[i][2][n - 1: n] for i, n in enumerate(lens)] + [torch.zeros(1, HKV, D)])
        sm = torch.cat([slots(table[i], range(n - 1, n), BS) for i, n in enumerate(lens)] + [torch.tensor([-1])])
        bt = torch.cat([table[:3], torch.zeros(1, table.shape[1], dtype=torch.int32)])
        meta = common_metadata([1, 1, 1, 0], lens + [0], bt, sm)
        meta.num_actual_tokens = 4
        md = builder.build(0, meta)
        assert md.num_decodes == 4 and md.num_prefills == 0 and not md.decodes_joined
        now = (md.decode_seq_lens.data_ptr(), md.decode_block_table.data_ptr())
        assert ptrs is None or now == ptrs
        ptrs = now
        out = torch.full_like(q, float("nan"))
        layer.impl.forward(layer, q, k, v, kv, md, output=out)
        assert torch.equal(out[3], torch.zeros_like(out[3]))
        for i, n in enumerate(lens):
            qi, ki, vi = (x[:n].permute(1, 0, 2)[None] for x in data[i])
            ref, _ = dash_reference(qi, ki, vi, head_cls, params, rows=[n - 1])
            torch.testing.assert_close(out[i], ref[0, :, 0].to(out.dtype), atol=ATOL, rtol=0)


# --- the auxiliary head: indexer + page mode through a real layer (engine-free) ---

HI = 3


def _aux_layer(vllm_config, params, head_cls, head_cls_i, page_rope):
    """A real ``Attention`` layer on ``DashAuxAttentionBackend`` (Hkv + 1 KV heads), its spec and builder."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.worker.utils import customize_attention_spec

    from adapters.vllm.backend import AuxHead, DashAuxAttentionBackend, StepRoles

    aux = AuxHead(num_q_heads=HQ, indexer_heads=HI, page_rope=page_rope)
    name = "model.layers.0.self_attn.attn"
    with set_current_vllm_config(vllm_config):
        vllm_config.compilation_config.static_forward_context.pop(name, None)
        layer = Attention(aux.q_slots(HKV), D, D ** -0.5, num_kv_heads=HKV + 1, prefix=name,
                          cache_config=vllm_config.cache_config, attn_backend=DashAuxAttentionBackend,
                          head_cls=head_cls, dash_params=params, dash_aux=aux, head_cls_i=head_cls_i)
        spec = customize_attention_spec(DashAuxAttentionBackend, layer.get_kv_cache_spec(vllm_config))
        builder = DashAuxAttentionBackend.get_builder_cls()(spec, [name], vllm_config, torch.device("cpu"))
    layer.impl.step_roles = StepRoles()
    return layer, spec, builder, aux


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_indexer_page_mode_mixed_batch_matches_the_oracle(vllm_config, layout):
    """Step 1 prefills request 0 (text, two pages, a question); step 2 decodes it while request 1
    (adjacent pages, then text) is prefilled. The impl unpacks iq / ik from the layer's head slots,
    takes roles from ``StepRoles`` and positions from the builder (derived: this metadata carries
    none), and the ops apply page RoPE; the oracle gets q/k/iq/ik rotated at ``page_coordinates``."""
    from dash_core.rope import PageRopeSettings, RotarySettings, page_coordinates, page_rope

    params = DashParams(block_size=BS, topk=2, scaling_factor=2.0)
    rot = RotarySettings(theta=10000.0)
    settings = PageRopeSettings(rot, rot, None)
    g = torch.Generator().manual_seed(3)
    head_cls, head_cls_i = torch.randn(HKV, D, generator=g), torch.randn(D, generator=g) * 2
    layer, spec, builder, aux = _aux_layer(vllm_config, params, head_cls, head_cls_i, settings)
    _, kv = allocate_kv_cache(spec, NUM_BLOCKS, layout)
    free = (torch.randperm(NUM_BLOCKS - 1, generator=g) + 1).to(torch.int32)  # scattered; block 0 unused
    table = free[:10].view(2, 5)  # 5 pages (80 tokens) per request
    roles = [torch.tensor([0] * 5 + [1] + [2] * 19 + [1] + [2] * 14 + [0] * 9),  # 49 prompt tokens + 1 decode
             torch.tensor([1] + [2] * 16 + [1] + [2] * 20 + [0] * 30)]  # 68 prompt tokens
    lengths = [roles[0].numel() + 1, roles[1].numel()]
    data = [[torch.randn(n, h, D, generator=g) for h in (HQ, HKV, HKV, HI, 1)] for n in lengths]  # q k v iq ik

    def step(requests, step_roles):
        parts = [[data[i][x][lo:hi] for i, lo, hi in requests] for x in range(5)]
        q, k, v, iq, ik = (torch.cat(p) for p in parts)
        t, pad = q.shape[0], aux.q_slots(HKV) - HQ - HI
        query = torch.cat([q, iq, torch.zeros(t, pad, D)], 1)
        key, value = torch.cat([k, ik], 1), torch.cat([v, torch.zeros(t, 1, D)], 1)
        sm = torch.cat([slots(table[i], range(lo, hi), BS) for i, lo, hi in requests])
        meta = common_metadata([hi - lo for _, lo, hi in requests], [hi for _, _, hi in requests],
                               table[[i for i, _, _ in requests]], sm)
        md = builder.build(0, meta)
        layer.impl.step_roles.roles = step_roles
        out = torch.full_like(query, float("nan"))
        layer.impl.forward(layer, query, key, value, kv, md, output=out)
        return md, out[:, :HQ]

    n0 = roles[0].numel()
    step([(0, 0, n0)], roles[0])
    md, out = step([(0, n0, n0 + 1), (1, 0, lengths[1])], torch.cat([torch.zeros(1, dtype=torch.long), roles[1]]))
    assert (md.num_decodes, md.num_prefills) == (1, 1) and not md.decodes_joined  # page mode: two calls
    assert md.decode_positions.tolist() == [n0] and md.prefill_positions.tolist() == list(range(lengths[1]))
    assert md.decode_positions.data_ptr() == builder.graph_buffers.positions.data_ptr()  # persistent

    for i, rows in ((0, [n0]), (1, list(range(lengths[1])))):
        generated = lengths[i] - roles[i].numel()
        tok, page = page_coordinates(roles[i], generated=generated)
        q, k, v, iq, ik = data[i]
        q, k = page_rope(q, tok, page, settings), page_rope(k, tok, page, settings)
        iq, ik = page_rope(iq, tok, page, settings, main=False), page_rope(ik, tok, page, settings, main=False)
        ref, active = dash_reference(*(x.permute(1, 0, 2)[None] for x in (q, k, v)), head_cls, params, rows=rows,
                                     iq=iq.permute(1, 0, 2)[None], ik=ik[:, 0][None], head_cls_i=head_cls_i)
        got = out[:1] if i == 0 else out[1:]
        # fp32 cache and page RoPE in fp32 on both sides; the oracle's float64 math: fp32 rounding.
        torch.testing.assert_close(got.permute(1, 0, 2), ref[0], atol=1e-5, rtol=0, msg=f"request {i}")
        assert active[0, :, -1].max().item() < -(-lengths[i] // BS)  # the last row skips a block: routed
