"""The kernels against the published DashAttention kernels' outputs (the golden files, docs/semantics.md section 10):
each case's prompt through the prefill kernels, and its decode step through the decode kernels, on shuffled pages
of two blocks. Under the interpreter on the CPU, compiled on a GPU.

Tolerances are the golden files' (docs/semantics.md section 10): a block at the entmax threshold moves with one bf16
unit of its summary, so at most 3% of the prefill rows may count other active blocks than the published kernels;
the rows that agree must be within 3e-2. A decode step is one row a KV head: its count must agree, its output within
1e-2 plus the bf16 rounding of the returned output (4e-3).
"""

from __future__ import annotations

import pytest
import torch

from dash_core.kernels.decode.buffers import DecodeBuffers
from dash_core.kernels.kv_write import write_kv_and_summaries
from dash_core.kernels.prefill import launch as pf_launch, route as pf_route, tiles as pf_tiles
from dash_core.kernels.prefill.config import PrefillConfig
from dash_core.layout import PagedKVCache, alloc_summaries
from tests import _golden as golden
from tests.kernels._kernel_env import KERNEL_DEVICE
from tests.kernels._kernel_ops import kernel_decode, kernel_prefill

DEV = KERNEL_DEVICE
pytestmark = pytest.mark.skipif(not golden.CASES, reason=golden.SKIP_REASON)
cases = pytest.mark.parametrize("path", golden.CASES, ids=golden.case_id)


class Case:
    """A golden case on a shuffled paged cache (SGLang's layout, pages of two blocks, room for the decode token)."""

    def __init__(self, path: str):
        g = self.g = torch.load(path, weights_only=True)
        self.p = p = golden.params_of(g)
        b, hq, n, d = g["q"].shape  # [B, H, N, D]
        hkv = g["k"].shape[1]
        if d not in (64, 128, 256):
            pytest.skip(f"head_dim {d} is not a kernel head size")
        self.b, self.hq, self.hkv, self.n, self.d = b, hq, hkv, n, d
        bs = p.block_size
        ps = 2 * bs
        npages = -(-(n + 1) // ps)
        perm = torch.randperm(b * npages + 2, generator=torch.Generator().manual_seed(1))
        self.bt = perm[: b * npages].view(b, npages).to(torch.int32).to(DEV)
        slots_total = (b * npages + 2) * ps
        kb = torch.zeros(slots_total, hkv, d, dtype=g["q"].dtype, device=DEV)
        self.cache = PagedKVCache.from_sglang(kb, torch.zeros_like(kb), ps,
                                              alloc_summaries(slots_total, bs, hkv, d, kb.dtype, DEV))
        self.hc = g["head_cls"].to(DEV)
        pos = torch.arange(n + 1, device=DEV)
        self.slots = self.bt[:, pos // ps].long() * ps + pos % ps  # [B, N + 1]: the prompt, then the decode token
        flat = lambda x: x.permute(0, 2, 1, 3).reshape(-1, x.shape[1], d).to(DEV)  # [B * N, H, D]
        self.qf, self.kf, self.vf = flat(g["q"]), flat(g["k"]), flat(g["v"])

    def local_blocks(self, pos: int) -> int:
        """Local-window blocks of the query at ``pos`` (the published kernels count them as active)."""
        return min(pos // self.p.block_size + 1, self.p.local_blocks)


@cases
@pytest.mark.parametrize("split", [None, 0.37])
def test_prefill_matches_published(path, split):
    """The prompt as one varlen batch (optionally in two chunks split mid-block) through ``paged_dash_prefill``'s
    kernels, and the route kernel's active counts."""
    c = Case(path)
    b, n, hq, hkv, d, p = c.b, c.n, c.hq, c.hkv, c.d, c.p
    cuts = [0, n] if split is None else [0, int(split * n), n]
    out = torch.empty(b, n, hq, d, dtype=c.qf.dtype, device=DEV)
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        rows = torch.cat([torch.arange(lo, hi) + i * n for i in range(b)]).to(DEV)
        cu = torch.arange(b + 1, dtype=torch.int32, device=DEV) * (hi - lo)
        seq = torch.full((b,), hi, dtype=torch.int32, device=DEV)
        o = kernel_prefill(c.qf[rows], c.kf[rows], c.vf[rows], c.cache, c.bt, cu, seq,
                           c.slots[:, lo:hi].reshape(-1), c.hc, p)
        out[:, lo:hi] = o.view(b, hi - lo, hq, d)
    active = _prefill_active_counts(c)  # [B, Hkv, N]
    agree = active == c.g["active"]
    assert 1 - agree.float().mean().item() <= 0.03
    err = (out.permute(0, 2, 1, 3).float().cpu() - c.g["out"]).abs().amax(-1)  # [B, Hq, N]
    rows_ok = agree.repeat_interleave(hq // hkv, dim=1)
    assert err[rows_ok].max().item() <= 3e-2


def _prefill_active_counts(c: Case) -> torch.Tensor:
    """``[B, Hkv, N]`` active blocks of each prompt position from the prefill route kernel: its kept blocks plus the
    local window."""
    b, n, p = c.b, c.n, c.p
    cu = torch.arange(b + 1, dtype=torch.int32, device=DEV) * n
    seq = torch.full((b,), n, dtype=torch.int32, device=DEV)
    plan, scratch = pf_launch.plan_and_scratch(c.qf, c.cache, c.bt, cu, seq, p, PrefillConfig(scratch_bytes=1 << 40),
                                               recompute=False)
    scratch.sel_count.zero_()
    pf_route.route_wave(c.qf, c.cache, c.bt, cu, seq, p, plan, scratch, 0, plan.num_tiles)
    counts = scratch.sel_count.cpu()
    active = torch.zeros(b, c.hkv, n, dtype=torch.int32)
    for w, (i, a0, lo, hi, _) in enumerate(pf_tiles.tile_layout_host(cu, seq, plan.qt)):
        for pos in range(lo, hi):
            active[i, :, pos] = counts[w * plan.qt + pos - a0].expand(c.hkv) + c.local_blocks(pos)
    return active


@cases
def test_decode_step_matches_published(path):
    """The prompt written with its summaries, then the decode token at position N through ``paged_dash_decode``'s
    kernels (its K/V written by the step)."""
    c = Case(path)
    b, n, p = c.b, c.n, c.p
    write_kv_and_summaries(c.kf, c.vf, c.cache, c.slots[:, :n].reshape(-1), c.hc, p.block_size, decode=False)
    q, k, v = (c.g[x][:, :, 0].to(DEV) for x in ("q_dec", "k_dec", "v_dec"))  # [B, H, D]
    seq = torch.full((b,), n + 1, dtype=torch.int32, device=DEV)
    bufs = DecodeBuffers.for_step(q, c.cache, c.bt, p)
    out = kernel_decode(q, k, v, c.cache, c.bt, seq, c.slots[:, n].contiguous(), c.hc, p, buffers=bufs)
    active = bufs.sel_count[:b].cpu() + c.local_blocks(n)  # [B, Hkv]
    assert torch.equal(active, c.g["active_dec"][:, :, 0])
    err = (out.float().cpu() - c.g["out_dec"][:, :, 0]).abs().max().item()
    assert err <= 1e-2 + 4e-3
