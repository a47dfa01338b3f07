"""The generated parts of ``docs/PERFORMANCE.md`` and the README, and the charts, from the benchmarks' JSON records.

The benchmarks write records only (``docs/perf/decode.json``, ``prefill.json``, ``model.json``); this script writes
each table between its markers in ``docs/PERFORMANCE.md`` and ``README.md`` (``<!-- report:NAME -->`` ...
``<!-- /report:NAME -->``; the prose around them is left alone; the whole model's table is ``model.py``'s) and the
charts ``docs/perf/decode.svg`` and ``prefill.svg`` (plain SVG, no plotting library). Every "vs best dense" divides
by the fastest dense peer recorded for the same shape, taken from the DASH row's own run where that run measured any
(records carry their run's id), else from any run.

    python benchmarks/report.py            # rewrite the tables and charts
    python benchmarks/report.py --check    # exit 1 if they differ from what the records give
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from model import readme_table as model_table
DOC = ROOT / "docs" / "PERFORMANCE.md"
PERF = ROOT / "docs" / "perf"
DOC_TOPKS = (64, None)  # the caps the one-prompt and decode tables show; the records hold every cap measured
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf")


# ---------------------------------------------------------------------------- helpers

def tokens(n: int) -> str:
    """A token count as the tables show it: ``131072`` -> ``128k``, ``300`` -> ``300``."""
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def num(x) -> str:
    """A time: three significant digits, ``-`` where there is none."""
    return "-" if x is None else f"{x:.3g}" if x < 1000 else f"{x:.0f}"


def speedup(base, ms) -> str:
    return "-" if base is None or not ms else f"{base / ms:.2f}x"


def topk_of(r: dict) -> str:
    return "none" if r.get("topk") is None else str(r["topk"])


def shape(r: dict) -> tuple:
    """What dense peers and DASH rows of one case share."""
    return r["device"], r["batch"], r["context"], r["hq"], r["hkv"], r["head_dim"]


def dense_peers(records: list, row: dict, match) -> dict:
    """``{peer: fastest ms}`` of the dense records that ``match`` (same shape as ``row``), from ``row``'s run when
    that run measured any of them."""
    found = [r for r in records if r["method"].startswith("dense-") and r.get("ms") and shape(r) == shape(row)
             and match(r)]
    same_run = [r for r in found if row.get("run") and r.get("run") == row.get("run")]
    out: dict = {}
    for r in same_run or found:
        peer = r["method"][len("dense-"):]
        out[peer] = min(out.get(peer, math.inf), r["ms"])
    return out


def peers_cell(peers: dict, scale: float = 1.0) -> str:
    """``cudnn 40.4, **sdpa 38.1**``: every peer measured, the fastest in bold."""
    if not peers:
        return "-"
    best = min(peers.values())
    return ", ".join((f"**{p} {num(ms * scale)}**" if ms == best else f"{p} {num(ms * scale)}")
                     for p, ms in sorted(peers.items(), key=lambda kv: kv[1]))


def best(peers: dict):
    return min(peers.values()) if peers else None


def md_table(head: list, rows: list) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def pick(records: list, **want) -> list:
    return [r for r in records if all(r.get(k) == v for k, v in want.items())]


def one(records: list, **want):
    """The record of ``want`` (the last when several match), or None."""
    found = pick(records, **want)
    return found[-1] if found else None


def with_devices(records: list, table: str) -> str:
    """``table``, preceded by the devices where the records come from more than one."""
    devs = sorted({r["device"] for r in records})
    return f"Devices: {', '.join(devs)}.\n\n{table}" if len(devs) > 1 else table


def run_table(records: list, unit: str = "ms") -> str:
    """Every record of one run, one line each (what a benchmark prints when it ends), with its speed-up over the
    fastest dense peer of the same shape and phase variant."""
    scale = 1e3 if unit == "us" else 1.0
    rows = []
    for r in records:
        kind = r["variant"] if r["variant"] in ("serving", "mixed") else None
        peers = dense_peers(records, r, lambda x: (x["variant"] if x["variant"] in ("serving", "mixed") else None)
                            == kind and x.get("chunk") == r.get("chunk"))
        rows.append([r["batch"], tokens(r["context"]), r["hkv"], topk_of(r), r["method"], r["variant"],
                     "yes" if r.get("includes_write") else "no", "yes" if r.get("graph") else "no",
                     num(r["ms"] * scale) if r.get("ms") else f"not run: {r.get('note', '')}",
                     "-" if r["method"].startswith("dense-") or not r.get("ms") else speedup(best(peers), r["ms"])])
    return md_table(["B", "context", "Hkv", "topk", "method", "variant", "write", "graph", f"time ({unit})",
                     "vs best dense"], rows)


# ---------------------------------------------------------------------------- decode

def decode_rows(records: list) -> list:
    """The served decode step of each case: ``dash-triton`` captured in a graph with its K/V write."""
    rows = [r for r in records if r["method"] == "dash-triton" and r["variant"] == "zero-copy" and r["includes_write"]
            and r["graph"] and r["topk"] in DOC_TOPKS]
    return sorted(rows, key=lambda r: (r["device"], r["hkv"], r["context"], r["batch"], topk_of(r),
                                       r.get("layout", "sglang")))


def decode_table(records: list) -> str:
    """Decode: the captured step with its write, its two stages alone, the floor and every dense peer (us)."""
    rows = []
    for r in decode_rows(records):
        same = dict(device=r["device"], batch=r["batch"], context=r["context"], hkv=r["hkv"], topk=r["topk"],
                    graph=True)
        lay = r.get("layout", "sglang")
        route = [x for x in pick(records, variant="route-only", **same) if x.get("layout", "sglang") == lay]
        attend = [x for x in pick(records, variant="attend-only", **same) if x.get("layout", "sglang") == lay]
        peers = dense_peers(records, r, lambda x: True)
        rows.append([r["batch"], tokens(r["context"]), r["hkv"], topk_of(r), lay, num(r["ms"] * 1e3),
                     num(route[-1]["ms"] * 1e3) if route else "-", num(attend[-1]["ms"] * 1e3) if attend else "-",
                     num(r["floor_ms"] * 1e3), f"{r['floor_fraction']:.0%}", peers_cell(peers, 1e3),
                     speedup(best(peers), r["ms"])])
    if not rows:
        return "_No decode records yet: `bash ci/gpu.sh decode bench --preset serving`._"
    head = ["B", "context", "Hkv", "topk", "layout", "DASH step (us)", "routing alone", "attention alone",
            "floor (us)", "of floor", "dense peers (us)", "vs best dense"]
    return with_devices(records, md_table(head, rows))


def backends_table(records: list) -> str:
    """Decode's attention stage on each backend (captured, no write; the same Triton routing), in us."""
    seg = [r for r in records if r["method"] in ("dash-flashinfer", "dash-flash-attn") and r["graph"]
           and r["topk"] in DOC_TOPKS]
    keys = sorted({(r["device"], r["batch"], r["context"], r["hkv"], topk_of(r), r.get("layout", "sglang"))
                   for r in seg}, key=lambda k: (k[0], k[3], k[2], k[1], k[4], k[5]))
    rows = []
    for dev, b, ctx, hkv, topk, lay in keys:
        def t(method, variant):
            found = [r for r in records if r["method"] == method and r["variant"] == variant and r["graph"]
                     and not r["includes_write"] and r["device"] == dev and r["batch"] == b and r["context"] == ctx
                     and r["hkv"] == hkv and topk_of(r) == topk and r.get("layout", "sglang") == lay]
            return found[-1] if found else None

        tri = t("dash-triton", "zero-copy")
        cells = [num(x["ms"] * 1e3) if x else "-" for x in
                 (tri, t("dash-flashinfer", "zero-copy"), t("dash-flashinfer", "gathered"),
                  t("dash-flash-attn", "zero-copy"), t("dash-flash-attn", "gathered"))]
        ref = tri or seg[0]
        peers = dense_peers(records, dict(ref, device=dev, batch=b, context=ctx, hkv=hkv), lambda x: True)
        rows.append([b, tokens(ctx), hkv, topk, lay, cells[0], f"{cells[1]} / {cells[2]}", f"{cells[3]} / {cells[4]}",
                     num(best(peers) * 1e3) if peers else "-"])
    if not rows:
        return "_No segment-backend records yet: `bash ci/gpu.sh decode bench --preset required --layout vllm`._"
    head = ["B", "context", "Hkv", "topk", "layout", "`TRITON`", "`FLASHINFER` zero-copy / gathered",
            "`FLASH_ATTN` zero-copy / gathered", "best dense"]
    return md_table(head, rows)


