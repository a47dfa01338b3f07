"""The oracle's indexer router (docs/semantics.md section 9) against a direct computation."""

import math

import pytest
import torch

from dash_core import DashParams, dash_reference
from dash_core.reference import entmax15_threshold


def direct_indexer_dash(q, k, v, iq, ik, hci, p: DashParams):
    """One sequence, written out: q [Hq,N,D], k, v [Hkv,N,D], iq [Hi,N,Di], ik [N,Di], hci [Di].

    topk = None and estimate_diagonal = False, so the prior is the mean entmax probability itself.
    Reuses only the oracle's entmax threshold (three Halley steps are part of the semantics).
    """
    hq, n, d = q.shape
    hkv = k.shape[0]
    hi, _, di = iq.shape
    bs, lb = p.block_size, p.local_blocks
    nblk = n // bs
    # summaries of ik, one head, stored in the KV dtype
    summ = torch.zeros(nblk, di, dtype=torch.float64)
    for j in range(nblk):
        kb = ik[j * bs:(j + 1) * bs].double()
        w = torch.softmax(kb @ hci.double() / math.sqrt(di), 0)
        summ[j] = (w[:, None] * kb).sum(0)
    summ = summ.to(ik.dtype).double()
    iqs = (iq * p.scaling_factor).to(iq.dtype).double()
    out = torch.zeros(hq, n, d, dtype=torch.float64)
    for t in range(n):
        ncand = max(0, t // bs - lb + 1)
        logpi = torch.full((n,), -math.inf, dtype=torch.float64)
        if ncand:
            x = 0.5 * (iqs[:, t] @ summ[:ncand].T) / math.sqrt(di)  # [Hi, ncand]
            tau = entmax15_threshold(x, torch.ones_like(x, dtype=torch.bool))
            prob = torch.clamp(x - tau[:, None], min=0) ** 2
            mp = prob.mean(0)  # the shared selection: mean over the indexer heads
            for j in range(ncand):
                if mp[j] > 0:
                    logpi[j * bs:(j + 1) * bs] = math.log(mp[j])
        lo = max(0, t // bs - lb + 1) * bs
        logpi[lo:t + 1] = 0.0
        logpi[t + 1:] = -math.inf
        for h in range(hq):
            kv = h // (hq // hkv)
            logits = k[kv].double() @ q[h, t].double() / math.sqrt(d) + logpi
            out[h, t] = torch.softmax(logits, 0) @ v[kv].double()
    return out


def make(seed, b=1, hq=4, hkv=2, hi=3, n=150, d=16, di=8, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g).to(dtype) for h in (hq, hkv, hkv))
    iq = torch.randn(b, hi, n, di, generator=g).to(dtype) * 2
    ik = torch.randn(b, n, di, generator=g).to(dtype) * 2
    return q, k, v, torch.randn(hkv, d, generator=g), iq, ik, torch.randn(di, generator=g)


@pytest.mark.parametrize("local", [16, 32])
def test_indexer_router_matches_direct_computation(local):
    q, k, v, hc, iq, ik, hci = make(0)
    p = DashParams(block_size=16, local=local, scaling_factor=3.0)
    out, active = dash_reference(q, k, v, hc, p, iq=iq, ik=ik, head_cls_i=hci)
    exp = direct_indexer_dash(q[0], k[0], v[0], iq[0], ik[0], hci, p)
    # float64 throughout on both sides; the oracle returns q.dtype = float32: 1e-6 covers that rounding
    assert torch.allclose(out[0].double(), exp, atol=1e-6, rtol=1e-6)
    # one shared selection: every KV head has the same number of active blocks
    assert (active == active[:, :1]).all()
    # and it differs from routing with the attention queries (the indexer really routes)
    plain, _ = dash_reference(q, k, v, hc, p)
    assert (plain - out).abs().max() > 1e-3


def test_indexer_equal_to_attention_gives_the_shared_router():
    # Hkv = 1, iq = q, ik = k, head_cls_i = head_cls[0]: the indexer is the attention router itself
    q, k, v, hc, _, _, _ = make(1, hkv=1, d=16)
    p = DashParams(block_size=16, scaling_factor=2.0, topk=3, estimate_diagonal=True, sigma=4.0)
    ref, act_ref = dash_reference(q, k, v, hc, p)
    out, act = dash_reference(q, k, v, hc, p, iq=q, ik=k[:, 0], head_cls_i=hc[0])
    assert torch.equal(out, ref) and torch.equal(act, act_ref)


def test_indexer_dense_equivalent_is_dense_attention():
    q, k, v, hc, iq, ik, hci = make(2, b=2, n=70)
    out, _ = dash_reference(q, k, v, hc, DashParams.dense_equivalent(16), iq=iq, ik=ik, head_cls_i=hci)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1), is_causal=True)
    assert torch.allclose(out.double(), dense, atol=1e-6)


def test_indexer_rows_and_bf16():
    # rows select the same values as the full call; bf16 inputs go the same path (rounding once)
    q, k, v, hc, iq, ik, hci = make(3, n=100, dtype=torch.bfloat16)
    p = DashParams(block_size=16, scaling_factor=5.0, topk=2)
    full, act = dash_reference(q, k, v, hc, p, iq=iq, ik=ik, head_cls_i=hci)
    rows = [99, 3, 64, 50]
    part, act_part = dash_reference(q, k, v, hc, p, rows=rows, iq=iq, ik=ik, head_cls_i=hci)
    assert torch.equal(part, full[:, :, rows]) and torch.equal(act_part, act[:, :, rows])


def test_indexer_arguments_checked():
    q, k, v, hc, iq, ik, hci = make(4, n=40)
    p = DashParams(block_size=16)
    with pytest.raises(ValueError, match="go together"):
        dash_reference(q, k, v, hc, p, iq=iq, ik=ik)
    with pytest.raises(ValueError, match="ik must be"):
        dash_reference(q, k, v, hc, p, iq=iq, ik=ik[:, :-1], head_cls_i=hci)
    with pytest.raises(ValueError, match="iq must be"):
        dash_reference(q, k, v, hc, p, iq=iq[0], ik=ik, head_cls_i=hci)
