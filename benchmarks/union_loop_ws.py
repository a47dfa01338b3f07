"""Warp-specialized Gluon variants of the prefill union loop (Hopper), for ``benchmarks/union_loop.py``.

Several warpgroups of one program each run a tile of their own (``warp_specialize``), so that a
multiprocessor holds 3 or 4 warpgroups where the Triton loop fits 2 programs of one:

- ``union_ws``: ``NC`` (3 or 4) warpgroups, each with its own K and V rings; in FlashAttention 3's order
  (block j's QK and block j - 1's PV issued together before block j's softmax) or one block after the other;
- ``union_shared``: 3 warpgroups over 3 neighbouring tiles share one K/V ring that a producer warp fills with
  the union of their unions, each block once; a warpgroup runs its own union's blocks and skips the others.

Results and their reading: ``docs/PERFORMANCE.md``, "The union loop alone".
"""

from __future__ import annotations

import sys
from pathlib import Path

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dash_core.kernels.prefill_ws import _union_loop, issue_block, softmax_step, wgmma_layout  # noqa: E402

# name: (NC warpgroups, K slots, V slots, FlashAttention 3's order, registers a thread); three warpgroups fit in
# shared memory only with 3 slots each, four with 2; spills at four (CPU compile check): 80 B in order, 400 B overlapped
WS_CONFIGS = {
    "gluon-ws3-k1v2": (3, 1, 2, True, 168), "gluon-ws3-k2v1": (3, 2, 1, True, 168),
    "gluon-ws3-k1v2-sync": (3, 1, 2, False, 168), "gluon-ws3-k2v1-sync": (3, 2, 1, False, 168),
    "gluon-ws4-k1v1-sync": (4, 1, 1, False, 128), "gluon-ws4-k1v1": (4, 1, 1, True, 128),
}
SHARED_CONFIGS = {"gluon-shared-s4": 4, "gluon-shared-s5": 5}  # name: slots of the shared ring
SHARED_GROUP = 3  # tiles (warpgroups) sharing a ring
SHARED_REGS = 160  # registers of the worker consumers (the default partition's gets 168) beside a producer of 24
SHARED_MAXNREG = 128


@gluon.jit
def store_rows(o_ptr, acc, l_i, unit, ROWS: gl.constexpr, D: gl.constexpr, o_layout: gl.constexpr):
    """Rows ``unit ROWS ..`` of ``o [., D]``: ``acc / l`` (0 where ``l`` is 0: no block routed)."""
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    o = acc / gl.where(l_o > 0, l_o, 1.0)[:, None]
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    gl.store(o_ptr + (unit * ROWS + rows)[:, None].to(gl.int64) * D + cols[None, :], o)


@gluon.jit
def _tile_start(c, unit, q_desc, q_all, qbar, prior_ptr, NU, ROWS: gl.constexpr, D: gl.constexpr, BS: gl.constexpr,
                QT: gl.constexpr, G: gl.constexpr):
    """A warpgroup's tile: its queries' TMA into ``q_all[c]`` issued (on ``qbar[c]``), its rows' prior pointers and
    its online softmax state: ``(q_s, prow, m, l, acc, zero logits)``."""
    s_layout: gl.constexpr = wgmma_layout(BS)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    q_s = q_all.index(c)
    mbarrier.expect(qbar.index(c), ROWS * D * 2)
    tma.async_copy_global_to_shared(q_desc, [unit * ROWS, 0], qbar.index(c), q_s)
    prow = prior_ptr + unit.to(gl.int64) * NU * QT + gl.arange(0, ROWS, layout=row_s) // G
    m_i = gl.full([ROWS], float("-inf"), gl.float32, row_s)
    l_i = gl.full([ROWS], 0.0, gl.float32, row_s)
    acc = gl.zeros([ROWS, D], gl.float32, wgmma_layout(D))
    return q_s, prow, m_i, l_i, acc, gl.zeros([ROWS, BS], gl.float32, s_layout)


