"""Triton segment attention: one normalised partial output and natural-log LSE per segment.

The ``"TRITON"`` backend of ``dash_core.segments.flash_dash_attention`` (gathered layout, see
that module). Segments are merged afterwards by ``dash_core.segments.merge_segments``, the one
implementation of ``softmax(lse + log prior)``.
"""

from __future__ import annotations

import math
from typing import Tuple

import torch
import triton
import triton.language as tl

from .common import LN2, LOG2E_F, interpreting, max_or_zero, pow2, raise_max
from .launcher import cached_launch


@cached_launch
@triton.jit
def _segment_attn_kernel(
    q_ptr, sq_n, sq_h, k_ptr, v_ptr, sk_t, sk_h, sv_t, sv_h,
    used_ptr, su_n, su_s, su_c, o_ptr, lse_ptr,
    qk_scale, HSEL, HU, G, S, TOPK,
    BS: tl.constexpr, LOCAL: tl.constexpr, MAXCAP: tl.constexpr, G_PAD: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):
    """Grid ``(n * Hsel * (TOPK + 1), Hk)``: program (r, j) owns segment request r = (row i,
    unit s, segment c) for gathered KV head j and its G query heads (padded to G_PAD rows).

    Loads ``q [G_PAD, D_PAD]``, walks the segment's ``min(used, capacity)`` rows of k/v in tiles
    of ``[BLOCK_N, D_PAD]`` with an online softmax (exp2, fp32), and writes the normalised output
    to ``o [r, j*G + g, :]`` (fp32, ``[R, HU, D]`` contiguous) and the natural-log LSE to
    ``lse [r, j*G + g]`` (-inf and zeros for an empty segment). IEEE: both products in fp32
    (float32 inputs, and bfloat16 under the interpreter, whose bf16 ``tl.dot`` is wrong in triton
    3.6); otherwise q @ k^T in the input dtype and P rounded to it for P @ V, as FlashAttention.
    """
    r = tl.program_id(0)
    j = tl.program_id(1)
    c = r % (TOPK + 1)
    unit = r // (TOPK + 1)
    s = unit % HSEL
    i = unit // HSEL
    cap = tl.where(c == TOPK, LOCAL, BS)
    used = tl.load(used_ptr + i.to(tl.int64) * su_n + s * su_s + c * su_c).to(tl.int32)
    length = tl.minimum(tl.maximum(used, 0), cap)
    start = unit.to(tl.int64) * S + c * BS

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    gm = offs_g < G
    dm = offs_d < D
    heads = s * HU + j * G + offs_g
    q = tl.load(q_ptr + i.to(tl.int64) * sq_n + heads[:, None] * sq_h + offs_d[None, :],
                mask=gm[:, None] & dm[None, :], other=0.0)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for t0 in range(0, MAXCAP, BLOCK_N):
        if t0 < length:
            offs_t = t0 + tl.arange(0, BLOCK_N)
            tm = offs_t < length
            rows = start + offs_t
            kt = tl.load(k_ptr + rows[:, None] * sk_t + j * sk_h + offs_d[None, :],
                         mask=tm[:, None] & dm[None, :], other=0.0)
            vt = tl.load(v_ptr + rows[:, None] * sv_t + j * sv_h + offs_d[None, :],
                         mask=tm[:, None] & dm[None, :], other=0.0)
            if IEEE:
                qk = tl.dot(q.to(tl.float32), tl.trans(kt.to(tl.float32)), input_precision="ieee")
            else:
                qk = tl.dot(q, tl.trans(kt))
            qk = tl.where(tm[None, :], qk * qk_scale, float("-inf"))
            m_i, l_i, acc = raise_max(m_i, l_i, acc, tl.max(qk, axis=1))
            p = tl.exp2(qk - max_or_zero(m_i)[:, None])
            l_i += tl.sum(p, axis=1)
            if IEEE:
                acc += tl.dot(p, vt.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(p.to(vt.dtype), vt)
    nonempty = l_i > 0
    o = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, (m_i + tl.log2(tl.where(nonempty, l_i, 1.0))) * LN2, float("-inf"))
    out_rows = r.to(tl.int64) * HU + j * G + offs_g
    tl.store(o_ptr + out_rows[:, None] * D + offs_d[None, :], o, mask=gm[:, None] & dm[None, :])
    tl.store(lse_ptr + out_rows, lse, mask=gm)


def segment_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, used: torch.Tensor,
                             geo) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-segment attention of a validated gathered call (``dash_core.segments.check_segments``).

    q: ``[n, Hq, D]``; k, v: ``[n * Hsel * S, Hk, D]`` (last dim contiguous); used ``[n, Hsel,
    topk + 1]``. One launch, no synchronisation. Returns ``o [n, Hsel, topk + 1, Hu, D]`` fp32
    and ``lse [n, Hsel, topk + 1, Hu]`` fp32 natural log.
    """
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k, v must have a contiguous last dimension")
    hu = geo.heads_per_unit
    g = hu // geo.hk
    c = geo.num_segments
    o = torch.empty(geo.n, geo.hsel, c, hu, geo.d, dtype=torch.float32, device=q.device)
    lse = torch.empty(geo.n, geo.hsel, c, hu, dtype=torch.float32, device=q.device)
    d_pad = max(16, pow2(geo.d))
    ieee = q.dtype == torch.float32 or (interpreting() and q.dtype == torch.bfloat16)
    _segment_attn_kernel[(geo.requests, geo.hk)](
        q, q.stride(0), q.stride(1), k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        used, used.stride(0), used.stride(1), used.stride(2), o, lse,
        LOG2E_F / math.sqrt(geo.d), geo.hsel, hu, g, geo.unit_tokens, geo.topk,
        BS=geo.bs, LOCAL=geo.local, MAXCAP=max(geo.bs, geo.local), G_PAD=max(16, pow2(g)),
        D=geo.d, D_PAD=d_pad, BLOCK_N=32 if d_pad <= 128 else 16, IEEE=ieee,
        num_warps=4,
    )
    return o, lse
