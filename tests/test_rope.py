"""Page coordinates and page RoPE (docs/semantics.md section 9) against direct derivations."""

import random

import pytest
import torch

from dash_core import DashParams
from dash_core.rope import (PageRopeSettings, RotarySettings, decode_coordinates, extend_coordinates,
                            page_coordinates, page_rope, page_state)


def direct_coordinates(roles, generated=0):
    """docs/semantics.md section 9 read literally, one token at a time (lookahead for 'after the last page')."""
    n = len(roles)
    num_pages = sum(1 for r in roles if r == 1)
    last_page_tok = max([i for i, r in enumerate(roles) if r > 0], default=-1)
    query_page = num_pages + 1 if num_pages else 0
    tok, page = [], []
    cur_page, offset = 0, -1
    for i in range(n + generated):
        role = roles[i] if i < n else 0
        if role == 1:
            cur_page += 1
            offset = 0
            tok.append(0)
            page.append(cur_page)
        elif role == 2:
            offset += 1
            tok.append(offset)
            page.append(cur_page)
        elif num_pages and i > last_page_tok:  # the question and generated tokens: the query page
            offset = 0 if i == last_page_tok + 1 else offset + 1
            tok.append(offset)
            page.append(query_page)
        else:  # text before the first page, or between pages: continues the page before it
            offset += 1
            tok.append(offset)
            page.append(cur_page)
    if not num_pages:  # a prompt without pages is ordinary RoPE: page = tok = position
        page = list(tok)
    return tok, page


def random_roles(rng, kind):
    def page():
        return [1] + [2] * rng.randrange(0, 6)

    def text():
        return [0] * rng.randrange(1, 5)

    if kind == "none":
        return text() + text()
    if kind == "one":
        return text() + page() + text()
    if kind == "adjacent":
        return page() + page() + page() + text()
    if kind == "between":
        return text() + page() + text() + page() + text() + page() + text()
    if kind == "ends_in_page":
        return text() + page() + text() + page()
    raise AssertionError(kind)


KINDS = ("none", "one", "adjacent", "between", "ends_in_page")


@pytest.mark.parametrize("kind", KINDS)
def test_coordinates_match_direct_derivation(kind):
    rng = random.Random(hash(kind) % 1000)
    for _ in range(50):
        roles = random_roles(rng, kind)
        gen = rng.randrange(0, 4)
        tok, page = page_coordinates(torch.tensor(roles), generated=gen)
        exp_tok, exp_page = direct_coordinates(roles, gen)
        assert tok.tolist() == exp_tok and page.tolist() == exp_page, roles


def test_coordinates_worked_example():
    # text, page 1 (3 tokens), text continuing page 1, page 2 (2 tokens), question, 2 generated
    roles = [0, 0, 1, 2, 2, 0, 1, 2, 0, 0]
    tok, page = page_coordinates(torch.tensor(roles), generated=2)
    assert tok.tolist() == [0, 1, 0, 1, 2, 3, 0, 1, 0, 1, 2, 3]
    assert page.tolist() == [0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 3, 3]
    assert page_state(roles) == (2, 3)
    # no page: ordinary RoPE (tok = page = position), generated tokens continue
    tok, page = page_coordinates(torch.zeros(5, dtype=torch.long), generated=2)
    assert tok.tolist() == list(range(7)) and page.tolist() == list(range(7))


def test_coordinates_reject_bad_roles():
    with pytest.raises(ValueError, match="roles"):
        page_coordinates(torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="before the first page start"):
        page_coordinates(torch.tensor([0, 2, 1]))
    with pytest.raises(ValueError, match="integer"):
        page_coordinates(torch.tensor([0.0, 1.0]))


@pytest.mark.parametrize("kind", KINDS)
def test_decode_coordinates_equal_prefill(kind):
    rng = random.Random(7 + hash(kind) % 1000)
    for _ in range(20):
        roles = random_roles(rng, kind)
        gen = rng.randrange(1, 6)
        tok, page = page_coordinates(torch.tensor(roles), generated=gen)
        _, qpage = page_state(roles)
        n = len(roles)
        t, p = tok[n - 1: n], page[n - 1: n]
        q = torch.tensor([qpage])
        for i in range(gen):
            t, p = decode_coordinates(t, p, q)
            assert (t.item(), p.item()) == (tok[n + i].item(), page[n + i].item()), roles


