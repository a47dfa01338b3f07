"""The public ops with the auxiliary head (docs/semantics.md section 9) on the PyTorch paged path, against the
float64 oracle: the indexer router, page mode (page RoPE applied by the op from roles and positions,
decode coordinates derived from the stored rows), chunked extend on history, validation."""

import pytest
import torch

from dash_core import DashParams, dash_reference
from dash_core.layout import PagedKVCache, alloc_aux_sglang, alloc_summaries, decode_aux
from dash_core.ops import cache_dash_prefill, paged_dash_decode, paged_dash_prefill
from dash_core.rope import PageRopeSettings, RotarySettings, page_coordinates, page_rope

D, HQ, HKV, HI, PS = 32, 4, 2, 3, 16
I32 = torch.int32
PR = PageRopeSettings(main=RotarySettings(theta=10000.0), indexer=RotarySettings(theta=500.0, rotary_dim=16),
                      tok_pairs=4)
# The op and the oracle evaluate the same float64 math on identical stored values and cast the result: bf16
# outputs are equal bit for bit; float32 ones are allowed a few float32 ulps (1e-6 is four at |out| < 4), in
# case the two sum in other orders.
TOL = {torch.float32: 1e-6, torch.bfloat16: 0.0}


def make_cache(dtype, slots=512, store=True):
    summ = alloc_summaries(slots, 16, 1, D, dtype) if store else None
    return PagedKVCache.from_sglang(torch.zeros(slots, HKV, D, dtype=dtype), torch.zeros(slots, HKV, D, dtype=dtype),
                                    PS, summ, aux=alloc_aux_sglang(slots, D, dtype))


