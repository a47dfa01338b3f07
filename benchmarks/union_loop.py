"""The prefill attention's union loop alone, in Triton and in Gluon (Hopper), on the same synthetic work.

The prefill attention kernel (``dash_core.kernels.prefill``) runs a tile of 64 query rows (16 tokens x 4 query
heads of one KV head) over the union of the blocks its tokens routed to, each block a 64-key tile with a per-token
log prior (``-inf``: the token did not route there). At 128k tokens, topk 64, this loop is most of the attention
(63.8 of about 71 ms), while FlashInfer's dense prefill runs near 600 TFLOPS. Triton 3.6 waits for each warpgroup
MMA right after issuing it, so a warpgroup's softmax never overlaps its own MMAs.

This script measures what an explicitly written loop gains over the Triton one (results and their reading:
``docs/PERFORMANCE.md``, "The union loop alone", and for the small tiles "How much tiling wastes"):

- ``triton``: the loop as the prefill kernel writes it (TMA loads, ``tl.dot``, 3 pipeline stages); with ``--rows``
  16 or 32 (4 or 8 tokens) and ``--warps`` 1 or 2, a tile a warp or two on warp-level MMAs (``mma.sync``): the
  rate of small tiles that run as programs of their own (``--tstages``: Triton's ``num_stages``; Triton 3.6 gives
  those programs one K/V slot at 2 and at 3);
- ``triton-t``: the same loop transposed (keys as the MMAs' M, the tile's rows as N), also on tiles of 16 or 32 rows
  (``--rows``: 4 or 8 tokens; with ``triton`` the only variants run there);
- ``gluon``: the same loop in Gluon with TMA into a ring of shared-memory slots and mbarriers, synchronous
  warpgroup MMAs; ``--per 2``: two blocks (128 keys) an iteration;
- ``gluon-no-reload``: as ``gluon``, loading only the first blocks and reusing them (wrong values, not checked):
  the loop's rate without its K/V traffic;
- ``gluon-overlap``: as ``gluon``, with the next block's QK MMA issued before this block's softmax and the PV MMA
  left in flight while the next softmax runs (the intra-warpgroup overlap of FlashAttention 3);
- ``gluon-mma2``: as ``gluon`` on warp-level MMAs (``mma.sync``, 16 rows a warp), its four warps sharing each
  block: an upper bound for a design whose warps walk block lists of their own (they would also load their own
  blocks);
- ``gluon-ws3-*``, ``gluon-ws4-*`` (``union_loop_ws.py``): 3 or 4 warpgroups a program, each its own tile, with K
  and V rings of their own (``k1v2``: one K slot and two V slots), in FlashAttention 3's order or, ``-sync``, each
  MMA waited for; the configurations are ``WS_CONFIGS``;
- ``gluon-shared-s4``, ``-s5`` (with ``--share``): 3 warpgroups over 3 neighbouring tiles share one ring of 4 or 5
  K/V slots that a producer warp fills with the union of their unions, each block loaded once for the group.

Every variant but ``gluon-no-reload`` is checked against a float32 PyTorch computation of the same loop before it
is timed. Work: ``tiles x Hkv`` programs, each over ``--union`` random blocks (with repeats) of a paged cache of
``--pages`` pages laid out as SGLang's ``[pages, 64, Hkv, D]``: 96 pages stay in L2, 4096 do not. With ``--share F``
each group of 3 neighbouring tiles draws its unions from one of ``F x 3 x union`` blocks, which they hold together
(0.65 at the prefill benchmark's 128k prompt, topk 64: ``benchmarks/tile_sharing.py --group 3``).

    python benchmarks/union_loop.py --tiles 1056 --union 230 --pages 96   # on a Hopper GPU
    python benchmarks/union_loop.py --compile-only                         # CPU: compile the variants for sm_90
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_init, warpgroup_mma_wait)
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parent))

from union_loop_ws import (SHARED_CONFIGS, SHARED_GROUP, SHARED_MAXNREG, SHARED_REGS, WS_CONFIGS,  # noqa: E402
                           softmax_step, store_rows, union_shared, union_ws)

ROWS, BS, D, QT, G = 64, 64, 128, 16, 4
LOG2E = 1.4426950408889634
NO_RELOAD = "gluon-no-reload"  # timing only: its values are wrong by design


@triton.jit
def _union_triton(q_ptr, k_desc, v_desc, ublk_ptr, nu_ptr, prior_ptr, o_ptr, qk_scale, NU, HKV,
                  ROWS: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, QT: tl.constexpr, G: tl.constexpr,
                  TRANSPOSED: tl.constexpr = False):
    """Grid ``(tiles, Hkv)``: rows of tile w, KV head h over its union (the prefill kernel's loop).
    TRANSPOSED (``triton-t``): keys are the MMAs' M and the tile's rows their N (``S^T = K Q^T``, ``O^T += V^T
    P^T``), so that a tile of fewer than 64 rows (``ROWS`` 16 or 32: 4 or 8 tokens) still runs on warpgroup MMAs;
    the softmax then reduces over the keys (axis 0)."""
    w = tl.program_id(0)
    h = tl.program_id(1)
    unit = w * HKV + h
    rows = tl.arange(0, ROWS)
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + (unit * ROWS + rows)[:, None].to(tl.int64) * D + offs_d[None, :])
    nu = tl.load(nu_ptr + unit)
    ublk = ublk_ptr + unit.to(tl.int64) * NU
    prow = prior_ptr + unit.to(tl.int64) * NU * QT + rows // G
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    AX: tl.constexpr = 0 if TRANSPOSED else 1  # the keys' axis of a logits tile
    if TRANSPOSED:
        q_t = tl.trans(q)  # [D, ROWS]
        acc = tl.zeros([D, ROWS], tl.float32)
    else:
        acc = tl.zeros([ROWS, D], tl.float32)
    for j in range(nu):
        blk = tl.load(ublk + j)
        kt = k_desc.load([blk * BS, h * D])
        prior = tl.load(prow + j * QT)
        if TRANSPOSED:
            qk = tl.dot(kt, q_t) * qk_scale + prior[None, :]  # [BS, ROWS]
        else:
            qk = tl.dot(q, tl.trans(kt)) * qk_scale + prior[:, None]
        m_new = tl.maximum(m_i, tl.max(qk, axis=AX))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(qk - tl.expand_dims(m_use, AX))
        l_i = l_i * alpha + tl.sum(p, axis=AX)
        vt = v_desc.load([blk * BS, h * D])
        if TRANSPOSED:
            acc = acc * alpha[None, :] + tl.dot(tl.trans(vt), p.to(vt.dtype))
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
        m_i = m_new
    l_i = tl.where(l_i > 0, l_i, 1.0)
    if TRANSPOSED:
        tl.store(o_ptr + (unit * ROWS + rows)[None, :].to(tl.int64) * D + offs_d[:, None], acc / l_i[None, :])
    else:
        tl.store(o_ptr + (unit * ROWS + rows)[:, None].to(tl.int64) * D + offs_d[None, :], acc / l_i[:, None])


@gluon.jit
def _issue_kv(k_desc, v_desc, k_s, v_s, bar, ublk, j, nu, h, BS: gl.constexpr, D: gl.constexpr, PER: gl.constexpr):
    """TMA of union blocks ``PER j .. PER j + PER - 1`` (K and V) into one ring slot, nothing when ``PER j >= nu``;
    a block past ``nu`` is replaced by block ``PER j`` (finite data behind a ``-inf`` prior)."""
    pred = PER * j < nu
    blk0 = gl.load(ublk + PER * j, mask=pred, other=0)
    mbarrier.expect(bar, PER * 2 * BS * D * 2, pred=pred)
    for b in gl.static_range(PER):
        blk = gl.load(ublk + PER * j + b, mask=PER * j + b < nu, other=blk0)
        tma.async_copy_global_to_shared(k_desc, [blk * BS, h * D], bar, k_s.slice(b * BS, BS), pred=pred)
        tma.async_copy_global_to_shared(v_desc, [blk * BS, h * D], bar, v_s.slice(b * BS, BS), pred=pred)


@gluon.jit
def _add_prior(s, qk_scale, prow, j, nu, QT: gl.constexpr, BS: gl.constexpr, PER: gl.constexpr, s_layout: gl.constexpr):
    """``s * qk_scale`` plus each row's log2 prior for the ``PER`` blocks of iteration ``j`` (``-inf`` past ``nu``)."""
    qk = s * qk_scale
    if PER == 1:
        qk = qk + gl.load(prow + j * QT)[:, None]
    else:
        col = gl.arange(0, PER * BS, layout=gl.SliceLayout(0, s_layout)) // BS
        for b in gl.static_range(PER):
            pr = gl.load(prow + (PER * j + b) * QT, mask=PER * j + b < nu, other=float("-inf"))
            qk = gl.where((col == b)[None, :], qk + pr[:, None], qk)
    return qk


@gluon.jit
def _ring_start(q_desc, k_desc, v_desc, ublk_ptr, nu_ptr, w, h, NU, HKV, ROWS: gl.constexpr, D: gl.constexpr,
                BS: gl.constexpr, STAGES: gl.constexpr, PER: gl.constexpr):
    """A program's shared memory (Q, and a ring of STAGES slots of PER blocks' K and V with one mbarrier each),
    with Q's TMA and the first STAGES slots' loads issued: ``(q_s, k_s, v_s, bar, qbar, unit, nu, ublk)``."""
    q_s = gl.allocate_shared_memory(gl.bfloat16, [ROWS, D], q_desc.layout)
    k_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, PER * BS, D], k_desc.layout)
    v_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, PER * BS, D], v_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    qbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bar.index(s), count=1)
    mbarrier.init(qbar, count=1)
    fence_async_shared()
    unit = w * HKV + h
    nu = gl.load(nu_ptr + unit)
    ublk = ublk_ptr + unit.to(gl.int64) * NU
    mbarrier.expect(qbar, ROWS * D * 2)
    tma.async_copy_global_to_shared(q_desc, [unit * ROWS, 0], qbar, q_s)
    for s in gl.static_range(STAGES):
        _issue_kv(k_desc, v_desc, k_s.index(s), v_s.index(s), bar.index(s), ublk, s, nu, h, BS, D, PER)
    return q_s, k_s, v_s, bar, qbar, unit, nu, ublk


