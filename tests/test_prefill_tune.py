"""``benchmarks/prefill.py``'s ``--tune``: settings of the prefill kernels by their lower-case names."""

from __future__ import annotations

import pytest

from tests._benchmarks import import_benchmark

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def bench():
    return import_benchmark("prefill")  # benchmarks/prefill.py


def test_tune_sets_settings_of_either_module_and_restores_them(bench):
    pf = bench.pf
    before = (pf.UNION_TILE, pf.prefill_ws.WS_REGS)
    configs = bench.tune_configs(["union_tile=2048,ws_regs=160"])
    assert configs == [("", {}), (" union_tile=2048 ws_regs=160", {"UNION_TILE": 2048, "WS_REGS": 160})]
    with bench.tuned(configs[1][1]):
        assert (pf.UNION_TILE, pf.prefill_ws.WS_REGS) == (2048, 160)
        assert not hasattr(pf, "WS_REGS")  # set where it is read, not added beside it
    assert (pf.UNION_TILE, pf.prefill_ws.WS_REGS) == before


def test_tune_refuses_names_of_neither_module(bench):
    with pytest.raises(ValueError, match="not_a_setting"):
        bench.tune_configs(["not_a_setting=1"])
    with pytest.raises(ValueError, match="name=value"):
        bench.tune_configs(["attn_stages"])
    with pytest.raises(SystemExit):  # the command line reports it as a usage error
        bench.main(["--tune", "not_a_setting=1", "--no-write"])
