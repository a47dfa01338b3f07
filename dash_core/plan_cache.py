"""FlashInfer plans for the segment backend: an LRU for eager calls, pinned entries for CUDA graphs.

A FlashInfer wrapper's ``plan()`` runs on the host (it copies index arrays to the CPU and fills
the wrapper's buffers), so it cannot run inside CUDA-graph capture, and a captured graph keeps
reading the buffers its plan filled. The segment layout of ``dash_core.segments`` is static for
a given shape (fixed segment capacities; the valid lengths live in a device-side mask), so one
plan serves every call of that shape: the key below is the whole shape.

- Eager calls: ``get(key, make)`` returns the cached plan or makes it; least recently used plans
  beyond ``capacity`` are dropped (with their buffers).
- Graphs: make the plan before capture with ``pin(key, make)`` (or by one eager call: a plan
  looked up during capture is pinned on the spot); pinned plans are never evicted, until
  ``unpin(key)`` when the graph is released.
- Inside capture a missing plan raises ``RuntimeError``: ``plan()`` is never called there.

Example (any callable can play the planner)::

    >>> cache = PlanCache(capacity=1)
    >>> k1 = PlanKey("cpu", 2, 4, 64, 64, 8, 2, 128, "bfloat16", 0, "gathered", 2)
    >>> k2 = PlanKey("cpu", 4, 4, 64, 64, 8, 2, 128, "bfloat16", 0, "gathered", 2)
    >>> cache.pin(k1, lambda: "plan 1") and cache.get(k2, lambda: "plan 2")
    'plan 2'
    >>> cache.get(k2, lambda: "never called"), k1 in cache, len(cache)
    ('plan 2', True, 2)
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

import torch

logger = logging.getLogger(__name__)

DEFAULT_CAPACITY = 16
# FlashInfer's recommended float workspace (one per device, shared by every plan of a cache:
# calls on one stream never overlap, and the workspace only holds a run's split-KV partials).
DEFAULT_WORKSPACE_BYTES = 128 * 1024 * 1024


@dataclass(frozen=True)
class PlanKey:
    """Everything a segment plan depends on.

    device: ``str(torch.device)``; batch: query rows ``n``; topk: routed segments per row;
    bs, local: segment capacities; heads, kv_heads: ``Hq``, ``Hkv``; head_dim; dtype: name of the
    q/k/v dtype; page_size: 0 for the gathered layout; layout: ``"gathered"`` or ``"paged"``;
    selection_heads: ``Hsel`` (``Hkv`` for router ``kv_head``, 1 for ``shared``).
    """

    device: str
    batch: int
    topk: int
    bs: int
    local: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    page_size: int
    layout: str
    selection_heads: int


def _capturing() -> bool:
    """True while the current CUDA stream is being captured into a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class PlanCache:
    """Plans by ``PlanKey``: LRU of at most ``capacity`` eager plans plus any number of pinned ones.

    Thread-safe. ``make`` is called with no argument and returns the plan object (for FlashInfer:
    the wrapper and the buffers it was planned into); it is only ever called outside capture.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY,
                 workspace_bytes: int = DEFAULT_WORKSPACE_BYTES) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"PlanCache capacity = {capacity!r} is not allowed: expected an integer >= 1")
        self.capacity = capacity
        self.workspace_bytes = workspace_bytes
        self._lru: "OrderedDict[PlanKey, Any]" = OrderedDict()
        self._pinned: Dict[PlanKey, Any] = {}
        self._workspaces: Dict[str, torch.Tensor] = {}
        self._lock = threading.RLock()

    def __contains__(self, key: PlanKey) -> bool:
        with self._lock:
            return key in self._pinned or key in self._lru

    def __len__(self) -> int:
        with self._lock:
            return len(self._pinned) + len(self._lru)

    @property
    def pinned_keys(self) -> tuple:
        with self._lock:
            return tuple(self._pinned)

    def get(self, key: PlanKey, make: Callable[[], Any]) -> Any:
        """The plan of ``key``, made by ``make()`` if absent (eager calls only).

        During CUDA-graph capture an existing plan is returned and pinned (the graph will read
        its buffers on every replay); a missing one raises ``RuntimeError``.
        """
        with self._lock:
            if key in self._pinned:
                return self._pinned[key]
            if key in self._lru:
                plan = self._lru[key]
                if _capturing():
                    del self._lru[key]
                    self._pinned[key] = plan
                    logger.debug("plan %s pinned: looked up during CUDA-graph capture", key)
                else:
                    self._lru.move_to_end(key)
                return plan
            if _capturing():
                raise RuntimeError(
                    f"no plan for {key} and FlashInfer plan() cannot run inside CUDA-graph capture: "
                    "make it before capture with PlanCache.pin(key, make) (or one eager call of the "
                    "same shape), then capture")
            plan = make()
            self._lru[key] = plan
            while len(self._lru) > self.capacity:
                old, _ = self._lru.popitem(last=False)
                logger.debug("plan %s evicted (LRU capacity %d)", old, self.capacity)
            return plan

    def pin(self, key: PlanKey, make: Optional[Callable[[], Any]] = None) -> Any:
        """Make (or take from the LRU) the plan of ``key`` and keep it until ``unpin(key)``.

        Call before capturing a graph that uses this shape; never evicted while pinned.
        """
        with self._lock:
            if key in self._pinned:
                return self._pinned[key]
            if key in self._lru:
                plan = self._lru.pop(key)
            else:
                if make is None:
                    raise ValueError(f"pin({key}): no plan cached for this key and no make() given")
                if _capturing():
                    raise RuntimeError(
                        f"pin({key}) during CUDA-graph capture: FlashInfer plan() cannot run inside "
                        "capture; pin the plan before capturing")
                plan = make()
            self._pinned[key] = plan
            return plan

    def unpin(self, key: PlanKey) -> None:
        """Release a pinned plan (its graph is gone) into the LRU, where it may be evicted."""
        with self._lock:
            plan = self._pinned.pop(key, None)
            if plan is None:
                return
            self._lru[key] = plan
            self._lru.move_to_end(key)
            while len(self._lru) > self.capacity:
                self._lru.popitem(last=False)

    def clear(self, pinned: bool = False) -> None:
        """Drop every eager plan (and the pinned ones too with ``pinned=True``)."""
        with self._lock:
            self._lru.clear()
            if pinned:
                self._pinned.clear()
                self._workspaces.clear()

    def workspace(self, device: torch.device) -> torch.Tensor:
        """The zero-initialised float workspace (uint8) shared by this cache's plans on ``device``."""
        name = str(device)
        with self._lock:
            ws = self._workspaces.get(name)
            if ws is None:
                if _capturing():
                    raise RuntimeError("the FlashInfer workspace must be allocated before CUDA-graph capture")
                ws = torch.zeros(self.workspace_bytes, dtype=torch.uint8, device=device)
                self._workspaces[name] = ws
            return ws


_default: Optional[PlanCache] = None
_default_lock = threading.Lock()


def default_plan_cache() -> PlanCache:
    """The process-wide cache used when a call passes none."""
    global _default
    with _default_lock:
        if _default is None:
            _default = PlanCache()
        return _default
