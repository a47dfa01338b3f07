"""The prefill router's entmax passes with the scores recomputed in every pass, against contiguous summaries.

The prefill route kernel (``dash_core.kernels.prefill``) stores each tile's fp32 scores (16 tokens x 4 query
heads against every candidate summary) and reads them back in four passes (three Halley steps, then mp). At
128k tokens that moves about 17 GB a pass. This script times the alternative: no score scratch, each of the five
passes (row maxima, three Halley steps, mp with its lists) recomputes the scores by ``tl.dot`` from summaries
laid out contiguously per candidate (``[blocks, Hkv * D]``, as a request's summaries could be gathered once
per prefill), loaded by TMA boxes (``tma``) or by pointers through a shuffled page table (``paged``, as the
route kernel loads them today). The cap is not run: compare with the route kernel's stages before the cap.

Work: the prompt's tiles (``--context / 16`` tiles x Hkv 8, tile t with ``t * 16 // 64`` candidates), bf16,
D 128, block size 64. Checked against float64 PyTorch entmax on sampled tiles before it is timed.

    python benchmarks/route_recompute.py --context 131072      # on a Hopper GPU
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dash_core import reference as ref_mod  # noqa: E402
from dash_core.kernels.routing import append_positive, halley_step, mp_key_range  # noqa: E402

QT, G, D, BS = 16, 4, 128, 64
ROWS = QT * G


@triton.jit
def _scores(q, s_desc, summ_ptr, perm_ptr, c0, h, ncand, x_scale, BN: tl.constexpr, D: tl.constexpr,
            TMA: tl.constexpr, HKV: tl.constexpr):
    """``[ROWS, BN]`` fp32 scores of candidates ``c0 ..`` (-inf past ``ncand``)."""
    c = c0 + tl.arange(0, BN)
    if TMA:
        s = s_desc.load([c0, h * D])
    else:
        blk = tl.load(perm_ptr + c, mask=c < ncand, other=0).to(tl.int64)
        s = tl.load(summ_ptr + blk[:, None] * (HKV * D) + h * D + tl.arange(0, D)[None, :], mask=(c < ncand)[:, None],
                    other=0.0)
    x = tl.dot(q, tl.trans(s)) * x_scale
    return tl.where((c < ncand)[None, :], x, float("-inf")), c


@triton.jit
def _entmax_recompute(q_ptr, s_desc, summ_ptr, perm_ptr, mp_ptr, ck_ptr, npos_ptr, tau_ptr, x_scale, SLOTS,
                      HKV: tl.constexpr, QT: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                      BN: tl.constexpr, MAXC: tl.constexpr, TMA: tl.constexpr):
    """Grid ``(tiles, Hkv)``: tile w's rows (token u, head g) over candidates ``0 .. w QT // BS - 1``."""
    w = tl.program_id(0)
    h = tl.program_id(1)
    ROWS: tl.constexpr = QT * G
    rows = tl.arange(0, ROWS)
    ncand = (w * QT) // BS
    q = tl.load(q_ptr + ((w * QT + rows // G) * HKV * G + h * G + rows % G)[:, None].to(tl.int64) * D
                + tl.arange(0, D)[None, :])
    m = tl.full([ROWS], float("-inf"), tl.float32)
    for c0 in range(0, ncand, BN):
        x, _c = _scores(q, s_desc, summ_ptr, perm_ptr, c0, h, ncand, x_scale, BN, D, TMA, HKV)
        m = tl.maximum(m, tl.max(x, axis=1))
    m = tl.where(ncand > 0, m, 0.0)
    lo = m - 1.0
    hi = m
    tau = (lo + hi) * 0.5
    for _ in tl.static_range(3):
        ssq = tl.zeros([ROWS], tl.float32)
        sdf = tl.zeros([ROWS], tl.float32)
        cnt = tl.zeros([ROWS], tl.float32)
        for c0 in range(0, ncand, BN):
            x, _c = _scores(q, s_desc, summ_ptr, perm_ptr, c0, h, ncand, x_scale, BN, D, TMA, HKV)
            above = x > tau[:, None]
            diff = tl.where(above, x - tau[:, None], 0.0)
            ssq += tl.sum(diff * diff, axis=1)
            sdf += tl.sum(diff, axis=1)
            cnt += tl.sum(above.to(tl.float32), axis=1)
        tau, lo, hi = halley_step(ssq, sdf, cnt, tau, lo, hi)
    slot = (w % SLOTS) * HKV + h
    tl.store(tau_ptr + (w * HKV + h) * ROWS + rows, tau)
    unit = (slot * QT + tl.arange(0, QT)).to(tl.int64) * MAXC
    npos = tl.zeros([QT], tl.int32)
    key_min = tl.full([QT], 0x7F800000, tl.int32)
    key_max = tl.zeros([QT], tl.int32)
    for c0 in range(0, ncand, BN):
        x, c = _scores(q, s_desc, summ_ptr, perm_ptr, c0, h, ncand, x_scale, BN, D, TMA, HKV)
        diff = tl.where(x > tau[:, None], x - tau[:, None], 0.0)
        mp = tl.sum(tl.reshape(diff * diff, [QT, G, BN]), axis=1) / G
        cok = (c < ncand)[None, :] & (tl.arange(0, QT) >= 0)[:, None]
        before = npos
        npos, key_min, key_max = mp_key_range(mp, cok, npos, key_min, key_max)
        append_positive(mp, c, cok, mp_ptr, ck_ptr, unit, before)
    tl.store(npos_ptr + (w * HKV + h) * QT + tl.arange(0, QT), npos + 0 * key_min + 0 * key_max)


def make_work(context: int, hkv: int = 8, sf: float = 4.0, seed: int = 0, device="cuda"):
    g = torch.Generator(device="cpu").manual_seed(seed)
    nblk = context // BS
    tiles = context // QT
    q = (torch.randn(context, hkv * G, D, generator=g) * sf).to(device, torch.bfloat16)
    summ = torch.randn(nblk, hkv * D, generator=g).to(device, torch.bfloat16)
    perm = torch.randperm(nblk, generator=g).to(torch.int32)
    summ_paged = torch.empty_like(summ)
    summ_paged[perm.long().to(device)] = summ  # candidate c lives at row perm[c]
    return dict(q=q, summ=summ, summ_paged=summ_paged, perm=perm.to(device), hkv=hkv, tiles=tiles, nblk=nblk)


def launcher(work: dict, tma: bool, slots: int = 1056, warps: int = 8, bn: int = 64, stages: int = 3):
    hkv, tiles, nblk = work["hkv"], work["tiles"], work["nblk"]
    dev = work["q"].device
    maxc = max(16, nblk)
    mp = torch.empty(slots * hkv * QT * maxc, dtype=torch.float32, device=dev)
    ck = torch.empty(slots * hkv * QT * maxc, dtype=torch.int32, device=dev)
    npos = torch.empty(tiles * hkv * QT, dtype=torch.int32, device=dev)
    tau = torch.empty(tiles * hkv * ROWS, dtype=torch.float32, device=dev)
    desc = TensorDescriptor.from_tensor(work["summ"], [bn, D])
    summ = work["summ"] if tma else work["summ_paged"]

    def call():
        _entmax_recompute[(tiles, hkv)](work["q"], desc, summ, work["perm"], mp, ck, npos, tau, 0.5 / math.sqrt(D),
                                        slots, HKV=hkv, QT=QT, G=G, D=D, BS=BS, BN=bn, MAXC=maxc, TMA=tma,
                                        num_warps=warps, num_stages=stages)

    return call, dict(mp=mp, ck=ck, npos=npos, tau=tau, maxc=maxc, slots=slots)


def check(work: dict, out: dict, tiles) -> float:
    """Largest |tau - reference tau| over the rows of some tiles (float64 scores, the oracle's entmax)."""
    hkv = work["hkv"]
    worst = 0.0
    for w in tiles:
        ncand = w * QT // BS
        if ncand == 0:
            continue
        for h in range(hkv):
            q = work["q"][w * QT:(w + 1) * QT, h * G:(h + 1) * G].reshape(ROWS, D).double()
            s = work["summ"][:ncand, h * D:(h + 1) * D].double()
            x = 0.5 * (q @ s.T) / math.sqrt(D)
            want = ref_mod.entmax15_threshold(x, torch.ones_like(x, dtype=torch.bool))
            got = out["tau"][(w * hkv + h) * ROWS:(w * hkv + h + 1) * ROWS].double()
            worst = max(worst, float((got - want.reshape(-1)).abs().max()))
    return worst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--configs", default="tma:8:64:3,paged:8:64:3",
                    help="comma-separated loads:warps:candidates per tile:stages")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from decode import time_calls
    work = make_work(a.context)
    rc = 0
    for cfg in a.configs.split(","):
        name, warps, bn, stages = cfg.split(":")
        call, out = launcher(work, name == "tma", warps=int(warps), bn=int(bn), stages=int(stages))
        call()
        torch.cuda.synchronize()
        err = check(work, out, [work["tiles"] // 7 * i + 5 for i in range(1, 7)])
        ms = time_calls([call], a.iters, 1, True)
        ok = err < 1e-4
        rc |= not ok
        print(f"recompute {cfg:14s} {ms:8.2f} ms  max |tau err| {err:.2e} {'ok' if ok else 'WRONG'}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