# ---------------------------------------------------------------------------- prefill

def _base_variant(v: str) -> bool:
    """A default-settings prefill row of one prompt: ``one-shot`` or ``chunks-N``, on either layout."""
    v = v.replace(" vllm-layout", "")
    return v == "one-shot" or (v.startswith("chunks-") and " " not in v)


def prompt_label(r: dict) -> str:
    lab = tokens(r["context"]) + ("" if r.get("batch", 1) == 1 else f" x {r['batch']}")
    if r.get("chunk"):
        lab += f", {tokens(r['chunk'])} chunks"
    if "vllm-layout" in r["variant"]:
        lab += ", vLLM layout"
    return lab


def prefill_rows(records: list) -> list:
    rows = [r for r in records if r["method"] == "dash-triton" and r["includes_write"] and r.get("ms")
            and _base_variant(r["variant"]) and r["topk"] in DOC_TOPKS]
    return sorted(rows, key=lambda r: (r["device"], -r["hkv"], r["context"], str(r.get("chunk")),
                                       "vllm" in r["variant"], -1 if r["topk"] is None else r["topk"]))


def _one_prompt_peer(r: dict):
    return lambda x: x["variant"] not in ("serving", "mixed") and x.get("chunk") == r.get("chunk")


def prefill_table(records: list) -> str:
    """One prompt (B 1): DASH with its write, a later layer sharing the workspace, routing alone, the dense peers."""
    rows = []
    for r in prefill_rows(records):
        same = dict(device=r["device"], batch=r["batch"], context=r["context"], hkv=r["hkv"], topk=r["topk"])
        ws = one(records, method="dash-triton", variant=r["variant"] + " workspace", includes_write=True, **same)
        route = None
        if r.get("chunk") is None:
            route = one(records, method="dash-triton", variant=r["variant"].replace("one-shot", "route-only"), **same)
        peers = dense_peers(records, r, _one_prompt_peer(r))
        rows.append([prompt_label(r), r["hkv"], topk_of(r), num(r["ms"]), num(ws["ms"]) if ws else "-",
                     num(route["ms"]) if route else "-",
                     "-" if r.get("kv_fraction") is None else f"{r['kv_fraction']:.1%}",
                     "-" if r.get("peak_mb") is None else f"{r['peak_mb']:.0f}", peers_cell(peers),
                     speedup(best(peers), r["ms"])])
    if not rows:
        return "_No prefill records yet: `bash ci/gpu.sh prefill bench --preset required`._"
    head = ["prompt", "Hkv", "topk", "DASH (ms)", "later layer (ms)", "routing alone", "KV read", "peak scratch (MiB)",
            "dense peers (ms)", "vs best dense"]
    return with_devices(records, md_table(head, rows))


