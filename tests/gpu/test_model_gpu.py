"""The model benchmark's code on the GPU, small and fast: a captured whole-model decode step replays to the
eager step's logits (DASH and the dense SDPA peers), and ``measure_point`` times both phases with DASH and the
dense peers. Run it before ``benchmarks/model.py`` (``pytest -m gpu tests/gpu/test_model_gpu.py``)."""

import pytest
import torch

from dash_core import DashParams
from dash_core.llama import DashAttention, DenseAttention, KVStore, LlamaModel, LlamaShape, LlamaWeights, Step
from dash_core.model_timing import DashSettings, available_peers, capture_graph, measure_point

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPE = LlamaShape(layers=2, hidden=512, q_heads=32, kv_heads=8, head_dim=128, mlp=1024, vocab=64)


@pytest.fixture(scope="module")
def model():
    return LlamaModel(LlamaWeights(SHAPE, torch.bfloat16, "cuda", seed=0))


@pytest.mark.parametrize("method", ["dash", "dense-sdpa", "dense-cudnn"])
def test_captured_decode_step_replays_the_eager_step(model, method):
    if method != "dash" and available_peers([method[len("dense-"):]], torch.device("cuda"))[1]:
        pytest.skip(f"{method} cannot run here")
    store = KVStore(SHAPE, SHAPE.layers, 3, 1024, 64, 64, torch.bfloat16, "cuda")
    p = DashParams(block_size=64, topk=4, scaling_factor=2.0)
    store.fill_synthetic(model.weights.head_cls, p, seed=2)
    attn = DashAttention(p, model.weights.head_cls) if method == "dash" else DenseAttention(method[len("dense-"):])
    step = Step.decode_step(store)
    x = torch.randn(3, SHAPE.hidden, device="cuda", dtype=torch.bfloat16)
    attn.prepare(step)
    eager = model.forward(x, step, attn).clone()
    out = []
    graph = capture_graph(lambda: out.append(model.forward(x, step, attn)))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(eager).all()
    torch.testing.assert_close(out[-1], eager, atol=2e-2, rtol=2e-2)  # split counts may differ: merge order only


@pytest.mark.parametrize("phase,batch,context", [("ttft", 2, 2048), ("tpot", 4, 4096)])
def test_measure_point_times_dash_and_the_dense_peers(model, phase, batch, context):
    recs = measure_point(model, phase, batch, context, ["cudnn", "sdpa"], DashSettings(), iters=2,
                         replays=5, log=print)
    by = {r["method"]: r for r in recs}
    dash = by["dash"]
    assert "note" not in dash, dash["note"]
    assert dash["ms"] > 0 and dash["no_attention_ms"] > 0 and 0 < dash["selected_fraction"] <= 1
    measured = [r for r in recs if r["method"].startswith("dense-sdpa") and r["ms"] is not None]
    assert measured, [r.get("note") for r in recs]
    assert all(r["ms"] > 0 and r["no_attention_ms"] == dash["no_attention_ms"] for r in measured)
    assert all(r["graph"] == (phase == "tpot") and r["layers"] == SHAPE.layers for r in recs)
