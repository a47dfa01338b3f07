"""Kernel tests: the interpreter on the CPU, compiled (and marked ``gpu``) on a CUDA machine."""

from __future__ import annotations

import pytest

from tests.kernels import _kernel_env  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)
from tests.kernels._kernel_env import KERNEL_DEVICE, NEEDS_FRESH_PROCESS, triton

# without triton there is nothing to test here: skip the whole kernel suite
collect_ignore_glob = ["test_*.py"] if triton is None else []


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/kernels/" not in str(item.fspath).replace("\\", "/"):
            continue
        if NEEDS_FRESH_PROCESS:
            if "test_kernel_suite_subprocess" not in item.nodeid:
                item.add_marker(pytest.mark.skip(reason="triton was imported before TRITON_INTERPRET was set: run "
                                                        "in a fresh process by test_kernel_suite_subprocess.py"))
        elif KERNEL_DEVICE is None:
            item.add_marker(pytest.mark.skip(reason="no CUDA device and TRITON_INTERPRET is not set"))
        elif KERNEL_DEVICE == "cuda":
            item.add_marker(pytest.mark.gpu)  # the same tests, compiled, run with `pytest -m gpu`
