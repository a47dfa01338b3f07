"""The benchmarks' command lines: ``--tune`` (configurations of the kernels built from the fields' names, prefill and
decode) and the prefill benchmark's mixed steps."""

from __future__ import annotations

import pytest

from tests._benchmarks import import_benchmark

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def bench():
    return import_benchmark("prefill")  # benchmarks/prefill.py


def test_tune_builds_configurations_of_either_level(bench):
    default = bench.PrefillConfig()
    configs = bench.tune_configs(["union_tile=2048,gluon_regs=160", "gluon_enabled=0,attn_tma=0"], default)
    assert [tag for tag, _ in configs] == ["", " union_tile=2048 gluon_regs=160", " attn_tma=0 gluon_enabled=0"]
    assert configs[0][1] == default
    tuned = configs[1][1]
    assert (tuned.union_tile, tuned.gluon.regs) == (2048, 160)
    assert tuned.route_tile_budget == default.route_tile_budget and tuned.gluon.k_slots == default.gluon.k_slots
    off = configs[2][1]
    assert off.gluon.enabled is False and off.attn_tma is False  # the switches stay booleans


def test_tune_refuses_names_of_neither_module(bench):
    default = bench.PrefillConfig()
    with pytest.raises(ValueError, match="not_a_setting"):
        bench.tune_configs(["not_a_setting=1"], default)
    with pytest.raises(ValueError, match="name=value"):
        bench.tune_configs(["attn_stages"], default)
    with pytest.raises(SystemExit):  # the command line reports it as a usage error
        bench.main(["--tune", "not_a_setting=1", "--no-write"])


def test_decode_tune_builds_decode_configurations():
    decode = import_benchmark("decode")
    default = decode.DecodeConfig()
    (tag0, c0), (tag, tuned) = decode.tune_configs(["score_split_min_candidates=32,attn_split_max=16"], default)
    assert (tag0, c0) == ("", default) and tag == " score_split_min_candidates=32 attn_split_max=16"
    assert (tuned.score_split_min_candidates, tuned.attn_split_max) == (32, 16)
    assert tuned.one_tile_max == default.one_tile_max
    with pytest.raises(SystemExit):
        decode.main(["--tune", "gluon_regs=1", "--no-write"])  # a prefill setting is not the decode kernels'


def test_mixed_cases_parse_every_step_and_refuse_malformed_ones(bench):
    assert bench.parse_mixed_cases(bench.MIXED_CASES) == [(8, 32768, 2048), (32, 16384, 2048)]
    assert bench.parse_mixed_cases(" 4x8192+512 ,") == [(4, 8192, 512)]
    for bad in ("8x32768", "0x32768+2048", "8x32768+0", "8+2048", "ax1+2"):
        with pytest.raises(ValueError, match="--mixed-cases"):
            bench.parse_mixed_cases(bad)
    with pytest.raises(SystemExit):  # a usage error on the command line
        bench.main(["--preset", "serving", "--mixed-cases", "8x32768", "--no-write"])
