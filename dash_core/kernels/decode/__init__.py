"""Triton paged decode: one new token per request, routed and attended in four launches (five where the K/V write
cannot ride in the select launch) with no host synchronisation; a wide batch as two halves on two streams. One
module a stage: ``config`` (tuning as values), ``buffers`` (the static scratch a CUDA graph owns), ``route`` (scores
and selection), ``attention`` (split-KV attention and its merge), ``launch`` (the step).
"""
