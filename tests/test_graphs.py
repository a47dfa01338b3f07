"""graphs/: static decode buffers (CPU-checkable parts: refill in place, padding, memory report)."""

import torch

from dash_core import DashParams
from graphs import DecodeGraphBuffers


def test_fill_refills_in_place_and_pads():
    p = DashParams(block_size=16, topk=4)
    b = DecodeGraphBuffers.allocate(4, 6, 8, 2, 64, 32, p, torch.bfloat16, device="cpu")
    ptrs = [b.block_table.data_ptr(), b.q.data_ptr(), b.seq_lens.data_ptr(), b.kernel.sel_idx.data_ptr()]
    q, k = torch.randn(3, 8, 64).bfloat16(), torch.randn(3, 2, 64).bfloat16()
    bt = torch.tensor([[5, 1], [2, 3], [4, 0]], dtype=torch.int32)
    n = b.fill(q, k, k, bt, torch.tensor([40, 33, 7], dtype=torch.int32), torch.tensor([161, 97, 135]))
    assert n == 3
    assert torch.equal(b.block_table[:3, :2], bt) and b.block_table[:, 2:].abs().sum() == 0
    assert b.seq_lens.tolist() == [40, 33, 7, 0] and b.slot_mapping.tolist() == [161, 97, 135, -1]
    assert torch.equal(b.q[:3], q) and torch.equal(b.k[:3], k)
    # a smaller step with K/V already written: rows past it padded again, nothing to write
    b.fill(q[:1], None, None, bt[:1], torch.tensor([41], dtype=torch.int32), None)
    assert b.seq_lens.tolist() == [41, 0, 0, 0] and b.slot_mapping.tolist() == [-1, -1, -1, -1]
    assert ptrs == [b.block_table.data_ptr(), b.q.data_ptr(), b.seq_lens.data_ptr(), b.kernel.sel_idx.data_ptr()]


def test_memory_report():
    p = DashParams(block_size=64, topk=64)
    b = DecodeGraphBuffers.allocate(8, 2048, 32, 8, 128, 64, p, torch.bfloat16, device="cpu")
    inputs = 8 * (2048 * 4 + 4 + 8) + 8 * (32 + 32 + 8 + 8) * 128 * 2  # tables, lengths, slots, q/out/k/v
    scratch = sum(t.numel() * t.element_size() for t in vars(b.kernel).values() if isinstance(t, torch.Tensor))
    assert scratch > 8 * 32 * 2048 * 4  # at least the fp32 scores of every candidate
    assert b.nbytes() == inputs + scratch
    assert abs(b.bytes_per_slot() * 8 - b.nbytes()) < 1e-6


def test_too_large_step_is_rejected():
    b = DecodeGraphBuffers.allocate(2, 4, 4, 2, 64, 16, DashParams(block_size=16), torch.float16, device="cpu")
    x = torch.zeros(3, 4, 64, dtype=torch.float16)
    try:
        b.fill(x, None, None, torch.zeros(3, 4, dtype=torch.int32), torch.ones(3, dtype=torch.int32), None)
    except ValueError as e:
        assert "does not fit" in str(e)
    else:
        raise AssertionError("expected ValueError")
