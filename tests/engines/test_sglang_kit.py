"""The ``dash`` backend inside SGLang's own attention test kit (real pools, ForwardBatch, RadixAttention).

- Dense-equivalent configuration (docs/semantics.md section 1): extend and decode equal the kit's dense
  reference, on shuffled pages at page sizes 16 and 64 with block size 16.
- The kit's CUDA-graph contract (init_cuda_graph_state -> out_graph(in_capture) -> forward ->
  replay metadata from a padded SimpleNamespace view -> forward), at batch sizes 1 and 4.
- A sparse configuration (small topk, several blocks): a prefix prefill, a chunked extend over paged
  history and decode steps through the backend equal the float64 oracle ``dash_reference``.
- Start-up errors (page size, unsupported modes) and the pool-attached summary store.
"""

from __future__ import annotations

import types

import pytest
import torch

pytestmark = pytest.mark.engine_sglang
pytest.importorskip("sglang")

from dash_core import DashParams, dash_reference
from graphs.decode import DecodeGraphBuffers
from tests.engines._sglang_support import KitTestCase, budget, dash_kit, head_cls_for

_budget = budget("kit", 90)

BS = 16
DENSE = DashParams.dense_equivalent(block_size=BS)
F32 = dict(dtype=torch.float32, device="cpu")
# Both sides compute in float32 (the kit's reference) or float64 cast to float32 (DASH's CPU path), then
# apply the same o_proj over 4 heads x 16 dims: the outputs agree to a few float32 ulps of values of
# order 1; 1e-4 leaves a margin of about 100x and still catches any wrong key, block or weight.
ATOL = RTOL = 1e-4


def _case(kit, name, mode, page_size, prefix_lens, extend_lens=(), heads=(4, 2)):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return kit.DenseAttentionCase(name=name, backend="dash", forward_mode=getattr(ForwardMode, mode),
                                  num_heads=heads[0], num_kv_heads=heads[1], page_size=page_size,
                                  prefix_lens=prefix_lens, extend_lens=extend_lens)


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("mode,prefix_lens,extend_lens", [
    ("EXTEND", (0, 16, 35), (40, 9, 17)),  # fresh prompts, a page-aligned prefix, a prefix inside a block
    ("DECODE", (14, 15, 47, 63), ()),      # decode rows that end, start and straddle blocks
])
def test_dense_equivalent_matches_kit_reference(dash_kit, page_size, mode, prefix_lens, extend_lens):
    kit = dash_kit(DENSE)
    case = _case(kit, f"dash_{mode.lower()}_p{page_size}", mode, page_size, prefix_lens, extend_lens)
    fx = kit.build_dense_attention_fixture(KitTestCase(), case, max_context_len=128, **F32)
    actual = kit.run_dense_fixture_eager(fx)
    expected = kit.expected_dense_fixture_output(fx)
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("prefix_lens", [(37,), (14, 15, 16, 47)], ids=["bs1", "bs4"])
def test_cuda_graph_capture_replay_contract(dash_kit, page_size, prefix_lens, monkeypatch):
    """SGLang's capture -> replay simulation; the replay must equal the dense reference and eager, to this
    module's tolerance (the kit's own, 3e-2, is sized for bf16 kernels)."""
    from sglang.test.kits.attention_unittest.runner_modes import cuda_graph_decode_runner as runner

    monkeypatch.setattr(runner, "DENSE_ATOL", ATOL)
    monkeypatch.setattr(runner, "DENSE_RTOL", RTOL)
    kit = dash_kit(DENSE)
    case = _case(kit, f"dash_graph_p{page_size}_bs{len(prefix_lens)}", "DECODE", page_size, prefix_lens)
    runner.run_dense_cuda_graph_decode_case(KitTestCase(), case, max_context_len=128,
                                            cuda_graph_capture_batch_size=4, **F32)


