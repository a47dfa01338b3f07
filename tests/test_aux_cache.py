"""PagedKVCache's auxiliary head (``aux``) over both engines' storage, and ``extend_coordinates``."""

import random

import pytest
import torch

from dash_core.layout import (PagedKVCache, alloc_aux_sglang, aux_view_vllm, decode_aux, encode_aux,
                              page_count_rows)
from dash_core.rope import extend_coordinates, page_state
from tests.test_rope import KINDS, direct_coordinates, random_roles

D = 32


def test_vllm_aux_slot_is_head_hkv():
    kv = torch.zeros(6, 3, 16, 2 * D, dtype=torch.bfloat16)  # Hkv = 2 plus the auxiliary head
    c = PagedKVCache.from_vllm(kv, 2, D, aux=True)
    slots = torch.tensor([0, 17, 95])
    rows = encode_aux(torch.randn(3, D), torch.tensor([0, 1, 2]), torch.tensor([5, 0, 70000]),
                      torch.tensor([0, 1, 65535]), 3, 4, head_dim=D, dtype=torch.bfloat16)
    c.aux[slots // 16, slots % 16] = rows
    assert torch.equal(kv[slots // 16, 2, slots % 16], rows)  # stored in head slot Hkv, no copy
    assert torch.equal(c.aux_rows(slots), rows) and torch.equal(c.index_keys(slots)[:, 0], rows[:, :D])
    assert decode_aux(c.aux_rows(slots), D).tok.tolist() == [5, 0, 70000]
    assert torch.equal(c.aux, aux_view_vllm(kv, 2, D))
    assert PagedKVCache.from_vllm(kv, 2, D).aux is None
    with pytest.raises(ValueError, match="auxiliary head"):
        PagedKVCache.from_vllm(torch.zeros(6, 2, 16, 2 * D), 2, D, aux=True)


def test_sglang_aux_buffer_by_slot():
    k, v = torch.zeros(64, 2, D), torch.zeros(64, 2, D)
    buf = alloc_aux_sglang(64, D, torch.float32)
    c = PagedKVCache.from_sglang(k, v, 16, aux=buf)
    c.aux[2, 3, 5] = 7.0
    assert buf[2 * 16 + 3, 5] == 7.0
    with pytest.raises(ValueError, match="alloc_aux_sglang"):
        PagedKVCache.from_sglang(k, v, 16, aux=torch.zeros(63, 2 * D))
    with pytest.raises(ValueError, match="aux must be"):
        PagedKVCache(c.k_pages, c.v_pages, aux=buf.to(torch.float16).view(4, 16, 2 * D))
    with pytest.raises(ValueError, match="no auxiliary head"):
        PagedKVCache.from_sglang(k, v, 16).aux_rows(torch.tensor([0]))


def _extend(roles, cu, has_prev, prev):
    return extend_coordinates(torch.tensor(roles, dtype=torch.long), torch.tensor(cu), torch.tensor(has_prev),
                              *(torch.as_tensor(x, dtype=torch.long) for x in prev))


def test_extend_coordinates_fresh_batch_and_decode():
    """A batch of fresh prompts equals the literal SPEC derivation per request (page counts included);
    one role-0 token continuing the stored state equals the derivation with generated tokens."""
    rng = random.Random(0)
    for _ in range(60):
        reqs = [random_roles(rng, rng.choice(KINDS)) for _ in range(3)]
        cu = [0]
        for r in reqs:
            cu.append(cu[-1] + len(r))
        tok, page, npages, qpage, counts = _extend(sum(reqs, []), cu, [False] * 3, [[0] * 3] * 4)
        for i, r in enumerate(reqs):
            et, ep = direct_coordinates(r, 3)
            n = len(r)
            assert tok[cu[i]:cu[i + 1]].tolist() == et[:n] and page[cu[i]:cu[i + 1]].tolist() == ep[:n]
            p, qp = page_state(r)
            assert (npages[i].item(), qpage[i].item()) == (p, qp)
            per_page = torch.bincount(torch.tensor(ep[:n] if p else [0] * n), minlength=p + 2)
            assert torch.equal(counts[cu[i]:cu[i + 1]], page_count_rows(per_page, n))
            # three decode steps from the stored state
            st = (et[n - 1], ep[n - 1], p, qp)
            for j in range(3):
                t2, p2, n2, q2, c2 = _extend([0], [0, 1], [True], [[x] for x in st])
                assert (t2.item(), p2.item(), n2.item(), q2.item()) == (et[n + j], ep[n + j], p, qp)
                assert not c2.any()
                st = (t2.item(), p2.item(), p, qp)


def test_extend_coordinates_chunk_on_history():
    """A chunk after history continues the stored state and is the end of the prompt: split inside a
    page or after the last page token, the two chunks give the whole prompt's coordinates."""
    rng = random.Random(1)
    checked = 0
    for _ in range(200):
        r = random_roles(rng, rng.choice(KINDS[1:]))
        first_page = r.index(1)
        s = rng.randrange(first_page + 1, len(r))  # history holds the first page start
        if r[s - 1] == 0 and 1 in r[s:]:
            continue  # text between pages ending the history: stored in the query page (documented limit)
        t1, p1, n1, q1, _ = _extend(r[:s], [0, s], [False], [[0]] * 4)
        t2, p2, n2, q2, c2 = _extend(r[s:], [0, len(r) - s], [True], [t1[-1:], p1[-1:], n1, q1])
        et, ep = direct_coordinates(r)
        assert t1.tolist() + t2.tolist() == et and p1.tolist() + p2.tolist() == ep, (r, s)
        assert (n2.item(), q2.item()) == page_state(r) and not c2.any()
        checked += 1
    assert checked > 50
