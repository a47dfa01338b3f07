"""The FlashInfer plan cache's LRU / pin semantics with a fake planner (no FlashInfer needed)."""

from __future__ import annotations

import pytest
import torch

from dash_core import plan_cache as pc
from dash_core.plan_cache import PlanCache, PlanKey


def key(batch: int, **over) -> PlanKey:
    f = dict(device="cuda:0", batch=batch, topk=8, bs=64, local=64, heads=32, kv_heads=8, head_dim=128,
             dtype="bfloat16", page_size=0, layout="gathered", selection_heads=8)
    f.update(over)
    return PlanKey(**f)


class Planner:
    """Counts plan() calls; each plan is a fresh object holding a 'buffer'."""

    def __init__(self):
        self.calls = []

    def __call__(self, k):
        def make():
            self.calls.append(k)
            return {"key": k, "buffer": torch.zeros(4)}
        return make


def test_lru_reuses_and_evicts_least_recent():
    cache, plan = PlanCache(capacity=2), Planner()
    a = cache.get(key(1), plan(key(1)))
    cache.get(key(2), plan(key(2)))
    assert cache.get(key(1), plan(key(1))) is a  # hit: no new plan, key 1 becomes most recent
    cache.get(key(3), plan(key(3)))  # evicts key 2, the least recently used
    assert key(2) not in cache and key(1) in cache and key(3) in cache and len(cache) == 2
    cache.get(key(2), plan(key(2)))
    assert plan.calls == [key(1), key(2), key(3), key(2)]


def test_keys_differ_by_every_field():
    cache, plan = PlanCache(capacity=32), Planner()
    variants = [key(1), key(2), key(1, topk=4), key(1, bs=32), key(1, local=128), key(1, heads=16),
                key(1, kv_heads=4), key(1, head_dim=64), key(1, dtype="float16"), key(1, page_size=64),
                key(1, layout="paged"), key(1, selection_heads=1), key(1, device="cuda:1")]
    for k in variants:
        cache.get(k, plan(k))
    assert len(plan.calls) == len(variants) == len(cache)


def test_segment_plan_keys_follow_every_field_a_plan_depends_on():
    """``segments.plan_key``: geometries that differ in any field a plan is built from get distinct keys; the same
    call gets the same key."""
    import dataclasses

    from dash_core.segments import SegmentGeometry, plan_key

    geo = SegmentGeometry(n=4, hsel=2, topk=8, bs=64, local=64, hq=8, hk=1, d=128)
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    keys = [plan_key(geo, bf16, cpu)]
    for name, value in (("n", 5), ("hsel", 4), ("topk", 4), ("bs", 32), ("local", 128), ("hq", 16), ("hk", 2),
                        ("d", 64)):
        keys.append(plan_key(dataclasses.replace(geo, **{name: value}), bf16, cpu))
    keys += [plan_key(geo, torch.float16, cpu), plan_key(geo, bf16, torch.device("meta")),
             plan_key(geo, bf16, cpu, layout="paged", page_size=64)]
    assert len(set(keys)) == len(keys)
    assert plan_key(dataclasses.replace(geo), bf16, cpu) == keys[0]


def test_pinned_plans_survive_eager_evictions():
    cache, plan = PlanCache(capacity=1), Planner()
    pinned = cache.pin(key(8), plan(key(8)))
    buf = pinned["buffer"]
    for b in range(20):  # many eager shapes churn through an LRU of one
        cache.get(key(100 + b), plan(key(100 + b)))
    assert cache.get(key(8), plan(key(8))) is pinned and pinned["buffer"] is buf
    assert cache.pinned_keys == (key(8),) and plan.calls.count(key(8)) == 1
    assert len(cache) == 2  # the pinned plan + one eager plan
    cache.unpin(key(8))  # the graph is gone: the plan becomes an ordinary LRU entry
    assert cache.pinned_keys == () and key(8) in cache
    cache.get(key(200), plan(key(200)))
    assert key(8) not in cache


def test_pin_takes_an_eager_plan_without_replanning():
    cache, plan = PlanCache(capacity=4), Planner()
    a = cache.get(key(1), plan(key(1)))
    assert cache.pin(key(1)) is a and plan.calls == [key(1)]
    with pytest.raises(ValueError, match="no plan cached"):
        cache.pin(key(2))


def test_no_plan_inside_capture(monkeypatch):
    cache, plan = PlanCache(capacity=4), Planner()
    eager = cache.get(key(1), plan(key(1)))
    monkeypatch.setattr(pc, "_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="cannot run inside CUDA-graph capture"):
        cache.get(key(2), plan(key(2)))
    with pytest.raises(RuntimeError, match="capture"):
        cache.pin(key(3), plan(key(3)))
    # a plan made before capture is used, and pinned for the graph's lifetime
    assert cache.get(key(1), plan(key(1))) is eager and cache.pinned_keys == (key(1),)
    assert plan.calls == [key(1)]
    monkeypatch.setattr(pc, "_capturing", lambda: False)
    for b in range(10):
        cache.get(key(10 + b), plan(key(10 + b)))
    assert key(1) in cache


def test_bad_capacity():
    with pytest.raises(ValueError, match="capacity = 0"):
        PlanCache(capacity=0)


def test_workspace_is_shared_per_device():
    cache = PlanCache(workspace_bytes=1024)
    ws = cache.workspace(torch.device("cpu"))
    assert ws is cache.workspace(torch.device("cpu")) and ws.numel() == 1024 and not ws.any()


def test_an_empty_cache_passed_explicitly_is_used():
    """An empty PlanCache is falsy (len 0); the segment backends must still use it, not the default."""
    from dash_core.plan_cache import PlanCache, default_plan_cache
    from dash_core.segments import cache_or_default

    mine = PlanCache()
    assert len(mine) == 0 and cache_or_default(mine) is mine
    assert cache_or_default(None) is default_plan_cache()
