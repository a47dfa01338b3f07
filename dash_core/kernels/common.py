"""What the DASH Triton kernels share: the index math of paging and decode bounds, the routing scores' query rows,
the online softmax's rescale, and the host helpers every launch uses (one place for each).

A request's block ``b`` (tokens ``b*bs .. b*bs + bs - 1``) lives in page
``block_table[req, b // (ps // bs)]`` at rows ``(b % (ps // bs)) * bs ..``; its summary is at index
``page * (ps // bs) + b % (ps // bs)`` of the summary store (``slot // bs``, docs/semantics.md section 8).
All offsets that scale with the cache size are computed in int64.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from ..limits import nvidia_capability

LOG2E_F = 1.4426950408889634
LN2_F = 0.6931471805599453
LOG2E = tl.constexpr(LOG2E_F)  # usable inside kernels
LN2 = tl.constexpr(LN2_F)


DEFAULT_NUM_SMS = 132  # the H200's multiprocessors: grids are sized for it under the interpreter


def interpreting() -> bool:
    """Whether kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, the CPU tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def pow2(x: int) -> int:
    """The smallest power of two ``>= x`` (1 for ``x <= 1``)."""
    return 1 << max(0, int(x) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA ``device`` (``DEFAULT_NUM_SMS`` elsewhere: the Triton interpreter)."""
    device = torch.device(device)
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return _cuda_sms(torch.cuda.current_device() if device.index is None else device.index)


@functools.lru_cache(maxsize=None)
def _cuda_sms(index) -> int:
    return torch.cuda.get_device_properties(torch.device("cuda", index)).multi_processor_count


def tma_supported(device) -> bool:
    """NVIDIA Hopper or later, or the interpreter (which emulates descriptors: the CPU tests run the TMA paths)."""
    return interpreting() or nvidia_capability(device)[0] >= 9


def sm90(device) -> bool:
    """An NVIDIA Hopper GPU (compiled code, not the interpreter)."""
    return not interpreting() and nvidia_capability(device) == (9, 0)


def pdl_supported(device) -> bool:
    """Programmatic dependent launch (a launch starts while the one before it ends; its programs wait with
    ``gdc_wait``): NVIDIA Hopper or later, compiled (the interpreter runs launches one after the other)."""
    return not interpreting() and nvidia_capability(device)[0] >= 9


def pdl_launch(on: bool) -> dict:
    """The launch options of a programmatic dependent launch (none when off)."""
    return {"launch_pdl": True} if on else {}


@triton.jit
def decode_bounds(seq_lens_ptr, req, max_tokens, LOCAL_BLOCKS: tl.constexpr, BS: tl.constexpr):
    """(length, position, current block, first local block, candidates) of a decode row.

    The length is clamped to ``max_tokens`` (what the page table can address); a padded row
    (length 0) has no local block and no candidate.
    """
    length = tl.minimum(tl.load(seq_lens_ptr + req).to(tl.int32), max_tokens)
    length = tl.maximum(length, 0)
    pos = tl.maximum(length - 1, 0)
    cur = pos // BS
    first_local = tl.maximum(cur - LOCAL_BLOCKS + 1, 0)
    ncand = tl.where(length > 0, first_local, 0)
    return length, pos, cur, first_local, ncand


@triton.jit
def block_page(bt_row_ptr, blk, PS: tl.constexpr, BS: tl.constexpr, mask=None):
    """Physical page (int64) and first row of logical block ``blk`` (scalar or tensor)."""
    ppb: tl.constexpr = PS // BS
    page = tl.load(bt_row_ptr + blk // ppb, mask=mask, other=0).to(tl.int64)
    return page, (blk % ppb) * BS


@triton.jit
def summary_index(page, blk, PS: tl.constexpr, BS: tl.constexpr):
    """Index of a block's summary in the store (``slot // bs``), int64."""
    ppb: tl.constexpr = PS // BS
    return page * ppb + (blk % ppb)


@triton.jit
def summary_scores(qs, bt_row_ptr, summ_ptr, ss_b, h, ss_h, blk, mask, x_scale, offs_d,
                   PS: tl.constexpr, BS: tl.constexpr):
    """``[M, BLOCK_N]`` fp32 scores ``x_scale * <qs, s>`` of query rows ``qs [M, D]`` against the
    summaries of KV head ``h`` of logical blocks ``blk [BLOCK_N]`` (read through the page table;
    masked blocks score 0)."""
    page, _ = block_page(bt_row_ptr, blk, PS, BS, mask=mask)
    sidx = summary_index(page, blk, PS, BS)
    summ = tl.load(summ_ptr + sidx[:, None] * ss_b + h * ss_h + offs_d[None, :], mask=mask[:, None], other=0.0)
    return tl.dot(qs, tl.trans(summ)) * x_scale


@triton.jit
def scaled_query(q, sf):
    """``sf * q`` rounded to the query dtype (docs/semantics.md section 4), the routing scores' query rows."""
    return (q.to(tl.float32) * sf).to(q.dtype)


@triton.jit
def max_or_zero(m):
    """Running row maxima of an online softmax, 0 where still ``-inf`` (a row with no finite logit yet: its
    exponentials are 0)."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def raise_max(m_i, l_i, acc, top):
    """``(m_i, l_i, acc)`` of the online softmax (base 2) before a tile whose row maxima are ``top``: the running
    maxima raised to them, the sums and the accumulator rescaled to match. The tile's exponentials are then
    ``exp2(logit - max_or_zero(m))`` with ``m`` the returned maxima."""
    m_new = tl.maximum(m_i, top)
    alpha = tl.exp2(m_i - max_or_zero(m_new))
    return m_new, l_i * alpha, acc * alpha[:, None]


@triton.jit
def load_group_query(q_ptr, i, sq_n, sq_h, h, G, G_PAD: tl.constexpr, D: tl.constexpr):
    """The query rows of KV head ``h``'s group in decode row ``i``: ``q [G_PAD, D]`` (zero past ``G``), their head
    ids ``heads [G_PAD]``, the mask ``g_ok`` and ``offs_d``."""
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D)
    g_ok = offs_g < G
    heads = h * G + offs_g
    q = tl.load(q_ptr + i * sq_n + heads[:, None] * sq_h + offs_d[None, :], mask=g_ok[:, None], other=0.0)
    return q, heads, g_ok, offs_d
