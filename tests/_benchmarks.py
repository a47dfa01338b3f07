"""Import a script of ``benchmarks/`` as a module in the tests (the scripts import each other by name,
so ``benchmarks/`` is on the path while one is imported)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def import_benchmark(name: str):
    """``benchmarks/<name>.py`` as a module."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))
