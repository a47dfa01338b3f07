"""Where the decode cap's radix select goes wrong: tiles whose keys several threads hold, the pattern isolated.

The decode cap's radix select (``routing.select_kept``) runs only on tiles of at least ``RADIX_MIN_KEYS`` keys, where
every thread of the select kernel holds distinct keys: with smaller tiles it kept the wrong block on the H200 (triton
3.6). This sweep checks the pieces apart on random inputs against torch (``tests/kernels/_radix_probe.py``): the
histogram of a [TS] tile loaded from memory, the kernel's own 4-pass radix select (``routing.radix_kth``) on it, and
the same with keys made as the kernel makes them in registers (a reduction over heads of a [1, NH, TS] tile,
reshaped to [TS]). It prints one line per shape with the number of wrong results; run it after a Triton upgrade
before moving the bound:

    python benchmarks/investigations/histogram_probe.py   # a CUDA GPU; TRITON_INTERPRET=1 checks the script on the CPU
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.kernels._radix_probe import probe


def main() -> int:
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    if not torch.cuda.is_available() and not interp:
        print("needs a CUDA GPU (or TRITON_INTERPRET=1 to check the script on the CPU)")
        return 2
    device = "cpu" if interp else "cuda"
    g = torch.Generator().manual_seed(0)
    trials = 2 if interp else 100
    bad = 0
    for warps in (1, 4, 8):
        for ts in (16, 32, 64, 128, 256, 512):
            for nh in (0, 2, 4, 16):  # 0: keys loaded from memory
                wh, wk = probe(device, ts, max(nh, 1), nh > 0, warps, trials, g)
                bad += wh + wk
                print(f"warps {warps} TS {ts:4d} keys {'from memory' if nh == 0 else f'from {nh:2d} heads'}: "
                      f"histogram wrong {wh}/{trials}, topk-th key wrong {wk}/{trials}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
