"""Triton routing: scores against block summaries, 1.5-entmax, group mean, ``topk`` cap, prior.

Stage 2 and the prior of docs/semantics.md (sections 4-5). ``route_tile`` is the one routing routine: it
takes the scores ``x = 0.5 * <sf q, s> / sqrt(D)`` of a tile of selection *units* (a unit is what
gets one selection: a (request, KV head) for router ``kv_head``, a request for ``shared``; a
prefill tile is several query tokens), each with ``nrows`` score rows (its query heads), from a
scratch buffer, and writes each unit's kept blocks. Decode (``decode/route.py``) calls it with one
unit per program; prefill (``prefill/route.py``) with a tile of query tokens.

All arithmetic is fp32 (scores accumulate fp32 from products of the query/summary dtype). The
entmax reads the score rows from the scratch (L2-resident at decode sizes) once when a unit's
candidates fit one register tile (or takes them from the caller's registers), else once per Halley
step. The cap never sorts: the ``topk``-th largest ``mp`` is found on the fp32 bit patterns (positive
floats order like their bits). Where a decode unit's scores fit the select program's registers (X_IN_REGS), it
writes its positive mp as a list (with their candidates) as mp is computed; a list of at most
``DecodeConfig.cap_rank_max`` keys (the usual case: a few percent of the candidates are positive) is ranked by
comparison, each key against all, a longer one takes a radix select on histograms (8 bits a pass) over every
candidate's key in registers. A one-unit tile of at least ``RADIX_MIN_KEYS`` keys without a list takes the radix
select too; every other tile (prefill's, several units each) takes a multi-pivot search, over the mp bits in
registers where they fit one tile (ONE_TILE), else over each unit's list of positive mp from the range of its keys
(LIST) or over its stored mp. The ties and the compaction read the lists where there are lists; ties go to the
lower block.

Who takes which path (``route_tile``'s flags):

    decode, one unit a program                 ONE_TILE, X_IN_REGS, LIST: the scores loaded once, the mp list
                                               ranked (or the radix select over the keys in registers), while a
                                               unit's scores fit select_tile_budget (halved from 16 padded rows)
    decode, scores wider than that             ONE_TILE up to DecodeConfig.one_tile_max candidates (the cap's
                                               keys loaded: the radix select, the pivot search below
                                               RADIX_MIN_KEYS keys), beyond it neither (the multi-pivot search)
    prefill, short tables (one score tile)     ONE_TILE, X_IN_REGS: the scores never leave registers
    prefill, longer tables, stored scores      LIST: the scores re-read each pass, the cap over the mp lists
    prefill, long tables, router kv_head       no route_tile: prefill/route.py's _route_recompute, with the
                                               same arithmetic, computes the scores again each pass
"""

from __future__ import annotations

import triton
import triton.language as tl

from .. import reference

PRIOR_EPS = tl.constexpr(reference.PRIOR_EPS)  # docs/semantics.md section 5
HALLEY_SLACK = tl.constexpr(reference.HALLEY_SLACK)  # docs/semantics.md section 4 (globals kernels read are constexprs)
INF_BITS = tl.constexpr(0x7F800000)  # bit pattern of +inf: above every finite mp
# The one-tile cap's radix select runs on tiles of at least this many keys, and of at least one key a thread of the
# program (``route_tile``'s RADIX_MIN: ``radix_min_keys`` of the decode select's warps), else the pivot
# search. On a smaller tile several threads hold each key, and with the keys made in registers
# (X_IN_REGS: the mean over heads of a [1, NH, TS] tile, reshaped) the compiled radix select finds the wrong
# topk-th key (Triton 3.6, sm_90); each histogram alone is right, and the same keys loaded from memory give the
# right key. benchmarks/investigations/histogram_probe.py isolates it: rerun it after a Triton upgrade before moving
# this bound.
RADIX_MIN_KEYS = tl.constexpr(256)


def radix_min_keys(num_warps: int) -> int:
    """``route_tile``'s RADIX_MIN for a program of ``num_warps`` warps: one key a thread, and ``RADIX_MIN_KEYS``."""
    return max(RADIX_MIN_KEYS.value, 32 * num_warps)


@triton.jit
def _add2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _add3(a0, a1, a2, b0, b1, b2):
    return a0 + b0, a1 + b1, a2 + b2


@triton.jit
def halley_sums(x, tau):
    """Per row of a score tile (its last axis the candidates): sum of ``(x - tau)^2``, of ``x - tau`` and the
    count, over the entries strictly above ``tau`` (``x``'s shape without its last axis). One reduction of the
    three (one exchange between warps instead of three; each sum in the order ``tl.sum`` takes); the count is
    summed as integers (fewer instructions)."""
    diff = positive_part(x - tau)
    ssq, sdf, cnt = tl.reduce((diff * diff, diff, (diff > 0).to(tl.int32)), -1, _add3)
    return ssq, sdf, cnt.to(tl.float32)