def graph_cell(records: list, r: dict, variant: str, match) -> str:
    """``DASH / best dense (ms) (speed-up)`` of the ``variant`` records (a step replayed from a graph) of ``r``'s case
    that ``match``, or ``-``."""
    graph = [g for g in pick(records, method="dash-triton", variant=variant, topk=r["topk"])
             if shape(g) == shape(r) and match(g)]
    gpeers = dense_peers(records, graph[-1], lambda x: x["variant"] == variant and match(x)) if graph else {}
    if not gpeers:
        return "-"
    return f"{num(graph[-1]['ms'])} / {num(best(gpeers))} ({speedup(best(gpeers), graph[-1]['ms'])})"


def with_host(r: dict) -> str:
    """``ms`` of an eager step's record, with the host's time to issue it (``host_ms``) where measured."""
    return num(r["ms"]) + ("" if r.get("host_ms") is None else f" (host {num(r['host_ms'])})")


def serving_table(records: list) -> str:
    """Per layer of an engine step (``variant: "serving"``): ``batch`` prompts of ``context`` tokens."""
    dash = sorted(pick(records, method="dash-triton", variant="serving"),
                  key=lambda r: (r["device"], -r["hkv"], r["context"] * r["batch"], r["batch"]))
    rows = []
    for r in dash:
        peers = dense_peers(records, r, lambda x: x["variant"] == "serving")
        rows.append([f"{r['batch']} x {tokens(r['context'])}", r["hkv"], topk_of(r), with_host(r),
                     "-" if r.get("peak_mb") is None else f"{r['peak_mb']:.0f}", peers_cell(peers),
                     speedup(best(peers), r["ms"]), graph_cell(records, r, "serving-graph", lambda x: True)])
    if not rows:
        return "_No serving records yet: `bash ci/gpu.sh prefill bench --preset serving`._"
    head = ["prompts", "Hkv", "topk", "DASH per layer (ms)", "peak scratch (MiB)", "dense peers (ms)", "vs best dense",
            "in a graph: DASH / best dense (ms)"]
    return md_table(head, rows)