def test_graph_buffers_are_static_and_refilled_in_place(dash_kit):
    """out_graph writes the live batch into the buffers init_cuda_graph_state made, never new ones."""
    kit = dash_kit(DENSE)
    case = _case(kit, "dash_graph_static", "DECODE", 16, (20, 40, 5))
    fx = kit.build_dense_attention_fixture(KitTestCase(), case, max_context_len=128, runner_batch_size=4, **F32)
    be, fb = fx.backend, fx.forward_batch
    be.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    bufs = be.graph_buffers  # graphs.decode owns every tensor the captured decode reads
    assert isinstance(bufs, DecodeGraphBuffers) and bufs.max_batch == 4
    assert bufs.q is None and bufs.slot_mapping is None  # SGLang owns q/k/v, the output and out_cache_loc
    assert bufs.kernel is None  # no Triton scratch where decode runs the PyTorch path (CPU)
    ptrs = (bufs.block_table.data_ptr(), bufs.seq_lens.data_ptr())
    view = types.SimpleNamespace(batch_size=3, forward_mode=fb.forward_mode, req_pool_indices=fb.req_pool_indices,
                                 seq_lens=fb.seq_lens, seq_lens_cpu=fb.seq_lens_cpu, out_cache_loc=fb.out_cache_loc)
    be.init_forward_metadata_out_graph(view, in_capture=True)
    md = be.forward_metadata
    assert (md.block_table.data_ptr(), md.seq_lens.data_ptr()) == ptrs
    r2t = fx.runner.req_to_token_pool.req_to_token
    want = r2t[fb.req_pool_indices.long(), ::16] // 16
    assert torch.equal(md.block_table, want.to(torch.int32))
    assert md.seq_lens.tolist() == [21, 41, 6]
    # A second step with other lengths lands in the same storage.
    view.seq_lens = fb.seq_lens + 1
    be.init_forward_metadata_out_graph(view)
    assert be.forward_metadata.seq_lens.data_ptr() == ptrs[1] and bufs.seq_lens[:3].tolist() == [22, 42, 7]
    assert be.graph_buffers is bufs
    assert be.get_cuda_graph_seq_len_fill_value() == 1


# ---- sparse configuration against the oracle ------------------------------------------------------

SPARSE = DashParams(block_size=BS, topk=2, scaling_factor=4.0)


def _run_steps(kit, fx, steps, loc_fn, max_context_len, graph_bs=0):
    """Run ``steps`` [(mode, prefix_lens, extend_lens, hidden)] through the fixture's module and backend.

    Returns the attention module's outputs per step. Every step is a real ForwardBatch over the same
    pools and req_to_token rows, so later steps read the K/V and summaries earlier steps wrote. With
    ``graph_bs``, decode steps take the CUDA-graph route: static buffers from ``init_cuda_graph_state``,
    a capture pass on an all-padding batch, then per step ``init_forward_metadata_out_graph`` on a
    replay view padded to ``graph_bs`` rows the way SGLang pads (req_pool_indices 0, seq_lens 1,
    out_cache_loc 0), and the backend's ``forward_decode`` on that view.
    """
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    mod, be = fx.actual_module, fx.backend

    def padded_view(batch, n):
        pad = graph_bs - n
        zeros = torch.zeros(pad, dtype=torch.int64)
        return types.SimpleNamespace(
            batch_size=graph_bs, forward_mode=ForwardMode.DECODE,
            req_pool_indices=torch.cat([batch.req_pool_indices[:n].long(), zeros]),
            seq_lens=torch.cat([batch.seq_lens[:n].long(), zeros + be.get_cuda_graph_seq_len_fill_value()]),
            out_cache_loc=torch.cat([batch.out_cache_loc[:n], zeros]))

    def graph_decode(view, hidden, in_capture=False):
        rows = torch.cat([hidden, torch.zeros(graph_bs - hidden.shape[0], hidden.shape[1])])
        q, k, v = mod.project_qkv(rows)
        be.init_forward_metadata_out_graph(view, in_capture=in_capture)
        out = be.forward_decode(q, k.view(-1, mod.num_kv_heads, mod.head_dim), v.view(-1, mod.num_kv_heads,
                                mod.head_dim), mod.attn, view, head_cls=mod.dash_head_cls)
        assert be.forward_metadata.block_table.data_ptr() == be.graph_buffers.block_table.data_ptr()  # static
        assert torch.isfinite(out).all()  # padded rows attend to one token of the padding slot: no NaN
        return mod.o_proj(out)[: hidden.shape[0]]

    outs = []
    with forward_context(ForwardContext(attn_backend=be)):
        if graph_bs:
            be.init_cuda_graph_state(max_bs=graph_bs, max_num_tokens=graph_bs)
        for mode, prefix_lens, extend_lens, hidden in steps:
            case = _case(kit, "step", mode, fx.case.page_size, prefix_lens, extend_lens)
            batch = kit._make_forward_batch(case, fx.runner, max_context_len=max_context_len, device="cpu",
                                            loc_fn=loc_fn)
            if graph_bs and mode == "DECODE":
                outs.append(graph_decode(padded_view(batch, len(prefix_lens)), hidden))
                continue
            be.init_forward_metadata(batch)
            outs.append(mod(hidden, batch))
            if graph_bs and len(outs) == 1:  # capture: a real forward on a batch of padding rows only
                capture = padded_view(batch, 0)
                graph_decode(capture, torch.zeros(0, hidden.shape[1]), in_capture=True)
    return outs


