"""Register and spill counts of compiled PTX from triton's bundled ``ptxas``, and a cubin's SASS instructions per
source line from its bundled ``nvdisasm``: the compile checks run them on machines without a GPU."""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile
from pathlib import Path


def _bundled(tool: str) -> str:
    """Path of one of triton's bundled NVIDIA tools."""
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)


def ptxas_usage(ptx: str, arch: str = "sm_90a") -> tuple:
    """``(registers, spill store bytes)`` that triton's bundled ptxas reports for ``ptx`` (None where it reports
    none)."""
    ptxas = _bundled("ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        Path(path).write_text(ptx)
        r = subprocess.run([ptxas, "-v", "--gpu-name", arch, path, "-o", path + ".o"], capture_output=True, text=True)
    regs = re.search(r"Used (\d+) registers", r.stderr)
    spill = re.search(r"(\d+) bytes spill stores", r.stderr)
    return (int(regs.group(1)) if regs else None), (int(spill.group(1)) if spill else None)


def sass_lines(cubin: bytes) -> collections.Counter:
    """SASS instructions of ``cubin`` per source line ``(file name, line)`` (static counts: a loop's body once), from
    triton's bundled nvdisasm; empty where it is missing. A kernel that waits on the latency of each instruction in
    turn (the decode select) takes about as long as it executes instructions, so these counts compare variants of
    it without a GPU."""
    nvdisasm = _bundled("nvdisasm")
    if not os.path.exists(nvdisasm):
        return collections.Counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        Path(path).write_bytes(cubin)
        text = subprocess.run([nvdisasm, "--print-line-info", "-c", path], capture_output=True, text=True).stdout
    counts: collections.Counter = collections.Counter()
    where = None
    for line in text.splitlines():
        m = re.search(r'//## File "([^"]+)", line (\d+)', line)
        if m:
            where = (os.path.basename(m.group(1)), int(m.group(2)))
        elif re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+\S", line):
            counts[where] += 1
    return counts
