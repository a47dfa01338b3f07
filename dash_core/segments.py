"""DASH's attention stage as segments on off-the-shelf attention kernels (docs/semantics.md section 6).

Every query row attends, per selection unit (a KV head for router ``kv_head``, the whole row for
``shared``), to ``topk`` routed segments of ``bs`` tokens and one local segment of up to ``local``
tokens. Each segment is plain softmax attention returning its output ``o_c`` and natural-log
normaliser ``lse_c``; the segments are merged with weights ``softmax_c(lse_c + log prior_c)``
(local prior 1), and a segment of length 0 has weight 0 whatever a library returns for it.

Gathered layout (this module's input; ``segments_paged.gather_segments`` builds it from a paged cache):

- ``k, v``: ``[n * Hsel * S, Hk, D]`` with ``S = topk * bs + local``: unit ``(i, s)`` owns rows
  ``(i * Hsel + s) * S ..``; routed segment ``c < topk`` starts at ``c * bs``, the local segment
  at ``topk * bs``. ``Hk = 1`` when ``Hsel = Hkv`` (per-KV-head selections fold KV heads into the
  batch), ``Hk = Hkv`` when ``Hsel = 1``.
- ``used``: ``[n, Hsel, topk + 1]`` int, the valid length of each segment (0 = inactive); values
  above the capacity are clamped on the device (nothing is read back to the host).
- ``bias``: ``[n, Hsel, topk]`` float, the log prior of the routed segments.

Zero-copy variant (``dash_core.segments_paged``: ``segment_pages`` + ``flash_dash_attention_paged``) addresses the
same segments through page tables into the engine's cache when its page size equals the block size.

Backends: ``"TRITON"`` (``dash_core.kernels.segment_attention``; on CPU tensors the PyTorch
segment attention below runs instead, as the ops do), ``"TORCH"`` (the PyTorch path on any
device), ``"FLASHINFER"`` (ragged prefill wrapper, custom mask, plans from ``plan_cache``) and
``"FLASH_ATTN"`` (FlashAttention 4 ``flash_attn.cute``, else vLLM's ``vllm_flash_attn``).

Example (one row, ``shared`` router, checked against dense attention over the same tokens)::

    >>> import torch
    >>> q, k, v = torch.randn(1, 4, 16), torch.randn(2 * 8 + 16, 2, 16), torch.randn(2 * 8 + 16, 2, 16)
    >>> used = torch.tensor([[[8, 0, 16]]])          # routed segment 1 is empty
    >>> out = flash_dash_attention(q, k, v, used, torch.zeros(1, 1, 2), "TORCH", bs=8, local=16)
    >>> keep = torch.cat([torch.arange(8), torch.arange(16, 32)])
    >>> ref = torch.nn.functional.scaled_dot_product_attention(
    ...     q.transpose(0, 1)[:, None], k[keep].permute(1, 0, 2).repeat_interleave(2, 0)[:, None],
    ...     v[keep].permute(1, 0, 2).repeat_interleave(2, 0)[:, None])
    >>> bool(torch.allclose(out, ref[:, 0].transpose(0, 1), atol=1e-5))
    True
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .limits import HAVE_TRITON
from .params import ATTENTION_BACKENDS, DashParams
from .plan_cache import PlanCache, PlanKey, default_plan_cache

if HAVE_TRITON:  # the Triton segment kernel (Linux); the PyTorch segment attention serves without it
    from .kernels.segment_attention import segment_attention_triton

logger = logging.getLogger(__name__)

SEGMENT_BACKENDS = ATTENTION_BACKENDS + ("TORCH",)
LIBRARY_DTYPES = (torch.float16, torch.bfloat16)
LN2 = math.log(2.0)


# ----------------------------------------------------------------------------------------------
# geometry and validation


@dataclass(frozen=True)
class SegmentGeometry:
    """Static shape of one segmented call (everything a plan or a kernel grid depends on).

    n: query rows; hsel: selection units per row; topk: routed segments per unit; bs, local:
    segment capacities; hq: query heads; hk: KV heads in the gathered tensors; d: head size.
    """

    n: int
    hsel: int
    topk: int
    bs: int
    local: int
    hq: int
    hk: int
    d: int

    @property
    def num_segments(self) -> int:
        return self.topk + 1

    @property
    def unit_tokens(self) -> int:
        """Rows of k/v per unit, ``S = topk * bs + local``."""
        return self.topk * self.bs + self.local

    @property
    def hkv(self) -> int:
        return self.hsel * self.hk

    @property
    def heads_per_unit(self) -> int:
        """Query heads of one unit (``G`` for ``kv_head``, ``Hq`` for ``shared``)."""
        return self.hq // self.hsel

    @property
    def requests(self) -> int:
        """Segments in all, one library 'request' each: ``n * Hsel * (topk + 1)``."""
        return self.n * self.hsel * self.num_segments


def segment_count(params: DashParams) -> int:
    """The static number of routed segments (``params.topk``); raises without a cap.

    The segment backends size every tensor and plan from ``topk``; uncapped routing has no
    static bound, so it is refused here rather than deep inside a library.
    """
    if params.topk is None:
        raise ValueError(
            "DashParams.topk = None is not allowed for the segment backends (FLASH_ATTN, FLASHINFER): "
            "expected an integer >= 1 (config key dash_topk), the static number of routed segments")
    return params.topk


def check_capacity(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 8 or value % 8:
        raise ValueError(f"{name} = {value!r} is not allowed: expected a positive multiple of 8 "
                         "(segment capacities must be whole bytes of a FlashInfer mask)")


def check_segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, used: torch.Tensor,
                   bias: torch.Tensor, backend: str, bs: int, local: int) -> SegmentGeometry:
    """Validate a ``flash_dash_attention`` call on the host (shapes and dtypes only)."""
    if backend not in SEGMENT_BACKENDS:
        raise ValueError(f"backend = {backend!r} is not allowed: expected one of {SEGMENT_BACKENDS}")
    check_capacity("bs", bs)
    check_capacity("local", local)
    if q.dim() != 3:
        raise ValueError(f"q must be [n, Hq, D]; got {tuple(q.shape)}")
    n, hq, d = q.shape
    if used.dim() != 3 or used.shape[0] != n or used.shape[2] < 1:
        raise ValueError(f"used must be [n, Hsel, topk + 1] = [{n}, Hsel, topk + 1]; got {tuple(used.shape)}")
    if used.dtype.is_floating_point or used.dtype == torch.bool:
        raise ValueError(f"used must be an integer tensor; got {used.dtype}")
    _, hsel, c = used.shape
    topk = c - 1
    if tuple(bias.shape) != (n, hsel, topk) or not bias.dtype.is_floating_point:
        raise ValueError(f"bias must be a float tensor [n, Hsel, topk] = {(n, hsel, topk)}; "
                         f"got {bias.dtype} {tuple(bias.shape)}")
    s = topk * bs + local
    if k.dim() != 3 or k.shape != v.shape or k.shape[0] != n * hsel * s or k.shape[2] != d:
        raise ValueError(f"k and v must be equal [n * Hsel * (topk * bs + local), Hk, D] = "
                         f"[{n * hsel * s}, Hk, {d}]; got k {tuple(k.shape)}, v {tuple(v.shape)}")
    hk = k.shape[1]
    if hsel > 1 and hk != 1:
        raise ValueError(f"with per-KV-head selections (Hsel = {hsel}) k and v must fold KV heads: "
                         f"[.., 1, D]; got {tuple(k.shape)}")
    if hq % (hsel * hk):
        raise ValueError(f"query heads ({hq}) must be a multiple of the KV heads (Hsel * Hk = {hsel * hk})")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    devices = {t.device for t in (q, k, v, used, bias)}
    if len(devices) != 1:
        raise ValueError(f"q, k, v, used, bias must be on one device; got {sorted(map(str, devices))}")
    if backend in ("FLASH_ATTN", "FLASHINFER"):
        if q.dtype not in LIBRARY_DTYPES:
            raise ValueError(f"backend {backend} takes float16 or bfloat16 q/k/v; got {q.dtype} "
                             "(use TRITON or TORCH for float32)")
        if q.device.type != "cuda":
            raise ValueError(f"backend {backend} needs CUDA tensors; got {q.device}")
    return SegmentGeometry(n=n, hsel=hsel, topk=topk, bs=bs, local=local, hq=hq, hk=hk, d=d)


def cache_or_default(plan_cache: Optional[PlanCache]) -> PlanCache:
    """The given plan cache (even when empty: an empty cache is falsy) or the process-wide one."""
    return plan_cache if plan_cache is not None else default_plan_cache()


# ----------------------------------------------------------------------------------------------
# the merge (the one place where segment results are combined)


def segment_weights_inputs(used: torch.Tensor, bias: torch.Tensor, bs: int, local: int
                           ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Clamped lengths, log priors and validity of every segment, ``[n, Hsel, topk + 1]`` each.

    The local segment's log prior is 0 (prior 1); a segment is valid when its clamped length
    is > 0 and its log prior is not -inf.
    """
    topk = used.shape[-1] - 1
    seg = torch.arange(topk + 1, device=used.device)
    cap = torch.where(seg == topk, local, bs).to(torch.int32)  # no host-to-device copy (graph-safe)
    length = torch.minimum(used.to(torch.int32).clamp(min=0), cap)
    local_prior = torch.zeros(*bias.shape[:-1], 1, dtype=torch.float32, device=bias.device)
    log_prior = torch.cat([bias.float(), local_prior], dim=-1)
    valid = (length > 0) & (log_prior > -math.inf)
    return length, log_prior, valid


