"""Trim a FlashInfer wheel for the GPU machine's 64 MiB per-call limit (docs/segments.md, "Wheels").

Drops the kernel sources under ``flashinfer/data/csrc/<subdirectory>/`` (MoE, sampling, GDN, ...; never
built by this project), keeps the top-level ``data/csrc`` files (batch prefill/decode, page, cascade,
quantization) and ``data/include``, ``data/cutlass``, ``data/cccl``, ``data/spdlog``, and rewrites ``RECORD``
without the dropped files.

    python ci/trim_flashinfer_wheel.py IN.whl OUT_DIR
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path


def dropped(name: str) -> bool:
    """A member under a subdirectory of ``flashinfer/data/csrc/``."""
    prefix = "flashinfer/data/csrc/"
    return name.startswith(prefix) and "/" in name[len(prefix):]


def trim(src: Path, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    dst = out_dir / src.name
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        for info in zin.infolist():
            if dropped(info.filename):
                continue
            data = zin.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = ("\n".join(line for line in lines if not dropped(line.split(",", 1)[0])) + "\n").encode()
            zout.writestr(info, data)
    return dst


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    out = trim(Path(sys.argv[1]), Path(sys.argv[2]))
    print(f"{out}: {out.stat().st_size / 2**20:.1f} MiB")
