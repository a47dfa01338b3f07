"""Kernel tests: the interpreter on the CPU, compiled (and marked ``gpu``) on a CUDA machine."""

from __future__ import annotations

import pytest

from tests.kernels import _kernel_env  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)
from tests.kernels._kernel_env import KERNEL_DEVICE, triton

# without triton there is nothing to test here: skip the whole kernel suite
collect_ignore_glob = ["test_*.py"] if triton is None else []


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/kernels/" not in str(item.fspath).replace("\\", "/"):
            continue
        if KERNEL_DEVICE is None:
            item.add_marker(pytest.mark.skip(reason="no CUDA device and TRITON_INTERPRET is not set"))
        elif KERNEL_DEVICE == "cuda":
            item.add_marker(pytest.mark.gpu)  # the same tests, compiled, run with `pytest -m gpu`