def test_decode_coordinates_batched():
    # a batch of requests in one call: continuing a query-page run, right after a page, no pages
    # (ordinary RoPE: tok = page = position)
    t, p = decode_coordinates(torch.tensor([4, 7, 9]), torch.tensor([3, 2, 9]), torch.tensor([3, 3, 0]))
    assert t.tolist() == [5, 0, 10] and p.tolist() == [3, 3, 10]


def test_extend_on_a_prefix_written_by_a_prompt_with_more_pages():
    """A prefix-cache hit: prompt B reuses the first tokens of prompt A (cut inside A's first or second
    page); A has more pages than B. B's new tokens, continued from the state A stored at the cut, must get
    B's own coordinates (pages counted from the cut token's page, not from A's page count)."""
    a = [0, 0, 1, 2, 2, 2, 1, 2, 2, 1, 2, 0, 0]  # three pages, then the question
    b = [0, 0, 1, 2, 2, 2, 1, 2, 0, 0, 0]  # the same first two pages (second one shorter), then its question
    tok_a, page_a = page_coordinates(torch.tensor(a))
    p_a, q_a = page_state(a)
    tok_b, page_b = page_coordinates(torch.tensor(b))
    for cut in (4, 7):  # inside page 1, inside page 2
        t, p, npages, qpage, _ = extend_coordinates(
            torch.tensor(b[cut:]), torch.tensor([0, len(b) - cut]), torch.tensor([True]),
            tok_a[cut - 1: cut], page_a[cut - 1: cut], torch.tensor([p_a]), torch.tensor([q_a]))
        assert t.tolist() == tok_b[cut:].tolist() and p.tolist() == page_b[cut:].tolist(), cut
        assert (int(npages), int(qpage)) == page_state(b)


def neox_rope(x, pos, theta, rotary_dim):
    """A standard neox RoPE (Llama / vLLM ``is_neox_style=True``), written independently."""
    half = rotary_dim // 2
    inv = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / rotary_dim)
    ang = pos.double()[:, None] * inv[None]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    xd = x.double()
    a, b = xd[..., :half], xd[..., half:rotary_dim]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, xd[..., rotary_dim:]], -1)


@pytest.mark.parametrize("rotary_dim", [None, 32])
def test_page_rope_without_roles_is_neox_rope(rotary_dim):
    torch.manual_seed(0)
    x = torch.randn(300, 3, 64)
    pos = torch.arange(300) * 7  # positions up to 2093
    rot = RotarySettings(theta=500000.0, rotary_dim=rotary_dim)
    got = page_rope(x, pos, pos, rot)
    # float32 angles (as engines compute them) vs float64: |angle| <= 2093 rad, f32 ulp there ~1.2e-4,
    # so the rotated values move by at most ~1.2e-4 * |x| (|x| < 5); 1e-3 bounds it.
    assert torch.allclose(got.double(), neox_rope(x, pos, 500000.0, rotary_dim or 64), atol=1e-3, rtol=0)
    # and the tok/page split is irrelevant when both coordinates agree
    s = PageRopeSettings(main=rot, indexer=RotarySettings(), tok_pairs=5)
    assert torch.equal(page_rope(x, pos, pos, s, main=True), got)