@gluon.jit
def _ws_consumer(c: gl.constexpr, rt, NC: gl.constexpr, ROWS: gl.constexpr, D: gl.constexpr, BS: gl.constexpr,
                 QT: gl.constexpr, G: gl.constexpr, KST: gl.constexpr, VST: gl.constexpr, OVERLAP: gl.constexpr):
    """Warpgroup c of ``union_ws``: tile ``NC pid + c`` over its union, with rings of its own for K (``KST`` slots)
    and V (``VST``), a K slot refilled as soon as its QK is done, a V slot once its PV is. OVERLAP: FlashAttention
    3's order, the prefill's loop (``prefill_ws._union_loop``, its K/V loads issued once the queries are in); else
    each MMA is waited for (fewer registers)."""
    q_desc, k_desc, v_desc, q_all, k_all, v_all, kbar, vbar, qbar, ublk_ptr, nu_ptr, prior_ptr, o_ptr, qk_scale, NU, \
        HKV, pid, h = rt
    o_layout: gl.constexpr = wgmma_layout(D)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    unit = (NC * pid + c) * HKV + h
    nu = gl.load(nu_ptr + unit)
    ublk = ublk_ptr + unit.to(gl.int64) * NU
    q_s, prow, m_i, l_i, acc, s_zero = _tile_start(c, unit, q_desc, q_all, qbar, prior_ptr, NU, ROWS, D, BS, QT, G)
    if OVERLAP:  # the prefill's loop
        mbarrier.wait(qbar.index(c), 0)
        m_i, l_i, acc = _union_loop(q_s, k_all, v_all, kbar, vbar, k_desc, v_desc, ublk, prow, nu, h * D, qk_scale,
                                    0, c, ROWS, QT, D, BS, KST, VST)
    else:  # one block after the other, each MMA waited for
        for s in gl.static_range(KST):
            issue_block(k_desc, k_all.index(c * KST + s), kbar.index(c * KST + s), ublk, s, nu, h * D)
        for s in gl.static_range(VST):
            issue_block(v_desc, v_all.index(c * VST + s), vbar.index(c * VST + s), ublk, s, nu, h * D)
        mbarrier.wait(qbar.index(c), 0)
        for j in range(0, nu):
            ks = c * KST + j % KST
            vs = c * VST + j % VST
            mbarrier.wait(kbar.index(ks), (j // KST) & 1)
            s_cur = warpgroup_mma(q_s, k_all.index(ks).permute((1, 0)), s_zero, use_acc=False)
            gl.thread_barrier()
            issue_block(k_desc, k_all.index(ks), kbar.index(ks), ublk, j + KST, nu, h * D)
            p, alpha, m_i, l_i = softmax_step(s_cur * qk_scale + gl.load(prow + j * QT)[:, None], m_i, l_i)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            mbarrier.wait(vbar.index(vs), (j // VST) & 1)
            acc = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), p_layout), v_all.index(vs), acc)
            gl.thread_barrier()
            issue_block(v_desc, v_all.index(vs), vbar.index(vs), ublk, j + VST, nu, h * D)
    store_rows(o_ptr, acc, l_i, unit, ROWS, D, o_layout)


@gluon.jit
def union_ws(q_desc, k_desc, v_desc, ublk_ptr, nu_ptr, prior_ptr, o_ptr, qk_scale, NU, HKV,
             ROWS: gl.constexpr, D: gl.constexpr, BS: gl.constexpr, QT: gl.constexpr, G: gl.constexpr,
             NC: gl.constexpr, KST: gl.constexpr, VST: gl.constexpr, CONSUMER_REGS: gl.constexpr,
             OVERLAP: gl.constexpr):
    """Grid ``(tiles / NC, Hkv)``: ``NC`` warpgroups (3 or 4) in one program, each its own tile and K and V rings
    (``_ws_consumer``)."""
    pid = gl.program_id(0)
    h = gl.program_id(1)
    q_all = gl.allocate_shared_memory(gl.bfloat16, [NC, ROWS, D], q_desc.layout)
    k_all = gl.allocate_shared_memory(gl.bfloat16, [NC * KST, BS, D], k_desc.layout)
    v_all = gl.allocate_shared_memory(gl.bfloat16, [NC * VST, BS, D], v_desc.layout)
    kbar = gl.allocate_shared_memory(gl.int64, [NC * KST, 1], mbarrier.MBarrierLayout())
    vbar = gl.allocate_shared_memory(gl.int64, [NC * VST, 1], mbarrier.MBarrierLayout())
    qbar = gl.allocate_shared_memory(gl.int64, [NC, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NC * KST):
        mbarrier.init(kbar.index(s), count=1)
    for s in gl.static_range(NC * VST):
        mbarrier.init(vbar.index(s), count=1)
    for c in gl.static_range(NC):
        mbarrier.init(qbar.index(c), count=1)
    fence_async_shared()
    gl.static_assert(NC == 3 or NC == 4, "three or four warpgroups")
    rt = (q_desc, k_desc, v_desc, q_all, k_all, v_all, kbar, vbar, qbar, ublk_ptr, nu_ptr, prior_ptr, o_ptr, qk_scale,
          NU, HKV, pid, h)
    if NC == 4:
        gl.warp_specialize([
            (_ws_consumer, (0, rt, NC, ROWS, D, BS, QT, G, KST, VST, OVERLAP)),
            (_ws_consumer, (1, rt, NC, ROWS, D, BS, QT, G, KST, VST, OVERLAP)),
            (_ws_consumer, (2, rt, NC, ROWS, D, BS, QT, G, KST, VST, OVERLAP)),
            (_ws_consumer, (3, rt, NC, ROWS, D, BS, QT, G, KST, VST, OVERLAP)),
        ], [4, 4, 4], [CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS])
    else:
        gl.warp_specialize([
            (_ws_consumer, (0, rt, NC, ROWS, D, BS, QT, G, KST, VST, OVERLAP)),
            (_ws_consumer, (1, rt, NC, ROWS, D, BS, QT, G, KST, VST, OVERLAP)),
            (_ws_consumer, (2, rt, NC, ROWS, D, BS, QT, G, KST, VST, OVERLAP)),
        ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])


@gluon.jit
def _shared_producer(rt, BS: gl.constexpr, D: gl.constexpr, S: gl.constexpr):
    """The loads of ``union_shared``: group block P into ring slot ``P % S`` once every consumer has released the
    slot's previous block (P - S)."""
    _, k_desc, v_desc, _, k_ring, v_ring, full, empty, _, gblk_ptr, ng_ptr, _, _, _, _, _, _, GU, HKV, pid, h = rt
    g = pid * HKV + h
    ng = gl.load(ng_ptr + g)
    for pos in range(ng):
        slot = pos % S
        mbarrier.wait(empty.index(slot), ((pos // S) & 1) ^ 1)
        blk = gl.load(gblk_ptr + g.to(gl.int64) * GU + pos)
        mbarrier.expect(full.index(slot), 2 * BS * D * 2)
        tma.async_copy_global_to_shared(k_desc, [blk * BS, h * D], full.index(slot), k_ring.index(slot))
        tma.async_copy_global_to_shared(v_desc, [blk * BS, h * D], full.index(slot), v_ring.index(slot))


@gluon.jit
def _pass_on(full, empty, lo, hi, S: gl.constexpr):
    """Release group blocks ``lo .. hi - 1`` of the shared ring unused, each once loaded: a release ahead of its load
    would count for the slot's previous block."""
    for sk in range(lo, hi):
        mbarrier.wait(full.index(sk % S), (sk // S) & 1)
        mbarrier.arrive(empty.index(sk % S), count=1)


@gluon.jit
def _shared_consumer(c: gl.constexpr, rt, NC: gl.constexpr, ROWS: gl.constexpr, D: gl.constexpr, BS: gl.constexpr,
                     QT: gl.constexpr, G: gl.constexpr, S: gl.constexpr):
    """Warpgroup c of ``union_shared``: tile ``NC pid + c`` over its own union, a sorted list of positions in the
    group's (``own``); it releases every group block, those it skips once loaded."""
    q_desc, k_desc, v_desc, q_all, k_ring, v_ring, full, empty, qbar, gblk_ptr, ng_ptr, own_ptr, nu_ptr, prior_ptr, \
        o_ptr, qk_scale, NU, GU, HKV, pid, h = rt
    o_layout: gl.constexpr = wgmma_layout(D)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    unit = (NC * pid + c) * HKV + h
    nu = gl.load(nu_ptr + unit)
    ng = gl.load(ng_ptr + pid * HKV + h)
    own = own_ptr + unit.to(gl.int64) * NU
    q_s, prow, m_i, l_i, acc, s_zero = _tile_start(c, unit, q_desc, q_all, qbar, prior_ptr, NU, ROWS, D, BS, QT, G)
    mbarrier.wait(qbar.index(c), 0)
    nxt = 0  # the first group block this warpgroup has not released
    for j in range(nu):
        pos = gl.load(own + j)
        _pass_on(full, empty, nxt, pos, S)  # blocks of the group this tile skips
        slot = pos % S
        mbarrier.wait(full.index(slot), (pos // S) & 1)
        s_acc = warpgroup_mma(q_s, k_ring.index(slot).permute((1, 0)), s_zero, use_acc=False)
        qk = s_acc * qk_scale + gl.load(prow + j * QT)[:, None]
        p, alpha, m_i, l_i = softmax_step(qk, m_i, l_i)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        acc = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), p_layout), v_ring.index(slot), acc)
        mbarrier.arrive(empty.index(slot), count=1)
        nxt = pos + 1
    _pass_on(full, empty, nxt, ng, S)
    store_rows(o_ptr, acc, l_i, unit, ROWS, D, o_layout)


@gluon.jit
def _shared_worker(c: gl.constexpr, rt, NC: gl.constexpr, ROWS: gl.constexpr, D: gl.constexpr, BS: gl.constexpr,
                   QT: gl.constexpr, G: gl.constexpr, S: gl.constexpr):
    """Worker partition c of ``union_shared``: the producer (c = NC) or a consumer."""
    if c == NC:
        _shared_producer(rt, BS, D, S)
    else:
        _shared_consumer(c, rt, NC, ROWS, D, BS, QT, G, S)


@gluon.jit
def union_shared(q_desc, k_desc, v_desc, gblk_ptr, ng_ptr, own_ptr, nu_ptr, prior_ptr, o_ptr, qk_scale, NU, GU,
                  HKV, ROWS: gl.constexpr, D: gl.constexpr, BS: gl.constexpr, QT: gl.constexpr, G: gl.constexpr,
                  NC: gl.constexpr, S: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    """Grid ``(tiles / NC, Hkv)``: ``NC`` (3) warpgroups, each a tile of a group of ``NC`` neighbouring tiles, share
    one ring of ``S`` K/V slots that a producer warp fills with the union of the group's unions (``gblk``), each
    block once; a warpgroup runs the blocks of its own union and skips the others."""
    pid = gl.program_id(0)
    h = gl.program_id(1)
    q_all = gl.allocate_shared_memory(gl.bfloat16, [NC, ROWS, D], q_desc.layout)
    k_ring = gl.allocate_shared_memory(gl.bfloat16, [S, BS, D], k_desc.layout)
    v_ring = gl.allocate_shared_memory(gl.bfloat16, [S, BS, D], v_desc.layout)
    full = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    qbar = gl.allocate_shared_memory(gl.int64, [NC, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(S):
        mbarrier.init(full.index(s), count=1)
        mbarrier.init(empty.index(s), count=NC)
    for c in gl.static_range(NC):
        mbarrier.init(qbar.index(c), count=1)
    fence_async_shared()
    gl.static_assert(NC == 3, "three consumer warpgroups and a producer warp")
    rt = (q_desc, k_desc, v_desc, q_all, k_ring, v_ring, full, empty, qbar, gblk_ptr, ng_ptr, own_ptr, nu_ptr,
          prior_ptr, o_ptr, qk_scale, NU, GU, HKV, pid, h)
    gl.warp_specialize([
        (_shared_consumer, (0, rt, NC, ROWS, D, BS, QT, G, S)),
        (_shared_worker, (1, rt, NC, ROWS, D, BS, QT, G, S)),
        (_shared_worker, (2, rt, NC, ROWS, D, BS, QT, G, S)),
        (_shared_worker, (3, rt, NC, ROWS, D, BS, QT, G, S)),
    ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])
