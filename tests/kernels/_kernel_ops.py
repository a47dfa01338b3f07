"""The public ops on the Triton kernels' path wherever the kernel tests run: on a GPU as the ops choose it, on the
CPU under the interpreter by naming the path (``check_step(..., kernels=True)``), so that the CPU tests run the same
validation and dispatch as the ops on CUDA."""

from __future__ import annotations

from dash_core import ops
from dash_core.checks import check_step


def kernel_decode(q, k, v, cache, block_table, seq_lens, slot_mapping, head_cls, params, **kw):
    """``ops.paged_dash_decode`` on the kernels' path."""
    kw.setdefault("backend", params.attention_backend)
    step = check_step(q, k, v, cache, block_table, None, seq_lens, slot_mapping, head_cls, params, kw.get("out"),
                      iq=kw.get("iq"), ik=kw.get("ik"), head_cls_i=kw.get("head_cls_i"),
                      positions=kw.get("positions"), page_rope=kw.get("page_rope"), backend=kw["backend"],
                      buffers=kw.get("buffers"), kernels=True)
    return ops.run_decode(step, q, k, v, cache, block_table, seq_lens, slot_mapping, head_cls, params, **kw)


def kernel_prefill(q, k, v, cache, block_table, cu_seqlens_q, seq_lens, slot_mapping, head_cls, params, **kw):
    """``ops.paged_dash_prefill`` on the kernels' path."""
    step = check_step(q, k, v, cache, block_table, cu_seqlens_q, seq_lens, slot_mapping, head_cls, params,
                      kw.get("out"), iq=kw.get("iq"), ik=kw.get("ik"), head_cls_i=kw.get("head_cls_i"),
                      roles=kw.get("roles"), positions=kw.get("positions"), page_rope=kw.get("page_rope"),
                      workspace=kw.get("workspace"), kernels=True)
    return ops.run_prefill(step, q, k, v, cache, block_table, cu_seqlens_q, seq_lens, slot_mapping, head_cls,
                           params, **kw)
