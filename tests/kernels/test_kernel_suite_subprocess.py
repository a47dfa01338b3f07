"""Runs the kernel suite in a fresh interpreter process when this one cannot interpret kernels.

CI collects ``--doctest-modules dash_core tests`` in one process: importing ``dash_core.kernels``
for its doctests imports triton before ``conftest.py`` can set ``TRITON_INTERPRET``, and triton
then compiles instead of interpreting. On a CPU machine the other kernel tests are then skipped
(``conftest.py``) and this test runs them all, with the interpreter, in a subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernels._kernel_env import NEEDS_FRESH_PROCESS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not NEEDS_FRESH_PROCESS, reason="the kernel tests run in this process")
def test_kernel_suite_in_fresh_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu",
                        str(ROOT / "tests" / "kernels")], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=1500)
    tail = r.stdout[-6000:] + r.stderr[-2000:]
    print(tail)
    assert r.returncode == 0, tail
