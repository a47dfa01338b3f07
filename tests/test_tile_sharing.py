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
    tokens 0 and 15 (two quarters, two halves), block 3 by none."""
    kept = torch.zeros(1, 16, 4, dtype=torch.bool)
    kept[0, :, 0] = True
    kept[0, 0, 1] = True
    kept[0, [0, 15], 2] = True
    w = tile_sharing.tiling_work(kept, thresholds=(2, 4))
    assert w == {"useful": 19, "tile 16": 3 * 16, "tiles 8": (2 + 1 + 2) * 8, "tiles 4": (4 + 1 + 2) * 4,
                 "two tiers 2": 2 * 16 + 1 * 4, "two tiers 4": 1 * 16 + (1 + 2) * 4,
                 "two tiers 2 halves": 2 * 16 + 1 * 8, "two tiers 4 halves": 1 * 16 + (1 + 2) * 8,
                 "two tiers 2 full": 2 * 16, "two tiers 4 full": 1 * 16}


def test_script_on_a_short_prompt(tile_sharing, capsys):
    """A 2k prompt: every tiling executes at least the useful work, smaller tiles waste less."""
    assert tile_sharing.main(["--context", "2048", "--samples", "3", "--sf", "4.0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    cut = next(i for i, ln in enumerate(lines) if ln.startswith("per (token, KV head)"))
    ratio = {ln.rsplit(None, 1)[0].strip(): float(ln.rsplit(None, 1)[1]) for ln in lines[1:cut]}
    band = {ln.split()[0]: float(ln.split()[1]) for ln in lines[cut + 1:]}
    assert 0 < band["support"] <= band["band"] <= band["candidates"]
    tiers = [f"two tiers {t}" for t in (2, 4, 6, 8)]
    parts = [f"{k} {s}" for k in tiers for s in ("full", "halves")]
    assert set(ratio) == {"tile 16", "tiles 8", "tiles 4", *tiers, *parts}
    assert all(v >= 1.0 for k, v in ratio.items() if not k.endswith("full"))
    assert all(0 <= ratio[f"{k} full"] <= min(ratio[k], ratio[f"{k} halves"]) for k in tiers)
    assert ratio["tiles 4"] <= ratio["tiles 8"] <= ratio["tile 16"]


def test_group_sharing_counts_each_block_once_per_group(tile_sharing):
    """Two units, 3 tiles of 2 tokens, 4 blocks. Unit 0: block 0 routed in every tile, block 1 in tile 1 only,
    block 3 in tiles 0 and 2. Unit 1: nothing routed."""
    kept = torch.zeros(2, 6, 4, dtype=torch.bool)
    kept[0, [0, 3, 5], 0] = True
    kept[0, 2, 1] = True
    kept[0, [1, 4], 3] = True
    assert tile_sharing.group_sharing(kept, qt=2) == (3, 3 + 1 + 2)


def test_script_counts_groups_of_tiles(tile_sharing, capsys):
    """``--group 3`` on a 2k prompt: the group's union holds between a third of the tiles' sum and all of it."""
    assert tile_sharing.main(["--context", "2048", "--samples", "2", "--sf", "4.0", "--group", "3"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("groups of 3 tiles"))
    assert 1 / 3 <= float(line.split()[-1]) <= 1.0


def test_entmax_band_counts(tile_sharing):
    """One KV head of two query heads, two tokens. Token 0 (4 candidates): head 0 scores [1.9, 1.9, 2.0,
    1.05], whose threshold is near 1.36: 1.05 lies in the band (above 2.0 - 1), not in the support; head 1
    scores [0, -5, -5, -5]: candidate 0. Token 1 sees only its first 2 candidates (the others masked)."""
    row0 = [1.9, 1.9, 2.0, 1.05]
    row1 = [0.0, -5.0, -5.0, -5.0]
    x = torch.tensor([[row0, row0], [row1, row1]], dtype=torch.float64)  # [Hq 2, R 2, nblk 4]
    band, support = tile_sharing.entmax_band(x, torch.tensor([4, 2]), hkv=1)
    assert band.tolist() == [[4, 2]]
    assert support.tolist() == [[3, 2]]