def mixed_table(records: list) -> str:
    """The mixed steps: decode tokens and a prompt chunk in one call, per layer."""
    rows = []
    for r in pick(records, method="dash-triton", variant="mixed"):
        peers = dense_peers(records, r, lambda x: x["variant"] == "mixed"
                            and x.get("prompt_tokens") == r.get("prompt_tokens")
                            and x.get("decode_tokens") == r.get("decode_tokens"))
        step = f"{r['decode_tokens']} decode tokens at {tokens(r['context'])} + a {tokens(r['prompt_tokens'])} chunk"
        same_step = lambda x: x.get("prompt_tokens") == r.get("prompt_tokens")
        split, split_graph = ([x for x in pick(records, method="dash-triton", variant=v, topk=r["topk"])
                               if shape(x) == shape(r) and same_step(x)] for v in ("mixed-split", "mixed-split-graph"))
        split_cell = "-" if not split else with_host(split[-1]) + (
            f"; graph {num(split_graph[-1]['ms'])}" if split_graph else "")
        rows.append([step, r["hkv"], topk_of(r), with_host(r), split_cell, peers_cell(peers),
                     speedup(best(peers), r["ms"]), graph_cell(records, r, "mixed-graph", same_step)])
    if not rows:
        return "_No mixed-step records yet: `bash ci/gpu.sh prefill bench --preset serving`._"
    return md_table(["step", "Hkv", "topk", "DASH per layer (ms)", "decode + prefill op (ms)", "dense peers (ms)",
                     "vs best dense", "in a graph: DASH / best dense (ms)"], rows)


def crossover_lines(records: list) -> str:
    """Per (Hkv, topk, chunking), from which prompt length on DASH (with its write) beats the fastest dense peer."""
    series: dict = {}
    for r in prefill_rows(records):
        if "vllm" in r["variant"]:
            continue
        peers = dense_peers(records, r, _one_prompt_peer(r))
        if peers:
            key = (r["device"], r["hkv"], r.get("chunk"), -1 if r["topk"] is None else r["topk"])
            series.setdefault(key, {})[r["context"]] = r["ms"] < best(peers)
    lines = []
    for (dev, hkv, chunk, topk), wins in sorted(series.items(), key=lambda kv: (kv[0][0], -kv[0][1], str(kv[0][2]),
                                                                                  kv[0][3])):
        sizes = sorted(wins)
        cross = None
        for s in reversed(sizes):
            if not wins[s]:
                break
            cross = s
        what = f"Hkv {hkv}, topk {'none' if topk < 0 else topk}, " + ("one shot" if chunk is None
                                                                      else f"in {tokens(chunk)} chunks")
        line = (f"- {what}: faster than the fastest dense peer from {tokens(cross)} tokens on" if cross is not None
                else f"- {what}: not faster than the fastest dense peer at the longest prompt measured")
        losing = [tokens(s) for s in sizes if not wins[s]]
        if losing:
            line += f"; slower at {', '.join(losing)}"
        lines.append(line)
    return "\n".join(lines) if lines else "_No DASH and dense rows to compare yet._"


# ---------------------------------------------------------------------------- the published kernels, the model

def published_table(decode: list, prefill: list) -> str:
    """The authors' kernels (uncapped, same ``scaling_factor``) against DASH in the same call form. Eager decode is
    bound by the host, whose time moves between runs: a decode ratio needs DASH's records of the published row's
    run; DASH's latest from another run are shown, marked, without one."""
    rows = []
    for r in sorted(pick(decode, method="published-dash"), key=lambda r: (r["hkv"], r["context"], r["batch"])):
        same = dict(device=r["device"], batch=r["batch"], context=r["context"], hkv=r["hkv"], topk=None)
        dash = dict(method="dash-triton", variant="zero-copy", includes_write=False, **same)
        eager = one(decode, graph=False, run=r.get("run"), **dash)
        graph = one(decode, graph=True, run=r.get("run"), **dash)
        other_run = eager is None
        if other_run:
            eager, graph = one(decode, graph=False, **dash), one(decode, graph=True, **dash)
        ours = (f"{num(eager['ms'] * 1e3)} us eager" if eager else "-") + (
            f" ({num(graph['ms'] * 1e3)} us in a graph)" if graph else "") + (
            ", another run" if other_run and eager else "")
        rows.append(["decode", r["batch"], tokens(r["context"]), r["hkv"], f"{num(r['ms'] * 1e3)} us", ours,
                     speedup(r["ms"], eager["ms"]) if eager and not other_run else "-"])
    for r in sorted(pick(prefill, method="published-dash"), key=lambda r: (-r["hkv"], r["context"])):
        same = dict(device=r["device"], batch=r["batch"], context=r["context"], hkv=r["hkv"], topk=None)
        ours = one(prefill, method="dash-triton", variant="one-shot", includes_write=True, **same)
        if r.get("ms") is None:
            rows.append(["prefill", r["batch"], tokens(r["context"]), r["hkv"], f"not run: {r.get('note', '')}",
                         f"{num(ours['ms'])} ms" if ours else "-", "-"])
            continue
        rows.append(["prefill", r["batch"], tokens(r["context"]), r["hkv"], f"{num(r['ms'])} ms",
                     f"{num(ours['ms'])} ms (with its write)" if ours else "-",
                     speedup(r["ms"], ours["ms"]) if ours else "-"])
    if not rows:
        return "_No records of the published kernels yet (`DASH_PUBLISHED_DIR`)._"
    return md_table(["phase", "B", "context", "Hkv", "published", "DASH uncapped", "DASH faster by"], rows)