def merge_segments(o: torch.Tensor, lse: torch.Tensor, log_prior: torch.Tensor,
                   valid: torch.Tensor) -> torch.Tensor:
    """Merge normalised segment outputs by ``softmax_c(lse_c + log_prior_c)`` (docs/semantics.md section 6).

    o: ``[..., C, H, D]`` per-segment outputs; lse: ``[..., C, H]`` natural-log normalisers;
    log_prior, valid: ``[..., C]``. Invalid segments get weight 0 whatever ``o`` and ``lse``
    hold (NaN, +inf); a row with no valid segment returns zeros. Returns ``[..., H, D]`` fp32.
    """
    score = torch.where(valid[..., None], lse.float() + log_prior.float()[..., None],
                        torch.full_like(lse, -math.inf, dtype=torch.float32))
    score = torch.nan_to_num(score, nan=-math.inf, posinf=-math.inf, neginf=-math.inf)
    m = score.amax(dim=-2, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(score - m)  # exactly 0 for invalid segments
    tot = w.sum(dim=-2)
    part = torch.where(w[..., None] > 0, o.float(), torch.zeros((), dtype=torch.float32, device=o.device))
    out = (w[..., None] * part).sum(dim=-3)
    return out / torch.where(tot > 0, tot, torch.ones_like(tot))[..., None]


def combine_segments(o: torch.Tensor, lse: torch.Tensor, used: torch.Tensor, bias: torch.Tensor,
                     geo: SegmentGeometry, dtype: torch.dtype) -> torch.Tensor:
    """Merge a backend's ``o [n, Hsel, C, Hu, D]`` and ``lse [n, Hsel, C, Hu]`` (natural log)
    with the call's ``used`` and ``bias`` into ``[n, Hq, D]`` of ``dtype``."""
    _, log_prior, valid = segment_weights_inputs(used, bias, geo.bs, geo.local)
    out = merge_segments(o, lse, log_prior, valid)  # [n, Hsel, Hu, D]
    return out.reshape(geo.n, geo.hq, geo.d).to(dtype)


# ----------------------------------------------------------------------------------------------
# per-backend segment attention: each returns o [n, Hsel, C, Hu, D] and lse [n, Hsel, C, Hu] (ln)


def segment_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, used: torch.Tensor,
                            geo: SegmentGeometry) -> Tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch segment attention in fp32 (the CPU path and the GPU cross-check).

    Returns ``o [n, Hsel, C, Hu, D]`` fp32 (0 for empty segments) and ``lse [n, Hsel, C, Hu]``
    fp32 natural log (-inf for empty segments).
    """
    n, hsel, topk, bs, local, hk, d = geo.n, geo.hsel, geo.topk, geo.bs, geo.local, geo.hk, geo.d
    hu = geo.heads_per_unit
    g = hu // hk
    length, _, _ = segment_weights_inputs(used, torch.zeros(n, hsel, topk, device=used.device), bs, local)
    kk = k.float().view(n, hsel, geo.unit_tokens, hk, d)
    vv = v.float().view(n, hsel, geo.unit_tokens, hk, d)
    qq = q.float().view(n, hsel, hk, g, d) / math.sqrt(d)

    def attend(lo: int, count: int, width: int, lens: torch.Tensor):
        # tokens lo .. lo + count * width of each unit, as `count` segments of `width`
        ks = kk[:, :, lo: lo + count * width].reshape(n, hsel, count, width, hk, d)
        vs = vv[:, :, lo: lo + count * width].reshape(n, hsel, count, width, hk, d)
        logits = torch.einsum("nshgd,nscthd->nschgt", qq, ks)
        keep = torch.arange(width, device=q.device) < lens[..., None]  # [n, hsel, count, width]
        logits = logits.masked_fill(~keep[:, :, :, None, None, :], -math.inf)
        lse = torch.logsumexp(logits, dim=-1)  # [n, hsel, count, hk, g]
        p = torch.exp(logits - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
        o = torch.einsum("nschgt,nscthd->nschgd", p, vs)
        return o.reshape(n, hsel, count, hu, d), lse.reshape(n, hsel, count, hu)

    o_r, lse_r = attend(0, topk, bs, length[..., :topk])
    o_l, lse_l = attend(topk * bs, 1, local, length[..., topk:])
    return torch.cat([o_r, o_l], dim=2), torch.cat([lse_r, lse_l], dim=2)


def unit_queries(q: torch.Tensor, geo: SegmentGeometry) -> torch.Tensor:
    """Queries of every segment request, ``[n * Hsel * C, Hu, D]`` (request order (i, s, c))."""
    hu = geo.heads_per_unit
    qq = q.reshape(geo.n, geo.hsel, 1, hu, geo.d).expand(geo.n, geo.hsel, geo.num_segments, hu, geo.d)
    return qq.reshape(geo.requests, hu, geo.d)


def segment_starts(geo: SegmentGeometry, device) -> torch.Tensor:
    """Row offsets of every segment in the gathered k/v, ``[n * Hsel * C + 1]`` int32.

    Entry r is the first row of request r = (i, s, c); the last entry is the total row count.
    Computed on the device from static shapes (capturable).
    """
    r = torch.arange(geo.requests + 1, device=device, dtype=torch.int32)
    c = geo.num_segments
    return (r // c) * geo.unit_tokens + (r % c) * geo.bs


def mask_byte_index(geo: SegmentGeometry, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """For each byte of the packed segment mask: its request (int64) and its byte within it.

    Request r's mask is ``capacity_r / 8`` bytes at byte offset ``segment_starts[r] / 8``.
    """
    starts = segment_starts(geo, device) // 8
    byte = torch.arange(geo.n * geo.hsel * geo.unit_tokens // 8, device=device, dtype=torch.int32)
    req = torch.searchsorted(starts, byte, right=True) - 1
    return req, byte - starts[req]


def length_mask_bytes(lengths: torch.Tensor, byte_req: torch.Tensor, byte_pos: torch.Tensor) -> torch.Tensor:
    """Packed keep-mask (uint8, little bit order as FlashInfer reads it): bit t of request r is
    ``t < lengths[r]``. Elementwise on the device (capturable)."""
    bits = (lengths.to(torch.int32)[byte_req] - 8 * byte_pos).clamp(0, 8)
    return (torch.bitwise_left_shift(torch.ones_like(bits), bits) - 1).to(torch.uint8)


def segment_lengths(used: torch.Tensor, geo: SegmentGeometry) -> torch.Tensor:
    length, _, _ = segment_weights_inputs(used, torch.zeros(used.shape[0], used.shape[1], geo.topk,
                                                            device=used.device), geo.bs, geo.local)
    return length.reshape(geo.requests).contiguous()


# FlashInfer ------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def import_flashinfer():
    try:
        import flashinfer
    except ImportError as e:
        raise RuntimeError("backend FLASHINFER needs FlashInfer: pip install dash-serve[flashinfer] "
                           f"(import flashinfer failed: {e})") from e
    return flashinfer


class FlashInferSegmentPlan:
    """A planned ``BatchPrefillWithRaggedKVCacheWrapper`` for one ``SegmentGeometry``.

    Every segment is a request with one query row (the unit's query heads) and a fixed KV
    capacity (``bs`` or ``local``); the valid length is a custom mask rewritten on the device
    per call, so the plan (host work) is made once per shape and is graph-safe. Buffers (graph
    mode, caller-owned): qo/kv indptr ``[R + 1]``, mask indptr ``[R + 1]`` (byte offsets), packed
    mask ``[sum(capacities) / 8]`` uint8 (little bit order); ``R = n * Hsel * (topk + 1)``.
    """

    def __init__(self, geo: SegmentGeometry, dtype: torch.dtype, device: torch.device,
                 workspace: torch.Tensor) -> None:
        fi = import_flashinfer()
        r = geo.requests
        kv_indptr = segment_starts(geo, device)
        qo_indptr = torch.arange(r + 1, device=device, dtype=torch.int32)
        total_bits = geo.n * geo.hsel * geo.unit_tokens
        self.geo = geo
        self.qo_indptr_buf = torch.empty(r + 1, dtype=torch.int32, device=device)
        self.kv_indptr_buf = torch.empty(r + 1, dtype=torch.int32, device=device)
        self.mask_indptr_buf = torch.empty(r + 1, dtype=torch.int32, device=device)
        self.mask_buf = torch.zeros(total_bits // 8, dtype=torch.uint8, device=device)
        self.byte_req, self.byte_pos = mask_byte_index(geo, device)
        bstart = kv_indptr // 8  # capacities are multiples of 8: bit offsets / 8 = byte offsets
        self.wrapper = fi.BatchPrefillWithRaggedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=self.qo_indptr_buf,
            kv_indptr_buf=self.kv_indptr_buf, custom_mask_buf=self.mask_buf,
            mask_indptr_buf=self.mask_indptr_buf, backend="fa2")
        # A boolean custom_mask makes plan() pack it and compute *byte* offsets itself (the
        # packed_custom_mask path takes bit offsets for bytes: flashinfer#2201).
        extra = {}
        if "uniform_q_len" in inspect.signature(self.wrapper.plan).parameters:
            extra["uniform_q_len"] = 1  # one query row per request: size the q tile for it (fa2, graph mode)
        self.wrapper.plan(qo_indptr, kv_indptr, geo.heads_per_unit, geo.hk, geo.d,
                          custom_mask=torch.ones(total_bits, dtype=torch.bool, device=device),
                          causal=False, sm_scale=1.0 / math.sqrt(geo.d), q_data_type=dtype,
                          kv_data_type=dtype, o_data_type=dtype, disable_split_kv=True, **extra)
        # Byte offsets, whatever plan() wrote (one request's mask is capacity / 8 bytes).
        self.mask_indptr_buf.copy_(bstart)

    def write_mask(self, lengths: torch.Tensor) -> None:
        """Fill the packed mask from ``lengths [R]`` on the device."""
        self.mask_buf.copy_(length_mask_bytes(lengths, self.byte_req, self.byte_pos))

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, used: torch.Tensor
            ) -> Tuple[torch.Tensor, torch.Tensor]:
        geo = self.geo
        self.write_mask(segment_lengths(used, geo))
        o, lse = self.wrapper.run(unit_queries(q, geo), k, v, return_lse=True)
        # FlashInfer's LSE is base 2, [requests, heads]: to natural log.
        c, hu = geo.num_segments, geo.heads_per_unit
        return (o.view(geo.n, geo.hsel, c, hu, geo.d),
                (lse.float() * LN2).view(geo.n, geo.hsel, c, hu))


def plan_key(geo: SegmentGeometry, dtype: torch.dtype, device: torch.device,
             layout: str = "gathered", page_size: int = 0) -> PlanKey:
    return PlanKey(device=str(device), batch=geo.n, topk=geo.topk, bs=geo.bs, local=geo.local,
                   heads=geo.hq, kv_heads=geo.hkv, head_dim=geo.d, dtype=str(dtype).replace("torch.", ""),
                   page_size=page_size, layout=layout, selection_heads=geo.hsel)


def flashinfer_plan(geo: SegmentGeometry, dtype: torch.dtype, device: torch.device,
                     cache: PlanCache, pin: bool = False, paged: bool = False) -> FlashInferSegmentPlan:
    key = plan_key(geo, dtype, device, layout="paged", page_size=geo.bs) if paged else plan_key(geo, dtype, device)

    def make():
        logger.debug("FlashInfer segment plan for %s", key)
        cls = FlashInferPagedSegmentPlan if paged else FlashInferSegmentPlan
        return cls(geo, dtype, device, cache.workspace(device))

    return cache.pin(key, make) if pin else cache.get(key, make)


class FlashInferPagedSegmentPlan(FlashInferSegmentPlan):
    """A planned ``BatchPrefillWithPagedKVCacheWrapper`` over the segments' pages (zero-copy).

    Requests as in ``FlashInferSegmentPlan``; a routed segment is one page, the local segment
    ``local / bs`` pages, every last page full (``last_page_len = bs``) and the valid length a
    custom mask. Page ids are rewritten on the device per call into ``indices_buf`` (the plan
    does not depend on them), so one plan serves every step of the shape.
    """

    def __init__(self, geo: SegmentGeometry, dtype: torch.dtype, device: torch.device,
                 workspace: torch.Tensor) -> None:
        fi = import_flashinfer()
        r, w, c = geo.requests, geo.local // geo.bs, geo.num_segments
        self.geo = geo
        req = torch.arange(r, device=device, dtype=torch.int32)
        npages = torch.where(req % c == geo.topk, w, 1).to(torch.int32)
        kv_indptr = torch.cat([npages.new_zeros(1), torch.cumsum(npages, 0, dtype=torch.int32)])
        total_pages = geo.n * geo.hsel * (geo.topk + w)
        total_bits = geo.n * geo.hsel * geo.unit_tokens
        self.qo_indptr_buf = torch.empty(r + 1, dtype=torch.int32, device=device)
        self.kv_indptr_buf = torch.empty(r + 1, dtype=torch.int32, device=device)
        self.indices_buf = torch.zeros(total_pages, dtype=torch.int32, device=device)
        self.last_page_len_buf = torch.empty(r, dtype=torch.int32, device=device)
        self.mask_indptr_buf = torch.empty(r + 1, dtype=torch.int32, device=device)
        self.mask_buf = torch.zeros(total_bits // 8, dtype=torch.uint8, device=device)
        self.byte_req, self.byte_pos = mask_byte_index(geo, device)
        self.wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=self.qo_indptr_buf,
            paged_kv_indptr_buf=self.kv_indptr_buf, paged_kv_indices_buf=self.indices_buf,
            paged_kv_last_page_len_buf=self.last_page_len_buf, custom_mask_buf=self.mask_buf,
            mask_indptr_buf=self.mask_indptr_buf, backend="fa2")
        extra = {}
        if "uniform_q_len" in inspect.signature(self.wrapper.plan).parameters:
            extra["uniform_q_len"] = 1
        self.wrapper.plan(torch.arange(r + 1, device=device, dtype=torch.int32), kv_indptr,
                          torch.zeros(total_pages, dtype=torch.int32, device=device),
                          torch.full((r,), geo.bs, dtype=torch.int32, device=device),
                          geo.heads_per_unit, geo.hk, geo.d, geo.bs,
                          custom_mask=torch.ones(total_bits, dtype=torch.bool, device=device),
                          causal=False, sm_scale=1.0 / math.sqrt(geo.d), q_data_type=dtype,
                          kv_data_type=dtype, o_data_type=dtype, disable_split_kv=True, **extra)
        self.mask_indptr_buf.copy_(segment_starts(geo, device) // 8)  # byte offsets (flashinfer#2201)

    def run_paged(self, q, k_pages, v_pages, page_table, used) -> Tuple[torch.Tensor, torch.Tensor]:
        geo = self.geo
        idx = torch.cat([page_table[..., :geo.topk, 0], page_table[..., geo.topk, :]], dim=-1)
        self.indices_buf.copy_(idx.reshape(-1))
        self.write_mask(segment_lengths(used, geo))
        o, lse = self.wrapper.run(unit_queries(q, geo), (k_pages, v_pages), return_lse=True)
        c, hu = geo.num_segments, geo.heads_per_unit
        return (o.view(geo.n, geo.hsel, c, hu, geo.d),
                (lse.float() * LN2).view(geo.n, geo.hsel, c, hu))


# FlashAttention -------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def import_flash_attn():
    """``(flash_attn_varlen_func, style)``: FA4 (``flash_attn.cute``) first, then vLLM's fork."""
    errors = []
    try:
        from flash_attn.cute import flash_attn_varlen_func as fn
        return fn, "fa4"
    except ImportError as e:
        errors.append(f"flash_attn.cute: {e}")
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func as fn
        return fn, "vllm"
    except ImportError as e:
        errors.append(f"vllm.vllm_flash_attn: {e}")
    raise RuntimeError("backend FLASH_ATTN needs FlashAttention 4: pip install dash-serve[flash-attn] "
                       f"(or vLLM's vendored FlashAttention); imports failed: {'; '.join(errors)}")


def _flash_attn_segments(q, k, v, used, geo: SegmentGeometry) -> Tuple[torch.Tensor, torch.Tensor]:
    fn, style = import_flash_attn()
    params = inspect.signature(fn).parameters
    lens = segment_lengths(used, geo)
    qq = unit_queries(q, geo)
    cu_q = torch.arange(geo.requests + 1, device=q.device, dtype=torch.int32)
    common = dict(max_seqlen_q=1, max_seqlen_k=max(geo.bs, geo.local), cu_seqlens_q=cu_q, seqused_k=lens,
                  softmax_scale=1.0 / math.sqrt(geo.d), causal=False)
    if style == "fa4" and "return_lse" in params:
        # FA4: cu_seqlens_k gives each segment's offset, seqused_k its valid length.
        o, lse = fn(qq, k, v, cu_seqlens_k=segment_starts(geo, q.device), return_lse=True, **common)
    elif "return_softmax_lse" in params and "block_table" in params:
        # vLLM's fork takes seqused_k only without cu_seqlens_k: address the segments as pages.
        page = math.gcd(geo.bs, geo.local)
        kp = k.view(-1, page, geo.hk, geo.d)
        vp = v.view(-1, page, geo.hk, geo.d)
        width = max(geo.bs, geo.local) // page
        first = segment_starts(geo, q.device)[:-1] // page
        table = (first[:, None] + torch.arange(width, device=q.device, dtype=torch.int32)[None])
        table = table.clamp(max=kp.shape[0] - 1).to(torch.int32).contiguous()
        o, lse = fn(qq, kp, vp, block_table=table, return_softmax_lse=True, **common)
    else:
        raise RuntimeError(f"unsupported flash_attn_varlen_func signature ({style}): expected FA4's "
                           "return_lse or vLLM's return_softmax_lse with block_table")
    if isinstance(o, tuple):  # some versions return (out, lse, ...) nested
        o = o[0]
    c, hu = geo.num_segments, geo.heads_per_unit
    lse = lse.float().transpose(0, 1)  # FlashAttention: [heads, total_q], natural log
    return o.view(geo.n, geo.hsel, c, hu, geo.d), lse.reshape(geo.n, geo.hsel, c, hu)


def flash_attn_paged(q, k_pages, v_pages, page_table, used, geo: SegmentGeometry):
    fn, style = import_flash_attn()
    params = inspect.signature(fn).parameters
    table = page_table.reshape(geo.requests, -1).contiguous()
    common = dict(max_seqlen_q=1, max_seqlen_k=table.shape[1] * geo.bs,
                  cu_seqlens_q=torch.arange(geo.requests + 1, device=q.device, dtype=torch.int32),
                  seqused_k=segment_lengths(used, geo), softmax_scale=1.0 / math.sqrt(geo.d), causal=False)
    if "page_table" in params and "return_lse" in params:  # FA4
        o, lse = fn(unit_queries(q, geo), k_pages, v_pages, page_table=table, return_lse=True, **common)
    elif "block_table" in params and "return_softmax_lse" in params:  # vLLM's fork
        o, lse = fn(unit_queries(q, geo), k_pages, v_pages, block_table=table, return_softmax_lse=True, **common)
    else:
        raise RuntimeError(f"unsupported flash_attn_varlen_func signature ({style}) for paged segments")
    c, hu = geo.num_segments, geo.heads_per_unit
    return o.view(geo.n, geo.hsel, c, hu, geo.d), lse.float().transpose(0, 1).reshape(geo.n, geo.hsel, c, hu)


# ----------------------------------------------------------------------------------------------
# public entry points


def flash_dash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, used: torch.Tensor,
                         bias: torch.Tensor, backend: str = "TRITON", bs: int = 64, local: int = 64,
                         *, plan_cache: Optional[PlanCache] = None) -> torch.Tensor:
    """DASH attention over gathered segments, merged by ``softmax(lse + log prior)``.

    q: ``[n, Hq, D]``; k, v: ``[n * Hsel * (topk * bs + local), Hk, D]`` (module docstring);
    used: ``[n, Hsel, topk + 1]`` int (0 = empty segment); bias: ``[n, Hsel, topk]`` float log
    prior of the routed segments; backend: ``"TRITON" | "FLASH_ATTN" | "FLASHINFER" | "TORCH"``;
    bs, local: segment capacities, multiples of 8. The library backends take float16/bfloat16 on
    CUDA; FLASHINFER plans come from ``plan_cache`` (default: the process-wide one; make or pin
    them before CUDA-graph capture, ``prepare_flash_dash_attention``).
    Returns ``[n, Hq, D]`` in q's dtype; a row whose segments are all empty gives zeros.
    """
    geo = check_segments(q, k, v, used, bias, backend, bs, local)
    if geo.n == 0:
        return q.new_zeros(q.shape)
    if backend == "TRITON" and q.device.type != "cpu":
        o, lse = segment_attention_triton(q, k, v, used, geo)
    elif backend in ("TRITON", "TORCH"):
        o, lse = segment_attention_torch(q, k, v, used, geo)
    elif backend == "FLASHINFER":
        plan = flashinfer_plan(geo, q.dtype, q.device, cache_or_default(plan_cache))
        o, lse = plan.run(q, k, v, used)
    else:
        o, lse = _flash_attn_segments(q, k, v, used, geo)
    return combine_segments(o, lse, used, bias, geo, q.dtype)


