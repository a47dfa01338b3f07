"""``benchmarks/tile_sharing.py``: the attention work each tiling executes, counted on a crafted tile,
and the script end to end on a short prompt (the float64 oracle on the CPU)."""

from __future__ import annotations

import pytest

from tests._benchmarks import import_benchmark

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def tile_sharing():
    return import_benchmark("tile_sharing")  # benchmarks/tile_sharing.py


def test_tiling_work_counts_block_rows(tile_sharing):
    """One unit, 16 tokens, 4 blocks: block 0 routed by every token, block 1 by token 0, block 2 by
    tokens 0 and 15 (two quarters), block 3 by none."""
    kept = torch.zeros(1, 16, 4, dtype=torch.bool)
    kept[0, :, 0] = True
    kept[0, 0, 1] = True
    kept[0, [0, 15], 2] = True
    w = tile_sharing.tiling_work(kept, thresholds=(2, 4))
    assert w == {"useful": 19, "tile 16": 3 * 16, "tiles 8": (2 + 1 + 2) * 8, "tiles 4": (4 + 1 + 2) * 4,
                 "two tiers 2": 2 * 16 + 1 * 4, "two tiers 4": 1 * 16 + (1 + 2) * 4}


def test_script_on_a_short_prompt(tile_sharing, capsys):
    """A 2k prompt: every tiling executes at least the useful work, smaller tiles waste less."""
    assert tile_sharing.main(["--context", "2048", "--samples", "3", "--sf", "4.0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    ratio = {ln.rsplit(None, 1)[0].strip(): float(ln.rsplit(None, 1)[1]) for ln in lines[1:]}
    assert set(ratio) == {"tile 16", "tiles 8", "tiles 4", "two tiers 2", "two tiers 4", "two tiers 6",
                          "two tiers 8"}
    assert all(v >= 1.0 for v in ratio.values())
    assert ratio["tiles 4"] <= ratio["tiles 8"] <= ratio["tile 16"]
