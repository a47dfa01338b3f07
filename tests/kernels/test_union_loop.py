"""``benchmarks/union_loop.py``: every variant of the prefill union loop computes attention with a prior.

The script's float32 reference is checked here against a softmax written independently. On the CPU the Triton
variant runs under the interpreter, and the Gluon variants (``benchmarks/union_loop_ws.py``'s warp-specialized ones
too) are compiled for sm_90 in a subprocess (the interpreter cannot run Gluon). On a Hopper GPU every variant runs
against the reference.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests._benchmarks import import_benchmark
from tests.kernels._kernel_env import KERNEL_DEVICE

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ul():
    return import_benchmark("union_loop")  # benchmarks/union_loop.py


def _hopper() -> bool:
    return KERNEL_DEVICE == "cuda" and torch.cuda.get_device_capability()[0] == 9


def test_reference_is_a_softmax_weighted_by_the_prior(ul):
    work = ul.make_work(tiles=4, hkv=2, union=5, pages=16, device="cpu")
    units = list(range(8))
    ref = ul.reference(work, units).double()
    for i, u in enumerate(units):
        n, h = int(work["nu"][u]), u % work["hkv"]
        if n == 0:
            assert not ref[i].any()
            continue
        q = work["q"][u * ul.ROWS:(u + 1) * ul.ROWS].double()
        blk = work["ublk"][u, :n].long()
        k = work["k"][blk, :, h].reshape(n * ul.BS, ul.D).double()
        v = work["v"][blk, :, h].reshape(n * ul.BS, ul.D).double()
        prior = torch.exp2(work["prior"][u, :n].double())  # [n, QT]: 0 where the token did not route
        weight = prior.T[torch.arange(ul.ROWS) // ul.G].repeat_interleave(ul.BS, dim=1)  # [rows, n BS]
        logits = q @ k.T / math.sqrt(ul.D)
        e = torch.exp(logits - logits.amax(1, keepdim=True)) * weight
        total = e.sum(1, keepdim=True)
        want = torch.where(total > 0, e @ v / torch.where(total > 0, total, 1.0), 0.0)
        assert torch.allclose(ref[i], want, atol=1e-4, rtol=1e-4), (u, float((ref[i] - want).abs().max()))


@pytest.mark.parametrize("per", [1, 2])
def test_variants_match_the_reference(ul, per):
    if per == 2 and not _hopper():
        pytest.skip("two blocks an iteration is a Gluon variant: Hopper only")
    work = ul.make_work(tiles=3, hkv=2, union=7, pages=16, device=KERNEL_DEVICE)
    o, calls = ul.launchers(work, stages=3, per=per)
    if _hopper():
        names = ["triton", "gluon", "gluon-overlap", "gluon-mma2"] if per == 1 else ["gluon", "gluon-overlap"]
    else:
        names = ["triton"]  # the interpreter, or a GPU without warpgroup MMAs
    units = work["nu"].numel()
    ref = ul.reference(work, range(units))
    assert ref.abs().max() > 0.1  # not an all-zero case
    for name in names:
        o.fill_(float("nan"))
        calls[name]()
        got = o.view(units, ul.ROWS, ul.D)
        err = float((got - ref).abs().max())
        assert err < 2e-2, (name, err)  # bf16 probabilities in the PV product, fp32 accumulation


def test_shared_work_draws_each_union_from_its_group(ul):
    """``--share``: the tiles of a group of 3 take their unions, in order, from the group's blocks, and hold all of
    them together (a group's ring loads no block that none of its tiles runs)."""
    work = ul.make_work(tiles=6, hkv=2, union=7, pages=64, device="cpu", share=0.6)
    gu = work["group_union"]
    assert gu == round(0.6 * 3 * 7) and work["gblk"].shape == (2 * 2, gu)
    covered = {}
    for u in range(12):
        n = int(work["nu"][u])
        own = work["own"][u, :n]
        assert bool((own[1:] > own[:-1]).all()) and int(own.max()) < gu  # increasing positions in the group
        group = (u // 2) // 3 * 2 + u % 2  # (tile // 3, KV head)
        assert torch.equal(work["ublk"][u, :n], work["gblk"][group, own.long()])
        covered.setdefault(group, set()).update(own.tolist())
    assert all(c == set(range(gu)) for c in covered.values()), covered
    with pytest.raises(ValueError):
        ul.make_work(tiles=4, hkv=2, union=7, pages=64, device="cpu", share=0.6)  # not whole groups


@pytest.mark.skipif(not _hopper(), reason="warp-specialized Gluon variants: Hopper only")
def test_warp_specialized_variants_match_the_reference(ul):
    """Three or four warpgroups a program, each its own tile (``union_ws``; unions of their own, some empty), and
    three sharing one ring of their group's blocks (``union_shared``; unions from groups): 12 tiles, so that every
    grouping is whole."""
    for share, names in ((0.0, list(ul.WS_CONFIGS)), (0.6, list(ul.SHARED_CONFIGS))):
        work = ul.make_work(tiles=12, hkv=2, union=7, pages=16, device=KERNEL_DEVICE, share=share)
        o, calls = ul.launchers(work, stages=3, per=1)
        assert set(names) <= set(calls)
        units = work["nu"].numel()
        ref = ul.reference(work, range(units))
        assert ref.abs().max() > 0.1
        for name in names:
            o.fill_(float("nan"))
            calls[name]()
            err = float((o.view(units, ul.ROWS, ul.D) - ref).abs().max())
            assert err < 2e-2, (name, err)


@pytest.mark.parametrize("name", ["triton", "triton-t"])
@pytest.mark.parametrize("rows", [16, 32, 64])
def test_small_tiles_match_the_reference(ul, rows, name):
    """Tiles of 4, 8 and 16 tokens: ``triton`` with a warp per 16 rows, and ``triton-t`` (keys as the MMAs' M,
    the tile's rows as N)."""
    work = ul.make_work(tiles=3, hkv=2, union=7, pages=16, device=KERNEL_DEVICE, rows=rows)
    o, calls = ul.launchers(work, stages=3, per=1, warps=rows // 16, tstages=2)
    units = work["nu"].numel()
    ref = ul.reference(work, range(units))
    assert ref.abs().max() > 0.1
    o.fill_(float("nan"))
    calls[name]()
    err = float((o.view(units, rows, ul.D) - ref).abs().max())
    assert err < 2e-2, err


@pytest.mark.skipif(KERNEL_DEVICE != "cpu", reason="CPU check; on a GPU the variants run")
@pytest.mark.parametrize("per", [1, 2])
def test_gluon_variants_compile_for_sm90(ul, per):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "benchmarks/union_loop.py", "--compile-only", "--per", str(per)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    if r.returncode and "ptxas" in r.stderr and "No such file" in r.stderr:
        pytest.skip("triton's bundled ptxas is missing")
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    shared = {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\S+): shared (\d+) B", r.stdout, re.M)}
    assert set(shared) == {"triton", "triton-t16", "triton-t32", "triton-t64", "triton16-w1-s2", "triton16-w1-s3",
                           "triton32-w2-s2", "triton32-w2-s3", "gluon", "gluon-overlap", "gluon-mma2",
                           *ul.WS_CONFIGS, *ul.SHARED_CONFIGS}, r.stdout
    assert max(shared.values()) <= 227 * 1024, shared
    spills = {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\S+): .* spills (\d+)$", r.stdout, re.M)}
    assert {k for k, v in spills.items() if v and k.startswith("gluon")} == {
        "gluon-ws4-k1v1-sync", "gluon-ws4-k1v1"}, spills  # four warpgroups under 128 registers (docs)