def _oracle(module, hidden_per_req, params):
    """Per request: the oracle's attention output through o_proj for every position, ``[L, hidden]``."""
    res = []
    for h in hidden_per_req:
        q, k, v = module.project_qkv(h)
        t = h.shape[0]
        q4 = q.view(t, module.num_heads, module.head_dim).permute(1, 0, 2)[None]
        k4 = k.view(t, module.num_kv_heads, module.head_dim).permute(1, 0, 2)[None]
        v4 = v.view(t, module.num_kv_heads, module.head_dim).permute(1, 0, 2)[None]
        o, _ = dash_reference(q4, k4, v4, module.dash_head_cls, params)
        res.append(module.o_proj(o[0].permute(1, 0, 2).reshape(t, -1)))
    return res


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("page_size", [16, 64])
def test_sparse_prefill_chunked_extend_and_decode_match_oracle(dash_kit, page_size, graph):
    """Prefill 40 and 23 tokens, extend by 57 and 30 on that paged history, then decode 3 steps (eager,
    or through the CUDA-graph metadata path with the batch padded to 4 rows)."""
    kit = dash_kit(SPARSE)
    max_ctx = 192
    lens = [(40, 57), (23, 30)]
    decode_steps = 3
    case = _case(kit, f"dash_sparse_p{page_size}", "EXTEND", page_size, (0, 0), tuple(a for a, _ in lens))
    fx = kit.build_dense_attention_fixture(KitTestCase(), case, max_context_len=max_ctx, **F32)
    total = [a + b + decode_steps for a, b in lens]
    loc_fn = kit.make_loc_fn("shuffled_pages", batch_size=2, seq_lens=tuple(total), prefix_lens=(0, 0),
                             page_size=page_size, max_context_len=max_ctx, seed=11)
    g = torch.Generator().manual_seed(3)
    hidden = [torch.randn(n, fx.actual_module.hidden_size, generator=g) for n in total]

    def rows(lo, hi):
        return torch.cat([h[lo[i]:hi[i]] for i, h in enumerate(hidden)])

    first = [a for a, _ in lens]
    second = [a + b for a, b in lens]
    steps = [("EXTEND", (0, 0), tuple(first), rows([0, 0], first)),
             ("EXTEND", tuple(first), tuple(b for _, b in lens), rows(first, second))]
    for s in range(decode_steps):
        pos = [n + s for n in second]
        steps.append(("DECODE", tuple(pos), (), rows(pos, [p + 1 for p in pos])))
    outs = _run_steps(kit, fx, steps, loc_fn, max_ctx, graph_bs=4 if graph else 0)

    ref = _oracle(fx.actual_module, hidden, SPARSE)
    got = [[] for _ in lens]
    for (mode, prefix_lens, extend_lens, _), out in zip(steps, outs):
        n = extend_lens if mode == "EXTEND" else (1,) * len(lens)
        for i, part in enumerate(out.split(list(n))):
            got[i].append(part)
    for i in range(len(lens)):
        torch.testing.assert_close(torch.cat(got[i]), ref[i], atol=ATOL, rtol=RTOL)
    # The configuration is really sparse: dense attention gives a different answer on these inputs.
    dense = _oracle(fx.actual_module, hidden, DENSE)
    assert max((d - r).abs().max().item() for d, r in zip(dense, ref)) > 100 * ATOL


