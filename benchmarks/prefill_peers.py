"""The prefill benchmark's dense peers, on the same prompts and steps as DASH.

Each builder returns ``(call, variant, note)``: ``call()`` runs the peer once (its inputs laid out and its plan
made beforehand, outside any timed call). Peers that cannot run here raise; the benchmark logs the reason and goes on.

- ``cudnn``, ``sdpa``: PyTorch SDPA on its cuDNN or FlashAttention backend (``common.sdpa_fn``), the requests of a
  batch as one ``[B, Hq, n, D]`` tensor (a serving row's requests have equal lengths, so that is the same batch).
  Chunks on a history need a lower-right causal mask, which only the FlashAttention backend takes.
- ``flashinfer``: one prompt through ``single_prefill_with_kv_cache``, a batch through the ragged wrapper (the engines'
  path for fresh prompts), a mixed step through the paged wrapper on the paged cache (their path for extends).
- ``flash-attn``: FlashAttention 4's varlen kernel, on the packed tokens, or on the paged cache for a mixed step.
"""

from __future__ import annotations

import math

import torch

from common import flash_attn_varlen, sdpa_fn

FLASHINFER_WORKSPACE = 256 * 2**20


def heads_first(x: torch.Tensor, batch: int) -> torch.Tensor:
    """``[B n, H, D]`` packed tokens of ``batch`` requests of equal length as ``[B, H, n, D]`` (a copy)."""
    n = x.shape[0] // batch
    return x.view(batch, n, x.shape[1], x.shape[2]).permute(0, 2, 1, 3).contiguous()


def sdpa_prompt(peer: str, q, k, v, batch: int, chunk, cuda: bool) -> tuple:
    """SDPA causal prefill of ``batch`` equal prompts (q ``[B n, Hq, D]``, k, v ``[B n, Hkv, D]``), at once or, for
    one prompt, chunk by chunk over the history the earlier chunks wrote."""
    q4, k4, v4 = heads_first(q, batch), heads_first(k, batch), heads_first(v, batch)
    if chunk is None:
        fn, note = sdpa_fn(peer, q4, k4, v4, cuda, is_causal=True)
        return fn, "one-shot", note
    if peer != "sdpa" or batch != 1:
        raise RuntimeError("chunks on a history need a lower-right causal mask: only one prompt on SDPA's "
                           "FlashAttention backend")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    g = q4.shape[1] // k4.shape[1]
    kh, vh = k4.repeat_interleave(g, 1).contiguous(), v4.repeat_interleave(g, 1).contiguous()
    backends = [SDPBackend.FLASH_ATTENTION] if cuda else [SDPBackend.MATH]
    n = q4.shape[2]
    pieces = [(s, min(n, s + chunk)) for s in range(0, n, chunk)]

    def run():
        with sdpa_kernel(backends):
            for s, e in pieces:
                sdpa(q4[:, :, s:e], kh[:, :, :e], vh[:, :, :e], attn_mask=causal_lower_right(e - s, e))
    return run, f"chunks-{chunk}", "K/V heads repeated to Hq before the timed calls"


def flashinfer_prompt(q, k, v, batch: int, chunk) -> tuple:
    """FlashInfer causal prefill: one prompt (at once or in chunks on its history), or a batch (ragged wrapper)."""
    import flashinfer  # optional peer

    if batch == 1:
        if chunk is None:
            return lambda: flashinfer.single_prefill_with_kv_cache(q, k, v, causal=True), "one-shot", None
        pieces = [(s, min(q.shape[0], s + chunk)) for s in range(0, q.shape[0], chunk)]

        def run():  # causal aligned bottom-right: chunk tokens see the whole history
            for s, e in pieces:
                flashinfer.single_prefill_with_kv_cache(q[s:e], k[:e], v[:e], causal=True)
        return run, f"chunks-{chunk}", None
    if chunk is not None:
        raise RuntimeError("chunks are run for one prompt only")
    n = q.shape[0] // batch
    indptr = torch.arange(batch + 1, dtype=torch.int32, device=q.device) * n
    w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
        torch.empty(FLASHINFER_WORKSPACE, dtype=torch.uint8, device=q.device), "NHD")
    w.plan(indptr, indptr, q.shape[1], k.shape[1], q.shape[2], causal=True, q_data_type=q.dtype,
           kv_data_type=k.dtype)
    out = torch.empty_like(q)
    return lambda: w.run(q, k, v, out=out), "one-shot", "ragged batch"