def test_page_rope_splits_pairs():
    torch.manual_seed(1)
    x = torch.randn(40, 2, 32, dtype=torch.float64)
    tok, page = torch.randint(0, 100, (40,)), torch.randint(0, 9, (40,))
    got = page_rope(x, tok, page, RotarySettings(theta=10000.0), tok_pairs=3)
    # pairs 0..2 rotate like neox RoPE at tok, pairs 3..15 like neox RoPE at page
    at_tok, at_page = neox_rope(x, tok, 10000.0, 32), neox_rope(x, page, 10000.0, 32)
    pairs_tok = [0, 1, 2, 16, 17, 18]
    pairs_page = [i for i in range(32) if i not in pairs_tok]
    # float32 angles and rotation of float64 inputs: errors ~1e-5 (angle <= 100 rad)
    assert torch.allclose(got[..., pairs_tok], at_tok[..., pairs_tok], atol=1e-4)
    assert torch.allclose(got[..., pairs_page], at_page[..., pairs_page], atol=1e-4)
    # default r = rotary_dim / 4: the DashParams field None resolves to 8 of 16 pairs
    s = PageRopeSettings.from_params(DashParams(), RotarySettings(theta=10000.0))
    assert torch.equal(page_rope(x, tok, page, s), page_rope(x, tok, page, RotarySettings(), tok_pairs=8))
    with pytest.raises(ValueError, match="page_rope_tok_pairs"):
        page_rope(x, tok, page, RotarySettings(), tok_pairs=17)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_page_invariance(dtype):
    """The same page at two prompt offsets gives bit-identical rotated keys (and indexer keys)."""
    torch.manual_seed(2)
    page_len = 9
    page_keys = torch.randn(page_len, 2, 64).to(dtype)
    s = PageRopeSettings(main=RotarySettings(theta=10000.0), indexer=RotarySettings(theta=1000.0, rotary_dim=32))
    a = [0, 0, 0] + [1] + [2] * (page_len - 1) + [0, 0]
    b = [0] * 11 + [1] + [2] * (page_len - 1) + [0]
    outs = []
    for roles, start in ((a, 3), (b, 11)):
        tok, page = page_coordinates(torch.tensor(roles))
        n = len(roles)
        keys = torch.randn(n, 2, 64).to(dtype)
        keys[start: start + page_len] = page_keys
        for main in (True, False):
            rk = page_rope(keys, tok, page, s, main=main)
            outs.append(rk[start: start + page_len])
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])
    assert not torch.equal(outs[0], page_keys)  # it did rotate


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_through_the_auxiliary_rows(dtype):
    """Prefill writes the rows, each decode step reads the previous row and writes its own: the
    coordinates equal the prefill derivation with the generated tokens appended."""
    from dash_core.layout import encode_aux
    from dash_core.rope import decode_coordinates_from_aux

    d = 64
    for roles in ([0, 1, 2, 2, 0, 1, 2], [0, 0, 0], [1, 2, 0, 1, 2, 2, 0, 0], [0] * 300 + [1] + [2] * 300):
        gen = 5
        tok, page = page_coordinates(torch.tensor(roles), generated=gen)
        p, qp = page_state(roles)
        n = len(roles)
        rows = encode_aux(None, torch.tensor(roles), tok[:n], page[:n], p, qp, head_dim=d, dtype=dtype)
        for i in range(gen):
            t, pg = decode_coordinates_from_aux(rows[-1:], d)
            assert (t.item(), pg.item()) == (tok[n + i].item(), page[n + i].item())
            rows = torch.cat([rows, encode_aux(None, torch.zeros(1, dtype=torch.long), t, pg, p, qp,
                                               head_dim=d, dtype=dtype)])


def test_page_invariance_of_summaries():
    """A page that starts on a block boundary gives the same block summaries at two prompt offsets."""
    from dash_core.reference import block_summaries

    torch.manual_seed(3)
    bs, page_len = 16, 32
    page_keys = torch.randn(page_len, 2, 64).to(torch.bfloat16)
    hc = torch.randn(2, 64)
    s = RotarySettings(theta=10000.0)
    got = []
    for start in (16, 48):
        roles = [0] * start + [1] + [2] * (page_len - 1) + [0] * 5
        tok, page = page_coordinates(torch.tensor(roles))
        keys = torch.randn(len(roles), 2, 64).to(torch.bfloat16)
        keys[start: start + page_len] = page_keys
        rk = page_rope(keys, tok, page, s)
        summ = block_summaries(rk.transpose(0, 1), hc, bs)  # [Hkv, nblk, D]
        got.append(summ[:, start // bs: (start + page_len) // bs])
    assert torch.equal(got[0], got[1])