def test_each_extend_batch_brings_its_prefill_workspace(dash_kit, monkeypatch):
    """Every extend call gets the ``PrefillWorkspace`` of its batch's metadata (the layers of a batch share it;
    on CUDA the first makes the plan and scratch), and the next batch a new one."""
    import adapters.sglang.backend as backend
    from dash_core.workspace import PrefillWorkspace

    seen = []
    real = backend.paged_dash_prefill

    def spy(*args, **kwargs):
        seen.append((kwargs.get("workspace"), backend_of_fx.forward_metadata.workspace))
        return real(*args, **kwargs)

    monkeypatch.setattr(backend, "paged_dash_prefill", spy)
    kit = dash_kit(SPARSE)
    case = _case(kit, "dash_ws", "EXTEND", 16, (0, 0), (40, 23))
    fx = kit.build_dense_attention_fixture(KitTestCase(), case, max_context_len=128, **F32)
    backend_of_fx = fx.backend
    loc_fn = kit.make_loc_fn("shuffled_pages", batch_size=2, seq_lens=(70, 50), prefix_lens=(0, 0), page_size=16,
                             max_context_len=128, seed=5)
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(63, fx.actual_module.hidden_size, generator=g)
    steps = [("EXTEND", (0, 0), (40, 23), hidden), ("EXTEND", (40, 23), (30, 27), hidden[:57])]
    _run_steps(kit, fx, steps, loc_fn, 128)
    assert len(seen) == 2 and all(isinstance(w, PrefillWorkspace) and w is md for w, md in seen)
    assert seen[0][0] is not seen[1][0]


# ---- start-up errors, modes, summary store ------------------------------------------------------

@pytest.mark.parametrize("page_size", [1, 8, 24])
def test_page_size_not_multiple_of_block_fails_at_startup(dash_kit, page_size):
    kit = dash_kit(DENSE)
    case = _case(kit, "dash_bad_page", "DECODE", page_size, (4,))
    with pytest.raises(ValueError, match="page size must be a multiple of the DASH block size") as err:
        kit.build_dense_attention_fixture(KitTestCase(), case, max_context_len=48, **F32)
    assert "--page-size" in str(err.value) and str(page_size) in str(err.value)


def test_unsupported_modes_and_missing_head_cls(dash_kit):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    kit = dash_kit(DENSE)
    fx = kit.build_dense_attention_fixture(KitTestCase(), _case(kit, "dash_modes", "DECODE", 16, (4,)),
                                           max_context_len=48, **F32)
    for mode in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2):
        with pytest.raises(NotImplementedError, match="speculative"):
            fx.backend.init_forward_metadata(types.SimpleNamespace(forward_mode=mode))
    fx.backend.init_forward_metadata(fx.forward_batch)
    q = torch.zeros(1, 4 * 16)
    k = v = torch.zeros(1, 2, 16)
    with pytest.raises(ValueError, match="needs head_cls"):
        fx.backend.forward_decode(q, k, v, fx.actual_module.attn, fx.forward_batch)


def test_summary_store_lives_on_the_pool_and_is_shared(dash_kit):
    from adapters.sglang.backend import DashAttnBackend

    kit = dash_kit(DENSE)
    fx = kit.build_dense_attention_fixture(KitTestCase(), _case(kit, "dash_store", "DECODE", 32, (4,)),
                                           max_context_len=64, **F32)
    pool = fx.runner.token_to_kv_pool
    other = DashAttnBackend(fx.runner)  # e.g. a second runner over the same pool (TBO, draft, PD-multiplex)
    assert other.summaries is fx.backend.summaries is pool.dash_summaries
    assert len(pool.dash_summaries) == pool.layer_num
    assert pool.dash_summaries[0].shape == ((pool.size + pool.page_size) // BS, 2, 16)
    assert pool.dash_summaries[0].dtype == pool.dtype
    # each layer's PagedKVCache views (with what the kernels derive from them) are kept while the pool hands out
    # the same K and V buffers
    layer = fx.actual_module.attn
    cache = fx.backend._cache(layer)
    assert fx.backend._cache(layer) is cache and cache.summaries is pool.dash_summaries[layer.layer_id]
    assert other._cache(layer) is not cache


def test_a_model_without_dash_layers_is_refused(dash_kit):
    """--attention-backend dash on a plain Llama would get no head_cls: refused when the backend is built."""
    from adapters.sglang.backend import DashAttnBackend

    kit = dash_kit(DENSE)
    fx = kit.build_dense_attention_fixture(KitTestCase(), _case(kit, "dash_plain_model", "DECODE", 16, (4,)),
                                           max_context_len=48, **F32)
    fx.runner.model = types.SimpleNamespace(config=object())  # a real model has a config, a DASH one dash_layers
    with pytest.raises(ValueError, match="passes no head_cls"):
        DashAttnBackend(fx.runner)
    fx.runner.model.dash_layers = {0: object()}
    DashAttnBackend(fx.runner)


# ---- the attention-stage backend option (DashParams.attention_backend) ---------------------------

def test_backend_reads_the_environment_once_at_start_up(dash_kit, monkeypatch):
    """``DASH_ATTENTION_BACKEND`` reaches the backend's DashParams once, when it is built (the option's
    values and errors: tests/test_model_config.py)."""
    from dash_core.model_config import ATTENTION_BACKEND_ENV

    kit = dash_kit(SPARSE)
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "FLASH_ATTN")
    fx = kit.build_dense_attention_fixture(KitTestCase(), _case(kit, "dash_env", "DECODE", 16, (4,)),
                                           max_context_len=48, **F32)
    assert fx.backend.params.attention_backend == "FLASH_ATTN"
    assert fx.backend.params.topk == SPARSE.topk  # the rest still comes from the model config
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "TRITON")  # later changes do not reach a running backend
    assert fx.backend.params.attention_backend == "FLASH_ATTN"