def flash_attn_prompt(q, k, v, batch: int, chunk) -> tuple:
    """FlashAttention 4 causal varlen prefill of ``batch`` equal prompts, or of one prompt in chunks."""
    fn = flash_attn_varlen()
    n = q.shape[0] // batch
    dev = q.device
    scale = 1.0 / math.sqrt(q.shape[-1])
    if chunk is None:
        cu = torch.arange(batch + 1, dtype=torch.int32, device=dev) * n
        return (lambda: fn(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=n, max_seqlen_k=n,
                           softmax_scale=scale, causal=True)), "one-shot", None
    if batch != 1:
        raise RuntimeError("chunks are run for one prompt only")
    pieces = []
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        pieces.append((s, e, torch.tensor([0, e - s], dtype=torch.int32, device=dev),
                       torch.tensor([0, e], dtype=torch.int32, device=dev)))

    def run():  # causal aligned bottom-right: chunk tokens see the whole history
        for s, e, cu_q, cu_k in pieces:
            fn(q[s:e], k[:e], v[:e], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=e - s, max_seqlen_k=e,
               softmax_scale=scale, causal=True)
    return run, f"chunks-{chunk}", None


def prompt_peer(peer: str, q, k, v, batch: int, chunk, cuda: bool) -> tuple:
    """``(call, variant, note)`` of dense ``peer`` on the prompts (see the module's docstring)."""
    if peer in ("cudnn", "sdpa"):
        return sdpa_prompt(peer, q, k, v, batch, chunk, cuda)
    if peer == "flashinfer":
        return flashinfer_prompt(q, k, v, batch, chunk)
    if peer == "flash-attn":
        return flash_attn_prompt(q, k, v, batch, chunk)
    raise ValueError(f"peer must be one of cudnn, sdpa, flashinfer, flash-attn; got {peer!r}")


# ---------------------------------------------------------------------------- a mixed step

def mixed_peer(peer: str, step, layer: int, cuda: bool) -> tuple:
    """``(call, note)``: dense ``peer`` on one layer of a mixed step (``prefill.MixedStep``: ``nd`` decode tokens
    on histories of ``dctx`` tokens, then one prompt chunk of ``nc`` tokens with no history)."""
    nd, nc = step.nd, step.nc
    q = step.q[layer]
    if peer in ("cudnn", "sdpa"):
        kc, vc = step.contiguous_history(layer)
        dec, note_d = sdpa_fn(peer, q[:nd, :, None, :], kc, vc, cuda)
        kp, vp = step.k[layer][nd:], step.v[layer][nd:]
        pre, note_p = sdpa_fn(peer, heads_first(q[nd:], 1), heads_first(kp, 1), heads_first(vp, 1), cuda,
                              is_causal=True)

        def run():
            dec()
            pre()
        return run, "; ".join(n for n in ("two calls: the decode tokens over contiguous K/V, then the chunk",
                                          note_d or note_p) if n)
    cache, bt, ps = step.caches[layer], step.block_table, step.page_size
    if peer == "flashinfer":
        import flashinfer  # optional peer

        pages = -(-step.seq.long() // ps)
        indptr = torch.zeros(bt.shape[0] + 1, dtype=torch.int32, device=q.device)
        indptr[1:] = torch.cumsum(pages, 0).to(torch.int32)
        indices = torch.cat([bt[i, : int(pages[i])] for i in range(bt.shape[0])]).to(torch.int32)
        last = (step.seq.long() - (pages - 1) * ps).to(torch.int32)
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            torch.empty(FLASHINFER_WORKSPACE, dtype=torch.uint8, device=q.device), "NHD")
        w.plan(step.cu, indptr, indices, last, q.shape[1], cache.num_kv_heads, q.shape[2], ps, causal=True,
               q_data_type=q.dtype, kv_data_type=q.dtype)
        out = torch.empty_like(q)
        kv = (cache.k_pages, cache.v_pages)
        return (lambda: w.run(q, kv, out=out)), "paged wrapper, one call"
    if peer == "flash-attn":
        fn = flash_attn_varlen()
        scale = 1.0 / math.sqrt(q.shape[-1])
        k_pages, v_pages = cache.k_pages, cache.v_pages
        return (lambda: fn(q, k_pages, v_pages, cu_seqlens_q=step.cu, max_seqlen_q=max(nc, 1),
                           max_seqlen_k=step.dctx, seqused_k=step.seq, page_table=bt, softmax_scale=scale,
                           causal=True)), "paged varlen, one call"
    raise ValueError(f"peer must be one of cudnn, sdpa, flashinfer, flash-attn; got {peer!r}")