@gluon.jit
def _ring_end(bar, qbar, STAGES: gl.constexpr):
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bar.index(s))
    mbarrier.invalidate(qbar)


@gluon.jit
def _union_gluon(q_desc, k_desc, v_desc, ublk_ptr, nu_ptr, prior_ptr, o_ptr, qk_scale, NU, HKV,
                 ROWS: gl.constexpr, D: gl.constexpr, BS: gl.constexpr, QT: gl.constexpr, G: gl.constexpr,
                 STAGES: gl.constexpr, OVERLAP: gl.constexpr, PER: gl.constexpr,
                 RELOAD: gl.constexpr = True):
    """Grid ``(tiles, Hkv)``, one warpgroup: the loop of ``_union_triton`` with explicit TMA stages and
    warpgroup MMAs (OVERLAP: QK of block j + 1 in flight during block j's softmax, PV of block j during
    block j + 1's)."""
    w = gl.program_id(0)
    h = gl.program_id(1)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, PER * BS, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    q_s, k_s, v_s, bar, qbar, unit, nu, ublk = _ring_start(q_desc, k_desc, v_desc, ublk_ptr, nu_ptr, w, h, NU, HKV,
                                                          ROWS, D, BS, STAGES, PER)
    prow = prior_ptr + unit.to(gl.int64) * NU * QT + gl.arange(0, ROWS, layout=row_s) // G

    m_i = gl.full([ROWS], float("-inf"), gl.float32, row_s)
    l_i = gl.full([ROWS], 0.0, gl.float32, row_s)
    acc = gl.zeros([ROWS, D], gl.float32, o_layout)
    s_zero = gl.zeros([ROWS, PER * BS], gl.float32, s_layout)
    nit = gl.cdiv(nu, PER)
    mbarrier.wait(qbar, 0)
    if OVERLAP:
        gl.static_assert(STAGES >= 3, "S of block j + 1 is issued before block j - 1's slot is refilled")
        # S of block 0 issued before the loop; each iteration issues S of block j + 1, then block j's softmax,
        # then waits for PV of block j - 1 (its slot is refilled), rescales and issues PV of block j.
        mbarrier.wait(bar.index(0), 0, pred=nu > 0)
        s_cur = warpgroup_mma(q_s, k_s.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s_cur = warpgroup_mma_wait(0, deps=[s_cur])
        acc = warpgroup_mma_init(acc)
        for j in range(nit):
            slot = j % STAGES
            nslot = (j + 1) % STAGES
            has_next = j + 1 < nit
            mbarrier.wait(bar.index(nslot), ((j + 1) // STAGES) & 1, pred=has_next)
            s_next = warpgroup_mma(q_s, k_s.index(nslot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            qk = _add_prior(s_cur, qk_scale, prow, j, nu, QT, BS, PER, s_layout)
            p, alpha, m_i, l_i = softmax_step(qk, m_i, l_i)
            p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
            # outstanding: PV j-1 (older), S j+1: wait for PV j-1 only
            acc = warpgroup_mma_wait(1, deps=[acc])
            if j > 0:  # block j - 1's slot is free (every warp past its wait): refill it with block j - 1 + STAGES
                gl.thread_barrier()
                pslot = (j - 1) % STAGES
                _issue_kv(k_desc, v_desc, k_s.index(pslot), v_s.index(pslot), bar.index(pslot), ublk,
                          j - 1 + STAGES, nu, h, BS, D, PER)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            acc = warpgroup_mma(p_op, v_s.index(slot), acc, is_async=True)
            # outstanding: S j+1 (older), PV j: wait for S j+1 only
            s_cur = warpgroup_mma_wait(1, deps=[s_next])
        acc = warpgroup_mma_wait(0, deps=[acc])
    else:
        for j in range(nit):
            slot = j % STAGES
            mbarrier.wait(bar.index(slot), (j // STAGES) & 1, pred=RELOAD or j < STAGES)
            s_acc = warpgroup_mma(q_s, k_s.index(slot).permute((1, 0)), s_zero, use_acc=False)
            qk = _add_prior(s_acc, qk_scale, prow, j, nu, QT, BS, PER, s_layout)
            p, alpha, m_i, l_i = softmax_step(qk, m_i, l_i)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            acc = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), p_layout), v_s.index(slot), acc)
            if RELOAD:  # (not RELOAD: the first STAGES blocks again and again, to time the loop without its loads)
                gl.thread_barrier()  # every warp's MMAs are done with the slot before it is refilled
                _issue_kv(k_desc, v_desc, k_s.index(slot), v_s.index(slot), bar.index(slot), ublk, j + STAGES, nu,
                          h, BS, D, PER)
    _ring_end(bar, qbar, STAGES)
    store_rows(o_ptr, acc, l_i, unit, ROWS, D, o_layout)


@gluon.jit
def _union_mma2(q_desc, k_desc, v_desc, ublk_ptr, nu_ptr, prior_ptr, o_ptr, qk_scale, NU, HKV,
                ROWS: gl.constexpr, D: gl.constexpr, BS: gl.constexpr, QT: gl.constexpr, G: gl.constexpr,
                STAGES: gl.constexpr):
    """``_union_gluon``'s loop (no overlap, one block an iteration) on warp-level MMAs (``mma.sync``, 16 rows
    a warp) with operands read from the shared-memory ring: the rate a per-warp design would run at."""
    w = gl.program_id(0)
    h = gl.program_id(1)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    row_l: gl.constexpr = gl.SliceLayout(1, mma)

    q_s, k_s, v_s, bar, qbar, unit, nu, ublk = _ring_start(q_desc, k_desc, v_desc, ublk_ptr, nu_ptr, w, h, NU, HKV,
                                                          ROWS, D, BS, STAGES, 1)
    prow = prior_ptr + unit.to(gl.int64) * NU * QT + gl.arange(0, ROWS, layout=row_l) // G
    m_i = gl.full([ROWS], float("-inf"), gl.float32, row_l)
    l_i = gl.full([ROWS], 0.0, gl.float32, row_l)
    acc = gl.zeros([ROWS, D], gl.float32, mma)
    mbarrier.wait(qbar, 0)
    q = q_s.load(a_op)
    for j in range(nu):
        slot = j % STAGES
        mbarrier.wait(bar.index(slot), (j // STAGES) & 1)
        kt = k_s.index(slot).permute((1, 0)).load(b_op)
        s_acc = mma_v2(q, kt, gl.zeros([ROWS, BS], gl.float32, mma))
        qk = _add_prior(s_acc, qk_scale, prow, j, nu, QT, BS, 1, mma)
        p, alpha, m_i, l_i = softmax_step(qk, m_i, l_i)
        vt = v_s.index(slot).load(b_op)
        acc = mma_v2(gl.convert_layout(p.to(gl.bfloat16), a_op), vt, acc * alpha[:, None])
        gl.thread_barrier()  # every warp has read the slot before it is refilled
        _issue_kv(k_desc, v_desc, k_s.index(slot), v_s.index(slot), bar.index(slot), ublk, j + STAGES, nu, h,
                  BS, D, 1)
    _ring_end(bar, qbar, STAGES)
    store_rows(o_ptr, acc, l_i, unit, ROWS, D, mma)


def make_work(tiles: int, hkv: int, union: int, pages: int, seed: int = 0, device="cuda", rows: int = ROWS,
              share: float = 0.0, group: int = SHARED_GROUP):
    """Random queries (``rows`` per tile: ``rows // G`` tokens), a paged cache ``[pages, BS, Hkv, D]``, ``union``
    random blocks per (tile, KV head) and each token's log2 prior per union block (about 30% of the tokens routed
    to each block). With ``share``, the tiles' unions come from their group's (``_group_unions``: also ``gblk``,
    ``ng``, ``own`` and ``group_union``)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(tiles * hkv * rows, D, generator=g).to(device, torch.bfloat16)
    k = torch.randn(pages, BS, hkv, D, generator=g).to(device, torch.bfloat16)
    v = torch.randn(pages, BS, hkv, D, generator=g).to(device, torch.bfloat16)
    ublk = torch.randint(0, pages, (tiles * hkv, union), generator=g, dtype=torch.int32)  # few pages: L2-resident
    nu = torch.full((tiles * hkv,), union, dtype=torch.int32)
    nu[::7] = torch.randint(0, union + 1, nu[::7].shape, generator=g).to(torch.int32)  # ragged unions, some empty
    prior = torch.log2(torch.rand(tiles * hkv, union, rows // G, generator=g) * 0.5 + 0.01)
    prior[torch.rand(prior.shape, generator=g) > 0.3] = float("-inf")
    extra = {}
    if share > 0:
        extra = _group_unions(ublk, nu, tiles, hkv, union, pages, share, group, g, device)
    return dict(q=q, k=k, v=v, ublk=ublk.to(device), nu=nu.to(device), prior=prior.to(device), hkv=hkv, union=union,
                rows=rows, **extra)


def _group_unions(ublk, nu, tiles: int, hkv: int, union: int, pages: int, share: float, group: int, g, device) -> dict:
    """``--share``: each group of ``group`` neighbouring tiles (per KV head) gets a union of ``gu = share x group x
    union`` random blocks (``gblk``), and each of its tiles a sorted list of positions in it (``own``): a share of
    ``gu / group`` positions that no other tile of the group has, then others of the group's up to ``union`` (a
    ragged ``nu``, raised to its share if below), so that the tiles' unions together hold exactly the group's.
    Rewrites ``ublk`` and ``nu`` in place to the same work for the variants without a group."""
    if not 0 < share <= 1 or tiles % group:
        raise ValueError(f"--share in (0, 1] and tiles ({tiles}) a multiple of {group}")
    gu = max(union, round(share * group * union))
    gblk = torch.randint(0, pages, (tiles // group * hkv, gu), generator=g, dtype=torch.int32)
    own = torch.zeros(tiles * hkv, union, dtype=torch.int32)
    for gi in range(gblk.shape[0]):
        perm = torch.randperm(gu, generator=g)
        for t in range(group):
            u = ((gi // hkv) * group + t) * hkv + gi % hkv
            mine = perm[t::group]
            others = perm[torch.ones(gu, dtype=torch.bool).index_fill_(0, torch.arange(t, gu, group), False)]
            n = max(int(nu[u]), len(mine))
            pos = torch.cat([mine, others[torch.randperm(len(others), generator=g)][:n - len(mine)]]).sort().values
            nu[u] = n
            own[u, :n] = pos.to(torch.int32)
            ublk[u, :n] = gblk[gi, pos]
    return dict(gblk=gblk.to(device), ng=torch.full((gblk.shape[0],), gu, dtype=torch.int32, device=device),
                own=own.to(device), group_union=gu)


def reference(work: dict, units) -> torch.Tensor:
    """Float32 outputs ``[len(units), rows, D]`` of the loop for some (tile, KV head) units."""
    hkv, rows, scale = work["hkv"], work["rows"], LOG2E / math.sqrt(D)
    out = []
    for u in units:
        h, n = u % hkv, int(work["nu"][u])
        if n == 0:
            out.append(torch.zeros(rows, D, device=work["q"].device))
            continue
        q = work["q"][u * rows:(u + 1) * rows].float()
        blk = work["ublk"][u, :n].long()
        k = work["k"][blk, :, h].reshape(n * BS, D).float()
        v = work["v"][blk, :, h].reshape(n * BS, D).float()
        bias = work["prior"][u, :n].repeat_interleave(G, dim=1).T.repeat_interleave(BS, dim=1)  # [ROWS, n BS]
        s = q @ k.T * scale + bias
        m = s.amax(1, keepdim=True).clamp(min=-1e30)
        p = torch.exp2(s - m)
        l = p.sum(1, keepdim=True)
        out.append(torch.where(l > 0, (p @ v) / l.clamp(min=1e-30), 0.0))
    return torch.stack(out)


def _smem_layout():
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)


def launchers(work: dict, stages: int, per: int, warps: int = 4, tstages: int = 3):
    """``{variant: call}`` writing ``o [tiles Hkv rows, D]`` fp32 (tiles of other than ``ROWS`` rows: the Triton
    variants only). ``warps`` and ``tstages``: the ``triton`` variant's warps and ``num_stages``."""
    hkv, union, rows = work["hkv"], work["union"], work["rows"]
    units = work["nu"].numel()
    grid = (units // hkv, hkv)
    o = torch.empty(units * rows, D, dtype=torch.float32, device=work["q"].device)
    kv2 = {n: work[n].view(-1, hkv * D) for n in ("k", "v")}
    tdesc = {n: TensorDescriptor.from_tensor(t, [BS, D]) for n, t in kv2.items()}
    gdesc = {n: GluonDescriptor.from_tensor(t, [BS, D], _smem_layout()) for n, t in kv2.items()}
    qdesc = GluonDescriptor.from_tensor(work["q"], [rows, D], _smem_layout())
    scale = LOG2E / math.sqrt(D)
    args = (work["ublk"], work["nu"], work["prior"], o, scale, union, hkv)

    def tri(transposed, nw, ns):
        return lambda: _union_triton[grid](work["q"], tdesc["k"], tdesc["v"], *args, ROWS=rows, D=D, BS=BS,
                                           QT=rows // G, G=G, TRANSPOSED=transposed, num_warps=nw, num_stages=ns)

    triton_calls = {"triton": tri(False, warps, tstages), "triton-t": tri(True, 4, 3)}
    if rows != ROWS:
        return o, triton_calls

    def glu(overlap, reload=True):
        return lambda: _union_gluon[grid](qdesc, gdesc["k"], gdesc["v"], *args, ROWS=ROWS, D=D, BS=BS, QT=QT, G=G,
                                          STAGES=stages, OVERLAP=overlap, PER=per, RELOAD=reload, num_warps=4)

    def mma2():
        _union_mma2[grid](qdesc, gdesc["k"], gdesc["v"], *args, ROWS=ROWS, D=D, BS=BS, QT=QT, G=G, STAGES=stages,
                          num_warps=4)

    calls = {**triton_calls, "gluon": glu(False), "gluon-overlap": glu(True), NO_RELOAD: glu(False, False),
             "gluon-mma2": mma2}

    ws_args = (work["ublk"] * BS, *args[1:])  # prefill_ws's loop takes each block's first row, not its id

    def ws(nc, kst, vst, overlap, regs):
        return lambda: union_ws[(grid[0] // nc, hkv)](
            qdesc, gdesc["k"], gdesc["v"], *ws_args, ROWS=ROWS, D=D, BS=BS, QT=QT, G=G, NC=nc, KST=kst, VST=vst,
            CONSUMER_REGS=regs, OVERLAP=overlap, num_warps=4, maxnreg=regs)

    def shared(slots):
        return lambda: union_shared[(grid[0] // SHARED_GROUP, hkv)](
            qdesc, gdesc["k"], gdesc["v"], work["gblk"], work["ng"], work["own"], work["nu"], work["prior"], o,
            scale, union, work["group_union"], hkv, ROWS=ROWS, D=D, BS=BS, QT=QT, G=G, NC=SHARED_GROUP, S=slots,
            CONSUMER_REGS=SHARED_REGS, num_warps=4, maxnreg=SHARED_MAXNREG)

    for name, cfg in WS_CONFIGS.items():
        if grid[0] % cfg[0] == 0:  # whole programs of NC tiles
            calls[name] = ws(*cfg)
    if "gblk" in work and grid[0] % SHARED_GROUP == 0:  # the tiles' unions drawn from their group's (share)
        calls.update({name: shared(slots) for name, slots in SHARED_CONFIGS.items()})
    return o, calls


def compile_only(stages: int, per: int) -> int:
    """Compile each variant for sm_90 on a machine without a GPU; print shared memory, registers, spills."""
    import os

    from common import ptxas_usage
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    target = GPUTarget("cuda", 90, 32)
    lay = _smem_layout()
    common = {"ublk_ptr": "*i32", "nu_ptr": "*i32", "prior_ptr": "*fp32", "o_ptr": "*fp32", "qk_scale": "fp32",
              "NU": "i32", "HKV": "i32"}
    cons = dict(ROWS=ROWS, D=D, BS=BS, QT=QT, G=G)
    tsig = {"q_ptr": "*bf16", "k_desc": f"tensordesc<bf16[{BS}, {D}]>", "v_desc": f"tensordesc<bf16[{BS}, {D}]>",
            **common, **{k: "constexpr" for k in cons}}
    srcs = {"triton": (ASTSource(_union_triton, tsig, cons), dict(num_warps=4, num_stages=3))}
    for rows in (16, 32, 64):
        tc = dict(cons, ROWS=rows, QT=rows // G, TRANSPOSED=True)
        srcs[f"triton-t{rows}"] = (ASTSource(_union_triton, dict(tsig, TRANSPOSED="constexpr"), tc),
                                   dict(num_warps=4, num_stages=3))
    for rows, warps, st in ((16, 1, 2), (16, 1, 3), (32, 2, 2), (32, 2, 3)):  # small tiles, a warp (or two) each
        srcs[f"triton{rows}-w{warps}-s{st}"] = (ASTSource(_union_triton, tsig, dict(cons, ROWS=rows, QT=rows // G)),
                                                dict(num_warps=warps, num_stages=st))
    for overlap in (False, True):
        gc = dict(cons, STAGES=stages, OVERLAP=overlap, PER=per)
        gsig = {"q_desc": f"tensordesc<bf16[{ROWS}, {D}],{lay!r}>", "k_desc": f"tensordesc<bf16[{BS}, {D}],{lay!r}>",
                "v_desc": f"tensordesc<bf16[{BS}, {D}],{lay!r}>", **common, **{k: "constexpr" for k in gc}}
        srcs["gluon-overlap" if overlap else "gluon"] = (GluonASTSource(_union_gluon, gsig, gc), dict(num_warps=4))
    del gc["OVERLAP"], gc["PER"], gsig["OVERLAP"], gsig["PER"]
    srcs["gluon-mma2"] = (GluonASTSource(_union_mma2, gsig, gc), dict(num_warps=4))
    qkv = {n: f"tensordesc<bf16[{r}, {D}],{lay!r}>" for n, r in (("q_desc", ROWS), ("k_desc", BS), ("v_desc", BS))}
    for name, (nc, kst, vst, overlap, regs) in WS_CONFIGS.items():
        wc = dict(cons, NC=nc, KST=kst, VST=vst, CONSUMER_REGS=regs, OVERLAP=overlap)
        srcs[name] = (GluonASTSource(union_ws, {**qkv, **common, **{k: "constexpr" for k in wc}}, wc),
                      dict(num_warps=4, maxnreg=regs))
    for name, slots in SHARED_CONFIGS.items():
        sc = dict(cons, NC=SHARED_GROUP, S=slots, CONSUMER_REGS=SHARED_REGS)
        ssig = {**qkv, "gblk_ptr": "*i32", "ng_ptr": "*i32", "own_ptr": "*i32", "nu_ptr": "*i32",
                "prior_ptr": "*fp32", "o_ptr": "*fp32", "qk_scale": "fp32", "NU": "i32", "GU": "i32", "HKV": "i32",
                **{k: "constexpr" for k in sc}}
        srcs[name] = (GluonASTSource(union_shared, ssig, sc), dict(num_warps=4, maxnreg=SHARED_MAXNREG))
    rc = 0
    for name, (src, opts) in srcs.items():
        try:
            k = triton.compile(src, target=target, options=opts)
        except Exception as e:  # noqa: BLE001
            print(f"{name}: {type(e).__name__}: {str(e)[:3000]}")
            rc = 1
            continue
        regs, spill = ptxas_usage(k.asm["ptx"])
        print(f"{name}: shared {k.metadata.shared} B, registers {regs}, spills {spill}")
        if os.environ.get("UNION_LOOP_DUMP"):
            Path(os.environ["UNION_LOOP_DUMP"]).mkdir(parents=True, exist_ok=True)
            for ext in ("ttgir", "ptx"):
                Path(os.environ["UNION_LOOP_DUMP"], f"{name}.{ext}").write_text(k.asm[ext])
    return rc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiles", type=int, default=1056)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--union", type=int, default=230, help="blocks per (tile, KV head)")
    ap.add_argument("--pages", type=int, default=2048)
    ap.add_argument("--stages", type=int, default=3, help="Gluon's K/V ring slots (3 or more)")
    ap.add_argument("--per", type=int, default=1, choices=(1, 2), help="union blocks per Gluon iteration")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rows", type=int, default=ROWS, choices=(16, 32, 64),
                    help="rows of a tile (16 or 32: the Triton loops alone)")
    ap.add_argument("--warps", type=int, default=4, help="warps of the triton variant (1: a warp per tile)")
    ap.add_argument("--tstages", type=int, default=3,
                    help="num_stages of the triton variant (16- and 32-row programs get one K/V slot at 2 and 3)")
    ap.add_argument("--variants", default="", help="comma-separated variants to run (default: all)")
    ap.add_argument("--share", type=float, default=0.0,
                    help="groups of 3 neighbouring tiles draw their unions from one of share x 3 x union blocks")
    ap.add_argument("--compile-only", action="store_true")
    a = ap.parse_args(argv)
    if a.compile_only:
        return compile_only(a.stages, a.per)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (on a CPU machine: --compile-only)", file=sys.stderr)
        return 2
    from decode import time_calls
    work = make_work(a.tiles, a.hkv, a.union, a.pages, rows=a.rows, share=a.share)
    o, calls = launchers(work, a.stages, a.per, a.warps, a.tstages)
    if a.variants:
        want = a.variants.split(",")
        unknown = [v for v in want if v not in calls]
        if unknown:
            print(f"--variants {','.join(unknown)}: not among {', '.join(calls)} (at --rows {a.rows})",
                  file=sys.stderr)
            return 2
        calls = {k: v for k, v in calls.items() if k in want}
    if torch.cuda.get_device_capability()[0] != 9:
        print("not a Hopper GPU: the Gluon variants (warpgroup MMAs, sm_90 TMA) are left out", flush=True)
        calls = {k: calls[k] for k in ("triton", "triton-t") if k in calls}
    units = work["nu"].numel()
    # sampled units and the next tile's (same KV head): more than one warpgroup of a program is checked
    check = sorted({u + d for u in range(0, units, max(1, units // 24)) for d in (0, a.hkv) if u + d < units})
    ref = reference(work, check)
    flop = 4.0 * a.rows * BS * D * float(work["nu"].sum())
    rc = 0
    for name, fn in calls.items():
        o.fill_(float("nan"))
        try:
            fn()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            print(f"{name:16s} failed: {type(e).__name__}: {str(e)[:500]}", flush=True)
            rc = 1
            continue
        got = o.view(-1, a.rows, D)[check]
        err = float((got - ref).abs().max())
        ms = time_calls([fn], a.iters, 3, True)
        ok = err < 2e-2 or name == NO_RELOAD
        rc |= not ok
        verdict = "(no K/V loads after the first stages: not checked)" if name == NO_RELOAD else (
            f"max |err| {err:.2e} {'ok' if ok else 'WRONG'}")
        print(f"{name:16s} {ms:8.3f} ms  {flop / ms / 1e9:6.1f} TFLOPS  {verdict}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
