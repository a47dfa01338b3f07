"""The golden files of the published DashAttention kernels (docs/semantics.md section 10), which are not in the
repository: where they are found, and the ``DashParams`` of a case.

The folder is ``DASH_GOLDEN_DIR`` when set, else a git-ignored copy at ``shared/golden`` inside the checkout (what
a GPU machine is sent), else ``shared/golden`` beside the checkout. Tests that need the files skip without them,
with ``SKIP_REASON``.
"""

from __future__ import annotations

import os
from pathlib import Path

from dash_core import DashParams

ROOT = Path(__file__).resolve().parents[1]


def golden_dir() -> Path:
    """The folder the golden files are read from (see the module docstring)."""
    if os.environ.get("DASH_GOLDEN_DIR"):
        return Path(os.environ["DASH_GOLDEN_DIR"])
    inside = ROOT / "shared" / "golden"
    return inside if inside.is_dir() else ROOT.parent / "shared" / "golden"


GOLDEN = golden_dir()
CASES = sorted(str(p) for p in GOLDEN.glob("dash_ref_shared_*.pt"))
SKIP_REASON = f"no golden files under {GOLDEN} (set DASH_GOLDEN_DIR)"


def case_id(path: str) -> str:
    """A case's test id: its file name without ``.pt``."""
    return os.path.basename(path)[:-3]


def params_of(g: dict) -> DashParams:
    """The ``DashParams`` of a loaded case (its ``params``: ``chunk`` is the block size)."""
    p = g["params"]
    return DashParams(block_size=p["chunk"], scaling_factor=float(p["scaling_factor"]),
                      estimate_diagonal=bool(p["estimate_diagonal"]), sigma=float(p["sigma"]))