@triton.jit
def positive_part(d):
    """``max(d, 0)``: for ``d = x - tau`` the entries strictly above ``tau`` keep ``x - tau`` (a difference of two
    unequal floats is never 0), the others 0 (NaN too, compiled; the interpreter keeps NaN). Fewer instructions
    than a compare and a select."""
    return tl.maximum(d, 0.0)


@triton.jit
def halley_step(ssq, sdf, cnt, tau, lo, hi):
    """One safeguarded Halley step of the 1.5-entmax threshold (docs/semantics.md section 4) from the sums over the
    entries above ``tau``: of ``(x - tau)^2`` (``ssq``), of ``x - tau`` (``sdf``) and their count. Returns
    ``(tau, lo, hi)``: the step when it stays inside the bracket ``[lo, hi]`` (with slack), else its middle."""
    f = ssq - 1.0
    df = -2.0 * sdf
    ddf = 2.0 * cnt
    den = 2.0 * df * df - f * ddf
    # a zero denominator makes the step NaN or infinite: it fails the bracket test below
    new = tl.where(den != 0, tau - tl.div_rn(2.0 * f * df, tl.where(den != 0, den, 1.0)), float("nan"))
    lo = tl.where(f > 0, tau, lo)
    hi = tl.where(f < 0, tau, hi)
    good = (new > lo - HALLEY_SLACK) & (new < hi + HALLEY_SLACK)  # NaN fails both
    return tl.where(good, new, (lo + hi) * 0.5), lo, hi


@triton.jit
def mp_key_range(mp, ok, npos, key_min, key_max):
    """``(npos, key_min, key_max) [QT]`` updated with an ``[QT, T]`` mp tile (entries where ``ok``): the
    count of positive entries and the bits (int32) of the smallest positive and of the largest entry.
    Start from ``0, INF_BITS, 0``."""
    key = mp.to(tl.int32, bitcast=True)
    pos = (mp > 0) & ok
    n, lo, hi = tl.reduce((pos.to(tl.int32), tl.where(pos, key, INF_BITS), tl.where(ok, key, 0)), 1,
                          _count_min_max)  # one reduction of the three
    return npos + n, tl.minimum(key_min, lo), tl.maximum(key_max, hi)


@triton.jit
def _count_min_max(a0, a1, a2, b0, b1, b2):
    return a0 + b0, tl.minimum(a1, b1), tl.maximum(a2, b2)


@triton.jit
def radix_kth(keys, kvalid, topk):
    """The ``topk``-th largest of the ``kvalid`` entries of ``keys [T]`` (int32 bits of positive floats, ordered as
    the floats): 8 bits a pass, each pass a 256-bin histogram of the next byte of the keys under the prefix found
    so far (``select_kept``'s one-tile cap; ``tests/kernels/_radix_probe.py`` runs it alone)."""
    bins = tl.arange(0, 256)
    prefix = topk * 0
    krem = topk
    for p in range(4):  # a loop, not unrolled: one copy of the histogram's long code stays in the instruction cache
        shift = 24 - 8 * p
        above = tl.minimum(shift + 8, 31)  # the first pass has no prefix: every valid key (bit 31 clear) matches
        match = kvalid & ((keys >> above) == (prefix >> above))  # the bits above this digit equal the prefix
        hist = tl.histogram((keys >> shift) & 255, 256, mask=match)
        at_least = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # keys with digit >= bin
        d_sel = tl.max(tl.where(at_least >= krem, bins, -1), axis=0)
        krem = krem - tl.sum(tl.where(bins == d_sel, at_least - hist, 0), axis=0)  # keys above d_sel go first
        prefix = prefix | (d_sel << shift)
    return prefix


@triton.jit
def rank_kth(list_ptr, n, topk, RK: tl.constexpr, CH: tl.constexpr):
    """``(kth, n_gt, n_eq)``: the ``topk``-th largest (``1 <= topk <= n``) of the ``n <= RK`` positive floats at
    ``list_ptr`` (16-byte aligned, followed by zeros up to a multiple of 4: ``pad_list``), as int32 bits, and how
    many keys are above it and equal to it. Each key counts the keys above it, ``CH`` at a time (each thread compares
    its key with a chunk, loaded in whole groups of 4 (16-byte loads): only the last reductions cross threads; the
    chunks come from the cache lines loading ``mine`` brought in, and stop at ``n``); the answer is the smallest key
    with fewer than ``topk`` above it."""
    offs = tl.arange(0, RK)
    n4 = (n + 3) // 4 * 4
    mine = tl.load(list_ptr + offs, mask=offs < n4, other=0.0).to(tl.int32, bitcast=True)
    above = tl.zeros([RK], tl.int32)
    for c0 in range(0, n, CH):
        oc = c0 + tl.arange(0, CH)
        other = tl.load(list_ptr + oc, mask=oc < n4, other=0.0).to(tl.int32, bitcast=True)  # 0: above no key
        above += tl.sum((other[:, None] > mine[None, :]).to(tl.int32), axis=0)
    kth = tl.min(tl.where((offs < n) & (above < topk), mine, INF_BITS), axis=0)
    n_gt, n_eq = tl.reduce(((mine > kth).to(tl.int32), (mine == kth).to(tl.int32)), 0, _add2)  # (past n: 0 < kth)
    return kth, n_gt, n_eq


