"""Triton paged prefill / extend: tiled routing and tile-shared sparse attention.

Every request ``i`` of a batch extends its paged history by the tokens ``cu_seqlens_q[i] .. cu_seqlens_q[i+1] - 1``
at positions ``seq_lens[i] - qlen_i .. seq_lens[i] - 1``; K/V of the new tokens are already in the cache and so are
the summaries of every block they complete.

One module a stage: ``config`` (tuning as values), ``tiles`` (where each tile lies; tile tables), ``plan`` (a
call's geometry, waves and routing scratch), ``route`` (routing a wave), ``attention`` (each tile's union of
selected blocks, and the attention over it), ``gluon`` (the Hopper attention launch), ``launch`` (the call).
"""
