"""The model benchmark on the CPU: the Llama-shaped model's DASH path against the float64 oracle and against
dense attention, and ``benchmarks/model.py --smoke`` end to end (records, tables, chart), so that the GPU
script cannot rot between GPU runs. Timings on the CPU mean nothing and are not asserted."""

from __future__ import annotations

import json

import pytest
import torch

from dash_core import DashParams, dash_reference
from dash_core.llama import (DashAttention, DenseAttention, KVStore, LlamaModel, LlamaShape, LlamaWeights, NoAttention,
                             Step, correlated_rows)
from dash_core.model_timing import DashSettings, measure_point, speedups
from tests._benchmarks import import_benchmark

BS = 16


class OracleAttention:
    """Each layer's attention by ``dash_reference`` over the whole cached sequence (float64)."""

    method = "oracle"

    def __init__(self, params, head_cls):
        self.params, self.head_cls = params, head_cls

    def prepare(self, step):
        self.step = step

    def __call__(self, layer, q, k, v):
        st = self.step
        st.store.k[layer].index_copy_(0, st.slot_mapping, k)
        st.store.v[layer].index_copy_(0, st.slot_mapping, v)
        kk, vv = st.store.dense_kv(layer, st.context)  # [B, Hkv, ctx, D]
        outs = []
        for r in range(st.batch):
            qr = q[r * st.new: (r + 1) * st.new].permute(1, 0, 2)[None]  # [1, Hq, new, D]
            rows = list(range(st.context - st.new, st.context))
            qf = qr.new_zeros(1, qr.shape[1], st.context, qr.shape[3])
            qf[:, :, rows] = qr
            ref, _ = dash_reference(qf, kk[r: r + 1], vv[r: r + 1], self.head_cls[layer], self.params, rows=rows)
            outs.append(ref[0].permute(1, 0, 2))
        return torch.cat(outs).to(q.dtype)


def _run(model, attn, batch, prompt, seed=0):
    """Prefill ``batch`` prompts of ``prompt`` tokens, then decode one token: the two steps' logits."""
    shape = model.shape
    store = KVStore(shape, shape.layers, batch, prompt + 1, BS, BS, torch.float32, "cpu")
    g = torch.Generator().manual_seed(seed)
    x = correlated_rows(batch, prompt, shape.hidden, 0.9, g)
    xd = torch.randn(batch, shape.hidden, generator=g)
    step = Step.prefill(store, prompt)
    attn.prepare(step)
    first = model.forward(x, step, attn)
    step = Step.decode_step(store, prompt + 1)
    attn.prepare(step)
    return first, model.forward(xd, step, attn)


@pytest.fixture(scope="module")
def model():
    return LlamaModel(LlamaWeights(LlamaShape.tiny(layers=2), torch.float32, "cpu", seed=1))


def test_dash_model_equals_the_model_over_the_oracle_and_differs_from_dense(model):
    p = DashParams(block_size=BS, topk=2, scaling_factor=4.0)
    hc = model.weights.head_cls
    got = _run(model, DashAttention(p, hc), batch=2, prompt=95)  # the decode token starts a new block
    want = _run(model, OracleAttention(p, hc), batch=2, prompt=95)
    dense = _run(model, DenseAttention("sdpa-math"), batch=2, prompt=95)
    for g, w, d in zip(got, want, dense):
        assert g.shape == (2, model.shape.vocab)
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
        assert (g - d).abs().max() > 1e-2  # topk 2 of 4-5 candidates: sparse enough to change the logits


def test_dense_equivalent_dash_model_equals_dense_sdpa_and_no_attention_differs(model):
    p = DashParams.dense_equivalent(block_size=BS)
    got = _run(model, DashAttention(p, model.weights.head_cls), batch=3, prompt=40)
    dense = _run(model, DenseAttention("sdpa-math"), batch=3, prompt=40)
    none = _run(model, NoAttention(), batch=3, prompt=40)
    for g, d, n in zip(got, dense, none):
        torch.testing.assert_close(g, d, atol=1e-4, rtol=1e-4)
        assert (g - n).abs().max() > 1e-2


