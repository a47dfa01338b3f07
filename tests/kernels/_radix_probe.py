"""The decode cap's radix select run alone on random tiles, checked against torch: each histogram and the topk-th
key. ``test_kernel_routing`` runs it where the kernel uses the radix select (tiles of ``RADIX_MIN_KEYS`` keys and
more); ``benchmarks/investigations/histogram_probe.py`` sweeps the smaller tiles where it went wrong. ``rank_probe``
runs the cap's other search, ``rank_kth``, alone the same way."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dash_core.kernels.routing import radix_kth, rank_kth  # the kernel's own searches


@triton.jit
def _probe_kernel(x_ptr, n_ptr, topk_ptr, hist_ptr, kth_ptr, keys_ptr, TS: tl.constexpr, NH: tl.constexpr,
                  FROM_HEADS: tl.constexpr):
    """Keys: x [TS] floats (FROM_HEADS False) or the mean over NH rows of relu(x - 0.5)^2 of x [NH, TS] (as the
    kernel's mp in registers). Writes the keys, their top-byte histogram and the topk-th largest key."""
    offs = tl.arange(0, TS)
    n = tl.load(n_ptr)
    topk = tl.load(topk_ptr)
    if FROM_HEADS:
        rows = tl.arange(0, NH)
        x = tl.load(x_ptr + rows[None, :, None] * TS + offs[None, None, :], mask=offs[None, None, :] < n,
                    other=float("-inf"))
        d = tl.where(x > 0.5, x - 0.5, 0.0)
        keys = tl.reshape((tl.sum(d * d, axis=1) / NH).to(tl.int32, bitcast=True), [TS])
    else:
        keys = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.int32, bitcast=True)
    tl.store(keys_ptr + offs, keys)
    kvalid = (offs < n) & (keys > 0)
    bins = tl.arange(0, 256)
    tl.store(hist_ptr + bins, tl.histogram(keys >> 24, 256, mask=kvalid))  # as radix_kth's first pass
    tl.store(kth_ptr, radix_kth(keys, kvalid, topk))


def probe(device, ts: int, nh: int, from_heads: bool, warps: int, trials: int, g: torch.Generator) -> tuple:
    """(wrong histograms, wrong topk-th keys) in ``trials`` random cases of tiles of ``ts`` keys (made from ``nh``
    heads in registers with ``from_heads``, else loaded), on a program of ``warps`` warps."""
    wrong_hist = wrong_kth = 0
    for _ in range(trials):
        n = int(torch.randint(1, ts + 1, (1,), generator=g))
        topk = int(torch.randint(1, 4, (1,), generator=g))
        shape = (nh, ts) if from_heads else (ts,)
        x = (torch.rand(shape, generator=g) * (torch.rand(shape, generator=g) > 0.3) * 2).to(device)
        hist = torch.empty(256, dtype=torch.int32, device=device)
        kth = torch.empty(1, dtype=torch.int32, device=device)
        keys = torch.empty(ts, dtype=torch.int32, device=device)
        _probe_kernel[(1,)](x, torch.tensor([n], dtype=torch.int32, device=device),
                            torch.tensor([topk], dtype=torch.int32, device=device), hist, kth, keys, TS=ts, NH=nh,
                            FROM_HEADS=from_heads, num_warps=warps)
        k = keys.cpu()
        valid = (torch.arange(ts) < n) & (k > 0)
        ref = torch.bincount((k[valid] >> 24).long(), minlength=256).int()
        pos = k[valid]
        wrong_hist += int(not torch.equal(hist.cpu(), ref))
        wrong_kth += int(pos.numel() >= topk and int(kth) != int(torch.topk(pos, topk).values[-1]))
    return wrong_hist, wrong_kth


@triton.jit
def _rank_kernel(x_ptr, n_ptr, topk_ptr, out_ptr, RK: tl.constexpr, CH: tl.constexpr):
    kth, n_gt, n_eq = rank_kth(x_ptr, tl.load(n_ptr), tl.load(topk_ptr), RK=RK, CH=CH)
    tl.store(out_ptr, kth)
    tl.store(out_ptr + 1, n_gt)
    tl.store(out_ptr + 2, n_eq)


def rank_probe(device, rk: int, chunk: int, warps: int, trials: int, g: torch.Generator) -> int:
    """Wrong answers of ``rank_kth`` (the topk-th key, the counts above and at it) in ``trials`` random lists of 1
    to ``rk`` positive floats (from few distinct values half the time: ties at the threshold), on a program of
    ``warps`` warps."""
    wrong = 0
    for t in range(trials):
        n = int(torch.randint(1, rk + 1, (1,), generator=g))
        topk = int(torch.randint(1, n + 1, (1,), generator=g))
        x = torch.rand(n, generator=g) + 1e-3
        if t % 2:
            x = torch.ceil(x * 4) / 4
        out = torch.empty(3, dtype=torch.int32, device=device)
        padded = torch.cat([x, torch.zeros(-n % 4)])  # the list as the select leaves it (routing.pad_list)
        _rank_kernel[(1,)](padded.to(device), torch.tensor([n], dtype=torch.int32, device=device),
                           torch.tensor([topk], dtype=torch.int32, device=device), out, RK=rk, CH=chunk,
                           num_warps=warps)
        keys = x.view(torch.int32)
        kth = int(torch.topk(keys, topk).values[-1])
        wrong += int(out.cpu().tolist() != [kth, int((keys > kth).sum()), int((keys == kth).sum())])
    return wrong