# ---------------------------------------------------------------------------- charts

def _svg(width: int, height: int, body: list, title: str) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
            f'font-size="12"><rect width="100%" height="100%" fill="white"/><text x="10" y="18" font-size="14">'
            f'{title}</text>{"".join(body)}</svg>\n')


def bar_chart(items: list, title: str) -> str:
    """Horizontal bars of speed-ups ``[(label, value)]``, a line at 1x."""
    x0, width, top = 260, 440, 34
    vmax = max([v for _, v in items] + [1.0]) * 1.1
    body = []
    for i, (label, v) in enumerate(items):
        y = top + 20 * i
        w = max(1.0, v / vmax * width)
        body.append(f'<text x="{x0 - 6}" y="{y + 12}" text-anchor="end">{label}</text>'
                    f'<rect x="{x0}" y="{y}" width="{w:.1f}" height="14" fill="{COLORS[0] if v >= 1 else COLORS[3]}"/>'
                    f'<text x="{x0 + w + 4:.1f}" y="{y + 12}">{v:.2f}x</text>')
    bottom = top + 20 * len(items)
    one_x = x0 + width / vmax
    body.append(f'<line x1="{one_x:.1f}" y1="{top - 4}" x2="{one_x:.1f}" y2="{bottom}" stroke="black" '
                f'stroke-dasharray="4 3"/><text x="{one_x + 3:.1f}" y="{bottom + 14}">1x (fastest dense)</text>')
    return _svg(x0 + width + 80, bottom + 28, body, title)


