"""Where the Gluon attention's TMA finds a block (``gluon.kv_rows``, ``kv_row_views``, ``union_rows``), on the
CPU: every element of the pages of SGLang's and vLLM's layouts at the row and column the kernel computes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from dash_core.kernels.prefill import gluon
from dash_core.layout import PagedKVCache


def _sglang(pages, ps, hkv, d):
    k = torch.randn(pages * ps, hkv, d)
    return PagedKVCache.from_sglang(k, torch.randn_like(k), ps)


def _vllm(pages, ps, hkv, d, slots):
    return PagedKVCache.from_vllm(torch.randn(pages, slots, ps, 2 * d), hkv, d)


@pytest.mark.parametrize("make,geo", [
    (lambda: _sglang(5, 128, 4, 64), (128, 0, 64)),
    (lambda: _sglang(3, 64, 1, 128), (64, 0, 0)),
    (lambda: _vllm(4, 128, 4, 64, 4), (4 * 128, 128, 0)),
    (lambda: _vllm(3, 128, 2, 64, 3), (3 * 128, 128, 0)),  # a head slot more (an auxiliary head)
])
def test_each_block_at_its_row_and_column(make, geo):
    """Block b of page p, KV head h: its ``bs`` rows start at row ``p page + b step + h head`` of the views
    (``union_rows``, what the union launch stores), column ``h columns_a_head``, for K and for V."""
    cache = make()
    bs = 64
    assert gluon.kv_rows(cache) == geo
    page_m, step_m, head_m = gluon.union_rows(geo, bs)
    k2, v2 = gluon.kv_row_views(cache, geo)
    if gluon.HAVE_GLUON:  # the descriptors describe these views, with [bs, D] boxes
        for desc, view in zip(gluon.kv_block_descriptors(cache, bs, geo), (k2, v2)):
            assert (desc.base.data_ptr(), desc.base.shape, desc.base.stride()) == (view.data_ptr(), view.shape,
                                                                                    view.stride())
            assert list(desc.block_shape) == [bs, cache.k_pages.shape[3]]
    pages, ps, hkv, d = cache.k_pages.shape
    for p in range(pages):
        for b in range(ps // bs):
            for h in range(hkv):
                row, col = p * page_m + b * step_m + h * head_m, h * geo[2]
                for view, pg in ((k2, cache.k_pages), (v2, cache.v_pages)):
                    assert torch.equal(view[row: row + bs, col: col + d], pg[p, b * bs: (b + 1) * bs, h])


def test_layouts_without_one_row_stride_are_refused():
    """K and V of different strides, or rows that are not 16-byte aligned: no descriptor describes them (the Triton
    attention serves); padded rows that are aligned are described."""
    k = torch.randn(4 * 64, 2, 64)
    assert gluon.kv_rows(PagedKVCache.from_sglang(k, torch.randn(4 * 64, 2, 128)[..., :64], 64)) is None
    odd = torch.randn(4 * 64, 2, 33, dtype=torch.float16)  # rows of 66 elements: 132 bytes
    assert gluon.kv_rows(PagedKVCache.from_sglang(odd, odd.clone(), 64)) is None
    padded = torch.randn(4 * 64, 2, 72)[..., :64]  # heads 72 elements apart, rows of 144 (576 bytes)
    cache = PagedKVCache.from_sglang(padded, torch.randn(4 * 64, 2, 72)[..., :64], 64)
    assert gluon.kv_rows(cache) == (64, 0, 72)


def test_rows_past_int32_are_refused():
    """Pages stored head by head (``[Hkv, pages, page_size, D]``): the views span Hkv times the rows of the pages, and
    the union launch stores rows as int32, so a cache whose views would reach 2^31 rows is refused, one below is not
    (meta tensors: only shapes and strides)."""
    def head_outer(pages):
        k = torch.empty(8, pages, 64, 128, dtype=torch.bfloat16, device="meta").permute(1, 2, 0, 3)
        return PagedKVCache(k, k, None, None)

    pages = 2 ** 22  # 2^28 rows of pages; the views 8 times that, less one head's
    assert gluon.kv_rows(head_outer(pages // 2)) == (64, pages // 2 * 64, 0)
    assert gluon.kv_rows(head_outer(pages)) is None
