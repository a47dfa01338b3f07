"""The Triton (and, on Hopper, Gluon) kernels of DASH: K/V + summary writes, routing, sparse attention.

One folder a stage: ``decode/`` and ``prefill/`` (their configs, launches and kernels), with what both share beside
them: ``common`` (paging index math, online softmax, host helpers), ``kv_write`` (every K/V and summary write),
``routing`` (the routing routine), ``segment_attention`` (the Triton segment backend), ``checks`` (what the
kernels support) and ``launcher`` (``@cached_launch``, on every kernel the host launches: less host time a
launch). The ops (``dash_core.ops``) validate and call the launches; nothing here imports the ops, the segment
backends or the PyTorch path.
"""
