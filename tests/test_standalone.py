"""The standalone (Hugging Face style) cache and attention call against the oracle."""

import pytest
import torch

from dash_core import DashParams, dash_reference
from dash_core.standalone import DashKVCache, dash_attention


@pytest.mark.parametrize("page_size", [None, 64])
def test_chunked_prefill_and_decode_steps_equal_the_oracle(page_size):
    g = torch.Generator().manual_seed(0)
    p = DashParams(block_size=16, scaling_factor=3.0, topk=3, local=32)
    n = 90
    q, k, v = torch.randn(2, 4, n, 16, generator=g), torch.randn(2, 2, n, 16, generator=g), \
        torch.randn(2, 2, n, 16, generator=g)
    hcs = [torch.randn(2, 16, generator=g) for _ in range(2)]
    cache = DashKVCache(2, 2, 100, 2, 16, p, page_size=page_size)
    outs = [[], []]
    for lo, hi in [(0, 37), (37, 80)] + [(t, t + 1) for t in range(80, n)]:
        for layer in range(2):  # two layers with different weights share nothing but the cache object
            outs[layer].append(dash_attention(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], hcs[layer], cache, layer))
    for layer in range(2):
        ref, _ = dash_reference(q, k, v, hcs[layer], p)
        assert torch.allclose(torch.cat(outs[layer], dim=2), ref, atol=1e-5)
    assert cache.lengths == [n, n]


def test_errors():
    p = DashParams(block_size=16)
    cache = DashKVCache(1, 1, 20, 2, 16, p)
    x = torch.randn(1, 2, 21, 16)
    with pytest.raises(ValueError, match="max_length"):
        dash_attention(torch.randn(1, 4, 21, 16), x, x, torch.randn(2, 16), cache, 0)
    with pytest.raises(ValueError, match="batch"):
        dash_attention(torch.randn(2, 4, 3, 16), x[:, :, :3].expand(2, -1, -1, -1), x[:, :, :3].expand(2, -1, -1, -1),
                       torch.randn(2, 16), cache, 0)


def test_layers_of_a_step_share_its_inputs():
    """The layers of one step get the same length tensors and ``PrefillWorkspace`` (so the Triton path plans the
    step once); the next step, or a reset, makes new ones."""
    cache = DashKVCache(2, 3, 64, 2, 16, DashParams(block_size=16))
    first = cache.step_inputs(0, 10, "cpu")
    assert all(a is b for a, b in zip(first, cache.step_inputs(0, 10, "cpu")))
    seq_lens, cu, _ = first
    assert seq_lens.tolist() == [10, 10, 10] and cu.tolist() == [0, 10, 20, 30]
    later = cache.step_inputs(10, 1, "cpu")
    assert later[0].tolist() == [11, 11, 11] and later[2] is not first[2]
    cache.reset()
    assert cache.step_inputs(10, 1, "cpu")[2] is not later[2]
