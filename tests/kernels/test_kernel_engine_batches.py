"""The batches the engines recorded (``DASH_RECORD_DIR``, see ``dash_core.recorder``) replayed through
the kernels: vLLM's and SGLang's own page tables, lengths and slot mappings.

A record holds metadata only (no activations), so K/V, queries and ``head_cls`` are random, and
head sizes the kernels do not support (the CPU engine tests use tiny models) are replaced by 64;
page ids are relabelled onto a compact pool (same order) so that the cache stays small. Decode
batches are compared with the torch paged path on the same cache and stored summaries (only
near-threshold routing may differ, docs/semantics.md section 7); prefill batches' K/V + summary writes with
the torch write. On the GPU the ops dispatch to the kernels; here the op runs on the kernels' path under the
interpreter.
"""

from __future__ import annotations

import glob
from pathlib import Path

import pytest
import torch

from dash_core import DashParams, ops, paged
from dash_core import limits
from dash_core.kernels import checks as kchecks, kv_write
from dash_core.kernels.kv_write import write_kv_and_summaries
from dash_core.layout import PagedKVCache, alloc_summaries
from tests.kernels._kernel_env import KERNEL_DEVICE
from tests.kernels._kernel_ops import kernel_decode
from tests.kernels._kernel_scenarios import summary_tolerance

DEV = KERNEL_DEVICE
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "engine_batches"
MAX_FILES_INTERPRETED = 10


def _compact(rec, ps):
    """Block table and slot mapping relabelled onto pages 0..P-1 (sorted, so the order is kept)."""
    bt, lens, sm = rec["block_table"].long(), rec["seq_lens"].long(), rec["slot_mapping"]
    used = set((sm[sm >= 0] // ps).tolist())
    for i, L in enumerate(lens.tolist()):
        used |= set(bt[i, : -(-L // ps)].tolist())
    remap = {p: j for j, p in enumerate(sorted(used))}
    nbt = torch.zeros_like(bt)
    for i, L in enumerate(lens.tolist()):
        for j in range(-(-L // ps)):
            nbt[i, j] = remap[int(bt[i, j])]
    nsm = sm.clone()
    ok = sm >= 0
    nsm[ok] = torch.tensor([remap[int(s) // ps] * ps + int(s) % ps for s in sm[ok].tolist()], dtype=sm.dtype)
    return nbt.to(torch.int32), lens.to(torch.int32), nsm, len(used) + 1


def replay(rec, seed):
    """Returns (decode rows checked, decode rows differing) for one record."""
    p = DashParams(**{k: v for k, v in rec["params"].items() if k in DashParams.__dataclass_fields__})
    hq, hkv, ps = rec["num_heads"], rec["num_kv_heads"], rec["page_size"]
    d = rec["head_dim"] if rec["head_dim"] in limits.KERNEL_HEAD_DIMS else 64
    dtype = torch.float16 if rec.get("dtype") == "float16" else torch.bfloat16
    bt, lens, sm, npages = _compact(rec, ps)
    g = torch.Generator().manual_seed(seed)
    slots = npages * ps
    kb = torch.randn(slots, hkv, d, generator=g).to(dtype)
    vb = torch.randn(slots, hkv, d, generator=g).to(dtype)
    hc = torch.randn(hkv, d, generator=g).to(dtype)
    cache = PagedKVCache.from_sglang(kb.to(DEV), vb.to(DEV), ps,
                                     alloc_summaries(slots, p.block_size, hkv, d, dtype, DEV))
    try:
        kchecks.check_kernel_config(dtype, hq, cache, p)
    except ValueError:
        return None  # a configuration the kernels reject (test_kernel_validation.py)
    # summaries of every block of the random cache, written by the kernel
    write_kv_and_summaries(None, None, cache, torch.arange(slots, device=DEV), hc.to(DEV), p.block_size, decode=False)
    mirror = PagedKVCache.from_sglang(kb.clone(), vb.clone(), ps, cache.summaries.cpu().clone())
    cuda = DEV == "cuda"
    if rec["op"] == "decode":
        n = lens.shape[0]
        q = torch.randn(n, hq, d, generator=g).to(dtype)
        k = torch.randn(n, hkv, d, generator=g).to(dtype)
        v = torch.randn(n, hkv, d, generator=g).to(dtype)
        args = tuple(t.to(DEV) for t in (q, k, v)) + (cache,) + tuple(t.to(DEV) for t in (bt, lens, sm, hc)) + (p,)
        out = (ops.paged_dash_decode(*args) if cuda else kernel_decode(*args)).cpu()
        paged.write_kv(mirror, k, v, sm)
        paged.write_summaries(mirror, sm, hc, p)
        ref = torch.empty_like(q)
        paged.paged_dash_torch(q, mirror, bt, torch.arange(n + 1, dtype=torch.int32), lens, hc, p, ref)
        # both outputs are rounded to bf16/fp16: up to one ulp apart (2^-7 relative for bf16)
        err = ((out.double() - ref.double()).abs() - 1e-2 * ref.double().abs()).amax(-1)
        return err.numel(), int((err > 1e-2).sum())
    t = sm.shape[0]
    k = torch.randn(t, hkv, d, generator=g).to(dtype)
    v = torch.randn(t, hkv, d, generator=g).to(dtype)
    if cuda:
        ops.cache_dash_prefill(k.to(DEV), v.to(DEV), cache, sm.to(DEV), p, head_cls=hc.to(DEV))
    else:
        kv_write.write_prefill(k, v, cache, sm, p, hc)
    paged.write_kv(mirror, k, v, sm)
    paged.write_summaries(mirror, sm, hc, p)
    assert torch.equal(cache.k_pages.cpu(), mirror.k_pages) and torch.equal(cache.v_pages.cpu(), mirror.v_pages)
    torch.testing.assert_close(cache.summaries.cpu().double(), mirror.summaries.double(), **summary_tolerance(dtype))
    return 0, 0


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_replay_recorded_engine_batches(engine):
    files = sorted(glob.glob(str(FIXTURES / engine / "*.pt")))
    if not files:
        pytest.skip(f"no recorded {engine} batches under tests/fixtures/engine_batches/{engine}")
    if DEV != "cuda" and len(files) > MAX_FILES_INTERPRETED:  # an even sample keeps CI's interpreter run short
        step = len(files) / MAX_FILES_INTERPRETED
        files = [files[int(i * step)] for i in range(MAX_FILES_INTERPRETED)]
    checked = bad = replayed = 0
    for n, path in enumerate(files):
        res = replay(torch.load(path, weights_only=True), seed=n)
        if res is None:
            continue
        replayed += 1
        checked, bad = checked + res[0], bad + res[1]
    if not replayed:
        pytest.skip(f"no {engine} batch the kernels support among {len(files)} files")
    assert bad <= 0.05 * max(checked, 1), f"{bad} of {checked} decode rows differ from the torch paged path"