def test_measure_point_records_every_method_with_the_attention_share(model):
    """Every method's record at a prefill and a decode point, one shared no-attention baseline, and DASH's
    ``scaling_factor`` calibrated to route the target fraction (``calibrated`` only where it does)."""
    settings = DashSettings(block_size=BS, topk=2, local=BS, page_size=BS, target_fraction=0.3)
    for phase, b, n in (("ttft", 2, 128), ("tpot", 2, 128)):  # enough candidate blocks to calibrate on
        recs = measure_point(model, phase, b, n, ["auto", "flashinfer"], settings, iters=1, log=lambda m: None)
        by = {r["method"]: r for r in recs}
        assert set(by) == {"dash", "dense-sdpa-math", "dense-flashinfer"}
        assert by["dense-flashinfer"]["ms"] is None and "needs a CUDA device" in by["dense-flashinfer"]["note"]
        for m in ("dash", "dense-sdpa-math"):
            r = by[m]
            assert (r["phase"], r["batch"], r["context"], r["layers"], r["graph"]) == (phase, b, n, 2, False)
            assert r["ms"] > 0 and r["no_attention_ms"] > 0
        # one model without attention, timed once a point, is what every method's attention share is taken from
        assert by["dash"]["no_attention_ms"] == by["dense-sdpa-math"]["no_attention_ms"]
        d = by["dash"]
        assert (d["block_size"], d["topk"], d["local"], d["calibrated"]) == (BS, 2, BS, True)
        assert 0.8 * 0.3 <= d["selected_fraction"] <= 1.25 * 0.3 and d["scaling_factor"] > 0
        assert speedups(recs)["dense"]["method"] == "dense-sdpa-math"
    # at 64 tokens (three candidate blocks at most) no scaling_factor in the search's range routes as few as 30%
    recs = measure_point(model, "ttft", 2, 64, ["auto"], settings, iters=1, log=lambda m: None)
    d = next(r for r in recs if r["method"] == "dash")
    assert d["calibrated"] is False and not 0.8 * 0.3 <= d["selected_fraction"] <= 1.25 * 0.3


@pytest.fixture(scope="module")
def bench():
    return import_benchmark("model")  # benchmarks/model.py


def test_recorded_command_leaves_every_output_path_out(bench):
    """``--json`` is an alias of ``--out``: neither path (nor the chart's, nor ``--commit``) enters the records."""
    argv = ["--points", "tpot", "--json", "/x/model.json", "--svg", "/x/model.svg", "--out", "/y.json", "--commit", "c"]
    assert bench.shown_command("model.py", argv, bench.OUTPUT_OPTIONS) == "python benchmarks/model.py --points tpot"


def test_smoke_run_writes_records_tables_and_chart(bench, tmp_path):
    out = tmp_path / "model.json"
    assert bench.main(["--smoke", "--out", str(out)]) == 0
    recs = json.loads(out.read_text())
    points = {(r["phase"], r["batch"], r["context"]) for r in recs}
    assert points == {("ttft", 1, 128), ("ttft", 2, 64), ("tpot", 1, 256), ("tpot", 2, 128)}
    assert {r["method"] for r in recs} == {"dash", "dense-sdpa-math"}
    for r in recs:
        assert r["device"] == "cpu (smoke)" and r["command"] == "python benchmarks/model.py --smoke"
        assert r["commit"] and r["layers"] == 2 and r["ms"] > 0 and r["host_us"] == recs[0]["host_us"] > 0
    table = bench.readme_table(recs)
    assert len(table.splitlines()) == 2 + 4
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "model.svg").read_text().lstrip().startswith(("<?xml", "<svg"))