def inputs(n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, sc=1.0: (torch.randn(*s, generator=g) * sc).to(dtype)
    return r(n, HQ, D), r(n, HKV, D), r(n, HKV, D), r(n, HI, D, sc=2.0), r(n, D, sc=2.0)


def hf(x):  # [T, H, D] -> [1, H, T, D]
    return x.permute(1, 0, 2)[None]


def oracle(q, k, v, iq, ik, hci, p, rows=None):
    out, _ = dash_reference(hf(q), hf(k), hf(v), torch.zeros(HKV, D), p, rows=rows, iq=hf(iq), ik=ik[None],
                            head_cls_i=hci)
    return out[0].permute(1, 0, 2)


class Request:
    """One request's page table (scattered pages) and slots."""

    def __init__(self, pages):
        self.bt = torch.tensor(pages, dtype=I32)

    def slots(self, lo, hi):
        pos = torch.arange(lo, hi)
        return self.bt[pos // PS].long() * PS + pos % PS


def batch(reqs, lo, hi):
    """Block table, slots and cu_seqlens for requests extending [lo_i, hi_i)."""
    bt = torch.stack([r.bt for r in reqs])
    slots = torch.cat([r.slots(a, b) for r, a, b in zip(reqs, lo, hi)])
    cu = torch.tensor([0] + [b - a for a, b in zip(lo, hi)]).cumsum(0).to(I32)
    return bt, slots, cu, torch.tensor(hi, dtype=I32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("store", [True, False])
def test_indexer_prefill_and_decode(dtype, store):
    """Two requests (prompts of 75 and 40 tokens) prefilled in one batch, then three decode steps."""
    p = DashParams(block_size=16, scaling_factor=3.0, topk=2, local=32)
    lens = [75, 40]
    reqs = [Request([5, 2, 7, 9, 11, 3, 30]), Request([8, 1, 13, 20, 4, 6, 31])]
    data = [inputs(n + 3, dtype, seed) for n, seed in zip(lens, (1, 2))]
    hci = torch.randn(D, generator=torch.Generator().manual_seed(3)).to(dtype)
    cache = make_cache(dtype, store=store)
    bt, slots, cu, sl = batch(reqs, [0, 0], lens)
    cat = lambda j, lo, hi: torch.cat([d[j][a:b] for d, a, b in zip(data, lo, hi)])
    out = paged_dash_prefill(cat(0, [0, 0], lens), cat(1, [0, 0], lens), cat(2, [0, 0], lens), cache, bt, cu, sl,
                             slots, None, p, iq=cat(3, [0, 0], lens), ik=cat(4, [0, 0], lens), head_cls_i=hci)
    for i, (d, n) in enumerate(zip(data, lens)):
        ref = oracle(*(x[:n] for x in d), hci, p)
        assert torch.allclose(out[cu[i]:cu[i + 1]].double(), ref.double(), atol=TOL[dtype], rtol=0)
    for step in range(3):
        lo, hi = [n + step for n in lens], [n + step + 1 for n in lens]
        bt, slots, _, sl = batch(reqs, lo, hi)
        o = paged_dash_decode(cat(0, lo, hi), cat(1, lo, hi), cat(2, lo, hi), cache, bt, sl, slots, None, p,
                              iq=cat(3, lo, hi), ik=cat(4, lo, hi), head_cls_i=hci)
        for i, (d, n) in enumerate(zip(data, hi)):
            ref = oracle(*(x[:n] for x in d), hci, p, rows=[n - 1])
            assert torch.allclose(o[i].double(), ref[0].double(), atol=TOL[dtype], rtol=0)
    # the stored indexer keys are ik, rows carry tok = page = position without page mode
    st = decode_aux(cache.aux_rows(reqs[0].slots(0, 78)), D)
    assert torch.equal(st.ik, data[0][4][:78]) and st.tok.tolist() == list(range(78)) and not st.num_pages.any()


def page_prompt():
    """text, page 1 (20 tokens), text, page 2 (25 tokens), page 3 (9 tokens), question: 76 tokens."""
    return [0] * 6 + [1] + [2] * 19 + [0] * 4 + [1] + [2] * 24 + [1] + [2] * 8 + [0] * 12


def rotated(q, k, iq, ik, roles, generated=0):
    tok, page = page_coordinates(torch.tensor(roles), generated=generated)
    return (page_rope(q, tok, page, PR), page_rope(k, tok, page, PR), page_rope(iq, tok, page, PR, main=False),
            page_rope(ik, tok, page, PR, main=False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("indexer", [True, False])
def test_page_mode_prefill_and_decode(dtype, indexer):
    """The op rotates unrotated inputs itself; the oracle gets them rotated by page_rope at the prefill
    derivation of the whole sequence (prompt + generated tokens). Decode steps derive each token's
    coordinates from the stored row of the one before, so equal outputs and equal stored rows mean
    decode-derived coordinates equal prefill-derived ones."""
    p = DashParams(block_size=16, scaling_factor=3.0, local=32)
    roles = page_prompt()
    n, gen = len(roles), 4
    other = [0] * 30  # a second request without pages: ordinary RoPE
    reqs = [Request([5, 2, 7, 9, 11, 3, 30]), Request([8, 1, 13, 20, 4, 6, 31])]
    d0, d1 = inputs(n + gen, dtype, 4), inputs(len(other) + gen, dtype, 5)
    hci = torch.randn(D, generator=torch.Generator().manual_seed(6)).to(dtype)
    cache = make_cache(dtype) if indexer else PagedKVCache.from_sglang(
        torch.zeros(512, HKV, D, dtype=dtype), torch.zeros(512, HKV, D, dtype=dtype), PS,
        alloc_summaries(512, 16, HKV, D, dtype), aux=alloc_aux_sglang(512, D, dtype))
    hc = torch.randn(HKV, D, generator=torch.Generator().manual_seed(7))
    lens = [n, len(other)]
    bt, slots, cu, sl = batch(reqs, [0, 0], lens)
    cat = lambda j, lo, hi: torch.cat([d0[j][lo[0]:hi[0]], d1[j][lo[1]:hi[1]]])
    ind = lambda lo, hi: dict(iq=cat(3, lo, hi), ik=cat(4, lo, hi), head_cls_i=hci) if indexer else {}
    positions = torch.cat([torch.arange(n), torch.arange(len(other))])
    out = paged_dash_prefill(cat(0, [0, 0], lens), cat(1, [0, 0], lens), cat(2, [0, 0], lens), cache, bt, cu, sl,
                             slots, hc, p, roles=torch.tensor(roles + other), positions=positions, page_rope=PR,
                             **ind([0, 0], lens))

    def ref(d, rl, m, g, rows=None):
        q, k, iq, ik = rotated(d[0][:m], d[1][:m], d[3][:m], d[4][:m], rl, g)
        if indexer:
            return oracle(q, k, d[2][:m], iq, ik, hci, p, rows)
        o, _ = dash_reference(hf(q), hf(k), hf(d[2][:m]), hc, p, rows=rows)
        return o[0].permute(1, 0, 2)

    assert torch.allclose(out[:n].double(), ref(d0, roles, n, 0).double(), atol=TOL[dtype], rtol=0)
    assert torch.allclose(out[n:].double(), ref(d1, other, len(other), 0).double(), atol=TOL[dtype], rtol=0)
    for step in range(gen):
        lo, hi = [m + step for m in lens], [m + step + 1 for m in lens]
        bt, slots, _, sl = batch(reqs, lo, hi)
        o = paged_dash_decode(cat(0, lo, hi), cat(1, lo, hi), cat(2, lo, hi), cache, bt, sl, slots, hc, p,
                              positions=torch.tensor(lo), page_rope=PR, **ind(lo, hi))
        for i, (d, rl) in enumerate(((d0, roles), (d1, other))):
            r = ref(d, rl, hi[i], step + 1, rows=[hi[i] - 1])
            assert torch.allclose(o[i].double(), r[0].double(), atol=TOL[dtype], rtol=0)
    # stored rows: the prefill derivation of prompt + generated tokens, roles, page count, query page
    for req, rl, m in ((reqs[0], roles, n), (reqs[1], other, len(other))):
        st = decode_aux(cache.aux_rows(req.slots(0, m + gen)), D)
        tok, page = page_coordinates(torch.tensor(rl), generated=gen)
        assert torch.equal(st.tok, tok) and torch.equal(st.page, page)
        assert st.role.tolist() == rl + [0] * gen
        npages = rl.count(1)
        assert (st.num_pages == npages).all() and (st.query_page == (npages + 1 if npages else 0)).all()
    counts = decode_aux(cache.aux_rows(reqs[0].slots(0, 2)), D).counts.reshape(-1)[:5]
    assert counts.tolist() == [6, 24, 25, 9, 12]  # page 0 .. query page, prompt tokens only
    # the stored keys are the rotated ones
    _, k_rot, _, ik_rot = rotated(d0[0][:n], d0[1][:n], d0[3][:n], d0[4][:n], roles)
    assert torch.equal(cache.keys(reqs[0].slots(0, n)), k_rot)
    if indexer:
        assert torch.equal(decode_aux(cache.aux_rows(reqs[0].slots(0, n)), D).ik, ik_rot)


@pytest.mark.parametrize("split", [15, 40, 70])
def test_page_mode_chunked_extend_on_history(split):
    """A prompt prefilled in two chunks (split inside page 1, inside page 2, in the question) equals the
    one-chunk prefill: the second chunk continues the stored state of the history's last token."""
    p = DashParams(block_size=16, scaling_factor=3.0)
    roles = page_prompt()
    n = len(roles)
    req = Request([5, 2, 7, 9, 11, 3])
    q, k, v, iq, ik = inputs(n, torch.float32, 8)
    hci = torch.randn(D, generator=torch.Generator().manual_seed(9))
    cache = make_cache(torch.float32)
    outs = []
    for lo, hi in ((0, split), (split, n)):
        bt, slots, cu, sl = batch([req], [lo], [hi])
        outs.append(paged_dash_prefill(q[lo:hi], k[lo:hi], v[lo:hi], cache, bt, cu, sl, slots, None, p,
                                       iq=iq[lo:hi], ik=ik[lo:hi], head_cls_i=hci, roles=torch.tensor(roles[lo:hi]),
                                       positions=torch.arange(lo, hi), page_rope=PR))
    ref = oracle(*rotated(q, k, iq, ik, roles)[:2], v, *rotated(q, k, iq, ik, roles)[2:], hci, p)
    assert torch.allclose(torch.cat(outs), ref, atol=TOL[torch.float32], rtol=0)
    st = decode_aux(cache.aux_rows(req.slots(0, n)), D)
    tok, page = page_coordinates(torch.tensor(roles))
    assert torch.equal(st.tok, tok) and torch.equal(st.page, page)


def test_engine_writes_first_then_attends():
    """An engine that writes first: cache_dash_prefill writes (page RoPE, rows, indexer summaries) for a mixed
    batch of a prefill and a decode token, then the ops run with k = None and read the coordinates back."""
    p = DashParams(block_size=16, scaling_factor=3.0)
    roles = page_prompt()
    n = len(roles)
    reqs = [Request([5, 2, 7, 9, 11, 3]), Request([8, 1, 13, 20, 4, 6])]
    d0, d1 = inputs(n, torch.float32, 10), inputs(n + 1, torch.float32, 11)
    hci = torch.randn(D, generator=torch.Generator().manual_seed(12))
    cache = make_cache(torch.float32)
    # request 1's prompt first (one chunk), through the same two calls
    bt, slots, cu, sl = batch(reqs[1:], [0], [n])
    pos = torch.arange(n)
    cache_dash_prefill(d1[1][:n], d1[2][:n], cache, slots, p, ik=d1[4][:n], head_cls_i=hci,
                       roles=torch.tensor(roles), positions=pos, page_rope=PR, block_table=bt, cu_seqlens_q=cu)
    paged_dash_prefill(d1[0][:n], None, None, cache, bt, cu, sl, None, None, p, iq=d1[3][:n], head_cls_i=hci,
                       positions=pos, page_rope=PR)
    # mixed batch: request 0's whole prompt, request 1's first generated token
    bt, slots, cu, sl = batch(reqs, [0, n], [n, n + 1])
    pos = torch.cat([torch.arange(n), torch.tensor([n])])
    cat = lambda j: torch.cat([d0[j], d1[j][n:]])
    cache_dash_prefill(cat(1), cat(2), cache, slots, p, ik=cat(4), head_cls_i=hci, roles=torch.tensor(roles + [0]),
                       positions=pos, page_rope=PR, block_table=bt, cu_seqlens_q=cu)
    out = paged_dash_prefill(cat(0), None, None, cache, bt, cu, sl, None, None, p, iq=cat(3), head_cls_i=hci,
                             positions=pos, page_rope=PR)
    q, k, iq, ik = rotated(d0[0], d0[1], d0[3], d0[4], roles)
    assert torch.allclose(out[:n], oracle(q, k, d0[2], iq, ik, hci, p), atol=1e-5, rtol=0)
    q, k, iq, ik = rotated(d1[0], d1[1], d1[3], d1[4], roles, generated=1)
    assert torch.allclose(out[n:], oracle(q, k, d1[2], iq, ik, hci, p, rows=[n]), atol=1e-5, rtol=0)


def test_validation_before_any_write():
    p = DashParams(block_size=16)
    q, k, v, iq, ik = inputs(20, torch.float32, 13)
    hci = torch.randn(D)
    req = Request([1, 2])
    bt, slots, cu, sl = batch([req], [0], [20])
    roles = torch.zeros(20, dtype=torch.long)
    pos = torch.arange(20)
    cache = make_cache(torch.float32)
    plain = PagedKVCache(cache.k_pages, cache.v_pages, cache.summaries)
    cases = [
        (dict(cache=plain, iq=iq, ik=ik, head_cls_i=hci), "auxiliary head"),
        (dict(iq=iq, ik=ik), "go together"),
        (dict(iq=iq, head_cls_i=hci), "go together"),
        (dict(iq=iq[:, :, :16], ik=ik, head_cls_i=hci), "iq must be"),
        (dict(iq=iq, ik=ik, head_cls_i=hci[:8]), "head_cls_i must be"),
        (dict(roles=roles), "without page_rope"),
        (dict(iq=iq, ik=ik, head_cls_i=hci, page_rope=PR, roles=roles), "positions"),
        (dict(iq=iq, ik=ik, head_cls_i=hci, page_rope=PR, positions=pos), "roles"),
        (dict(iq=iq, ik=ik, head_cls_i=hci, page_rope=PR, positions=pos, roles=roles + 3), "roles must be"),
        (dict(iq=iq, ik=ik, head_cls_i=hci, page_rope=PR, positions=pos.float(), roles=roles), "positions"),
        (dict(iq=iq, ik=ik, head_cls_i=hci, page_rope=RotarySettings(), positions=pos, roles=roles), "page_rope"),
        (dict(cache=PagedKVCache(cache.k_pages, cache.v_pages, alloc_summaries(512, 16, HKV, D, torch.float32),
                                 cache.aux), iq=iq, ik=ik, head_cls_i=hci), "one head"),
    ]
    for kw, msg in cases:
        c = kw.pop("cache", cache)
        with pytest.raises(ValueError, match=msg):
            paged_dash_prefill(q, k, v, c, bt, cu, sl, slots, None, p, **kw)
    with pytest.raises(ValueError, match="slot_mapping must be"):  # a float slot mapping would index garbage
        paged_dash_prefill(q, k, v, cache, bt, cu, sl, slots.float(), None, p, iq=iq, ik=ik, head_cls_i=hci)
    assert not cache.k_pages.any() and not cache.aux.any() and not cache.summaries.any()
    with pytest.raises(ValueError, match="block_table"):
        cache_dash_prefill(k, v, cache, slots, p, ik=ik, head_cls_i=hci, roles=roles, positions=pos, page_rope=PR)
    assert not cache.k_pages.any() and not cache.aux.any()


def test_plain_call_on_an_indexer_store_fails_before_any_write():
    """A cache whose summary store holds the indexer's 1-head summaries of ik, called without the
    indexer (iq, ik, head_cls_i forgotten): every op refuses it with a ValueError before writing K/V
    (the store cannot take summaries of the Hkv heads of K)."""
    p = DashParams(block_size=16)
    q, k, v, _, _ = inputs(20, torch.float32, 21)
    hc = torch.randn(HKV, D)
    req = Request([1, 2])
    bt, slots, cu, sl = batch([req], [0], [20])
    cache = make_cache(torch.float32)  # 1-head (indexer) store
    calls = [
        lambda: cache_dash_prefill(k, v, cache, slots, p, head_cls=hc),
        lambda: paged_dash_prefill(q, k, v, cache, bt, cu, sl, slots, hc, p),
        lambda: paged_dash_decode(q[:1], k[:1], v[:1], cache, bt, torch.tensor([1], dtype=I32), slots[:1], hc, p),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="indexer"):
            call()
        assert not cache.k_pages.any() and not cache.summaries.any()


def test_standalone_indexer_page_mode():
    """The README's worked example: DashKVCache(indexer=True) and dash_attention with unrotated inputs,
    a page-mode prompt of two sequences then two decode steps, against the oracle."""
    from dash_core.standalone import DashKVCache, dash_attention

    p = DashParams(block_size=16, scaling_factor=3.0)
    roles = torch.tensor([page_prompt(), [0] * 20 + [1] + [2] * 40 + [0] * 15])  # [B = 2, S = 76]
    b, s, gen = 2, roles.shape[1], 2
    g = torch.Generator().manual_seed(14)
    q, k, v = (torch.randn(b, h, s + gen, D, generator=g) for h in (HQ, HKV, HKV))
    iq, ik = torch.randn(b, HI, s + gen, D, generator=g), torch.randn(b, s + gen, D, generator=g)
    hci = torch.randn(D, generator=g)
    cache = DashKVCache(1, b, 128, HKV, D, p, indexer=True)
    outs = [dash_attention(q[:, :, :s], k[:, :, :s], v[:, :, :s], None, cache, 0, iq=iq[:, :, :s], ik=ik[:, :s],
                           head_cls_i=hci, roles=roles, page_rope=PR)]
    for t in range(s, s + gen):
        sl = slice(t, t + 1)
        outs.append(dash_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], None, cache, 0, iq=iq[:, :, sl],
                                   ik=ik[:, sl], head_cls_i=hci, page_rope=PR))
    out = torch.cat(outs, dim=2)
    for i in range(b):
        tq, tk, tiq, tik = rotated(q[i].transpose(0, 1), k[i].transpose(0, 1), iq[i].transpose(0, 1), ik[i],
                                   roles[i].tolist(), gen)
        ref = oracle(tq, tk, v[i].transpose(0, 1), tiq, tik, hci, p)
        assert torch.allclose(out[i].transpose(0, 1), ref, atol=1e-5, rtol=0)


def test_cache_write_roles_default_to_text():
    """cache_dash_prefill without roles stores role 0 (decode tokens of an engine's mixed batch): the
    rows equal those of explicit zero roles."""
    p = DashParams(block_size=16)
    _, k, v, _, _ = inputs(20, torch.float32, 15)
    req = Request([1, 2])
    bt, slots, cu, _ = batch([req], [0], [20])
    rows = []
    for roles in (None, torch.zeros(20, dtype=torch.long)):
        cache = make_cache(torch.float32, store=False)
        cache_dash_prefill(k, v, cache, slots, p, roles=roles, positions=torch.arange(20), page_rope=PR,
                           block_table=bt, cu_seqlens_q=cu)
        rows.append(cache.aux_rows(slots))
    assert torch.equal(rows[0], rows[1])
    assert decode_aux(rows[0], D).tok.tolist() == list(range(20))


def test_padded_decode_rows_write_nothing():
    """A captured decode pads the batch (seq_len 0, slot -1, position 0): the padded row writes no K/V,
    row or summary and returns zeros; the real row equals the unpadded step."""
    p = DashParams(block_size=16, scaling_factor=3.0)
    roles = page_prompt()
    n = len(roles)
    req = Request([5, 2, 7, 9, 11, 3])
    q, k, v, iq, ik = inputs(n + 1, torch.float32, 16)
    hci = torch.randn(D, generator=torch.Generator().manual_seed(17))
    results = []
    for pad in (False, True):
        cache = make_cache(torch.float32)
        bt, slots, cu, sl = batch([req], [0], [n])
        paged_dash_prefill(q[:n], k[:n], v[:n], cache, bt, cu, sl, slots, None, p, iq=iq[:n], ik=ik[:n],
                           head_cls_i=hci, roles=torch.tensor(roles), positions=torch.arange(n), page_rope=PR)
        before = [x.clone() for x in (cache.k_pages, cache.aux, cache.summaries)]
        bt, slots, _, sl = batch([req], [n], [n + 1])
        sel = [0, 0] if pad else [0]
        rows = lambda x: x[n:][sel]
        if pad:
            bt, sl = torch.cat([bt, torch.zeros_like(bt)]), torch.tensor([n + 1, 0], dtype=I32)
            slots = torch.cat([slots, torch.tensor([-1])])
        out = paged_dash_decode(rows(q), rows(k), rows(v), cache, bt, sl, slots, None, p, iq=rows(iq), ik=rows(ik),
                                head_cls_i=hci, positions=torch.tensor([n, 0][:len(sel)]), page_rope=PR)
        changed = [(x != b).flatten(1).any(1).nonzero().flatten().tolist()
                   for x, b in zip((cache.k_pages, cache.aux), before[:2])]
        results.append((out, changed, cache.summaries.clone()))
    (o1, c1, s1), (o2, c2, s2) = results
    assert torch.equal(o2[0], o1[0]) and not o2[1].any()
    assert c1 == c2 and torch.equal(s1, s2)  # the same pages changed, nothing else


@pytest.mark.parametrize("indexer", [True, False])
def test_page_invariance_through_the_op(indexer):
    """The same page (block-aligned) at two prompt offsets: the op stores bit-identical rotated keys,
    indexer keys and block summaries for it (docs/semantics.md section 9, page invariance)."""
    p = DashParams(block_size=16, scaling_factor=3.0)
    page = [1] + [2] * 31
    prompts = [[0] * 16 + page + [0] * 5, [0] * 48 + page + [0] * 9]
    starts = [16, 48]
    g = torch.Generator().manual_seed(18)
    shared = [torch.randn(32, *s, generator=g).to(torch.bfloat16) for s in ((HQ, D), (HKV, D), (HKV, D), (HI, D), (D,))]
    reqs = [Request([5, 2, 7, 9, 11, 3]), Request([8, 1, 13, 20, 4, 6])]
    cache = make_cache(torch.bfloat16) if indexer else PagedKVCache.from_sglang(
        torch.zeros(512, HKV, D, dtype=torch.bfloat16), torch.zeros(512, HKV, D, dtype=torch.bfloat16), PS,
        alloc_summaries(512, 16, HKV, D, torch.bfloat16), aux=alloc_aux_sglang(512, D, torch.bfloat16))
    data = []
    for r, st in zip(prompts, starts):
        x = list(inputs(len(r), torch.bfloat16, 19 + st))
        for j in range(5):
            x[j][st: st + 32] = shared[j]
        data.append(x)
    lens = [len(r) for r in prompts]
    bt, slots, cu, sl = batch(reqs, [0, 0], lens)
    cat = lambda j: torch.cat([d[j] for d in data])
    ind = dict(iq=cat(3), ik=cat(4), head_cls_i=torch.randn(D, generator=g).to(torch.bfloat16)) if indexer else {}
    paged_dash_prefill(cat(0), cat(1), cat(2), cache, bt, cu, sl, slots, torch.randn(HKV, D, generator=g), p,
                       roles=torch.tensor(sum(prompts, [])), positions=torch.cat([torch.arange(n) for n in lens]),
                       page_rope=PR, **ind)
    page_slots = [req.slots(st, st + 32) for req, st in zip(reqs, starts)]
    assert torch.equal(cache.keys(page_slots[0]), cache.keys(page_slots[1]))
    assert torch.equal(cache.aux_rows(page_slots[0])[:, :D], cache.aux_rows(page_slots[1])[:, :D])
    summ = [cache.summaries[s[::16] // 16] for s in page_slots]
    assert torch.equal(summ[0], summ[1]) and summ[0].abs().sum() > 0