def prepare_flash_dash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, used: torch.Tensor,
                                 bias: torch.Tensor, backend: str, bs: int, local: int, *,
                                 plan_cache: Optional[PlanCache] = None) -> Optional[PlanKey]:
    """Before capturing a graph: make and pin the FlashInfer plan of this shape (host work).

    Returns the pinned key (release it with ``plan_cache.unpin(key)`` when the graph is freed),
    or None for backends without plans. Library kernels that compile on first use (FlashInfer
    JIT, FlashAttention 4's CuTe DSL) also need one eager call before capture.
    """
    geo = check_segments(q, k, v, used, bias, backend, bs, local)
    if backend != "FLASHINFER":
        return None
    cache = cache_or_default(plan_cache)
    flashinfer_plan(geo, q.dtype, q.device, cache, pin=True)
    return plan_key(geo, q.dtype, q.device)


def check_decode_backend(backend: str, params: DashParams) -> None:
    """Host-side check that a decode step can run its attention stage on ``backend`` (before any write)."""
    if backend not in SEGMENT_BACKENDS:
        raise ValueError(f"backend = {backend!r} is not allowed: expected one of {SEGMENT_BACKENDS}")
    if backend == "TRITON":
        return
    segment_count(params)
    check_capacity("block_size", params.block_size)
    check_capacity("local", params.local)
