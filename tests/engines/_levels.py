"""What the SGLang and vLLM engine test levels share: a run-time report per module and a free-disk check."""

from __future__ import annotations

import contextlib
import shutil
import sys
import time

import pytest

# Engines and checkpoints of these tests are tiny; this much free disk covers temp dirs and logs.
MIN_FREE_GB = 2


def budget(engine: str, name: str, seconds: float, note: str = ""):
    """A module-scoped fixture that prints the module's run time against its budget (no assertion), as
    ``[ENGINE level NAME] ... s of a SECONDS s budget NOTE``."""

    @pytest.fixture(scope="module", autouse=True)
    def _budget(request):
        start = time.monotonic()
        yield
        line = f"[{engine} level {name}] {time.monotonic() - start:.1f} s of a {seconds:.0f} s budget {note}".rstrip()
        capture = request.config.pluginmanager.get_plugin("capturemanager")
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
            sys.stderr.write("\n" + line + "\n")

    return _budget


def check_free_disk(engine: str, path: str, need_gb: float = MIN_FREE_GB) -> None:
    """Fail with a clear message when ``path``'s filesystem has less than ``need_gb`` free."""
    free = shutil.disk_usage(path).free / 2**30
    if free < need_gb:
        pytest.fail(f"only {free:.1f} GiB free under {path}; the {engine} engine tests need about {need_gb} GiB")
