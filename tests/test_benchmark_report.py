"""``benchmarks/report.py``: the tables of ``docs/PERFORMANCE.md`` and the charts, made from records as the GPU runs
write them.

Records of one case come from several runs and peers; some carry no value for a column (route-only rows have no peak
memory, a peer that could not run has no time). These checks run on the CPU: the numbers and ratios a table shows, and
that the repository's tables are the ones its records give.
"""

from __future__ import annotations

import json

import pytest

from tests._benchmarks import BENCHMARKS, import_benchmark


@pytest.fixture(scope="module")
def report():
    return import_benchmark("report")  # benchmarks/report.py


def _dec(batch, method, variant, ms, *, run="r2", topk=64, write=False, graph=False, **extra):
    r = dict(phase="decode", batch=batch, context=131072, hq=32, hkv=8, head_dim=128, bs=64, topk=topk,
             scaling_factor=1.41, method=method, variant=variant, includes_write=write, graph=graph, ms=ms,
             kv_fraction=0.03, floor_ms=0.04, floor_fraction=round(0.04 / ms, 4), device="GPU X", run=run,
             layout="sglang")
    r.update(extra)
    return r


def _pre(context, method, variant, ms, *, topk=64, write=False, batch=1, run="p1", chunk=None, **extra):
    r = dict(phase="prefill", batch=batch, context=context, hq=32, hkv=8, head_dim=128, bs=64, topk=topk,
             scaling_factor=1.41, method=method, variant=variant, includes_write=write, chunk=chunk, ms=ms,
             kv_fraction=0.06 if method == "dash-triton" else 1.0, floor_ms=1.0, peak_mb=100.0, device="GPU X",
             run=run)
    r.update(extra)
    return r


def _rows(text: str) -> list:
    """The cells of a markdown table's body rows."""
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()[2:] if line.startswith("|")]


def test_decode_divides_by_the_fastest_peer_of_its_own_run(report):
    recs = [
        _dec(8, "dash-triton", "zero-copy", 0.1, write=True, graph=True),
        _dec(8, "dash-triton", "route-only", 0.04, graph=True),
        _dec(8, "dash-triton", "attend-only", 0.05, graph=True),
        _dec(8, "dash-triton", "zero-copy", 0.3, write=True),  # eager: not the served step
        _dec(8, "dense-cudnn", "contiguous", 0.5, topk=None),
        _dec(8, "dense-sdpa", "contiguous", 0.9, topk=None),
        _dec(8, "dense-sdpa", "contiguous", 0.45, topk=None, graph=True),  # captured: the peer's fastest
        _dec(8, "dense-flashinfer", "paged", 0.2, topk=None, run="r1"),  # an older run: not this row's peer
        _dec(1, "dash-triton", "zero-copy", 0.04, write=True, graph=True, run="r3"),  # its run measured no peer
        _dec(1, "dense-sdpa", "contiguous", 0.12, topk=None, run="r1"),
        _dec(1, "dense-flashinfer", "paged", 0.2, topk=None, run="r1"),
        _dec(8, "dash-triton", "zero-copy", 0.2, topk=16, write=True, graph=True),  # a cap the doc does not show
    ]
    rows = {r[0]: r for r in _rows(report.decode_table(recs))}
    assert set(rows) == {"1", "8"}
    b8 = rows["8"]
    assert b8[5:10] == ["100", "40", "50", "40", "40%"]  # step, routing, attention, floor (us), of floor
    assert b8[10] == "**sdpa 450**, cudnn 500" and b8[11] == "4.50x"
    assert rows["1"][10] == "**sdpa 120**, flashinfer 200" and rows["1"][11] == "3.00x"
    chart = report.decode_chart(recs)
    assert "4.50x" in chart and "3.00x" in chart