def line_chart(series: dict, title: str) -> str:
    """Speed-up against prompt length (log scale): ``{label: [(tokens, speed-up)]}``, a line at 1x."""
    pts = [p for s in series.values() for p in s]
    x0, y0, w, h = 60, 40, 520, 280
    xs = [math.log2(x) for x, _ in pts] or [10.0, 17.0]
    xlo, xhi = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    yhi = max([y for _, y in pts] + [1.0]) * 1.15

    def px(x):
        return x0 + (math.log2(x) - xlo) / (xhi - xlo) * w

    def py(y):
        return y0 + h - y / yhi * h

    body = [f'<line x1="{x0}" y1="{y0 + h}" x2="{x0 + w}" y2="{y0 + h}" stroke="black"/>',
            f'<line x1="{x0}" y1="{y0}" x2="{x0}" y2="{y0 + h}" stroke="black"/>',
            f'<line x1="{x0}" y1="{py(1):.1f}" x2="{x0 + w}" y2="{py(1):.1f}" stroke="black" stroke-dasharray="4 3"/>',
            f'<text x="{x0 + w + 4}" y="{py(1) + 4:.1f}">1x</text>',
            f'<text x="{x0 + w / 2}" y="{y0 + h + 34}" text-anchor="middle">prompt tokens</text>',
            f'<text x="14" y="{y0 + h / 2}" transform="rotate(-90 14 {y0 + h / 2})" text-anchor="middle">'
            'speed-up over the fastest dense peer</text>']
    for e in range(math.ceil(xlo), math.floor(xhi) + 1):
        body.append(f'<text x="{px(2 ** e):.1f}" y="{y0 + h + 16}" text-anchor="middle">{tokens(2 ** e)}</text>')
    step = 1 if yhi <= 8 else 2
    for y in range(0, int(yhi) + 1, step):
        body.append(f'<text x="{x0 - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{y}</text>')
    for i, (label, s) in enumerate(series.items()):
        c = COLORS[i % len(COLORS)]
        s = sorted(s)
        body.append(f'<polyline fill="none" stroke="{c}" stroke-width="2" points="'
                    + " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in s) + '"/>')
        body += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{c}"/>' for x, y in s]
        body.append(f'<rect x="{x0 + w + 40}" y="{y0 + 18 * i}" width="12" height="12" fill="{c}"/>'
                    f'<text x="{x0 + w + 58}" y="{y0 + 18 * i + 11}">{label}</text>')
    return _svg(x0 + w + 300, y0 + h + 50, body, title)


def decode_chart(records: list) -> str:
    items = []
    for r in decode_rows(records):
        peers = dense_peers(records, r, lambda x: True)
        if peers:
            items.append((f"B {r['batch']}, {tokens(r['context'])}, Hkv {r['hkv']}, topk {topk_of(r)}"
                          f"{', vLLM layout' if r.get('layout') == 'vllm' else ''}", best(peers) / r["ms"]))
    return bar_chart(items, "DASH decode step (graph, with its K/V write) against the fastest dense peer")


def prefill_chart(records: list) -> str:
    series: dict = {}
    for r in prefill_rows(records):
        if r.get("chunk") is None and "vllm" not in r["variant"]:
            peers = dense_peers(records, r, _one_prompt_peer(r))
            if peers:
                series.setdefault(f"one prompt, Hkv {r['hkv']}, topk {topk_of(r)}", []).append(
                    (r["context"], best(peers) / r["ms"]))
    for r in pick(records, method="dash-triton", variant="serving", batch=1):
        peers = dense_peers(records, r, lambda x: x["variant"] == "serving")
        if peers:
            series.setdefault(f"per layer of a step, Hkv {r['hkv']}, topk {topk_of(r)}", []).append(
                (r["context"], best(peers) / r["ms"]))
    return line_chart(series, "DASH prefill (with its K/V write) against the fastest dense peer, B 1")


# ---------------------------------------------------------------------------- the document

def load(path: Path) -> list:
    return json.loads(path.read_text()) if path.exists() else []


def sections(perf: Path) -> dict:
    """``{marker name: generated markdown}`` from the records under ``perf``."""
    dec, pre, mod = load(perf / "decode.json"), load(perf / "prefill.json"), load(perf / "model.json")
    return {"model": model_table(mod), "decode": decode_table(dec), "backends": backends_table(dec),
            "prefill": prefill_table(pre), "crossover": crossover_lines(pre), "serving": serving_table(pre),
            "mixed": mixed_table(pre), "published": published_table(dec, pre)}


def fill(text: str, parts: dict) -> str:
    """``text`` with the body between each ``<!-- report:NAME -->`` / ``<!-- /report:NAME -->`` pair replaced."""
    for name, body in parts.items():
        begin, end = f"<!-- report:{name} -->", f"<!-- /report:{name} -->"
        if begin not in text or end not in text:
            continue
        pre, rest = text.split(begin, 1)
        post = rest.split(end, 1)[1]
        text = f"{pre}{begin}\n{body.rstrip()}\n{end}{post}"
    return text


def outputs(doc: Path, perf: Path) -> dict:
    """``{path: text}`` of everything this script writes: ``doc``, the ``README.md`` of its project (two folders up:
    its performance section leads with the whole model's table) where there is one, and the charts."""
    out = {}
    parts = sections(perf)
    for path in (doc, doc.resolve().parents[1] / "README.md"):
        if path.exists():
            out[path] = fill(path.read_text(), parts)
    out[perf / "decode.svg"] = decode_chart(load(perf / "decode.json"))
    out[perf / "prefill.svg"] = prefill_chart(load(perf / "prefill.json"))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--doc", default=str(DOC))
    ap.add_argument("--perf", default=str(PERF), help="folder of the JSON records and the charts")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if any output is out of date")
    a = ap.parse_args(argv)
    stale = []
    for path, text in outputs(Path(a.doc), Path(a.perf)).items():
        if path.exists() and path.read_text() == text:
            continue
        stale.append(str(path))
        if not a.check:
            path.write_text(text)
    if a.check and stale:
        print("out of date (run python benchmarks/report.py): " + ", ".join(stale))
        return 1
    print(("rewrote " + ", ".join(stale)) if stale else "up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
