"""K/V write and block summaries (stage 1) of the Triton kernels against the oracle."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tests._benchmarks import import_benchmark
from tests.kernels._kernel_env import KERNEL_DEVICE
from dash_core.kernels import kv_write
from dash_core.kernels.kv_write import write_kv_and_summaries
from dash_core.layout import PagedKVCache, alloc_summaries
from dash_core.reference import block_summaries
from tests.kernels._kernel_scenarios import batch_lens, make_scenario, summary_tolerance

EXAMPLES = int(os.environ.get("DASH_KERNEL_EXAMPLES", "10"))
DEV = KERNEL_DEVICE


@settings(max_examples=EXAMPLES, deadline=None)
# one request whose token completes a block of 32 (and so one of 16), in any order among the others
@given(seed=st.integers(0, 2**31 - 1), lens=batch_lens(st.integers(1, 3).map(lambda b: 32 * b), st.integers(0, 100)),
       bs=st.sampled_from([16, 32]), ppb=st.integers(1, 3), layout=st.sampled_from(["sglang", "vllm"]),
       dtype=st.sampled_from([torch.bfloat16, torch.float16]))
def test_decode_write_and_summary(seed, lens, bs, ppb, layout, dtype):
    """One decode token per request: K/V land in their slots bit-exactly; a token that completes a
    block writes that block's summary (oracle within one unit in the last place), nothing else changes."""
    sc = make_scenario(seed, lens, bs=bs, pages_per_block=ppb, layout=layout, dtype=dtype,
                       shared_prefix_pages=1).to(DEV)
    before = [x.clone().cpu() for x in (sc.cache.summaries, sc.cache.k_pages, sc.cache.v_pages)]
    write_kv_and_summaries(sc.k_new, sc.v_new, sc.cache, sc.slot_mapping, sc.head_cls, bs, decode=True)
    ps = sc.cache.page_size
    expect, k_expect, v_expect = before[0].double(), before[1], before[2]
    for i, L in enumerate(lens):
        if L == 0:
            continue
        slot = int(sc.slot_mapping[i])
        k_expect[slot // ps, slot % ps] = sc.k_new[i].cpu()
        v_expect[slot // ps, slot % ps] = sc.v_new[i].cpu()
        if L % bs == 0:
            s = block_summaries(sc.k_full[i][:, L - bs:], sc.head_cls.cpu(), bs)[:, 0]  # [Hkv, D]
            expect[slot // bs] = s
    assert torch.equal(sc.cache.k_pages.cpu(), k_expect) and torch.equal(sc.cache.v_pages.cpu(), v_expect)
    torch.testing.assert_close(sc.cache.summaries.cpu().double(), expect, **summary_tolerance(dtype))


@settings(max_examples=EXAMPLES, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), ntok=st.integers(1, 150), bs=st.sampled_from([16, 32, 64]),
       ppb=st.integers(1, 4), layout=st.sampled_from(["sglang", "vllm"]), d=st.sampled_from([64, 128]),
       dtype=st.sampled_from([torch.bfloat16, torch.float16]), pad=st.integers(0, 3))
def test_prefill_write_and_summaries(seed, ntok, bs, ppb, layout, d, dtype, pad):
    """A prefill batch (tokens of several blocks, padding slots < 0) in shuffled pages: K/V equal the
    torch path exactly, every completed block is summarised (oracle within one ulp), others stay 0."""
    g = torch.Generator().manual_seed(seed)
    hkv, ps = 2, bs * ppb
    npages = -(-ntok // ps) + 2
    pages = torch.randperm(npages, generator=g)
    pos = torch.arange(ntok)
    slots = pages[pos // ps] * ps + pos % ps
    slot_mapping = torch.cat([slots, torch.full((pad,), -1)])[torch.randperm(ntok + pad, generator=g)]
    k = torch.randn(ntok + pad, hkv, d, generator=g).to(dtype)
    v = torch.randn(ntok + pad, hkv, d, generator=g).to(dtype)
    head_cls = torch.randn(hkv, d, generator=g).to(dtype)
    num_slots = npages * ps
    if layout == "sglang":
        kb, vb = torch.zeros(num_slots, hkv, d, dtype=dtype), torch.zeros(num_slots, hkv, d, dtype=dtype)
        make = lambda s: PagedKVCache.from_sglang(kb.to(DEV), vb.to(DEV), ps, s)
    else:
        kv = torch.zeros(npages, hkv + 1, ps, 2 * d, dtype=dtype)
        make = lambda s: PagedKVCache.from_vllm(kv.to(DEV), hkv, d, s)
    cache = make(alloc_summaries(num_slots, bs, hkv, d, dtype, DEV))
    write_kv_and_summaries(k.to(DEV), v.to(DEV), cache, slot_mapping.to(DEV), head_cls.to(DEV), bs, decode=False)
    keep = slot_mapping >= 0
    sl = slot_mapping[keep]
    assert torch.equal(cache.k_pages.cpu()[sl // ps, sl % ps], k[keep])
    assert torch.equal(cache.v_pages.cpu()[sl // ps, sl % ps], v[keep])
    expect = torch.zeros(num_slots // bs, hkv, d, dtype=torch.float64)
    by_pos = torch.empty(ntok, hkv, d, dtype=dtype)
    inv = {int(s): j for j, s in enumerate(slot_mapping.tolist()) if s >= 0}
    for p_ in range(ntok):
        by_pos[p_] = k[inv[int(slots[p_])]]
    nblk = ntok // bs
    if nblk:
        s = block_summaries(by_pos[: nblk * bs].permute(1, 0, 2), head_cls, bs)  # [Hkv, nblk, D]
        expect[slots[: nblk * bs: bs] // bs] = s.permute(1, 0, 2)
    torch.testing.assert_close(cache.summaries.cpu().double(), expect, **summary_tolerance(dtype))


@pytest.mark.parametrize("consecutive", [True, False])
def test_row_programs_write_as_one_program_per_token(consecutive):
    """The prefill write's row programs (``ROWS`` tokens of a head each; ``consecutive``: one launch, a block's new
    keys from the input) against the decode kernel launched once per token and head, write then summaries (the
    prefill write before them; ``benchmarks/kv_write.py``'s peer), bit for bit: prompts in order on
    shuffled pages that end just before, on and after a program's last token (bs 16: four blocks end in each
    program), a padding slot and one past the cache; then the summaries alone (``k, v`` None) again."""
    from dash_core.kernels import kv_write

    hkv, d, bs, dtype = 2, 64, 16, torch.bfloat16
    for t in (kv_write.ROWS - 1, kv_write.ROWS, kv_write.ROWS + 1, 2 * kv_write.ROWS + 1):
        g = torch.Generator().manual_seed(t)
        npages = -(-t // bs) + 1
        pos = torch.arange(t)
        slots = torch.randperm(npages, generator=g)[pos // bs] * bs + pos % bs
        slots[kv_write.ROWS - 2] = -1
        slots[kv_write.ROWS // 2] = npages * bs + 5  # past the cache: skipped
        k, v = (torch.randn(t, hkv, d, generator=g).to(dtype).to(DEV) for _ in range(2))
        head_cls = torch.randn(hkv, d, generator=g).to(dtype).to(DEV)

        def cache():
            kb = torch.full((npages * bs, hkv, d), 3.0, dtype=dtype, device=DEV)  # a stale read shows
            return PagedKVCache.from_sglang(kb, torch.zeros_like(kb), bs, alloc_summaries(npages * bs, bs, hkv, d,
                                                                                            dtype, DEV))

        rows, per_token = cache(), cache()
        sm = slots.to(DEV)
        write_kv_and_summaries(k, v, rows, sm, head_cls, bs, decode=False, consecutive=consecutive)
        import_benchmark("kv_write").per_token(k, v, per_token, sm, head_cls, bs)  # the benchmark's peer
        assert torch.equal(rows.k_pages, per_token.k_pages) and torch.equal(rows.v_pages, per_token.v_pages)
        assert torch.equal(rows.summaries, per_token.summaries)
        assert int((per_token.summaries.abs().sum((1, 2)) > 0).sum()) >= t // bs - 2  # blocks were summarised
        rows.summaries.zero_()
        write_kv_and_summaries(None, None, rows, sm, head_cls, bs, decode=False)
        assert torch.equal(rows.summaries, per_token.summaries)
        if consecutive:  # the same prompt in two calls that split a block (and a program): its older keys cached
            for cut in (2 * bs + 5, kv_write.ROWS + 3):
                if cut >= t:
                    continue
                chunked = cache()
                for part in (slice(0, cut), slice(cut, t)):
                    write_kv_and_summaries(k[part], v[part], chunked, sm[part], head_cls, bs, decode=False,
                                           consecutive=True)
                assert torch.equal(chunked.k_pages, per_token.k_pages)
                assert torch.equal(chunked.summaries, per_token.summaries)


@pytest.mark.parametrize("layout", ["sglang", "vllm"])
def test_no_write_placeholders_follow_the_write_arguments(layout):
    """``no_write_args`` (a select launch that writes nothing) matches ``write_args`` entry by entry in kind: a
    tensor where the write passes a tensor, an int where it passes an int, a float for the scale, so the launch
    binds the same signature either way (a changed ``write_args`` fails here before it miscompiles there)."""
    sc = make_scenario(1, [40, 70], bs=16, pages_per_block=1, layout=layout, dtype=torch.bfloat16)
    real = kv_write.write_args(sc.k_new, sc.v_new, sc.cache, sc.slot_mapping, sc.head_cls)
    none = kv_write.no_write_args(sc.k_new, sc.slot_mapping)

    def kind(x):
        return torch.Tensor if isinstance(x, torch.Tensor) else type(x)

    assert [kind(x) for x in none] == [kind(x) for x in real]
    at = [i for i, x in enumerate(real) if x is sc.slot_mapping]
    assert len(at) == 1 and none[at[0]] is sc.slot_mapping
