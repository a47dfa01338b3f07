"""How much of the prefill attention's work is useful, for several ways of tiling the query tokens.

The prefill attention kernel (``dash_core.kernels.prefill``) runs a tile of ``QT`` query tokens (times
the G query heads of a KV head) over the union of the blocks those tokens routed to: every row of the
tile over every union block. Executed work is ``QT x union`` block-rows; useful work is the routed
(token, block) pairs (``docs/PERFORMANCE.md``, "Where the time goes").

This script routes sampled tiles of the prefill benchmark's synthetic prompt with the float64 oracle on
the CPU (the same generator as ``benchmarks/prefill.py``; CPU random draws differ from CUDA's, not their
statistics) and prints executed / useful attention work (union blocks only: the local window and the
scoring are the same for every tiling) for:

- ``tile QT``: today's tiles;
- ``tiles QT/2``, ``tiles QT/4``: smaller tiles, each loading its own union;
- ``two tiers T``: blocks that at least ``T`` of a tile's ``QT`` tokens routed to run at the full tile,
  the others only for the quarter tiles (``QT/4`` tokens) with a token that routed to them; ``two tiers T
  halves``: the same with half tiles (``QT/2`` tokens) for the others; ``two tiers T full``: the part of
  that work done at the full tile (the rest runs on the smaller tiles, smaller MMAs).

With ``--group N`` it also routes the ``N - 1`` tiles after each sampled one and prints how many blocks the union
of the ``N`` neighbouring tiles' unions holds, over the sum of their sizes: the K/V a group of tiles sharing one
ring would load, against what tiles loading their own unions do.

It also prints, per (token, KV head), how many candidates lie within 1 of some query head's maximum score
(the *band*: every other score is below every threshold the entmax's Halley steps try, so a router could read
the band alone) against the candidates and the entmax's support.

    python benchmarks/investigations/tile_sharing.py --context 131072 --topk 64 --samples 8
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from prefill import synthetic_prompt

from dash_core import DashParams
from dash_core.kernels.prefill.config import PrefillConfig
from dash_core.kernels.prefill.tiles import tile_tokens
from dash_core.reference import block_summaries, entmax15_threshold, route, routing_scores

THRESHOLDS = (2, 4, 6, 8)


def tiling_work(kept: torch.Tensor, thresholds=THRESHOLDS) -> dict:
    """Block-rows each tiling executes for one tile of ``QT`` tokens (a multiple of 4), from ``kept
    [units, QT, blocks]`` (bool: token t of the tile routed to block b, per selection unit), in units of
    one token-row over one block; ``useful`` is the routed pairs."""
    units, qt, nblk = kept.shape
    cnt = kept.sum(1)  # tokens of the tile per block
    out = {"useful": int(cnt.sum()), f"tile {qt}": int((cnt > 0).sum()) * qt}
    subs = {parts: kept.view(units, parts, qt // parts, nblk).any(2).sum(1) for parts in (2, 4)}  # per block
    for parts, n in subs.items():
        out[f"tiles {qt // parts}"] = int(n.sum()) * (qt // parts)
    for t in thresholds:
        popular = cnt >= t
        for parts, name in ((4, ""), (2, " halves")):
            rest = int((subs[parts] * (~popular & (cnt > 0))).sum()) * (qt // parts)
            out[f"two tiers {t}{name}"] = int(popular.sum()) * qt + rest
        out[f"two tiers {t} full"] = int(popular.sum()) * qt  # of which at the full tile (the rest: sub-tiles)
    return out


def group_sharing(kept: torch.Tensor, qt: int) -> tuple:
    """``(group, tiles)``: blocks of the union of the unions of the ``N`` neighbouring tiles of ``qt`` tokens in
    ``kept [units, N qt, blocks]``, and the sum of those tiles' union sizes, over all units."""
    units, tokens, nblk = kept.shape
    return int(kept.any(1).sum()), int(kept.view(units, tokens // qt, qt, nblk).any(2).sum())


def entmax_band(x: torch.Tensor, ncand: torch.Tensor, hkv: int) -> tuple:
    """``(band, support)``, ``[Hkv, R]`` counts per (KV head, token) from scores ``x [Hq, R, nblk]`` (token r
    over its first ``ncand[r]`` candidates): the candidates within 1 of some query head's maximum, and those
    some query head's 1.5-entmax keeps."""
    hq, r, nblk = x.shape
    valid = (torch.arange(nblk)[None, :] < ncand[:, None]).expand(hq, r, nblk)
    xv = torch.where(valid, x, torch.full_like(x, float("-inf")))
    band = xv > xv.amax(-1, keepdim=True) - 1.0
    support = valid & (x > entmax15_threshold(x, valid)[..., None])
    return tuple(t.view(hkv, hq // hkv, r, nblk).any(1).sum(-1) for t in (band, support))


def default_sf(context: int, hkv: int) -> float:
    """The scaling_factor the GPU benchmark calibrated for this prompt length (``docs/perf/prefill.json``)."""
    for r in json.loads((ROOT / "docs" / "perf" / "prefill.json").read_text()):
        if r["context"] == context and r["hkv"] == hkv and r["method"] == "dash-triton":
            return r["scaling_factor"]
    raise SystemExit(f"no benchmark record for {context} tokens, Hkv {hkv}: pass --sf")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--topk", default="64", help="an integer or none")
    ap.add_argument("--sf", type=float, default=None, help="scaling_factor (default: the benchmark's for the length)")
    ap.add_argument("--query-correlation", type=float, default=0.95)
    ap.add_argument("--samples", type=int, default=8, help="tiles, spread evenly over the prompt")
    ap.add_argument("--group", type=int, default=1, help="neighbouring tiles whose shared union is counted")
    a = ap.parse_args(argv)
    n, hq, hkv, d, bs = a.context, a.hq, a.hkv, a.head_dim, a.block_size
    sf = a.sf if a.sf is not None else default_sf(n, hkv)
    topk = None if a.topk.lower() == "none" else int(a.topk)
    p = DashParams(block_size=bs, topk=topk, scaling_factor=sf)
    qt = tile_tokens(hq, hkv, bs, PrefillConfig().attn_rows)
    if qt % 4:
        raise SystemExit(f"tiles of {qt} tokens: the quarter tilings need a multiple of 4")
    q, k, _, head_cls = synthetic_prompt(n, hq, hkv, d, bs, torch.bfloat16, torch.Generator().manual_seed(11),
                                         a.query_correlation)
    summ = block_summaries(k.permute(1, 0, 2), head_cls, bs).to(k.dtype)  # stored in the KV dtype
    total: dict = {}
    band = {"candidates": 0, "band": 0, "support": 0, "units": 0}
    span = qt * a.group  # tokens routed per sample: its tile and the group's others
    starts = torch.linspace(bs * (p.local_blocks + 1), n - span, a.samples).long() // qt * qt
    shared = [0, 0]  # blocks of the groups' unions, sum of their tiles' unions
    for a0 in starts.tolist():
        pos = torch.arange(a0, a0 + span)
        ncand = (pos // bs - p.local_blocks + 1).clamp(min=0)
        qs = (q[a0:a0 + span].float() * sf).to(q.dtype).permute(1, 0, 2)  # sf * q in the query dtype
        kept_group = route(qs, summ[:, :int(ncand.max())], ncand, p).kept  # each token routes on its own
        shared = [x + y for x, y in zip(shared, group_sharing(kept_group, qt))]
        kept, ncand, qs = kept_group[:, :qt], ncand[:qt], qs[:, :qt]  # the sampled tile
        for key, v in tiling_work(kept).items():
            total[key] = total.get(key, 0) + v
        b, sup = entmax_band(routing_scores(qs, summ[:, :int(ncand.max())]), ncand, hkv)
        band["candidates"] += int(ncand.sum()) * hkv
        band["band"] += int(b.sum())
        band["support"] += int(sup.sum())
        band["units"] += b.numel()
    useful = total.pop("useful")
    print(f"{n} tokens, Hq {hq}, Hkv {hkv}, bs {bs}, topk {topk}, sf {sf}, {a.samples} tiles of {qt} tokens: "
          f"executed / useful attention work")
    for key, v in total.items():
        print(f"  {key:18s} {v / max(useful, 1):5.2f}")
    if a.group > 1:
        print(f"groups of {a.group} tiles: union of their unions over the sum of their sizes "
              f"{shared[0] / max(shared[1], 1):.3f}")
    print("per (token, KV head), mean over the sampled tiles' tokens")
    for key in ("candidates", "band", "support"):
        print(f"  {key:14s} {band[key] / max(band['units'], 1):7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
