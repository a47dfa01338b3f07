"""Model benchmark: time to first token and time per output token of a whole Llama-3-8B-shaped model,
DASH attention against the same model with each dense attention kernel.

The model and its timing are ``dash_core.llama`` and ``dash_core.model_timing`` (the demo's closing line
runs the same code): 32 layers of random bf16 weights, every layer its own KV cache, DASH through the
public ops as the engine adapters call them (``paged_dash_prefill`` with one ``PrefillWorkspace`` per step,
decode captured as one CUDA graph of the whole step with ``graphs.DecodeGraphBuffers``), the dense peers
(SDPA with the cuDNN or flash backend, FlashInfer and FlashAttention 4 where they import) on the same cache,
and the step without attention, whose difference gives the attention's share. Points:

- TTFT (one eager prefill step): B 1 at 2k, 4k, 8k, 16k, 32k, 64k and 128k tokens; 8 x 2k and 4 x 4k.
- TPOT (one decode step, CUDA graph): (B 1, 4k), (B 8, 4k), (B 64, 8k), (B 1, 32k), (B 16, 32k), (B 1, 128k),
  (B 4, 128k).

DASH: block 64, topk 64, local 64, ``scaling_factor`` calibrated per point (about 5% of the candidate blocks
routed uncapped on layer 0). ``--layers`` is lowered at a point only where the KV cache does not fit, and
the record says so. Records go to ``docs/perf/model.json`` (merged by device, phase, batch, context and
method, after every point), the chart to ``docs/perf/model.svg`` (matplotlib, the ``bench`` extra); the
README table is printed (``readme_table``, also importable by the docs scripts).

    python benchmarks/model.py                                    # every point, every peer that imports
    python benchmarks/model.py --points ttft --peers cudnn,sdpa
    python benchmarks/model.py --points tpot:4x131072,ttft:1x2048 --iters 5
    python benchmarks/model.py --render-only                      # chart and tables from the JSON alone
    python benchmarks/model.py --smoke                            # CPU: 2 tiny layers, outputs in a temp dir
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import host_launch_us, merge_records, shown_command
from dash_core.llama import PEERS, LlamaModel, LlamaShape, LlamaWeights
from dash_core.model_timing import DashSettings, measure_point, speedup_sentence, speedups

TTFT_POINTS = [(1, 2048), (1, 4096), (8, 2048), (4, 4096), (1, 8192), (1, 16384), (1, 32768), (1, 65536),
               (1, 131072)]
TPOT_POINTS = [(1, 4096), (8, 4096), (64, 8192), (1, 32768), (16, 32768), (1, 131072), (4, 131072)]
OUTPUT_OPTIONS = ("--out", "--json", "--svg", "--commit")  # machine-specific: left out of the recorded command
SMOKE_TTFT = [(1, 128), (2, 64)]
SMOKE_TPOT = [(1, 256), (2, 128)]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------- points and options

def parse_points(spec: str, smoke: bool = False) -> list:
    """``--points``: "all", "ttft", "tpot", or a comma list of those and ``PHASE:BxN`` (e.g. ``tpot:4x131072``).
    Returns ``[(phase, batch, context)]`` in the order they run (TTFT first, each phase from small to large)."""
    ttft, tpot = (SMOKE_TTFT, SMOKE_TPOT) if smoke else (TTFT_POINTS, TPOT_POINTS)
    out = []
    for item in [s.strip() for s in spec.split(",") if s.strip()]:
        if item == "all":
            out += [("ttft", b, n) for b, n in ttft] + [("tpot", b, n) for b, n in tpot]
        elif item in ("ttft", "tpot"):
            out += [(item, b, n) for b, n in (ttft if item == "ttft" else tpot)]
        else:
            try:
                phase, bn = item.split(":")
                b, n = (int(x) for x in bn.lower().split("x"))
            except ValueError:
                raise ValueError(f"--points item {item!r}: expected all, ttft, tpot or PHASE:BxN (e.g. tpot:4x131072)")
            if phase not in ("ttft", "tpot") or b < 1 or n < 1:
                raise ValueError(f"--points item {item!r}: phase ttft or tpot, batch and context >= 1")
            out.append((phase, b, n))
    seen, ordered = set(), []
    for p in out:
        if p not in seen:
            seen.add(p)
            ordered.append(p)
    return ordered


def git_commit() -> str:
    """The checkout's short commit ("-dirty" when tracked files differ from it), or "unknown"."""
    try:
        sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (sha + ("-dirty" if dirty else "")) if sha else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# ---------------------------------------------------------------------------- records and outputs

def record_key(r: dict) -> tuple:
    return (r["device"], r["phase"], r["batch"], r["context"], r["method"])


def record_order(r: dict) -> tuple:
    return (r["device"], r["phase"] != "ttft", r["batch"] * r["context"] if r["phase"] == "ttft" else 0,
            r["context"], r["batch"], r["method"] != "dash", r["method"])


