"""Record the batches an engine hands to the ops, for replay on a GPU where engines cannot run.

Enabled by the environment variable ``DASH_RECORD_DIR``: every op call then saves one small
``.pt`` file there holding the batch metadata (page table, lengths, slot mapping, row offsets,
shapes and parameters), not the activations; ``load_batches`` reads them back. At most
``DASH_RECORD_MAX`` files (default 64) are written per process.
"""

from __future__ import annotations

import dataclasses
import glob
import itertools
import os
from typing import Optional

import torch

_counter = itertools.count()


def record(op: str, *, q: torch.Tensor, cache, block_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
           seq_lens: torch.Tensor, slot_mapping: Optional[torch.Tensor], params) -> None:
    """Save one call's metadata when ``DASH_RECORD_DIR`` is set (a no-op otherwise)."""
    out_dir = os.environ.get("DASH_RECORD_DIR")
    if not out_dir:
        return
    i = next(_counter)
    if i >= int(os.environ.get("DASH_RECORD_MAX", "64")):
        return
    os.makedirs(out_dir, exist_ok=True)
    cpu = (lambda t: None if t is None else t.detach().to("cpu").clone())
    torch.save({
        "op": op,
        "num_heads": q.shape[1], "num_kv_heads": cache.num_kv_heads, "head_dim": cache.head_dim,
        "num_pages": cache.k_pages.shape[0], "page_size": cache.page_size, "has_summaries": cache.summaries is not None,
        "dtype": str(q.dtype).replace("torch.", ""),
        "block_table": cpu(block_table), "cu_seqlens_q": cpu(cu_seqlens_q), "seq_lens": cpu(seq_lens),
        "slot_mapping": cpu(slot_mapping), "params": dataclasses.asdict(params),
    }, os.path.join(out_dir, f"{os.getpid()}_{i:05d}_{op}.pt"))


def load_batches(pattern: str) -> list[dict]:
    """All recorded batches matching a glob pattern, in file-name order."""
    return [torch.load(p, weights_only=True) for p in sorted(glob.glob(pattern))]