# ---- indexer + page mode through the backend (docs/semantics.md section 9) --------------------------------

PAGE_START, PAGE_TOKEN = 3, 4  # placeholder ids of the test config
AUX_KEYS = dict(dash_indexer_heads=2, dash_page_mode=True, dash_page_start_token_id=PAGE_START,
                dash_page_token_id=PAGE_TOKEN)


def _page_ids(roles):
    """Token ids whose placeholder ids give ``roles`` (text tokens get ids >= 5)."""
    return torch.tensor([PAGE_START if r == 1 else PAGE_TOKEN if r == 2 else 5 + i for i, r in enumerate(roles)])


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_indexer_page_mode_prefill_and_decode_match_oracle(dash_kit, monkeypatch, graph):
    """Two page-mode prompts (pages, text between, a question) prefilled through forward_extend with roles from
    the placeholder ids, then 3 decode steps (eager, or through init_forward_metadata_out_graph with the batch
    padded to 4 rows as SGLang pads, positions in the graph buffers): equal to the oracle on page-RoPE-rotated
    inputs with the indexer routing."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    from dash_core.rope import PageRopeSettings, RotarySettings, page_coordinates, page_rope

    kit = dash_kit(SPARSE)
    pr = PageRopeSettings(RotarySettings(theta=10000.0), RotarySettings(theta=10000.0), None)
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    kit_factory = ATTENTION_BACKENDS["dash"]

    def factory(runner):  # the DASH model's side: aux keys and page RoPE settings
        for key, value in AUX_KEYS.items():
            setattr(runner.model_config.hf_config, key, value)
        runner.model = types.SimpleNamespace(config=object(), dash_layers={0: None}, dash_page_rope=pr)
        return kit_factory(runner)

    monkeypatch.setitem(ATTENTION_BACKENDS, "dash", factory)
    roles = [[0] * 5 + [1] + [2] * 19 + [0] * 3 + [1] + [2] * 9 + [0] * 8,  # 46 tokens, 2 pages
             [1] + [2] * 15 + [1] + [2] * 7 + [0] * 6]  # 30 tokens, adjacent pages
    steps = 3
    lens = [len(r) for r in roles]
    max_ctx, d, hq, hkv, hi = 128, 32, 4, 2, 2
    case = _case(kit, "dash_aux", "EXTEND", 16, (0, 0), tuple(lens))
    fx = kit.build_dense_attention_fixture(KitTestCase(), case, max_context_len=max_ctx, head_dim=d, **F32)
    be, layer = fx.backend, fx.actual_module.attn
    assert be.aux_rows is not None and be.summaries[0].shape[1] == 1  # aux head on the pool, 1-head ik store
    total = [n + steps for n in lens]
    loc_fn = kit.make_loc_fn("shuffled_pages", batch_size=2, seq_lens=tuple(total), prefix_lens=(0, 0), page_size=16,
                             max_context_len=max_ctx, seed=5)
    g = torch.Generator().manual_seed(9)
    x = {name: [torch.randn(n, h, d, generator=g) for n in total]
         for name, h in (("q", hq), ("k", hkv), ("v", hkv), ("iq", hi), ("ik", 1))}
    hc, hci = head_cls_for(hkv, d), torch.randn(d, generator=g)

    def rows(name, lo, hi_):
        return torch.cat([t[lo[i]:hi_[i]] for i, t in enumerate(x[name])]).flatten(1)

    def call(op, batch, lo, hi_):
        return op(rows("q", lo, hi_), rows("k", lo, hi_), rows("v", lo, hi_), layer, batch, head_cls=hc,
                  iq=rows("iq", lo, hi_), ik=rows("ik", lo, hi_), head_cls_i=hci)

    outs = []
    with forward_context(ForwardContext(attn_backend=be)):
        batch = kit._make_forward_batch(case, fx.runner, max_context_len=max_ctx, device="cpu", loc_fn=loc_fn)
        batch.input_ids = torch.cat([_page_ids(r) for r in roles])
        be.init_forward_metadata(batch)
        outs.append(call(be.forward_extend, batch, [0, 0], lens))
        if graph:
            be.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
            assert be.graph_buffers.positions is not None
        for s in range(steps):
            pos = [n + s for n in lens]
            dcase = _case(kit, "step", "DECODE", 16, tuple(pos))
            batch = kit._make_forward_batch(dcase, fx.runner, max_context_len=max_ctx, device="cpu", loc_fn=loc_fn)
            if graph:  # SGLang's padded replay view: rows 2..3 are padding (pool row 0, length 1, slot 0)
                z = torch.zeros(2, dtype=torch.int64)
                batch = types.SimpleNamespace(
                    batch_size=4, forward_mode=ForwardMode.DECODE, out_cache_loc=torch.cat([batch.out_cache_loc, z]),
                    req_pool_indices=torch.cat([batch.req_pool_indices.long(), z]),
                    seq_lens=torch.cat([batch.seq_lens.long(), z + 1]), positions=torch.cat([batch.positions, z]))
                be.init_forward_metadata_out_graph(batch, in_capture=s == 0)
                md = be.forward_metadata
                assert md.positions.data_ptr() == be.graph_buffers.positions.data_ptr()
                live = {n: rows(n, pos, [p + 1 for p in pos]) for n in x}
                padded = {n: torch.cat([t, torch.zeros(2, t.shape[1])]) for n, t in live.items()}
                out = be.forward_decode(padded["q"], padded["k"], padded["v"], layer, batch, head_cls=hc,
                                        iq=padded["iq"], ik=padded["ik"], head_cls_i=hci)
                assert torch.isfinite(out).all()  # padded rows: no NaN
                out = out[:2]
            else:
                be.init_forward_metadata(batch)
                out = call(be.forward_decode, batch, pos, [p + 1 for p in pos])
            outs.append(out)

    got = [[] for _ in roles]
    for j, out in enumerate(outs):
        parts = out.view(out.shape[0], hq, d).split(lens if j == 0 else [1, 1])
        for i, part in enumerate(parts):
            got[i].append(part)
    for i, r in enumerate(roles):
        tok, page = page_coordinates(torch.tensor(r), generated=steps)
        q, k, iq = (page_rope(x[n][i], tok, page, pr, main=n != "iq") for n in ("q", "k", "iq"))
        ik = page_rope(x["ik"][i], tok, page, pr, main=False)[:, 0]
        heads = lambda t: t.permute(1, 0, 2)[None]
        ref, _ = dash_reference(heads(q), heads(k), heads(x["v"][i]), hc, SPARSE, iq=heads(iq), ik=ik[None],
                                head_cls_i=hci)
        torch.testing.assert_close(torch.cat(got[i]), ref[0].permute(1, 0, 2), atol=ATOL, rtol=RTOL)


def test_page_mode_start_up_checks():
    """Page mode refuses chunked prefill below the context length and mixed chunks (naming the flags);
    the config keys' validation: tests/test_model_config.py."""
    from adapters.sglang.backend import DashAttnBackend

    def runner(**args):
        base = dict(chunked_prefill_size=-1, enable_mixed_chunk=False, disable_radix_cache=True)
        return types.SimpleNamespace(server_args=types.SimpleNamespace(**dict(base, **args)),
                                     model_config=types.SimpleNamespace(context_len=4096))

    DashAttnBackend._check_page_mode_args(runner())
    DashAttnBackend._check_page_mode_args(runner(chunked_prefill_size=4096))  # covers any prompt
    with pytest.raises(ValueError, match=r"--chunked-prefill-size 2048.*pass --chunked-prefill-size -1"):
        DashAttnBackend._check_page_mode_args(runner(chunked_prefill_size=2048))
    with pytest.raises(ValueError, match="--enable-mixed-chunk"):
        DashAttnBackend._check_page_mode_args(runner(enable_mixed_chunk=True))
