"""``benchmarks/prefill_host.py``: the launches and allocations of one prefill call, counted on the CPU.

Short prompts are bound by the host, so the number of launches per call is a property to keep: these
tests fail when a change adds one."""

from __future__ import annotations

import pytest

from tests._benchmarks import import_benchmark

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def prefill_host():
    return import_benchmark("prefill_host")  # benchmarks/prefill_host.py


def test_launches_of_one_wave(prefill_host):
    """A 2k prompt is one wave: the tile tables, one route, one attention and the zero tail; the new K/V add a
    write launch and a summary launch."""
    base = {"_tile_tables_kernel": 1, "_prefill_route_kernel": 1, "_prefill_attn_kernel": 1, "_zero_tail_kernel": 1}
    assert prefill_host.host_counts(prefill_host.make_call(2048, write=False)).launches == base
    counts = prefill_host.host_counts(prefill_host.make_call(2048, write=True))
    assert counts.launches == dict(base, _kv_rows_kernel=2)
    assert counts.allocations >= 1


def test_waves_add_a_route_and_an_attention_launch_each(prefill_host):
    """A prompt longer than one wave's scratch: one route and one attention launch per wave, the rest once."""
    from dash_core.kernels import prefill as pf

    route, empty = pf._prefill_route_kernel, torch.empty
    counts = prefill_host.host_counts(prefill_host.make_call(32768, write=False)).launches
    waves = counts["_prefill_route_kernel"]
    assert waves > 1 and counts["_prefill_attn_kernel"] == waves
    assert counts["_tile_tables_kernel"] == counts["_zero_tail_kernel"] == 1
    assert pf._prefill_route_kernel is route and torch.empty is empty  # restored after counting


def test_a_shared_workspace_leaves_the_plan_to_the_first_call(prefill_host):
    """Calls after the first with one ``PrefillWorkspace`` (the later layers of a step): no tile tables launch and
    no scratch allocation; the route, attention and zero-tail launches remain."""
    from dash_core.workspace import PrefillWorkspace

    ws = PrefillWorkspace()
    call = prefill_host.make_call(2048, write=False, workspace=ws)
    first = prefill_host.host_counts(call)
    later = prefill_host.host_counts(call)
    assert first.launches["_tile_tables_kernel"] == 1 and first.allocations > 0
    assert later.launches == {"_prefill_route_kernel": 1, "_prefill_attn_kernel": 1, "_zero_tail_kernel": 1}
    assert later.allocations == 0 and ws.builds == 1


def test_script_prints_counts_and_time(prefill_host, capsys):
    assert prefill_host.main(["--tokens", "1024", "--iters", "20"]) == 0
    out = capsys.readouterr().out
    assert "4 launches" in out and "Python per call" in out


def test_long_tables_add_the_summary_copy(prefill_host):
    """Block tables of ``RECOMPUTE_MIN_CAND`` blocks or more (router kv_head), half as many where a KV head has
    ``RECOMPUTE_WIDE_GROUP`` query heads or more: one more launch per call, the copy of the summaries the route
    launches compute their scores from (small heads keep the CPU tensors small)."""
    from dash_core.kernels import prefill as pf

    def launches(blocks: int, hq: int, hkv: int = 1) -> dict:
        """Launches of a call whose block table holds ``blocks`` blocks (``make_call`` adds a page to the prompt's)."""
        call = prefill_host.make_call((blocks - 1) * 64, write=False, hq=hq, hkv=hkv, d=64)  # block size 64
        return prefill_host.host_counts(call).launches

    def copies(blocks: int, hq: int, hkv: int = 1) -> bool:
        return "_gather_summaries_kernel" in launches(blocks, hq, hkv)

    full, wide = pf.RECOMPUTE_MIN_CAND, pf.RECOMPUTE_WIDE_GROUP
    counts = launches(full, 1)
    assert counts["_gather_summaries_kernel"] == 1 and counts["_prefill_route_kernel"] >= 1
    assert not copies(full - 1, 1) and not copies(full // 2, wide - 1)
    assert copies(full // 2, wide) and not copies(full // 2 - 1, wide)
    assert copies(full // 2, 2 * wide, hkv=2) and not copies(full // 2, wide, hkv=2)  # the group is Hq / Hkv
