"""Triton kernels for paged DASH decode: K/V + summary write, routing, sparse attention.

Import ``dash_core.kernels.launcher`` for the host entry points (``paged_dash_decode_triton``,
``cache_dash_prefill_triton``, ``DecodeBuffers``); the submodules hold one stage each.
"""