@triton.jit
def _kept_entries(mp_ptr, ck_ptr, mp_unit, j, n_u, n_load, LIST: tl.constexpr):
    """Entries ``j [T]`` of each unit's mp (T: a tile width, TL): ``(mp [QT, T], candidate [QT, T]
    int32, valid [QT, T])``, loaded up to ``n_load [QT] >= n_u`` (whole groups of 4 make 16-byte loads) and
    zero past ``n_u``.
    LIST: ``mp_ptr + mp_unit[u] + j`` holds the unit's positive mp in increasing candidate order and
    ``ck_ptr + mp_unit[u] + j`` their candidates, ``n_u`` of them; otherwise mp of candidate ``j``, ``n_u``
    candidates."""
    valid = j[None, :] < n_u[:, None]
    ld = j[None, :] < n_load[:, None]
    mpv = tl.where(valid, tl.load(mp_ptr + mp_unit[:, None] + j[None, :], mask=ld, other=0.0), 0.0)
    if LIST:
        cand = tl.where(valid, tl.load(ck_ptr + mp_unit[:, None] + j[None, :], mask=ld, other=0), 0)
    else:
        cand = j[None, :] + tl.zeros_like(n_u)[:, None]
    return mpv, cand, valid


@triton.jit
def _mp_keys(mp_ptr, mp_unit, j, n_u, n_load):
    """``[QT, 1, T]``: the bits (int32) of entries ``j [T]`` of each unit's mp as ``_kept_entries`` loads them (0 past
    ``n_u``), shaped for ``select_kept``'s pivot counts, which compare keys only (loaded so, they need no layout
    conversion before the compare, so a load one tile ahead stays in flight)."""
    jj = j[None, None, :]
    mpv = tl.load(mp_ptr + mp_unit[:, None, None] + jj, mask=jj < n_load[:, None, None], other=0.0)
    return tl.where(jj < n_u[:, None, None], mpv, 0.0).to(tl.int32, bitcast=True)


@triton.jit
def append_positive(mp, c, ok, mp_ptr, ck_ptr, mp_unit, npos):
    """Append the positive entries of an ``[QT, T]`` mp tile (candidates ``c [T]``, entries where
    ``ok``) to each unit's list (``select_kept``'s LIST layout) after its ``npos [QT]`` entries;
    returns the new lengths. Tiles must come in increasing candidate order."""
    pos = (mp > 0) & ok
    pos_i = pos.to(tl.int32)
    j = npos[:, None] + tl.cumsum(pos_i, axis=1) - pos_i
    dst = mp_unit[:, None] + j
    tl.store(mp_ptr + dst, mp, mask=pos)
    tl.store(ck_ptr + dst, c[None, :] + tl.zeros_like(j), mask=pos)
    return npos + tl.sum(pos_i, axis=1)