def _rec(phase, b, n, method, ms, att=None, **kw):
    return dict(phase=phase, batch=b, context=n, layers=32, method=method, ms=ms, attention_ms=att,
                no_attention_ms=None if att is None else ms - att, graph=phase == "tpot", device="GPU X", **kw)


def test_tables_divide_by_the_fastest_dense_peer_and_name_the_slower_points(bench):
    dash = dict(block_size=64, topk=64, local=64, scaling_factor=1.4, selected_fraction=0.05)
    recs = [
        _rec("ttft", 1, 2048, "dash", 120.0, 20.0, **dash),
        _rec("ttft", 1, 2048, "dense-sdpa", 110.0, 10.0),
        _rec("ttft", 1, 2048, "dense-cudnn", 105.0, 5.0),
        _rec("ttft", 1, 2048, "dense-flashinfer", None, note="not run: import flashinfer failed"),
        _rec("tpot", 4, 131072, "dash", 5.0, 1.0, **dash),
        _rec("tpot", 4, 131072, "dense-sdpa", 10.0, 6.0),
    ]
    rows = {(c[1].strip(), c[2].strip(), c[3].strip()): c for c in
            (line.split("|") for line in bench.readme_table(recs).splitlines()[2:])}
    ttft = rows[("TTFT", "1", "2k")]
    assert "105.00 (cudnn)" in ttft[6] and ttft[7].strip() == "**0.88x**" and ttft[9].strip() == "0.25x"
    tpot = rows[("TPOT", "4", "128k")]
    assert tpot[7].strip() == "**2.00x**" and tpot[9].strip() == "6.00x"
    assert bench.slower_points(recs) == [("ttft", 1, 2048, 0.875)]
    assert "not run: import flashinfer failed" in bench.peers_table(recs)


def test_records_merge_by_point_and_method(bench, tmp_path):
    """A new run's record replaces the old one of its point and method; others stay, in table order."""
    path = tmp_path / "model.json"
    old = [_rec("tpot", 4, 131072, "dash", 9.0, 3.0), _rec("ttft", 1, 2048, "dash", 50.0, 5.0)]
    bench.merge_records(path, old, bench.record_key, bench.record_order)
    out = bench.merge_records(path, [_rec("tpot", 4, 131072, "dash", 7.0, 2.0)], bench.record_key, bench.record_order)
    assert [(r["phase"], r["ms"]) for r in out] == [("ttft", 50.0), ("tpot", 7.0)]


def test_points_parse_in_run_order(bench):
    assert bench.parse_points("tpot:4x131072,ttft:1x2048,ttft:1x2048") == [("tpot", 4, 131072), ("ttft", 1, 2048)]
    assert len(bench.parse_points("all")) == 16 and bench.parse_points("ttft")[-1] == ("ttft", 1, 131072)
    with pytest.raises(ValueError):
        bench.parse_points("decode:1x2")


def test_demo_model_section_prints_the_whole_model_speed_up(capsys):
    """The demo's GPU section, run tiny on the CPU: every method's line, then the closing speed-up line."""
    import argparse

    from dash_core import demo

    a = argparse.Namespace(requests=2, context=128, model_layers=2, peers="sdpa-math", seed=0)
    demo._time_model(a, torch.device("cpu"), shape=LlamaShape.tiny(layers=2),
                     settings=DashSettings(block_size=BS, topk=2, local=BS, page_size=BS, target_fraction=0.3))
    lines = capsys.readouterr().out.strip().splitlines()
    assert "2 layers" in lines[0] and "2 requests at 128 tokens" in lines[0]
    assert lines[1].lstrip().startswith("dash") and "topk 2" in lines[1] and "calibrated" in lines[1]
    assert lines[2].lstrip().startswith("dense-sdpa-math") and lines[3].lstrip().startswith("no attention")
    assert lines[-1].startswith("Whole model, decode step") and "dense-sdpa-math" in lines[-1]
