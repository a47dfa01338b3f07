"""Time the prefill K/V write against one program per token.

``write_kv_and_summaries(..., decode=False)`` writes a prompt's K/V into the paged cache and
summarises every block it completes, ``kv_write.ROWS`` tokens of one KV head a program: in one launch
where each request's tokens are consecutive (``consecutive``, the prefill op's write), else a write
launch, then a summary launch (``cache_dash_prefill``'s, slots in any order). The peer row launches the
decode kernel two ways (write, then summaries) with one program per token and KV head, as the prefill
write did before. Pages are shuffled; times are medians
of CUDA-event-timed calls after warm-up (``common.time_calls``: calls issued back to back); the floor is the
bytes moved (K/V read and written, each completed block's keys read, the summaries written) over the measured
copy bandwidth.

    python benchmarks/kv_write.py --tokens 2048,8192,131072
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import copy_bandwidth, time_calls

from dash_core.kernels import kv_write
from dash_core.layout import PagedKVCache, alloc_summaries


def per_token(k, v, cache, slot_mapping, head_cls, bs) -> None:
    """The write as one program per (token, KV head): a write launch, then a summary launch."""
    args = kv_write.write_args(k, v, cache, slot_mapping, head_cls)
    warps = kv_write.summary_warps(bs, cache.head_dim)
    for write, summ in ((True, False), (False, True)):
        kv_write._kv_write_kernel[(slot_mapping.shape[0], cache.num_kv_heads)](
            *args, D=cache.head_dim, BS=bs, PS=cache.page_size, WRITE=write, SUMMARIZE=summ, OWN_ROW=False,
            num_warps=warps)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="2048,8192,131072")
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    dev = torch.device("cuda")
    hkv, d, bs, dt = a.hkv, a.head_dim, a.block_size, torch.bfloat16
    bw = copy_bandwidth(dev)
    print(f"Hkv {hkv}, D {d}, block size {bs}, bf16, copy bandwidth {bw / 1e12:.2f} TB/s")
    print("| tokens | method | time (us) | floor (us) | of floor |")
    print("|---|---|---|---|---|")
    g = torch.Generator(device=dev).manual_seed(0)
    for t in (int(x) for x in a.tokens.split(",")):
        pages = -(-t // bs)
        slots = (torch.randperm(pages, device=dev, generator=g)[torch.arange(t, device=dev) // bs] * bs
                 + torch.arange(t, device=dev) % bs)
        k = torch.randn(t, hkv, d, device=dev, generator=g).to(dt)
        v = torch.randn(t, hkv, d, device=dev, generator=g).to(dt)
        head_cls = torch.randn(hkv, d, device=dev, generator=g).to(dt)
        kb = torch.zeros(pages * bs, hkv, d, dtype=dt, device=dev)
        cache = PagedKVCache.from_sglang(kb, torch.zeros_like(kb), bs, alloc_summaries(pages * bs, bs, hkv, d, dt, dev))
        moved = 2 * (2 * k.numel() * 2) + (t // bs) * hkv * (bs + 1) * d * 2 + t * 8
        floor_us = moved / bw * 1e6
        for name, fn in (("rows, one launch (consecutive)", lambda: kv_write.write_kv_and_summaries(
                             k, v, cache, slots, head_cls, bs, decode=False, consecutive=True)),
                         ("rows, two launches", lambda: kv_write.write_kv_and_summaries(
                             k, v, cache, slots, head_cls, bs, decode=False)),
                         ("one program per token", lambda: per_token(k, v, cache, slots, head_cls, bs))):
            us = time_calls([fn], a.iters, 3, True) * 1e3
            print(f"| {t} | {name} | {us:.1f} | {floor_us:.1f} | {floor_us / us:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
