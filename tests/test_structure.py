"""The house's structure, read from the source: no import cycle inside ``dash_core``, the kernels import neither the
ops, the segment backends nor the PyTorch path, imports inside functions only for optional packages, every kernel the
host launches goes through ``@cached_launch``, and no module of the product over 800 lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("dash_core", "adapters", "graphs")
# Packages a function may import late, to keep them optional (or not yet importable when the module loads).
OPTIONAL = ("flashinfer", "flash_attn", "vllm", "sglang", "transformers", "tokenizers", "safetensors", "matplotlib",
            "numpy", "triton.experimental")
MAX_LINES = 800


def modules(package: str) -> dict:
    """``{dotted module name: path}`` of every Python file under ``package``."""
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path) -> list:
    """``(imported module, inside a function)`` for every import of a module, relative ones resolved."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                found.extend((a.name, inner) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")
                    up = up[: len(up) - child.level + 1]
                    base = ".".join(up + ([base] if base else []))
                found.append((base, inner))
                found.extend((f"{base}.{a.name}", inner) for a in child.names)  # `from pkg import module`
            visit(child, inner)

    visit(tree, False)
    return found


def graph() -> dict:
    mods = modules("dash_core")
    return {name: {m for m, _ in imports(name, path) if m in mods and m != name} for name, path in mods.items()}


def test_no_import_cycle_in_dash_core():
    g = graph()
    state: dict = {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(g[node]):
            if state.get(nxt) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(g):
        if node not in state:
            visit(node, [node])


def test_kernels_do_not_import_the_ops_the_segments_or_the_pytorch_path():
    forbidden = ("dash_core.ops", "dash_core.segments", "dash_core.segments_paged", "dash_core.paged",
                 "dash_core.checks")
    for name, deps in graph().items():
        if name.startswith("dash_core.kernels"):
            assert not deps & set(forbidden), f"{name} imports {sorted(deps & set(forbidden))}"


def test_late_imports_only_for_optional_packages():
    """(The engines' plugin entry points, ``adapters/*/plugin.py``, and the start-up checks they hook into the
    engine's argument handling, ``adapters/*/startup.py``, import their backends and ``dash_core`` when the engine
    calls them: the plugin loads in every engine process, and stays light there.)"""
    for package in PRODUCT:
        for name, path in modules(package).items():
            if name.endswith((".plugin", ".startup")):
                continue
            late = sorted({m for m, inner in imports(name, path) if inner and not m.startswith(OPTIONAL)})
            assert not late, f"{name} imports {late} inside a function"


def test_no_module_over_800_lines():
    for package in PRODUCT:
        for name, path in modules(package).items():
            lines = len(path.read_text().splitlines())
            assert lines <= MAX_LINES, f"{name} has {lines} lines"


def _decorator_names(node) -> set:
    """The last name of each decorator of a function (``triton.jit(...)`` -> ``jit``)."""
    names = set()
    for d in node.decorator_list:
        d = d.func if isinstance(d, ast.Call) else d
        names.add(d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", ""))
    return names


def test_every_launched_kernel_has_a_cached_launch():
    """A kernel launched as ``kernel[grid](...)`` or bound by ``bind_launch(kernel, ...)`` without
    ``@cached_launch`` pays Triton's per-call binding."""
    kernels, launched = {}, set()

    def name(target) -> str:
        return target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")

    for path in modules("dash_core").values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and "jit" in _decorator_names(node):
                kernels[node.name] = _decorator_names(node)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
                launched.add(name(node.func.value))
            if isinstance(node, ast.Call) and name(node.func) == "bind_launch" and node.args:
                launched.add(name(node.args[0]))
    found = launched & set(kernels)
    bound = {"_prefill_route_kernel", "_prefill_attn_kernel", "prefill_attn_ws"}
    assert len(found) >= 12 and bound <= found, f"the kernel launches were not found: {sorted(found)}"
    bare = sorted(name for name in found if "cached_launch" not in kernels[name])
    assert not bare, f"launched without @cached_launch: {bare}"
