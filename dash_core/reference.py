"""The float64 oracle: docs/semantics.md sections 2-7 in code, written for clarity, not speed.

Every fast path in this project (paged PyTorch, Triton kernels, segment backends, engine
adapters) is tested against the functions here. The pipeline is split by stage so that a fast
path can be compared stage by stage (docs/design.md, "Tests"):

    block_summaries  ->  route  ->  attend           (dash_rows chains route and attend)

Example (dense-equivalent parameters reduce DASH to causal attention)::

    >>> import torch
    >>> from dash_core import DashParams, dash_reference
    >>> q, k, v = torch.randn(1, 4, 70, 16), torch.randn(1, 2, 70, 16), torch.randn(1, 2, 70, 16)
    >>> out, active = dash_reference(q, k, v, torch.randn(2, 16), DashParams.dense_equivalent(16))
    >>> dense = torch.nn.functional.scaled_dot_product_attention(
    ...     q.double(), k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1), is_causal=True)
    >>> bool(torch.allclose(out.double(), dense, atol=1e-6)), active[0, 0, -1].item()
    (True, 5)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional, Sequence, Union

import torch

from .params import DashParams

F64 = torch.float64
ENTMAX_ITERS = 3  # three safeguarded Halley steps: part of the semantics (docs/semantics.md section 4)
HALLEY_SLACK = 1e-5
PRIOR_EPS = 1e-20
# Row chunks are sized so that one chunk's float64 logits stay near this many bytes.
_LOGITS_BUDGET_BYTES = 1 << 27


def block_summaries(k: torch.Tensor, head_cls: torch.Tensor, block_size: int) -> torch.Tensor:
    """Summaries of the complete blocks of ``k`` (docs/semantics.md section 2).

    k: ``[..., Hkv, N, D]`` keys (post-RoPE); head_cls: ``[Hkv, D]``.
    Returns ``[..., Hkv, N // block_size, D]`` float64 holding values rounded to ``k.dtype``
    (summaries are stored in the KV dtype). A trailing partial block is not summarised.
    """
    *lead, hkv, n, d = k.shape
    nblk = n // block_size
    kb = k[..., : nblk * block_size, :].to(F64).reshape(*lead, hkv, nblk, block_size, d)
    logits = torch.einsum("...hjtd,hd->...hjt", kb, head_cls.to(F64)) / math.sqrt(d)
    w = torch.softmax(logits, dim=-1)
    s = torch.einsum("...hjt,...hjtd->...hjd", w, kb)
    return s.to(k.dtype).to(F64)


def entmax15_threshold(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The 1.5-entmax threshold ``tau`` of ``x`` over the ``valid`` entries of the last dim.

    Exactly three safeguarded Halley steps from the bracket ``[max - 1, max]`` (docs/semantics.md
    section 4). Rows without a valid entry get ``tau = 0`` (and no support).
    """
    xm = torch.where(valid, x, torch.full_like(x, -math.inf))
    m = xm.amax(dim=-1)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    lo, hi = m - 1.0, m.clone()
    tau = (lo + hi) / 2
    for _ in range(ENTMAX_ITERS):
        above = valid & (x > tau[..., None])
        diff = torch.where(above, x - tau[..., None], torch.zeros_like(x))
        f = (diff * diff).sum(-1) - 1.0
        df = -2.0 * diff.sum(-1)
        ddf = 2.0 * above.sum(-1).to(x.dtype)
        new = tau - 2.0 * f * df / (2.0 * df * df - f * ddf)
        lo = torch.where(f > 0, tau, lo)
        hi = torch.where(f < 0, tau, hi)
        ok = (new > lo - HALLEY_SLACK) & (new < hi + HALLEY_SLACK)  # NaN fails both
        tau = torch.where(ok, new, (lo + hi) / 2)
    return tau


@dataclass
class Routing:
    """The selection of one set of query rows.

    Hsel is Hkv for router ``kv_head`` and 1 for ``shared``.

    mp: ``[Hsel, R, nblk]`` float64, the aggregated entmax probability of every candidate.
    kept: ``[Hsel, R, nblk]`` bool, routed blocks kept after the ``topk`` cap with prior > 0.
    prior: ``[Hsel, R, nblk]`` float64, ``pi`` of the kept blocks, 0 elsewhere.
    """

    mp: torch.Tensor
    kept: torch.Tensor
    prior: torch.Tensor


def routing_scores(q_scaled: torch.Tensor, summaries: torch.Tensor) -> torch.Tensor:
    """The entmax's input ``x = 0.5 <sf q, s> / sqrt(D)`` (docs/semantics.md section 4), float64 ``[Hq, R, nblk]``,
    from ``q_scaled [Hq, R, D]`` and ``summaries [Hkv, nblk, D]`` (query head h scores KV head h // G)."""
    hq, _, d = q_scaled.shape
    g = hq // summaries.shape[0]
    z = torch.einsum("hrd,hjd->hrj", q_scaled.to(F64), summaries.to(F64).repeat_interleave(g, dim=0)) / math.sqrt(d)
    return 0.5 * z


def route(q_scaled: torch.Tensor, summaries: torch.Tensor, num_candidates: torch.Tensor,
          params: DashParams) -> Routing:
    """Stage 2 and the prior (docs/semantics.md sections 4-5) for R query rows.

    q_scaled: ``[Hq, R, D]``, ``sf * q`` already rounded to the query dtype.
    summaries: ``[Hkv, nblk, D]``; num_candidates: ``[R]`` int, row r routes over blocks
    ``0 .. num_candidates[r] - 1`` (which must be < nblk).
    """
    hq, r, d = q_scaled.shape
    hkv, nblk, _ = summaries.shape
    g = hq // hkv
    x = routing_scores(q_scaled, summaries)
    valid = (torch.arange(nblk)[None, :] < num_candidates.to(torch.long)[:, None]).expand(hq, r, nblk)
    tau = entmax15_threshold(x, valid)
    above = valid & (x > tau[..., None])
    prob = torch.where(above, (x - tau[..., None]) ** 2, torch.zeros_like(x))
    if params.router == "kv_head":
        mp = prob.reshape(hkv, g, r, nblk).mean(dim=1)
    else:
        mp = prob.mean(dim=0, keepdim=True)
    kept = mp > 0
    if params.topk is not None and nblk > params.topk:
        key = torch.where(kept, mp, torch.full_like(mp, -1.0))
        order = torch.sort(key, dim=-1, descending=True, stable=True).indices  # ties: lower index first
        rank = torch.empty_like(order)
        rank.scatter_(-1, order, torch.arange(nblk).expand_as(order).contiguous())
        kept = kept & (rank < params.topk)
    if params.estimate_diagonal:
        pos = kept & (mp > PRIOR_EPS)
        logmp = torch.log(torch.where(pos, mp, torch.ones_like(mp)))
        cnt = pos.sum(-1, keepdim=True)
        log_g = logmp.sum(-1, keepdim=True) / cnt.clamp(min=1)
        prior = torch.where(pos, torch.exp((logmp - log_g) / params.sigma), torch.zeros_like(mp))
    else:
        prior = torch.where(kept, mp, torch.zeros_like(mp))
    kept = kept & (prior > 0)
    return Routing(mp=mp, kept=kept, prior=prior)


def local_window_start(positions: torch.Tensor, params: DashParams) -> torch.Tensor:
    """First block of the local window of each position (docs/semantics.md section 3)."""
    return (positions // params.block_size - params.local_blocks + 1).clamp(min=0)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
           routing: Routing, params: DashParams) -> torch.Tensor:
    """Stage 3 (docs/semantics.md section 6): softmax attention over the local window and kept blocks.

    q: ``[Hq, R, D]`` (not scaled by sf); k, v: ``[Hkv, L, D]`` with ``L > max(positions)``;
    positions: ``[R]``; routing over candidate blocks ``0 .. nblk - 1``.
    Returns ``[Hq, R, D]`` float64.
    """
    hq, r, d = q.shape
    hkv, n, _ = k.shape
    g = hq // hkv
    bs = params.block_size
    nb_all = -(-n // bs)
    pos = positions.to(torch.long)
    blocks = torch.arange(nb_all)
    start = local_window_start(pos, params)
    in_local = (blocks[None, :] >= start[:, None]) & (blocks[None, :] <= (pos // bs)[:, None])
    hsel, _, nblk = routing.prior.shape
    logpi = torch.full((hsel, r, nb_all), -math.inf, dtype=F64)
    cand = torch.where(routing.kept, torch.log(routing.prior.clamp(min=1e-300)),
                       torch.full_like(routing.prior, -math.inf))
    logpi[:, :, : min(nblk, nb_all)] = cand[:, :, :nb_all]
    logpi = torch.where(in_local[None], torch.zeros_like(logpi), logpi)
    tok = torch.arange(n)
    bias = logpi[:, :, tok // bs]  # [Hsel, R, n]
    bias = bias.masked_fill(tok[None, None, :] > pos[None, :, None], -math.inf)
    qg = q.to(F64).reshape(hkv, g, r, d)
    logits = torch.einsum("hgrd,htd->hgrt", qg, k.to(F64)) / math.sqrt(d)
    logits = logits + bias[:, None] if hsel == hkv else logits + bias[None]
    w = torch.softmax(logits, dim=-1)
    out = torch.einsum("hgrt,htd->hgrd", w, v.to(F64))
    return out.reshape(hq, r, d)


def dash_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, summaries: torch.Tensor,
              positions: torch.Tensor, params: DashParams, iq: Optional[torch.Tensor] = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """DASH for chosen query rows of one sequence, given the block summaries.

    q: ``[Hq, R, D]`` queries at ``positions [R]``; k, v: ``[Hkv, L, D]`` (L > max position);
    summaries: ``[Hkv, >= L // bs, D]``. Rows are processed in chunks so memory stays linear in L.
    With an indexer (docs/semantics.md section 9), iq: ``[Hi, R, Di]`` routes instead of q, summaries are the
    indexer's ``[1, >= L // bs, Di]`` and the one shared selection applies to every KV head.
    Returns ``out [Hq, R, D]`` float64 and ``active [Hkv, R]`` int32 (docs/semantics.md section 5).
    """
    hq, r, d = q.shape
    hkv = k.shape[0]
    bs = params.block_size
    pos = torch.as_tensor(positions, dtype=torch.long)
    out = torch.empty(hq, r, d, dtype=F64)
    active = torch.empty(hkv, r, dtype=torch.int32)
    qr = q if iq is None else iq
    if iq is not None:
        params = replace(params, router="shared")  # the mean over the Hi indexer heads
    q_scaled = (qr * params.scaling_factor).to(qr.dtype)  # sf * q rounded to q's dtype (docs/semantics.md 4)
    for lo, hi in _row_chunks(pos, hq):
        p = pos[lo:hi]
        n = int(p.max()) + 1
        ncand = (p // bs - params.local_blocks + 1).clamp(min=0)
        nblk = int(ncand.max())
        if summaries.shape[1] < nblk:
            raise ValueError(f"summaries cover {summaries.shape[1]} blocks, position {n - 1} needs {nblk}")
        if nblk:
            rt = route(q_scaled[:, lo:hi], summaries[:, :nblk], ncand, params)
        else:  # no candidate anywhere in this chunk: only the local window
            hsel = hkv if params.router == "kv_head" else 1
            empty = torch.zeros(hsel, hi - lo, 0, dtype=F64)
            rt = Routing(mp=empty, kept=empty.bool(), prior=empty)
        out[:, lo:hi] = attend(q[:, lo:hi], k[:, :n], v[:, :n], p, rt, params)
        nlocal = torch.minimum(p // bs + 1, torch.tensor(params.local_blocks))
        act = (rt.kept.sum(-1) + nlocal[None]).to(torch.int32)
        active[:, lo:hi] = act.expand(hkv, hi - lo)
    return out, active


def _row_chunks(pos: torch.Tensor, hq: int):
    """Split rows into chunks whose float64 logits fit the budget (sorted order not required)."""
    r = pos.numel()
    lo = 0
    while lo < r:
        n = int(pos[lo:].max()) + 1
        step = max(1, _LOGITS_BUDGET_BYTES // (8 * n * (hq + 2)))
        yield lo, min(r, lo + step)
        lo += step


def dash_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_cls: torch.Tensor,
                   params: DashParams, rows: Optional[Union[Sequence[int], torch.Tensor]] = None,
                   iq: Optional[torch.Tensor] = None, ik: Optional[torch.Tensor] = None,
                   head_cls_i: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal DASH over whole prompts: every position attends to ``0..p``.

    q: ``[B, Hq, N, D]``; k, v: ``[B, Hkv, N, D]`` (post-RoPE); head_cls: ``[Hkv, D]``.
    rows: optional query positions to evaluate (same code path, memory linear in N); the output
    then has ``len(rows)`` rows in that order. A decode step at position N is the last row of a
    call on N + 1 tokens.
    Indexer (docs/semantics.md section 9; all three or none): iq ``[B, Hi, N, Di]``, ik ``[B, N, Di]``
    (post-RoPE), head_cls_i ``[Di]``. Routing then uses the summaries of ``ik`` and ``sf * iq``,
    averaged over the Hi heads into one selection for every KV head (``head_cls`` is unused).
    Returns ``out [B, Hq, R, D]`` in ``q.dtype`` and ``active [B, Hkv, R]`` int32.
    """
    _check_shapes(q, k, v, head_cls)
    indexer = _check_indexer(q, iq, ik, head_cls_i)
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    pos = torch.arange(n) if rows is None else torch.as_tensor(rows, dtype=torch.long).reshape(-1)
    if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= n):
        raise ValueError(f"rows must lie in 0..{n - 1}, got {pos.min().item()}..{pos.max().item()}")
    out = torch.empty(b, hq, pos.numel(), d, dtype=q.dtype)
    active = torch.empty(b, hkv, pos.numel(), dtype=torch.int32)
    for i in range(b):
        if indexer:
            summ = block_summaries(ik[i][None], head_cls_i[None], params.block_size)
            o, a = dash_rows(q[i][:, pos], k[i], v[i], summ, pos, params, iq=iq[i][:, pos])
        else:
            summ = block_summaries(k[i], head_cls, params.block_size)
            o, a = dash_rows(q[i][:, pos], k[i], v[i], summ, pos, params)
        out[i], active[i] = o.to(q.dtype), a
    return out, active


def _check_shapes(q, k, v, head_cls) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"expected q [B,Hq,N,D] and k, v [B,Hkv,N,D]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    b, hq, n, d = q.shape
    if k.shape[0] != b or k.shape[2] != n or k.shape[3] != d or hq % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree (Hq must be a multiple of Hkv)")
    if tuple(head_cls.shape) != (k.shape[1], d):
        raise ValueError(f"head_cls must be [Hkv, D] = {(k.shape[1], d)}, got {tuple(head_cls.shape)}")


def _check_indexer(q, iq, ik, head_cls_i) -> bool:
    given = [x is not None for x in (iq, ik, head_cls_i)]
    if not any(given):
        return False
    if not all(given):
        raise ValueError(f"iq, ik and head_cls_i go together; got iq {given[0]}, ik {given[1]}, head_cls_i {given[2]}")
    b, _, n, _ = q.shape
    if iq.dim() != 4 or iq.shape[0] != b or iq.shape[2] != n:
        raise ValueError(f"iq must be [B, Hi, N, Di] with B, N = {b}, {n}; got {tuple(iq.shape)}")
    di = iq.shape[3]
    if tuple(ik.shape) != (b, n, di) or tuple(head_cls_i.shape) != (di,):
        raise ValueError(f"ik must be [B, N, Di] = {(b, n, di)} and head_cls_i [Di] = {(di,)}; got "
                         f"{tuple(ik.shape)} and {tuple(head_cls_i.shape)}")
    return True
