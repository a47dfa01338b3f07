"""Output helpers shared by the benchmarks: JSON records merged by case, a marked section of
``docs/PERFORMANCE.md`` replaced in place (other sections untouched), and a dependency-free SVG
bar chart, the crossover of two timing series, synthetic correlated queries, and the register report of
compiled PTX. Timing helpers (``time_calls``, ``copy_bandwidth``, ``log``) live in ``decode.py``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import torch


def merge_records(path: Path, new: list, key: Callable[[dict], tuple], order: Callable[[dict], tuple]) -> list:
    """Records of ``path`` with ``new`` ones replacing those of the same ``key``; written back sorted."""
    old = json.loads(path.read_text()) if path.exists() else []
    keep = {key(r): r for r in old}
    for r in new:
        keep[key(r)] = r
    out = sorted(keep.values(), key=order)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    return out


def replace_section(path: Path, begin: str, end: str, body: str) -> None:
    """Put ``body`` between the ``begin``/``end`` markers of ``path`` (appended when absent)."""
    block = f"{begin}\n{body.rstrip()}\n{end}\n"
    text = path.read_text() if path.exists() else "# Performance\n\n"
    if begin in text and end in text:
        pre, rest = text.split(begin, 1)
        post = rest.split(end, 1)[1].lstrip("\n")
        text = pre + block + post
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def svg_bars(path: Path, groups: dict, title: str, unit: str, colors: dict) -> None:
    """Horizontal bars on a log scale: ``groups = {group label: [(bar label, value), ...]}``; the bar
    colour is ``colors[first word of the bar label]``."""
    values = [v for items in groups.values() for _, v in items if v > 0]
    vmax, vmin = (max(values), min(values)) if values else (1.0, 1.0)
    lo, hi = math.log10(vmin / 2), math.log10(vmax * 1.5)
    x0, width, y = 300, 500, 30
    lines = []
    for group, items in groups.items():
        lines.append(f'<text x="5" y="{y}" font-weight="bold">{group}</text>')
        y += 18
        for lab, v in items:
            w = max(1.0, (math.log10(max(v, vmin)) - lo) / (hi - lo) * width)
            c = colors.get(lab.split()[0], "#9467bd")
            lines.append(f'<text x="10" y="{y + 11}" font-size="11">{lab}</text>'
                         f'<rect x="{x0}" y="{y}" width="{w:.1f}" height="13" fill="{c}"/>'
                         f'<text x="{x0 + w + 4:.1f}" y="{y + 11}" font-size="11">{v:.3g} {unit}</text>')
            y += 17
        y += 8
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{x0 + width + 140}" height="{y + 20}" '
           f'font-family="sans-serif" font-size="12"><text x="5" y="15">{title}</text>{"".join(lines)}</svg>\n')
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(svg)


def crossover(ours: dict, peer: dict) -> tuple:
    """``(crossover, losing sizes)`` from ``{size: ms}`` of ours and of the peer: the smallest size from
    which on ours is faster at every measured size both have (None if never), and where it is slower."""
    sizes = sorted(set(ours) & set(peer))
    wins = {s: ours[s] < peer[s] for s in sizes}
    cross = None
    for s in reversed(sizes):
        if not wins[s]:
            break
        cross = s
    return cross, [s for s in sizes if not wins[s]]


def ar1_walk(x: torch.Tensor, rho: float, chunk: int = 256) -> torch.Tensor:
    """``y_t = rho y_{t-1} + sqrt(1 - rho^2) x_t`` along dim 0 (unit variance kept for unit-variance
    ``x``): synthetic queries whose neighbours are alike. Computed in chunks on ``x``'s device: inside a
    chunk ``y_j = rho^(j+1) (y_prev + c sum_{i<=j} x_i / rho^(i+1))``, ``c = sqrt(1 - rho^2)``."""
    out = torch.empty_like(x)
    out[0] = x[0]
    c = math.sqrt(1 - rho * rho)
    shape = (-1,) + (1,) * (x.dim() - 1)
    prev = x[0].double()
    for t0 in range(1, x.shape[0], chunk):
        e = x[t0: t0 + chunk].double()
        powers = (rho ** torch.arange(1, e.shape[0] + 1, device=x.device, dtype=torch.float64)).view(shape)
        y = powers * (prev + c * torch.cumsum(e / powers, 0))
        out[t0: t0 + e.shape[0]] = y.to(x.dtype)
        prev = y[-1]
    return out


def import_published(module: str):
    """``dash_attn.<module>`` of the authors' DashAttention copy at ``$DASH_PUBLISHED_DIR`` (their package
    sets the fp32 matmul precision globally on import: it is restored here)."""
    import importlib
    import os
    import sys

    import torch

    pub = os.environ.get("DASH_PUBLISHED_DIR")
    if not pub or not Path(pub, "dash_attn").is_dir():
        raise RuntimeError("set DASH_PUBLISHED_DIR to a copy of the authors' DashAttention repository")
    prec = torch.get_float32_matmul_precision()
    if pub not in sys.path:
        sys.path.insert(0, pub)
    try:
        return importlib.import_module(f"dash_attn.{module}")
    finally:
        torch.set_float32_matmul_precision(prec)


def ptxas_usage(ptx: str, arch: str = "sm_90a") -> tuple:
    """``(registers, spill store bytes)`` that triton's bundled ptxas reports for ``ptx`` (None where it
    reports none): the compile checks run it on machines without a GPU."""
    import os
    import re
    import subprocess
    import tempfile

    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        Path(path).write_text(ptx)
        r = subprocess.run([ptxas, "-v", "--gpu-name", arch, path, "-o", path + ".o"], capture_output=True, text=True)
    regs = re.search(r"Used (\d+) registers", r.stderr)
    spill = re.search(r"(\d+) bytes spill stores", r.stderr)
    return (int(regs.group(1)) if regs else None), (int(spill.group(1)) if spill else None)


def add_shape_args(ap, sf_help: str) -> None:
    """The arguments both benchmarks share: heads, head size, block and page size, topk, sf, peers."""
    ap.add_argument("--hkv", default="8")
    ap.add_argument("--topk", default="64,none")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--sf", type=float, default=None, help=sf_help)
    ap.add_argument("--target-fraction", type=float, default=0.05, help="uncapped selection to calibrate sf for")
    ap.add_argument("--peers", default="sdpa,flashinfer,published")


def add_output_args(ap, name: str) -> None:
    """Where a benchmark writes: ``docs/perf/NAME.json``, its section of ``docs/PERFORMANCE.md`` and
    ``docs/perf/NAME.svg`` by default; ``--no-write-docs`` writes none of them."""
    root = Path(__file__).resolve().parents[1]
    ap.add_argument("--json", default=str(root / f"docs/perf/{name}.json"))
    ap.add_argument("--markdown", default=str(root / "docs/PERFORMANCE.md"))
    ap.add_argument("--svg", default=str(root / f"docs/perf/{name}.svg"))
    ap.add_argument("--no-write-docs", action="store_true")


def shown_command(script: str, argv: list) -> str:
    """The command as the docs record it: output paths (machine-specific) left out."""
    outs = ("--json", "--markdown", "--svg")
    kept = [x for i, x in enumerate(argv) if x not in outs and not (i and argv[i - 1] in outs)]
    return f"python benchmarks/{script} " + " ".join(kept)
