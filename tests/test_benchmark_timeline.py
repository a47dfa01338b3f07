"""``common.launch_timeline``: when each launch of a captured decode step starts and ends inside the step, from a
profiler trace's kernel events (``benchmarks/decode.py --timeline``; the trace itself needs a GPU)."""

from __future__ import annotations

import random

import pytest

from tests._benchmarks import import_benchmark

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def common():
    return import_benchmark("common")  # benchmarks/common.py


def _steps(n: int, late_b: int = -1) -> list:
    """Kernel events of ``n`` steps 100 us apart: A 0-10, B 2-25 (launched while A runs), C 24-30; B of step
    ``late_b`` ends 6 us later (and C after it)."""
    ev = []
    for s in range(n):
        t, d = 100 * s, 6 if s == late_b else 0
        ev += [dict(name="A", ts=t, dur=10), dict(name="B", ts=t + 2, dur=23 + d), dict(name="C", ts=t + 24 + d, dur=6)]
    random.Random(0).shuffle(ev)  # the trace's order is not the launches'
    return ev


def test_launch_timeline_measures_from_the_end_of_the_step_before(common):
    # from the end of the step before (C at 30): A 70-80, B 72-95, C 94-100; step 2's late B is out-voted
    assert common.launch_timeline(_steps(4, late_b=2), 4) == [("A", 70, 80), ("B", 72, 95), ("C", 94, 100)]
    # with two steps, the one timed is the second: its late B (and the C after it) is what is reported
    assert common.launch_timeline(_steps(2, late_b=1), 2) == [("A", 70, 80), ("B", 72, 101), ("C", 100, 106)]


def test_launch_timeline_lists_a_step_by_stream(common):
    """A step on two streams (a halved decode step): its launches interleave differently from step to step, and are
    listed by stream, then start."""
    ev = []
    for s in range(3):
        t, lag = 100 * s, 5 * s  # the second stream's launch starts later at each step: after A, then after B
        ev += [dict(name="A", ts=t, dur=10, tid=1), dict(name="B", ts=t + 12, dur=10, tid=1),
               dict(name="P", ts=t + 4 + lag, dur=20, tid=2)]
    # from the end of the step before, its latest (P's: 24, then 129): A 76 and 71, B 88 and 83, P 85 and 85
    assert common.launch_timeline(ev, 3) == [("A", 73.5, 83.5), ("B", 85.5, 95.5), ("P", 85, 105)]


def test_launch_timeline_refuses_traces_that_are_not_whole_steps(common):
    with pytest.raises(ValueError, match="steps"):
        common.launch_timeline(_steps(3)[:-1], 3)  # a kernel missing
    with pytest.raises(ValueError, match="steps"):
        common.launch_timeline(_steps(1), 1)  # no step before the first
    renamed = _steps(3)
    next(e for e in renamed if e["ts"] == 202)["name"] = "X"  # step 2 runs another launch
    with pytest.raises(ValueError, match="same launches"):
        common.launch_timeline(renamed, 3)