def test_prefill_rows_serving_and_mixed_rows_each_against_their_own_peers(report):
    recs = [
        _pre(8192, "dash-triton", "one-shot", 4.0, write=True),
        _pre(8192, "dash-triton", "one-shot", 3.0),  # without the write: not the table's figure
        _pre(8192, "dash-triton", "one-shot workspace", 1.8, write=True),
        _pre(8192, "dash-triton", "route-only", 1.0, peak_mb=None, kv_fraction=None),
        _pre(8192, "dash-triton", "one-shot attn_stages=2", 1.5, write=True),  # a --tune row
        _pre(8192, "dash-triton", "one-shot vllm-layout", 4.4, write=True),
        _pre(8192, "dense-flashinfer", "one-shot", 2.0, topk=None),
        _pre(8192, "dense-cudnn", "one-shot", 1.6, topk=None),
        _pre(8192, "dense-sdpa", "one-shot", None, topk=None, note="no kernel"),  # a peer that could not run
        _pre(131072, "dash-triton", "one-shot", 125.0, write=True),
        _pre(131072, "dash-triton", "chunks-8192", 130.0, write=True, chunk=8192),
        _pre(131072, "dense-flashinfer", "one-shot", 250.0, topk=None),
        _pre(131072, "dense-flashinfer", "chunks-8192", 260.0, topk=None, chunk=8192),
        _pre(2048, "dash-triton", "serving", 0.4, write=True, batch=8, host_ms=0.31),
        _pre(2048, "dense-cudnn", "serving", 0.5, topk=None, batch=8),
        _pre(2048, "dense-flashinfer", "one-shot", 0.1, topk=None, batch=8),  # not a step of 8 layers
        _pre(2048, "dash-triton", "serving-graph", 0.2, write=True, batch=8),  # the step replayed from a graph
        _pre(2048, "dense-cudnn", "serving-graph", 0.3, topk=None, batch=8),
        _pre(32768, "dash-triton", "mixed", 0.5, write=True, batch=9, decode_tokens=8, prompt_tokens=2048),
        _pre(32768, "dense-flashinfer", "mixed", 0.6, topk=None, batch=9, decode_tokens=8, prompt_tokens=2048),
        _pre(32768, "dense-cudnn", "mixed", 0.4, topk=None, batch=9, decode_tokens=8, prompt_tokens=2048),
        _pre(32768, "dash-triton", "mixed-graph", 0.25, write=True, batch=9, decode_tokens=8, prompt_tokens=2048),
        _pre(32768, "dense-cudnn", "mixed-graph", 0.3, topk=None, batch=9, decode_tokens=8, prompt_tokens=2048),
        _pre(16384, "dash-triton", "mixed", 0.9, write=True, batch=33, decode_tokens=32, prompt_tokens=2048),
        _pre(16384, "dash-triton", "mixed-split", 0.7, write=True, batch=33, decode_tokens=32, prompt_tokens=2048,
             host_ms=0.3),
        _pre(16384, "dash-triton", "mixed-split-graph", 0.6, write=True, batch=33, decode_tokens=32,
             prompt_tokens=2048),
        _pre(16384, "dense-cudnn", "mixed", 1.8, topk=None, batch=33, decode_tokens=32, prompt_tokens=2048),
    ]
    rows = {r[0]: r for r in _rows(report.prefill_table(recs))}
    assert set(rows) == {"8k", "8k, vLLM layout", "128k", "128k, 8k chunks"}
    eight = rows["8k"]
    assert eight[3:8] == ["4", "1.8", "1", "6.0%", "100"]  # DASH, later layer, routing alone, KV read, peak
    assert eight[8] == "**cudnn 1.6**, flashinfer 2" and eight[9] == "0.40x"
    assert rows["128k"][9] == "2.00x" and rows["128k, 8k chunks"][9] == "2.00x"  # chunks against chunked peers
    assert rows["128k, 8k chunks"][4:6] == ["-", "-"]

    serving = _rows(report.serving_table(recs))
    assert serving == [["8 x 2k", "8", "64", "0.4 (host 0.31)", "100", "**cudnn 0.5**", "1.25x", "0.2 / 0.3 (1.50x)"]]
    mixed = _rows(report.mixed_table(recs))
    assert sorted(mixed) == [["32 decode tokens at 16k + a 2k chunk", "8", "64", "0.9", "0.7 (host 0.3); graph 0.6",
                              "**cudnn 1.8**", "2.00x", "-"],
                             ["8 decode tokens at 32k + a 2k chunk", "8", "64", "0.5", "-",
                              "**cudnn 0.4**, flashinfer 0.6", "0.80x", "0.25 / 0.3 (1.20x)"]]
    lines = report.crossover_lines(recs).splitlines()
    assert "- Hkv 8, topk 64, one shot: faster than the fastest dense peer from 128k tokens on; slower at 8k" in lines


def test_published_rows_compare_the_same_call_form(report):
    dec = [_dec(8, "published-dash", "contiguous", 0.31, topk=None),
           _dec(8, "dash-triton", "zero-copy", 0.155, topk=None),
           _dec(8, "dash-triton", "zero-copy", 0.117, topk=None, graph=True)]
    pre = [_pre(32768, "published-dash", "one-shot", 36.0, topk=None, write=True),
           _pre(32768, "dash-triton", "one-shot", 9.0, topk=None, write=True),
           _pre(131072, "published-dash", "one-shot", None, topk=None, write=True, note="failed: illegal access")]
    rows = _rows(report.published_table(dec, pre))
    assert rows[0][4:] == ["310 us", "155 us eager (117 us in a graph)", "2.00x"]
    # DASH's decode records from another run than the published one's: shown, marked, and no ratio
    elsewhere = [dict(r, run="r3") if r["method"] == "dash-triton" else r for r in dec]
    assert _rows(report.published_table(elsewhere, pre))[0][4:] == [
        "310 us", "155 us eager (117 us in a graph), another run", "-"]
    assert rows[1][4:] == ["36 ms", "9 ms (with its write)", "4.00x"]
    assert rows[2][4] == "not run: failed: illegal access"


def test_the_script_rewrites_only_the_marked_parts(report, tmp_path, capsys):
    perf = tmp_path / "perf"
    perf.mkdir()
    (perf / "decode.json").write_text(json.dumps([_dec(8, "dash-triton", "zero-copy", 0.1, write=True, graph=True),
                                                  _dec(8, "dense-cudnn", "contiguous", 0.5, topk=None)]))
    doc = tmp_path / "PERFORMANCE.md"
    doc.write_text("# Title\n\nprose before\n\n<!-- report:decode -->\nstale\n<!-- /report:decode -->\n\nprose after\n"
                   "<!-- report:serving -->\n<!-- /report:serving -->\n")
    args = ["--doc", str(doc), "--perf", str(perf)]
    assert report.main(args + ["--check"]) == 1
    assert report.main(args) == 0
    text = doc.read_text()
    assert text.startswith("# Title\n\nprose before\n\n<!-- report:decode -->\n| B |") and "stale" not in text
    assert "| 5.00x |" in text and text.count("prose after") == 1 and "No serving records yet" in text
    assert (perf / "decode.svg").read_text().startswith("<svg") and (perf / "prefill.svg").exists()
    assert report.main(args + ["--check"]) == 0
    capsys.readouterr()


def test_the_repository_tables_are_those_of_its_records(report):
    """``docs/PERFORMANCE.md`` and the charts as ``python benchmarks/report.py`` makes them from ``docs/perf``."""
    assert report.main(["--check"]) == 0, "run python benchmarks/report.py"
    assert (BENCHMARKS.parent / "docs" / "PERFORMANCE.md").read_text().count("\n") <= 250
