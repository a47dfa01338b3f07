"""The auxiliary-head byte layout (docs/semantics.md sections 8-9): exact round trips in every KV dtype."""

import pytest
import torch

from dash_core.layout import (AUX_MAX_INT, PagedKVCache, alloc_aux_sglang, aux_bytes_per_token,
                              aux_view_vllm, bytes_to_int, decode_aux, decode_page_counts, encode_aux,
                              int_to_bytes, page_count_rows)
from dash_core.rope import page_coordinates, page_state

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
D = 64


def edge_values():
    """Every byte boundary of the 4-byte range, plus the limits the state must hold."""
    vals = {0, 1, 254, 255, 256, 257, 65534, 65535, 65536, 65537, (1 << 24) - 1, 1 << 24, (1 << 24) + 1,
            (1 << 31) - 1, 1 << 31, AUX_MAX_INT - 1, AUX_MAX_INT}
    g = torch.Generator().manual_seed(0)
    vals |= set(torch.randint(0, AUX_MAX_INT, (200,), generator=g).tolist())
    return torch.tensor(sorted(vals))


@pytest.mark.parametrize("dtype", DTYPES)
def test_integer_fields_round_trip(dtype):
    v = edge_values()
    t = v.numel()
    g = torch.Generator().manual_seed(1)
    role = torch.randint(0, 3, (t,), generator=g)
    ik = torch.randn(t, D, generator=g)
    counts = torch.stack([v, v.flip(0), (v * 7) % (AUX_MAX_INT + 1)], -1)
    rows = encode_aux(ik, role, v, v.flip(0), torch.full((t,), 65535), v.roll(3), head_dim=D, dtype=dtype,
                      counts=counts)
    assert rows.dtype == dtype and rows.shape == (t, 2 * D)
    s = decode_aux(rows, D)
    assert torch.equal(s.role, role) and torch.equal(s.tok, v) and torch.equal(s.page, v.flip(0))
    assert torch.equal(s.num_pages, torch.full((t,), 65535)) and torch.equal(s.query_page, v.roll(3))
    assert torch.equal(s.counts, counts)
    assert torch.equal(s.ik, ik.to(dtype))  # ik is stored in the KV dtype, rounded once
    assert (rows[:, D + 29:] == 0).all()


def test_bytes_helpers_exact_for_every_byte_in_bf16():
    b = torch.arange(256)
    assert torch.equal(b.to(torch.bfloat16).to(torch.long), b)  # the premise: 0..255 exact in bf16
    x = torch.tensor([0, 255, 256, 65535, 65536, (1 << 24) + 3, AUX_MAX_INT])
    assert torch.equal(bytes_to_int(int_to_bytes(x).to(torch.bfloat16)), x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prompt_state_and_page_counts_round_trip(dtype):
    # a realistic page-mode prompt: text, 3 pages with text between, a question
    roles = torch.tensor([0, 0] + [1, 2, 2, 2] + [0] + [1, 2] + [1, 2, 2] + [0, 0, 0])
    tok, page = page_coordinates(roles)
    p, qpage = page_state(roles)
    counts = torch.bincount(page, minlength=p + 2)
    rows = encode_aux(None, roles, tok, page, p, qpage, head_dim=D, dtype=dtype,
                      counts=page_count_rows(counts, roles.numel()))
    s = decode_aux(rows, D)
    assert torch.equal(s.tok, tok) and torch.equal(s.page, page) and torch.equal(s.role, roles)
    assert (s.num_pages == p).all() and (s.query_page == qpage).all()
    assert torch.equal(decode_page_counts(rows, D, p), counts)
    assert counts.tolist() == [2, 5, 2, 3, 3]


@pytest.mark.parametrize("num_pages", [1, 2, 3, 4, 65535])
def test_page_counts_fit_the_shortest_prompt(num_pages):
    # the shortest prompt with P pages is P one-token pages: ceil((P + 2) / 3) <= P rows suffice
    counts = torch.tensor([0] + [1] * num_pages + [0])
    rows = encode_aux(None, torch.ones(num_pages, dtype=torch.long), 0, torch.arange(1, num_pages + 1),
                      num_pages, num_pages + 1, head_dim=D, dtype=torch.bfloat16,
                      counts=page_count_rows(counts, num_pages))
    assert torch.equal(decode_page_counts(rows, D, num_pages), counts)


def test_encode_rejects_out_of_range():
    with pytest.raises(ValueError, match="tok"):
        encode_aux(None, torch.zeros(2, dtype=torch.long), torch.tensor([0, AUX_MAX_INT + 1]), 0, 0, 0,
                   head_dim=D, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="page"):
        encode_aux(None, torch.zeros(1, dtype=torch.long), 0, -1, 0, 0, head_dim=D, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="role"):
        encode_aux(None, torch.tensor([3]), 0, 0, 0, 0, head_dim=D, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head_dim"):
        encode_aux(None, torch.tensor([0]), 0, 0, 0, 0, head_dim=16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="prompt rows"):
        page_count_rows(torch.zeros(7, dtype=torch.long), 2)


def test_vllm_aux_slot_is_a_view_beside_k_and_v():
    hkv, bs, nblk = 2, 16, 3
    cache = torch.zeros(nblk, hkv + 1, bs, 2 * D, dtype=torch.bfloat16)
    kv = PagedKVCache.from_vllm(cache, hkv, D)
    aux = aux_view_vllm(cache, hkv, D)
    assert aux.shape == (nblk, bs, 2 * D) and aux.data_ptr() == cache[:, hkv].data_ptr()
    slot = 37
    rows = encode_aux(torch.randn(1, D), torch.tensor([1]), 5, 70000, 65535, 65536, head_dim=D,
                      dtype=torch.bfloat16)
    aux[slot // bs, slot % bs] = rows[0]
    s = decode_aux(cache[slot // bs, hkv, slot % bs][None], D)
    assert (s.tok.item(), s.page.item(), s.num_pages.item(), s.query_page.item()) == (5, 70000, 65535, 65536)
    assert (kv.k_pages == 0).all() and (kv.v_pages == 0).all()  # K and V untouched
    # memory: one extra head slot = 1 / Hkv of the K+V bytes
    assert aux_bytes_per_token(hkv, D, torch.bfloat16) * hkv == 2 * hkv * D * 2
    assert alloc_aux_sglang(64, D, torch.float16).shape == (64, 2 * D)
