"""One validation of a step's inputs, at the public ops (``dash_core.ops``), before anything is written.

Every check reads shapes, dtypes and devices only, never a device value: the ops stay free of host
synchronisation. Slot values are the one exception, checked where they are free to read (CPU tensors) and, on the
GPU, without a synchronisation by ``SlotGuard`` (an out-of-range slot is never written: the write kernels mask it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .kernels.checks import check_kernel_step, check_kernel_tables, check_write_config
from .layout import PagedKVCache, check_page_size
from .limits import OP_DTYPES, uses_kernels
from .params import DashParams
from .rope import PageRopeSettings
from .segments import check_decode_backend
from .workspace import check_workspace

INT_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class Step:
    """What the validation found: which path runs the step and with what.

    kernels: the Triton kernels run it (CUDA, fp16/bf16), else the PyTorch paged path. aux: the step has an
    indexer or page mode (the auxiliary head). indexer: an indexer routes (iq, ik, head_cls_i).
    """

    kernels: bool
    aux: bool
    indexer: bool


def check_cache(cache: PagedKVCache, params: DashParams) -> None:
    if cache.dtype not in OP_DTYPES:
        raise ValueError(f"KV cache dtype {cache.dtype} is not supported; use one of {OP_DTYPES}")
    if cache.summaries is not None:
        check_page_size(cache.page_size, params.block_size)


def check_tokens(name: str, x: Optional[torch.Tensor], t: int, cache: PagedKVCache) -> None:
    want = (t, cache.num_kv_heads, cache.head_dim)
    if x is None or tuple(x.shape) != want:
        raise ValueError(f"{name} must be [T, Hkv, D] = {want}, got {None if x is None else tuple(x.shape)}")


def check_head_cls(head_cls: Optional[torch.Tensor], cache: PagedKVCache) -> None:
    want = (cache.num_kv_heads, cache.head_dim)
    if head_cls is None:
        raise ValueError(f"head_cls [Hkv, D] = {want} is required to summarise blocks (missing)")
    if tuple(head_cls.shape) != want:
        raise ValueError(f"head_cls must be [Hkv, D] = {want}, got {tuple(head_cls.shape)}")


def check_slot_mapping(slot_mapping: Optional[torch.Tensor], t: int, device: torch.device, num_slots: int) -> None:
    """``slot_mapping [T]`` int64 (or int32) on ``device``; its values below the cache's ``num_slots`` where they
    can be read for free (a CPU tensor; on CUDA, ``SlotGuard``). Negative slots are padding."""
    if (slot_mapping is None or tuple(slot_mapping.shape) != (t,) or slot_mapping.dtype not in INT_DTYPES
            or slot_mapping.device != device):
        got = (None if slot_mapping is None
               else (tuple(slot_mapping.shape), slot_mapping.dtype, str(slot_mapping.device)))
        raise ValueError(f"slot_mapping must be [T] = [{t}] int64 on {device} with k and v, got {got}")
    if not slot_mapping.is_cuda and t:
        top = int(slot_mapping.max())
        if top >= num_slots:
            raise ValueError(f"slot_mapping holds slot {top}, outside the cache's {num_slots} slots "
                             f"(num_pages x page_size); negative slots mark padding")


def check_out(out: Optional[torch.Tensor], q: torch.Tensor) -> None:
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.device != q.device):
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} on {q.device}, got {tuple(out.shape)} "
                         f"{out.dtype} on {out.device}")


def check_kv_store(cache: PagedKVCache) -> None:
    """A call without an indexer summarises K: the store (if any) must have the Hkv heads of K."""
    if cache.summaries is not None and cache.summaries.shape[1] != cache.num_kv_heads:
        raise ValueError(f"summaries must be [num_slots // block_size, Hkv = {cache.num_kv_heads}, D] without an "
                         f"indexer; got {tuple(cache.summaries.shape)} (a 1-head indexer store needs iq, ik and "
                         f"head_cls_i)")


def check_query(q: torch.Tensor, cache: PagedKVCache) -> None:
    if q.dim() != 3 or q.shape[2] != cache.head_dim or q.shape[1] % cache.num_kv_heads:
        raise ValueError(f"q must be [T, Hq, D] with D the cache's head_dim {cache.head_dim} and Hq a multiple of "
                         f"Hkv = {cache.num_kv_heads}; got {tuple(q.shape)}")
    if q.dtype not in OP_DTYPES:
        raise ValueError(f"q dtype {q.dtype} is not supported; use one of {OP_DTYPES}")


def check_tables(tables: tuple, t: int, device: torch.device, num_slots: int, params: DashParams, backend: str,
                 kernels: bool) -> None:
    """What the layers of a step share: its settings and its ``tables``, ``(block_table [n, max_pages],
    cu_seqlens_q [n + 1], seq_lens [n], slot_mapping [T])``, for ``t`` new tokens on ``device`` into a cache of
    ``num_slots`` slots; on the kernels' path, the tables' device and layout too. ``cu_seqlens_q`` None: a decode
    step (``n = T``); ``slot_mapping`` None: K/V already written."""
    block_table, cu_seqlens_q, seq_lens, slot_mapping = tables
    decode = cu_seqlens_q is None
    if decode:
        check_decode_backend(backend, params)
    if kernels:  # the settings first: a block size the kernels do not run fails whatever the cache
        params.check_kernel_support()
    if seq_lens.dim() != 1 or seq_lens.dtype not in INT_DTYPES:
        raise ValueError(f"seq_lens must be [n] int32; got {tuple(seq_lens.shape)} {seq_lens.dtype}")
    n = seq_lens.shape[0]
    if block_table.dim() != 2 or block_table.shape[0] != n or block_table.dtype not in INT_DTYPES:
        raise ValueError(f"block_table must be [n, max_pages] int32 with n = len(seq_lens) = {n}; "
                         f"got {tuple(block_table.shape)} {block_table.dtype}")
    if not decode and (tuple(cu_seqlens_q.shape) != (n + 1,) or cu_seqlens_q.dtype not in INT_DTYPES):
        raise ValueError(f"cu_seqlens_q must be [n + 1] = [{n + 1}] int32, got {tuple(cu_seqlens_q.shape)} "
                         f"{cu_seqlens_q.dtype}")
    if decode and n != t:
        raise ValueError(f"seq_lens must be [n = {t}] int32 (one new token per request); got {tuple(seq_lens.shape)}")
    if slot_mapping is not None:
        check_slot_mapping(slot_mapping, t, device, num_slots)
    if kernels:
        check_kernel_tables(device, block_table, seq_lens, cu_seqlens_q)


def check_aux(cache: PagedKVCache, t: int, iq, ik, head_cls_i, roles, positions, page_rope, *, decode: bool,
              query: Optional[torch.Tensor] = None, writes: bool = True, indexer: Optional[bool] = None,
              roles_optional: bool = False) -> bool:
    """Validate the auxiliary-head inputs from shapes and dtypes (values of roles only off CUDA); True when there
    is one (an indexer or page mode), False for a plain call. decode: roles are not taken; roles_optional: None
    means all 0 (``cache_dash_prefill``)."""
    if indexer is None:
        indexer = iq is not None or head_cls_i is not None or (ik is not None and writes)
    if not indexer and page_rope is None:
        if roles is not None:
            raise ValueError("roles are given without page_rope: page mode needs page_rope (PageRopeSettings)")
        if ik is not None:
            raise ValueError("ik is given without iq and head_cls_i: the indexer needs all three")
        check_kv_store(cache)
        return False
    d = cache.head_dim
    if cache.aux is None:
        raise ValueError("an indexer or page mode needs the cache's auxiliary head: build the PagedKVCache with aux "
                         "(from_vllm(..., aux=True) with Hkv + 1 head slots, or from_sglang(..., "
                         "aux=alloc_aux_sglang(...)))")
    if indexer:
        if head_cls_i is None or (query is not None and iq is None) or (writes and ik is None):
            raise ValueError(f"iq, ik and head_cls_i go together (ik may be None when k is None); got iq "
                             f"{iq is not None}, ik {ik is not None}, head_cls_i {head_cls_i is not None}")
        if tuple(head_cls_i.shape) != (d,):
            raise ValueError(f"head_cls_i must be [D] = [{d}], got {tuple(head_cls_i.shape)}")
        if iq is not None and (iq.dim() != 3 or iq.shape[0] != t or iq.shape[2] != d or iq.dtype != query.dtype):
            raise ValueError(f"iq must be [T, Hi, D] = [{t}, Hi, {d}] in the query dtype {query.dtype}; got "
                             f"{tuple(iq.shape)} {iq.dtype}")
        if ik is not None and (tuple(ik.shape) != (t, d) or ik.dtype not in OP_DTYPES):
            raise ValueError(f"ik must be [T, D] = {(t, d)} in one of {OP_DTYPES}; got {tuple(ik.shape)} "
                             f"{ik.dtype}")
        if cache.summaries is not None and cache.summaries.shape[1] != 1:
            raise ValueError(f"with an indexer the summary store holds summaries of ik, one head: "
                             f"alloc_summaries(num_slots, bs, 1, D, ...); got {tuple(cache.summaries.shape)}")
    else:
        check_kv_store(cache)
    if positions is not None and (tuple(positions.shape) != (t,) or positions.dtype.is_floating_point
                                  or positions.dtype == torch.bool):
        raise ValueError(f"positions must be [T] = [{t}] integers, got {tuple(positions.shape)} {positions.dtype}")
    if page_rope is None:
        if roles is not None:
            raise ValueError("roles are given without page_rope: page mode needs page_rope (PageRopeSettings)")
        return True
    if not isinstance(page_rope, PageRopeSettings):
        raise ValueError(f"page_rope must be a dash_core.rope.PageRopeSettings, got {type(page_rope).__name__}")
    if positions is None:
        raise ValueError(f"page mode needs positions [T] = [{t}] int64 (missing)")
    if decode and roles is not None:
        raise ValueError("decode takes no roles: generated tokens are text (role 0)")
    if not decode and writes and (roles is not None or not roles_optional):
        if roles is None or tuple(roles.shape) != (t,) or roles.dtype.is_floating_point or roles.dtype == torch.bool:
            raise ValueError(f"page-mode prefill needs roles [T] = [{t}] integers (0 text, 1 page start, 2 page "
                             f"token); got {None if roles is None else (tuple(roles.shape), roles.dtype)}")
        if not roles.is_cuda and roles.numel() and (int(roles.min()) < 0 or int(roles.max()) > 2):
            raise ValueError(f"roles must be 0 (text), 1 (page start) or 2 (page token); got values "
                             f"{int(roles.min())}..{int(roles.max())}")
    return True


def check_writes(k, v, slot_mapping, cache: PagedKVCache, head_cls, t: int, *, summarise_k: bool) -> None:
    """``k, v [T, Hkv, D]`` with ``slot_mapping`` (all three or none; the slots are checked with the step's tables,
    ``check_tables`` or ``check_slot_mapping``), and ``head_cls`` where K is summarised."""
    if (k is None) != (v is None) or (k is None) != (slot_mapping is None):
        raise ValueError("pass k, v and slot_mapping together, or none of them (K/V already written)")
    if k is None:
        return
    check_tokens("k", k, t, cache)
    check_tokens("v", v, t, cache)
    if summarise_k and cache.summaries is not None:
        check_head_cls(head_cls, cache)


def check_step(q: torch.Tensor, k, v, cache: PagedKVCache, block_table: torch.Tensor,
               cu_seqlens_q: Optional[torch.Tensor], seq_lens: torch.Tensor, slot_mapping, head_cls,
               params: DashParams, out, *, iq=None, ik=None, head_cls_i=None, roles=None, positions=None,
               page_rope=None, workspace=None, backend: str = "TRITON", buffers=None,
               kernels: Optional[bool] = None) -> Step:
    """Validate one prefill (``cu_seqlens_q [n + 1]``) or decode (``cu_seqlens_q`` None) step of the ops.

    backend and buffers: decode's attention stage and ``DecodeBuffers``. kernels: the path to check for (None: by
    the device and dtype of q, as the ops choose; True: the Triton kernels, which the CPU tests run under the
    interpreter). workspace: the step's tables (``check_tables``) are checked at the first call that passes them
    with it, the layer's own inputs at every call. Returns the ``Step`` the op runs.
    """
    check_workspace(workspace)
    kernels = uses_kernels(q.device, q.dtype) if kernels is None else kernels
    t = q.shape[0]
    tables = (block_table, cu_seqlens_q, seq_lens, slot_mapping)
    settings = (t, q.device, cache.num_slots, params, backend, kernels)
    if workspace is None:
        check_tables(tables, *settings)
    else:  # the layers of a step pass the same tables
        workspace.checked(settings, tables, lambda: check_tables(tables, *settings))
    aux = check_aux(cache, t, iq, ik, head_cls_i, roles, positions, page_rope, decode=cu_seqlens_q is None, query=q,
                    writes=k is not None)
    indexer = iq is not None
    check_query(q, cache)
    check_cache(cache, params)
    if not indexer:
        check_head_cls(head_cls, cache)
    check_writes(k, v, slot_mapping, cache, head_cls, t, summarise_k=False)  # head_cls checked just above
    check_out(out, q)
    if kernels:
        routed = params.routed_by(indexer)
        check_kernel_step(q, None if aux else k, None if aux else v, cache, head_cls, routed, out, iq)
        if indexer and cache.summaries is not None:
            check_write_config(cache.indexer_view(), params)
        if buffers is not None:
            buffers.check(q, cache, block_table, params, iq=iq)
    return Step(kernels=kernels, aux=aux, indexer=indexer)


class SlotGuard:
    """Out-of-range slots on CUDA, found without a host synchronisation.

    The write kernels skip a slot at or past the cache's ``num_slots`` (as they skip negative, padding slots), so
    nothing is corrupted; this reports it. ``watch`` (an eager call, once per new ``slot_mapping``: the layers of a
    step share one) reduces the slots on the device to one flag and copies it to pinned host memory behind an
    event; ``raise_found`` (at the start of every eager call) raises ``ValueError`` for a flag whose copy has landed
    (``Event.query``, never a wait), so an eager caller learns of it at a later call. Inside a captured CUDA graph
    neither runs: out-of-range slots are masked only. ``raise_found(wait=True)`` synchronises (tests, debugging).
    """

    def __init__(self) -> None:
        self._pending: list = []  # (event, host flag [1] int32, num_slots)
        self._seen: Optional[tuple] = None

    def watch(self, slot_mapping: torch.Tensor, cache: PagedKVCache) -> None:
        if not slot_mapping.is_cuda or slot_mapping.numel() == 0 or torch.cuda.is_current_stream_capturing():
            return
        key = (slot_mapping.data_ptr(), slot_mapping._version, slot_mapping.shape[0], cache.num_slots)
        if key == self._seen:
            return
        self._seen = key
        flag = torch.empty(1, dtype=torch.int32, pin_memory=True)
        flag.copy_((slot_mapping.max() >= cache.num_slots).to(torch.int32).reshape(1), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending.append((event, flag, cache.num_slots))

    def raise_found(self, wait: bool = False) -> None:
        if not self._pending or torch.cuda.is_current_stream_capturing():
            return
        keep, found = [], None
        for event, flag, num_slots in self._pending:
            if wait:
                event.synchronize()
            if not event.query():
                keep.append((event, flag, num_slots))
            elif int(flag[0]) and found is None:
                found = num_slots
        self._pending = keep
        if found is not None:
            self._pending, self._seen = [], None
            raise ValueError(f"an earlier call's slot_mapping held slots outside the cache's {found} slots "
                             f"(num_pages x page_size); those K/V writes were skipped (negative slots mark padding)")


SLOT_GUARD = SlotGuard()