def by_point(records: list) -> dict:
    """``{(device, phase, batch, context): [records]}`` in table order."""
    points: dict = {}
    for r in sorted(records, key=record_order):
        points.setdefault((r["device"], r["phase"], r["batch"], r["context"]), []).append(r)
    return points


def _ctx(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def readme_table(records: list) -> str:
    """The README's performance table: per point, the whole step of DASH against the fastest dense peer, then
    the attention alone (step time minus the same step without attention). Speed-ups > 1: DASH faster."""
    rows = ["| | B | context | layers | DASH (ms) | fastest dense (ms) | whole model | attention: DASH / dense (ms) "
            "| attention alone |", "|---|---|---|---|---|---|---|---|---|"]
    for (_, phase, b, n), recs in by_point(records).items():
        s = speedups(recs)
        if s is None:
            continue
        d, k = s["dash"], s["dense"]
        att = "-" if s["attention"] is None else f"{s['attention']:.2f}x"
        att_ms = ("-" if d.get("attention_ms") is None or k.get("attention_ms") is None
                  else f"{d['attention_ms']:.2f} / {k['attention_ms']:.2f}")
        layers = f"{d['layers']}{' (memory)' if d.get('layers_lowered') else ''}"
        rows.append(f"| {phase.upper()} | {b} | {_ctx(n)} | {layers} | {d['ms']:.2f} | {k['ms']:.2f} "
                    f"({k['method'][len('dense-'):]}) | **{s['step']:.2f}x** | {att_ms} | {att} |")
    return "\n".join(rows)


def peers_table(records: list) -> str:
    """Every record: each method's whole-step and attention time at each point, and the DASH settings."""
    rows = ["| | B | context | layers | method | step (ms) | attention (ms) | no attention (ms) | graph | notes |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda x: "-" if x is None else f"{x:.3f}"
    for (_, phase, b, n), recs in by_point(records).items():
        for r in recs:
            notes = []
            if r["method"] == "dash":
                notes.append(f"block {r['block_size']}, topk {r['topk']}, local {r['local']}, sf {r['scaling_factor']}"
                             f" ({r['selected_fraction']:.1%} routed uncapped)")
            if r.get("note"):
                notes.append(r["note"])
            rows.append(f"| {phase.upper()} | {b} | {_ctx(n)} | {r['layers']} | {r['method']} | {fmt(r.get('ms'))} | "
                        f"{fmt(r.get('attention_ms'))} | {fmt(r.get('no_attention_ms'))} | "
                        f"{'yes' if r.get('graph') else 'no'} | {'; '.join(notes)} |")
    return "\n".join(rows)


def slower_points(records: list) -> list:
    """The points where DASH's whole step is slower than the fastest dense peer's: ``[(phase, B, context, x)]``."""
    out = []
    for (_, phase, b, n), recs in by_point(records).items():
        s = speedups(recs)
        if s is not None and s["step"] < 1:
            out.append((phase, b, n, round(s["step"], 3)))
    return out


def write_chart(path: Path, records: list) -> bool:
    """DASH's speed-up over the fastest dense peer against context length: one line for TTFT (B 1; batched
    prefills as their own markers) and one per TPOT batch; solid the whole model, dashed the attention alone.
    Needs matplotlib (the ``bench`` extra): returns False, writing nothing, without it."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is missing (pip install dash-serve[bench]): chart not written; "
            "render it later with --render-only")
        return False
    series: dict = {}
    devices = set()
    for (dev, phase, b, n), recs in by_point(records).items():
        s = speedups(recs)
        if s is None:
            continue
        devices.add(dev)
        series.setdefault((phase, b), []).append((n, s["step"], s["attention"]))
    fig, ax = plt.subplots(figsize=(10, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, ((phase, b), pts) in enumerate(sorted(series.items(), key=lambda kv: (kv[0][0] != "ttft", kv[0][1]))):
        pts.sort()
        c = colors[i % len(colors)]
        label = f"{phase.upper()} B {b}"
        xs = [p[0] for p in pts]
        ax.plot(xs, [p[1] for p in pts], marker="o", color=c, label=f"{label}: whole model")
        att = [(p[0], p[2]) for p in pts if p[2] is not None]
        if att:
            ax.plot([p[0] for p in att], [p[1] for p in att], marker="x", linestyle="--", color=c, alpha=0.6,
                    label=f"{label}: attention alone")
    ax.axhline(1.0, color="grey", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    from matplotlib.ticker import FuncFormatter

    xs = sorted({n for pts in series.values() for n, _, _ in pts})
    ax.set_xticks(xs, [_ctx(n) for n in xs])
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("context (tokens per request)")
    ax.set_ylabel("speed-up over the fastest dense peer (x)")
    ax.set_title(f"DASH in a Llama-3-8B-shaped model ({', '.join(sorted(devices)) or 'no data'}); "
                 "> 1: DASH faster", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)  # the format follows the suffix (.svg for the docs)
    plt.close(fig)
    return True


def render(records: list, svg: Path) -> None:
    write_chart(svg, records)
    print("\n" + readme_table(records) + "\n\n" + peers_table(records) + "\n", flush=True)
    slow = slower_points(records)
    if slow:
        print("DASH is slower than the fastest dense peer at: "
              + ", ".join(f"{p.upper()} B {b} at {_ctx(n)} ({x:.2f}x)" for p, b, n, x in slow), flush=True)


# ---------------------------------------------------------------------------- main

def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", default="all", help="all, ttft, tpot, or PHASE:BxN items, comma-separated")
    ap.add_argument("--peers", default="auto", help=f"auto (every one that can run) or some of {','.join(PEERS)}")
    ap.add_argument("--iters", type=int, default=3, help="TTFT: timed calls after the warm-up (fewer past --budget-s)")
    ap.add_argument("--budget-s", type=float, default=8.0, help="TTFT: seconds of timed calls per point and method")
    ap.add_argument("--replays", type=int, default=30, help="TPOT: timed graph replays")
    ap.add_argument("--layers", type=int, default=None, help="model layers (default 32; lowered only for memory)")
    ap.add_argument("--topk", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--local", type=int, default=64)
    ap.add_argument("--sf", type=float, default=None, help="fixed scaling_factor (default: calibrated per point)")
    ap.add_argument("--target-fraction", type=float, default=0.05, help="uncapped selection to calibrate sf for")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", "--json", default=None,
                    help="JSON records (default docs/perf/model.json; smoke: a temp dir)")
    ap.add_argument("--svg", default=None, help="chart (default next to --out, model.svg)")
    ap.add_argument("--no-write", action="store_true", help="print the tables only")
    ap.add_argument("--render-only", action="store_true", help="chart and tables from the JSON, no measurement")
    ap.add_argument("--commit", default=None, help="commit recorded (default: git rev-parse of this checkout)")
    ap.add_argument("--smoke", action="store_true", help="CPU check: 2 tiny layers, tiny points, temp outputs")
    a = ap.parse_args(argv)
    if a.out is None:
        a.out = (str(Path(tempfile.gettempdir()) / "dash_model_smoke" / "model.json") if a.smoke
                 else str(ROOT / "docs/perf/model.json"))
    out = Path(a.out)
    svg = Path(a.svg) if a.svg else out.with_suffix(".svg")
    if a.render_only:
        render(json.loads(out.read_text()), svg)
        return 0
    try:
        points = parse_points(a.points, a.smoke)
    except ValueError as e:
        ap.error(str(e))
    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    if device.type != "cuda" and not a.smoke:
        log("no CUDA device: use --smoke for a CPU check of the script")
        return 2
    if a.smoke:
        shape, dtype = LlamaShape.tiny(layers=2), torch.float32
        settings = DashSettings(block_size=16, topk=2, local=16, page_size=16, scaling_factor=a.sf,
                                target_fraction=0.25)
    else:
        shape, dtype = LlamaShape(), torch.bfloat16
        settings = DashSettings(block_size=a.block_size, topk=a.topk, local=a.local,
                                page_size=max(64, a.block_size), scaling_factor=a.sf,
                                target_fraction=a.target_fraction)
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke)"
    common = dict(device=dev_name, commit=a.commit or git_commit(),
                  command=shown_command("model.py", argv, OUTPUT_OPTIONS),
                  host_us=host_launch_us(device))
    t0 = time.time()
    weights = LlamaWeights(shape, dtype, device, seed=a.seed, layers=a.layers)
    model = LlamaModel(weights)
    log(f"device {dev_name}; model {weights.layers} layers, hidden {shape.hidden}, Hq {shape.q_heads}, Hkv "
        f"{shape.kv_heads}, D {shape.head_dim}, MLP {shape.mlp}, vocab {shape.vocab}, {dtype}; weights in "
        f"{time.time() - t0:.1f} s; {len(points)} points")
    records: list = []
    for phase, b, n in points:
        log(f"{phase.upper()} B {b} at {n} tokens")
        try:
            recs = measure_point(model, phase, b, n, a.peers.split(","), settings, iters=a.iters, replays=a.replays,
                                 budget_s=a.budget_s, seed=a.seed, log=log)
        except (RuntimeError, torch.cuda.OutOfMemoryError) as e:  # one point that cannot run: the others go on
            log(f"  point skipped: {type(e).__name__}: {str(e)[:300]}")
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        recs = [dict(r, **common) for r in recs]
        records += recs
        log(f"  {speedup_sentence(recs)}")
        if not a.no_write:
            merge_records(out, recs, record_key, record_order)
        log(f"elapsed {time.time() - t0:.0f} s")
    if a.no_write:
        print("\n" + readme_table(records) + "\n\n" + peers_table(records), flush=True)
        return 0
    all_recs = json.loads(out.read_text()) if out.exists() else records
    render([r for r in all_recs if r["device"] == dev_name], svg)
    log(f"records in {out}, chart {svg}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
