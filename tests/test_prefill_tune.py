"""``benchmarks/prefill.py``'s ``--tune``: constants of the Triton prefill module or of its Gluon attention."""

from __future__ import annotations

import argparse

import pytest

from tests._benchmarks import import_benchmark

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def bench():
    return import_benchmark("prefill")  # benchmarks/prefill.py


def test_tune_sets_constants_of_either_module_and_restores_them(bench):
    pf = bench.pf
    before = (pf.UNION_TILE, pf.prefill_ws.WS_REGS)
    settings = bench.tunings(argparse.ArgumentParser(), ["UNION_TILE=2048,WS_REGS=160"])
    assert settings == [{}, {"UNION_TILE": 2048, "WS_REGS": 160}]
    with bench.tuned(settings[1]):
        assert (pf.UNION_TILE, pf.prefill_ws.WS_REGS) == (2048, 160)
        assert not hasattr(pf, "WS_REGS")  # set where it is read, not added beside it
    assert (pf.UNION_TILE, pf.prefill_ws.WS_REGS) == before


def test_tune_refuses_names_of_neither_module(bench):
    with pytest.raises(SystemExit):
        bench.tunings(argparse.ArgumentParser(), ["NOT_A_CONSTANT=1"])