@triton.jit
def pad_list(mp_ptr, mp_unit, npos):
    """Zeros after each unit's list of ``npos [QT]`` entries (``append_positive``) up to a multiple of 4, for
    ``rank_kth``'s loads (a unit's rows have room for its candidates rounded up to 4; the other passes read the
    list's ``npos`` entries only)."""
    j = npos[:, None] + tl.arange(0, 4)[None, :]
    tl.store(mp_ptr + mp_unit[:, None] + j, tl.zeros_like(j).to(tl.float32), mask=j < (npos[:, None] + 3) // 4 * 4)


@triton.jit
def select_kept(
    mp_ptr, mp_unit, ncand, nmax, npos, bt_ptr, bt_unit, sel_idx_ptr, sel_blk_ptr, sel_bias_ptr, sel_unit, sel_cap,
    count_ptr, count_unit, topk, inv_sigma, mp_regs, key_min, key_max, ck_ptr,
    QT: tl.constexpr, TS: tl.constexpr, NPIV: tl.constexpr, HAS_TOPK: tl.constexpr, EST_DIAG: tl.constexpr,
    PS: tl.constexpr, BS: tl.constexpr, ONE_TILE: tl.constexpr, X_IN_REGS: tl.constexpr, TC: tl.constexpr,
    LIST: tl.constexpr, TL: tl.constexpr, RK: tl.constexpr = 0, RCH: tl.constexpr = 32,
    RADIX_MIN: tl.constexpr = RADIX_MIN_KEYS,
):
    """The ``topk`` cap, ties, prior and compaction of ``QT`` units from their ``mp`` in scratch
    (``mp_ptr + mp_unit[u] + c``, ``npos [QT]`` positive entries each, ``nmax`` the most candidates):
    the second half of ``route_tile``, also called by routing kernels that compute ``mp`` themselves.
    ``mp_regs [QT, TC]``: the mp already in registers (``X_IN_REGS``; otherwise any placeholder).
    LIST: the scratch holds only each unit's ``npos`` positive mp, in increasing
    candidate order, with their candidates at ``ck_ptr + mp_unit[u] + j`` (``append_positive``), and
    ``[key_min, key_max]`` (``[QT]`` int32) are the bits of the smallest and the largest: every pass
    reads the lists, never the other candidates, up to ``npos`` rounded up to 4 (each unit's rows must have
    room for that many). Without it ``key_min``, ``key_max`` and ``ck_ptr`` are unused.
    LIST with ONE_TILE (one unit, its mp in registers: decode): a list of at most ``RK`` keys is ranked
    (``rank_kth``), a longer one takes the radix select over the keys in registers.
    Tiles: ``[QT, NPIV, TS]`` for the pivot counts, ``[QT, TL]`` for the ties and the compaction, ``[RCH, RK]`` for
    the ranks.
    """
    tl.static_assert(not (LIST and ONE_TILE) or (X_IN_REGS and QT == 1 and (TS <= RK or TS >= RADIX_MIN)),
                     "LIST with ONE_TILE: one unit, its mp in registers, lists up to RK ranked, longer by radix")
    if LIST:  # the passes below read npos list entries instead of ncand candidates, in groups of 4
        n_u = npos
        n_load = (npos + 3) // 4 * 4
        n_hi = tl.max(npos, axis=0)
    else:
        n_u = ncand
        n_load = ncand
        n_hi = nmax
    thr, need, capped, ranked, rank_gt, rank_eq = _cap_threshold(
        mp_ptr, mp_unit, ncand, npos, n_u, n_load, n_hi, topk, mp_regs, key_min, key_max, QT, TS, NPIV, HAS_TOPK,
        ONE_TILE, X_IN_REGS, TC, LIST, RK, RCH, RADIX_MIN)
    ties, neq, log_g = _count_ties(mp_ptr, ck_ptr, mp_unit, n_u, n_load, n_hi, thr, need, capped, ranked, rank_gt,
                                   rank_eq, topk, QT, TL, HAS_TOPK, EST_DIAG, LIST)
    _compact(mp_ptr, ck_ptr, mp_unit, n_u, n_load, n_hi, thr, need, ties, neq, log_g, bt_ptr, bt_unit, sel_idx_ptr,
             sel_blk_ptr, sel_bias_ptr, sel_unit, sel_cap, count_ptr, count_unit, inv_sigma, QT, TL, EST_DIAG, PS, BS,
             LIST)


@triton.jit
def _cap_threshold(mp_ptr, mp_unit, ncand, npos, n_u, n_load, n_hi, topk, mp_regs, key_min, key_max,
                   QT: tl.constexpr, TS: tl.constexpr, NPIV: tl.constexpr, HAS_TOPK: tl.constexpr,
                   ONE_TILE: tl.constexpr, X_IN_REGS: tl.constexpr, TC: tl.constexpr, LIST: tl.constexpr,
                   RK: tl.constexpr, RCH: tl.constexpr, RADIX_MIN: tl.constexpr):
    """``select_kept``'s topk cap: each unit's threshold ``thr [QT]``, the bits of its topk-th largest mp (0, which
    keeps every mp > 0, where the cap does not bind), by a multi-pivot search (or, for one unit in one tile, a rank
    of its short list or a radix select). Returns ``(thr, need, capped, ranked, rank_gt, rank_eq)``: which units the
    cap binds, whether it binds any, whether the rank found the threshold (then ``rank_gt``, ``rank_eq`` count the
    keys above it and at it)."""
    offs_s = tl.arange(0, TS)
    thr = tl.zeros([QT], tl.int32)
    need = npos < 0
    ranked = tl.sum(npos, axis=0) < 0  # the rank search also counted the keys above and at the threshold:
    rank_gt = tl.zeros([QT], tl.int32)  # these counts, and no ties pass (unless EST_DIAG needs its sums)
    rank_eq = tl.zeros([QT], tl.int32)
    capped = ranked  # (False: no cap)
    if HAS_TOPK:
        need = npos > topk
        capped = tl.sum(need.to(tl.int32), axis=0) > 0  # some unit keeps more than topk: the cap binds
        if LIST:  # the topk-th largest key lies in [smallest positive, largest]
            lo_k = tl.where(need, key_min, 0)
            hi_k = tl.where(need, key_max + 1, 1)
        else:
            lo_k = tl.where(need, 1, 0)
            hi_k = tl.where(need, INF_BITS, 1)
        offs_p = tl.arange(0, NPIV)
        if ONE_TILE:  # every candidate fits one tile: keep the keys in registers for all passes
            if X_IN_REGS:
                tl.static_assert(TS == TC, "X_IN_REGS with ONE_TILE needs TS == TC")
                key_all = mp_regs.to(tl.int32, bitcast=True)
            else:
                key_all = tl.load(mp_ptr + mp_unit[:, None] + offs_s[None, :], mask=offs_s[None, :] < ncand[:, None],
                                  other=0.0).to(tl.int32, bitcast=True)
        if ONE_TILE and QT == 1 and (LIST or TS >= RADIX_MIN):  # one unit: its topk-th largest key
            if capped:  # (else lo_k, hi_k = 0, 1)
                n_list = tl.sum(npos, axis=0)
                kth = n_list * 0
                if LIST:  # rank a short list (from memory)
                    ranked = n_list <= RK
                    if ranked:
                        pad_list(mp_ptr, mp_unit, npos)
                        tl.debug_barrier()  # the zeros, for rank_kth's loads in groups of 4
                        kth, n_gt, n_eq = rank_kth(mp_ptr + tl.multiple_of(mp_unit, 4), n_list, topk, RK=RK, CH=RCH)
                        rank_gt += n_gt
                        rank_eq += n_eq
                if TS > RK or not LIST:  # a longer list (in a tile wider than RK), or no list: radix, 8 bits a pass
                    if not ranked:
                        keys = tl.reshape(key_all, [TS])
                        kth = radix_kth(keys, (offs_s < tl.sum(ncand, axis=0)) & (keys > 0), n_list * 0 + topk)
                lo_k = tl.where(need, kth, lo_k)
                hi_k = lo_k + 1
        # Multi-pivot search (tiles, or several units). Invariant: >= topk keys are >= lo_k, < topk are >= hi_k
        # (until a pivot splits them exactly: below).
        if not ONE_TILE:
            key_first = _mp_keys(mp_ptr, mp_unit, offs_s, n_u, n_load)
        while tl.max(hi_k - lo_k, axis=0) > 1:
            # Even steps of the span in int32 (any pivots inside it narrow it: at least one is while it exceeds 1;
            # those past it change nothing); the exact split of an int64 product costs far more instructions a pass.
            step = tl.maximum((hi_k - lo_k) // (NPIV + 1), 1)
            piv = lo_k[:, None] + step[:, None] * (offs_p[None, :] + 1)
            if ONE_TILE:
                ge = tl.sum((key_all[:, None, :] >= piv[:, :, None]).to(tl.int32), axis=2)
            else:  # each tile's keys loaded one tile ahead; the first tile's, loaded once before the passes
                ge = tl.zeros([QT, NPIV], tl.int32)
                key_next = key_first
                for c0 in range(0, n_hi, TS):
                    key = key_next
                    key_next = _mp_keys(mp_ptr, mp_unit, c0 + TS + offs_s, n_u, n_load)
                    ge += tl.sum((key >= piv[:, :, None]).to(tl.int32), axis=2)
            enough = ge >= topk
            new_lo = tl.max(tl.where(enough, piv, lo_k[:, None]), axis=1)
            new_hi = tl.min(tl.where(enough, hi_k[:, None], piv), axis=1)
            lo_k = tl.where(need, tl.maximum(lo_k, new_lo), lo_k)
            hi_k = tl.where(need, tl.minimum(hi_k, new_hi), hi_k)
            # A pivot with exactly topk keys at or above it (pivots of a unit that needs the cap are > 0): those
            # keys are the topk largest, all above every other. Stop there: the threshold one below it keeps them
            # and no tie (the ties pass below finds topk keys above it).
            exact = tl.max(tl.where(ge == topk, piv, 0), axis=1)
            stop = need & (exact > 0)
            lo_k = tl.where(stop, exact - 1, lo_k)
            hi_k = tl.where(stop, exact, hi_k)
        thr = tl.where(need, lo_k, 0)

    return thr, need, capped, ranked, rank_gt, rank_eq


@triton.jit
def _count_ties(mp_ptr, ck_ptr, mp_unit, n_u, n_load, n_hi, thr, need, capped, ranked, rank_gt, rank_eq, topk,
                QT: tl.constexpr, TL: tl.constexpr, HAS_TOPK: tl.constexpr, EST_DIAG: tl.constexpr,
                LIST: tl.constexpr):
    """``select_kept``'s ties: ``(ties, neq, log_g) [QT]``, how many of the ``neq`` keys at each unit's threshold
    it keeps, and (EST_DIAG) the log of the geometric mean of its kept mp."""
    offs_l = tl.arange(0, TL)
    ties = tl.zeros([QT], tl.int32)
    neq = tl.zeros([QT], tl.int32)
    log_g = tl.zeros([QT], tl.float32)
    if HAS_TOPK or EST_DIAG:
        ngt = tl.zeros([QT], tl.int32)
        if not EST_DIAG:
            ngt = rank_gt
            neq = rank_eq
        slog = tl.zeros([QT], tl.float32)
        nlog = tl.zeros([QT], tl.float32)
        n_ties = n_hi  # the pass counts what a unit keeps above the threshold: not needed where no cap binds
        if not EST_DIAG:  # (then HAS_TOPK)
            n_ties = tl.where(capped & ~ranked, n_hi, 0)
        for c0 in range(0, n_ties, TL):
            mpv, _c, cok = _kept_entries(mp_ptr, ck_ptr, mp_unit, c0 + offs_l, n_u, n_load, LIST)
            key = mpv.to(tl.int32, bitcast=True)
            gt = (key > thr[:, None]) & cok
            n_gt, n_eq = tl.reduce((gt.to(tl.int32), ((key == thr[:, None]) & (key > 0) & cok).to(tl.int32)), 1,
                                   _add2)
            ngt += n_gt
            neq += n_eq
            if EST_DIAG:
                pos = gt & (mpv > PRIOR_EPS)
                slog += tl.sum(tl.where(pos, tl.log(tl.where(pos, mpv, 1.0)), 0.0), axis=1)
                nlog += tl.sum(pos.to(tl.float32), axis=1)
        ties = tl.where(need, topk - ngt, 0)
        if EST_DIAG:
            v_thr = thr.to(tl.float32, bitcast=True)
            tie_pos = (ties > 0) & (v_thr > PRIOR_EPS)
            slog += tl.where(tie_pos, ties.to(tl.float32) * tl.log(tl.where(tie_pos, v_thr, 1.0)), 0.0)
            nlog += tl.where(tie_pos, ties.to(tl.float32), 0.0)
            log_g = slog / tl.maximum(nlog, 1.0)

    return ties, neq, log_g


@triton.jit
def _compact(mp_ptr, ck_ptr, mp_unit, n_u, n_load, n_hi, thr, need, ties, neq, log_g, bt_ptr, bt_unit, sel_idx_ptr,
             sel_blk_ptr, sel_bias_ptr, sel_unit, sel_cap, count_ptr, count_unit, inv_sigma, QT: tl.constexpr,
             TL: tl.constexpr, EST_DIAG: tl.constexpr, PS: tl.constexpr, BS: tl.constexpr, LIST: tl.constexpr):
    """``select_kept``'s compaction: each unit's kept blocks, in increasing order, with their log prior (logical
    index, physical block, bias at ``sel_unit[u] + j``, at most ``sel_cap``), and their count."""
    offs_l = tl.arange(0, TL)
    ppb: tl.constexpr = PS // BS
    nkept = tl.zeros([QT], tl.int32)
    nties = tl.zeros([QT], tl.int32)
    every_tie = tl.max((neq > ties).to(tl.int32), axis=0) == 0  # no unit leaves a tie out: no ranks needed
    whole_lists = False
    if LIST and not EST_DIAG:  # no unit capped: each keeps its whole list, in order (no prefix sums)
        whole_lists = tl.max(need.to(tl.int32), axis=0) == 0
    for c0 in range(0, n_hi, TL):
        mpv, c, cok = _kept_entries(mp_ptr, ck_ptr, mp_unit, c0 + offs_l, n_u, n_load, LIST)
        if whole_lists:
            keep = cok
            j = c0 + offs_l[None, :] + tl.zeros_like(nkept)[:, None]
            n_tile = tl.minimum(tl.maximum(n_u - c0, 0), TL)
        else:
            key = mpv.to(tl.int32, bitcast=True)
            gt = (key > thr[:, None]) & cok
            tie = (key == thr[:, None]) & (key > 0) & cok
            if every_tie:
                keep = gt | tie
            else:  # the first ties (lower blocks) of each unit
                tie_i = tie.to(tl.int32)
                tie_rank = nties[:, None] + tl.cumsum(tie_i, axis=1) - tie_i
                keep = gt | (tie & (tie_rank < ties[:, None]))
                nties += tl.sum(tie_i, axis=1)
            if EST_DIAG:
                keep = keep & (mpv > PRIOR_EPS)
            keep_i = keep.to(tl.int32)
            j = nkept[:, None] + tl.cumsum(keep_i, axis=1) - keep_i
            n_tile = tl.sum(keep_i, axis=1)
        keep_w = keep & (j < sel_cap)
        logmp = tl.log(tl.where(keep, mpv, 1.0))
        if EST_DIAG:
            bias = (logmp - log_g[:, None]) * inv_sigma
        else:
            bias = logmp
        page = tl.load(bt_ptr + bt_unit[:, None] + c // ppb, mask=keep_w, other=0).to(tl.int64)
        blk = page * ppb + c % ppb
        dst = sel_unit[:, None] + j
        tl.store(sel_idx_ptr + dst, c, mask=keep_w)
        tl.store(sel_blk_ptr + dst, blk.to(tl.int32), mask=keep_w)
        tl.store(sel_bias_ptr + dst, bias, mask=keep_w)
        nkept += n_tile
    tl.store(count_ptr + count_unit, tl.minimum(nkept, sel_cap))


@triton.jit
def score_rows(x_ptr, x_unit, x_row_stride, nrows, ncand, NH_PAD: tl.constexpr):
    """``(x_rows [QT, NH_PAD, 1], row_ok [NH_PAD], ncand4 [QT])`` of a tile of units' scores (``route_tile``'s
    layout): each row's pointer, whether the row is one of the ``nrows``, and each unit's ``ncand`` rounded up to a
    group of 4. The score loads take whole groups of 4 candidates (16-byte loads; a mask that may end mid-group makes
    the compiler load one element at a time) and set the up to 3 past ncand to -inf after the load; the group stays
    inside the row (x_row_stride >= the row's length >= ncand)."""
    offs_r = tl.arange(0, NH_PAD)
    x_rows = x_ptr + x_unit[:, None, None] + offs_r[None, :, None].to(tl.int64) * x_row_stride
    return x_rows, offs_r < nrows, tl.minimum((ncand + 3) // 4 * 4, x_row_stride)


@triton.jit
def load_scores(x_rows, c, row_ok, ncand, ncand4):
    """Scores ``[QT, NH_PAD, TC]`` of candidates ``c`` (-inf past each unit's ``ncand`` and on padded rows),
    read in whole groups of 4 up to ``ncand4``."""
    x = tl.load(x_rows + c[None, None, :], mask=row_ok[None, :, None] & (c[None, None, :] < ncand4[:, None, None]),
                other=float("-inf"))
    return tl.where(c[None, None, :] < ncand[:, None, None], x, float("-inf"))


@triton.jit
def route_tile(
    x_ptr, x_unit, x_row_stride, nrows, ncand, m,
    mp_ptr, mp_unit, ck_ptr, bt_ptr, bt_unit,
    sel_idx_ptr, sel_blk_ptr, sel_bias_ptr, sel_unit, sel_cap,
    count_ptr, count_unit, topk, inv_sigma,
    QT: tl.constexpr, NH_PAD: tl.constexpr, TC: tl.constexpr, TS: tl.constexpr, NPIV: tl.constexpr,
    HAS_TOPK: tl.constexpr, EST_DIAG: tl.constexpr, PS: tl.constexpr, BS: tl.constexpr, ONE_TILE: tl.constexpr,
    X_IN_REGS: tl.constexpr = False, LIST: tl.constexpr = False, TL: tl.constexpr = 0, x_regs=0,
    RK: tl.constexpr = 0, RCH: tl.constexpr = 32, RADIX_MIN: tl.constexpr = RADIX_MIN_KEYS,
):
    """Route a tile of ``QT`` units (docs/semantics.md sections 4-5) from their scores in a scratch buffer.

    x: unit u, row r, candidate c at ``x_ptr + x_unit[u] + r * x_row_stride + c`` (fp32, rows
    ``0 .. nrows-1``, candidates ``0 .. ncand[u]-1``; ``ncand[u] == 0`` = nothing to route);
    m ``[QT, NH_PAD]``: the maximum of each row. mp scratch: ``mp_ptr + mp_unit[u] + c``.
    bt: page-table row of unit u at ``bt_ptr + bt_unit[u]`` (to store physical block ids).
    Writes, per unit, its kept blocks in increasing order: logical index (``sel_idx``), summary
    index = physical block (``sel_blk``), ``log`` prior (``sel_bias``), at ``sel_unit[u] + j`` for
    ``j < count`` (at most ``sel_cap``), and the count at ``count_ptr + count_unit[u]``.
    Tiles: ``[QT, NH_PAD, TC]`` scores, ``[QT, TC]`` mp, ``[QT, NPIV, TS]`` pivot counts, ``[QT, TL]``
    for the cap's ties and compaction; ONE_TILE (``TS`` covers every candidate) keeps the mp bits in
    registers across the cap's passes (with one unit and ``TS >= RADIX_MIN``, at least ``RADIX_MIN_KEYS`` and one
    key a thread: a 4-pass radix select on 256-bin histograms instead of the pivot search);
    X_IN_REGS (``TC`` covers every candidate): the caller gives the scores in registers, ``x_regs [QT, NH_PAD, TC]``
    (masked here as a load would be; ``x_ptr`` unused), for every entmax pass.
    The entmax and ``mp`` are computed here; the cap and compaction are ``select_kept``. LIST: the mp
    scratch receives each unit's positive mp only, as a list with their candidates in ``ck_ptr`` (int32,
    shaped like mp, rows of at least ``ncand`` rounded up to 4), and the cap and compaction read those
    lists (with ONE_TILE and X_IN_REGS, one unit: lists up to ``RK`` long are ranked, ``rank_kth``, in chunks of
    ``RCH``; a longer list's tile must take the radix select: ``TS <= RK`` or ``TS >= RADIX_MIN``).
    TL: the width of the cap's ties and compaction tiles ``[QT, TL]`` (0: ``TS``).
    """
    offs_c = tl.arange(0, TC)
    nmax = tl.max(ncand, axis=0)
    x_rows, row_ok, ncand4 = score_rows(x_ptr, x_unit, x_row_stride, nrows, ncand, NH_PAD)

    # 1.5-entmax threshold: exactly three safeguarded Halley steps from [max - 1, max].
    if X_IN_REGS:  # every candidate in one [TC] tile: the caller's x_regs [QT, NH_PAD, TC] serve every pass
        x_ok = row_ok[None, :, None] & (offs_c[None, None, :] < ncand[:, None, None])
        x_all = tl.where(x_ok, x_regs, float("-inf"))
    lo = m - 1.0
    hi = m
    tau = (lo + hi) * 0.5
    for _ in tl.static_range(3):
        if X_IN_REGS:
            ssq, sdf, cnt = halley_sums(x_all, tau[:, :, None])
        else:
            ssq = tl.zeros([QT, NH_PAD], tl.float32)
            sdf = tl.zeros([QT, NH_PAD], tl.float32)
            cnt = tl.zeros([QT, NH_PAD], tl.float32)
            for c0 in range(0, nmax, TC):
                c = c0 + offs_c
                x = load_scores(x_rows, c, row_ok, ncand, ncand4)
                t_ssq, t_sdf, t_cnt = halley_sums(x, tau[:, :, None])
                ssq += t_ssq
                sdf += t_sdf
                cnt += t_cnt
        tau, lo, hi = halley_step(ssq, sdf, cnt, tau, lo, hi)

    # Probabilities (not renormalised), mean over the unit's rows -> mp scratch.
    nrows_f = nrows * 1.0  # (a runtime int, or a constexpr where Triton specialises it)
    npos = tl.zeros([QT], tl.int32)  # positive mp, bits of the smallest positive and of the largest mp
    key_min = tl.full([QT], INF_BITS, tl.int32)
    key_max = tl.zeros([QT], tl.int32)
    if X_IN_REGS:
        cok = offs_c[None, :] < ncand[:, None]
        diff = positive_part(x_all - tau[:, :, None])
        mp_regs = tl.sum(diff * diff, axis=1) / nrows_f
        if LIST:
            append_positive(mp_regs, offs_c, cok, mp_ptr, ck_ptr, mp_unit, npos)
        else:
            tl.store(mp_ptr + mp_unit[:, None] + offs_c[None, :], mp_regs, mask=cok)
        npos, key_min, key_max = mp_key_range(mp_regs, cok, npos, key_min, key_max)
    else:
        for c0 in range(0, nmax, TC):
            c = c0 + offs_c
            cok = c[None, :] < ncand[:, None]
            x = load_scores(x_rows, c, row_ok, ncand, ncand4)
            diff = positive_part(x - tau[:, :, None])
            mp = tl.sum(diff * diff, axis=1) / nrows_f
            npos_before = npos
            npos, key_min, key_max = mp_key_range(mp, cok, npos, key_min, key_max)
            if LIST:
                append_positive(mp, c, cok, mp_ptr, ck_ptr, mp_unit, npos_before)
            else:
                tl.store(mp_ptr + mp_unit[:, None] + c[None, :], mp, mask=cok)
    tl.debug_barrier()  # mp is read back by other threads of this program

    if X_IN_REGS:  # the cap reads the mp bits from registers
        select_kept(mp_ptr, mp_unit, ncand, nmax, npos, bt_ptr, bt_unit, sel_idx_ptr, sel_blk_ptr, sel_bias_ptr,
                    sel_unit, sel_cap, count_ptr, count_unit, topk, inv_sigma, mp_regs, key_min, key_max,
                    ck_ptr,
                    QT=QT, TS=TS, NPIV=NPIV, HAS_TOPK=HAS_TOPK, EST_DIAG=EST_DIAG, PS=PS, BS=BS, ONE_TILE=ONE_TILE,
                    X_IN_REGS=True, TC=TC, LIST=LIST, TL=TL if TL > 0 else TS, RK=RK, RCH=RCH,
                    RADIX_MIN=RADIX_MIN)
    else:
        select_kept(mp_ptr, mp_unit, ncand, nmax, npos, bt_ptr, bt_unit, sel_idx_ptr, sel_blk_ptr, sel_bias_ptr,
                    sel_unit, sel_cap, count_ptr, count_unit, topk, inv_sigma, npos, key_min, key_max,
                    ck_ptr,
                    QT=QT, TS=TS, NPIV=NPIV, HAS_TOPK=HAS_TOPK, EST_DIAG=EST_DIAG, PS=PS, BS=BS, ONE_TILE=ONE_TILE,
                    X_IN_REGS=False, TC=TC, LIST=LIST, TL=TL if TL > 0 else TS, RK=RK, RCH=RCH,
                    RADIX_MIN=RADIX_MIN)
