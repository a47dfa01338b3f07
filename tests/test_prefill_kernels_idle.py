"""``benchmarks/prefill_kernels.py``'s idle time: how long a call's GPU waits for its host, from kernel intervals."""

from __future__ import annotations

import pytest

from tests._benchmarks import import_benchmark

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def prefill_kernels():
    return import_benchmark("prefill_kernels")  # benchmarks/prefill_kernels.py


def test_idle_before_the_first_kernel_and_between_kernels(prefill_kernels):
    """Microseconds in, milliseconds out; the kernels' order of listing does not matter."""
    kernels = [(2500.0, 4000.0), (1000.0, 2000.0), (4100.0, 9000.0)]
    assert prefill_kernels.idle_ms(300.0, kernels) == pytest.approx((0.7, 0.6))


def test_overlapping_kernels_leave_no_gap(prefill_kernels):
    """A kernel that starts before the one before it ends (another stream) adds no idle time, and a short kernel
    inside a long one does not end the long one's busy span."""
    kernels = [(0.0, 5000.0), (1000.0, 2000.0), (4000.0, 6000.0), (6500.0, 7000.0)]
    assert prefill_kernels.idle_ms(0.0, kernels) == pytest.approx((0.0, 0.5))
    assert prefill_kernels.idle_ms(10.0, []) == (0.0, 0.0)
