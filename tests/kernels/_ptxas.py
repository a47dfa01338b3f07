"""Register and spill counts of compiled PTX from triton's bundled ``ptxas``: the compile checks run it on machines
without a GPU."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path


def ptxas_usage(ptx: str, arch: str = "sm_90a") -> tuple:
    """``(registers, spill store bytes)`` that triton's bundled ptxas reports for ``ptx`` (None where it reports
    none)."""
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        Path(path).write_text(ptx)
        r = subprocess.run([ptxas, "-v", "--gpu-name", arch, path, "-o", path + ".o"], capture_output=True, text=True)
    regs = re.search(r"Used (\d+) registers", r.stderr)
    spill = re.search(r"(\d+) bytes spill stores", r.stderr)
    return (int(regs.group(1)) if regs else None), (int(spill.group(1)) if spill else None)
