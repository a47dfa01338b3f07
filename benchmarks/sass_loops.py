"""Instructions per iteration of each loop of a prefill kernel, compiled for sm_90 on a machine without a GPU.

Records the launches of ``tests/kernels/_prefill_compile_check.py`` (the prefill kernels as the op calls them for
its configurations), compiles those of ``--kernel`` whose constexprs match every ``--where NAME=VALUE`` for
``cuda:90`` with Triton's bundled ``ptxas``, disassembles them with its ``nvdisasm`` and prints, for each loop (a
label and the backward branch to it; line numbers of the disassembly, from 1), the SASS instructions between the two
and the most frequent opcodes. The counts are static: a branch the loop skips at run time counts, and inner loops
count once inside their outer ones. A guide for changes whose GPU time cannot be measured here: fewer instructions in
a loop that issues its instructions back to back is less time (``docs/PERFORMANCE.md``).

    python benchmarks/sass_loops.py --kernel prefill_attn_ws --where QT=16
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LABEL = re.compile(r"^(\.L_x_\d+):")
BRANCH = re.compile(r"BRA(?:\.\w+)*\s+`\((\.L_x_\d+)\)")
INSTR = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")


def loops(sass: str) -> list:
    """``(first line, last line, opcodes)`` (lines from 1) of each loop of a disassembly: a label and a later branch
    to it, with no ``EXIT`` between (``nvdisasm`` places the retry loops of barrier waits after the end of the code,
    and they branch back into it: those are not loops, and neither are their waits, a cycle of two instructions)."""
    lines = sass.splitlines()
    at = {}
    found = []
    for i, line in enumerate(lines):
        m = LABEL.match(line.strip())
        if m:
            at[m.group(1)] = i
        b = BRANCH.search(line)
        if b and b.group(1) in at:
            start = at[b.group(1)]
            ops = [m.group(1) for x in lines[start:i + 1] if (m := INSTR.match(x))]
            if "EXIT" not in ops and len(ops) > 2:
                found.append((start + 1, i + 1, ops))
    return found


def disassemble(cubin: bytes) -> str:
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(nvdisasm), "-c", f.name], check=True, capture_output=True, text=True).stdout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", default="prefill_attn_ws")
    ap.add_argument("--where", action="append", default=[], help="NAME=VALUE: a constexpr the variant must have")
    ap.add_argument("--top", type=int, default=8, help="opcodes shown per loop")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        ap.error("run without TRITON_INTERPRET (the interpreter replaces the kernels)")
    from tests.kernels import _kernel_compile_check as kc
    from tests.kernels import _prefill_compile_check as pc

    want = dict(x.split("=", 1) for x in a.where)
    variants = [c for c in pc.record_launches().values()
                if c[0] == a.kernel and all(str(c[2].get(k)) == v for k, v in want.items())]
    if not variants:
        ap.error(f"no launch of {a.kernel} with {want} among the compile check's configurations")
    for item in variants:
        name, _, consts, opts, _ = item
        print(f"== {name} {consts} {opts}")
        for start, end, ops in loops(disassemble(kc.compile_variant(item).asm["cubin"])):
            top = " ".join(f"{op} {n}" for op, n in collections.Counter(ops).most_common(a.top))
            print(f"  lines {start}-{end}: {len(ops)} instructions ({top})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
