"""``kernels.launcher.BoundLaunch`` on a machine without a GPU: the launch path it takes is the compiled one (not
the interpreter's), with the driver's two calls and the compiled kernel replaced by recorders, so that what reaches
the compiled kernel can be read. The GPU test (``tests/gpu/test_launcher_gpu.py``) runs the same paths for real."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.runtime.jit import JITFunction  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from dash_core.kernels import launcher  # noqa: E402


def _axpy(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: "tl.constexpr", SQUARE: "tl.constexpr" = False):  # noqa: F821
    """A kernel's signature only: it is never compiled here."""


class _Compiled:
    """What ``CachedLaunch.launch`` returns: a compiled kernel, whose ``run`` records its arguments."""

    function, packed_metadata = "function", "metadata"

    def __init__(self, runs: list) -> None:
        self.runs = runs

    def run(self, *args) -> None:
        self.runs.append(args)


@pytest.fixture
def kernel(monkeypatch):
    """A ``CachedLaunch`` of ``_axpy`` as on an sm_90 GPU, whose first launches of a variant are recorded."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    monkeypatch.setattr(launcher, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7, raising=False)
    k = launcher.CachedLaunch(JITFunction(_axpy))
    k._backends[0] = CUDABackend(GPUTarget("cuda", 90, 32))
    k.first, k.runs = [], []

    def first_launch(grid, args, kwargs):  # Triton's path: compiles, or finds the variant in its own cache
        k.first.append((grid, args, kwargs))
        return _Compiled(k.runs)

    monkeypatch.setattr(k, "launch", first_launch)
    return k


def test_a_bound_launch_passes_its_kept_arguments_after_the_call_s_own(kernel):
    x, y, out = torch.zeros(64), torch.zeros(64), torch.zeros(64)
    bound = kernel.bind((4, 2), 3, (64, 0.5), BLOCK=32)
    bound(x, y, out)
    assert kernel.first == [((4, 2), (x, y, out, 64, 0.5), {"BLOCK": 32})] and kernel.runs == []
    x2, y2 = torch.zeros(64), torch.zeros(64)
    bound(x2, y2, out)  # the same specialisation: the kept variant, with the constexprs' values in their places
    assert len(kernel.first) == 1
    assert kernel.runs == [(4, 2, 1, 7, "function", "metadata", None, None, None, x2, y2, out, 64, 0.5, 32, False)]


def test_a_bound_launch_keys_its_variants_by_the_call_s_arguments_and_keywords(kernel):
    base = torch.zeros(128)
    bound = kernel.bind((1,), 3, (64, 0.5), BLOCK=32)
    xs = [base, base[8:], base[1:], base.half(), base, base]  # base[8:]: 32 bytes on, aligned as base; base[1:]: not
    for i, x in enumerate(xs):
        bound(x, base, base, **({"SQUARE": True} if i >= 4 else {}))
    firsts = [0, 2, 3, 4]  # the calls that made a variant: the others ran a kept one
    assert len(kernel.first) == len(firsts) and all(f[1][0] is xs[i] for f, i in zip(kernel.first, firsts))
    assert [first[2] for first in kernel.first] == [{"BLOCK": 32}] * 3 + [{"BLOCK": 32, "SQUARE": True}]
    assert [run[9] is x for run, x in zip(kernel.runs, (xs[1], xs[5]))] == [True, True] and len(kernel.runs) == 2
    assert len(bound._variants) == 4


def test_a_bound_launch_refuses_a_kept_constexpr_and_a_wrong_count(kernel):
    with pytest.raises(TypeError, match="runtime parameters"):
        kernel.bind((1,), 3, (64, 0.5, 32))  # BLOCK is a constexpr: a keyword
    bound = kernel.bind((1,), 3, (64, 0.5), BLOCK=32)
    with pytest.raises(TypeError, match="3 leading arguments"):
        bound(torch.zeros(4), torch.zeros(4))


class CudaLauncher:
    """Stands for Triton's ``driver.CudaLauncher`` (``launcher._direct`` knows it by its name): ``launch`` the C
    launch, or the wrapper ``driver.wrap_handle_tensordesc`` makes for a kernel with tensor descriptors."""

    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self, launch, scratch: int = 0) -> None:
        self.launch, self.global_scratch_size, self.profile_scratch_size = launch, scratch, 0


def _tensordesc_wrapper(launcher, tensordesc_indices, tensordesc_meta):
    def inner(*args):  # the name and the closure's names are what _direct reads
        return launcher, tensordesc_indices, tensordesc_meta
    return inner


def test_direct_launch_takes_the_c_launch_and_the_descriptor_positions_else_falls_back():
    class Compiled:
        def __init__(self, run) -> None:
            self.run = run

    c_launch = len  # a builtin stands for the C launch
    assert launcher._direct(Compiled(CudaLauncher(c_launch))) == (c_launch, (False, True, None, None), ())
    meta = [{"a": 1}, {"b": 2}]
    wrapped = CudaLauncher(_tensordesc_wrapper(c_launch, {15, 3}, meta))
    assert launcher._direct(Compiled(wrapped)) == (c_launch, (False, True, None, None), ((3, meta[0]), (15, meta[1])))
    assert launcher._direct(Compiled(CudaLauncher(lambda *a: None))) is False  # a wrapper of another form
    assert launcher._direct(Compiled(CudaLauncher(c_launch, scratch=64))) is False  # Triton allocates its scratch
    assert launcher._direct(Compiled(print)) is False  # not a CudaLauncher


def test_descriptor_arguments_are_expanded_in_place_and_encoded_once_per_descriptor(monkeypatch):
    """A descriptor with TMA metadata is encoded at its first launch only (a new descriptor object, or other metadata,
    anew) and held weakly; one without metadata expands to arguments holding its base tensor, never kept."""
    encoded = []

    def encode(desc, meta):  # stands for the driver's TMA encoding (it needs a GPU)
        encoded.append(id(desc))  # (not the object: the test checks that nothing else holds it)
        return ["map", *desc.shape] if meta is not None else [desc.base, *desc.shape]

    monkeypatch.setattr(launcher.nvidia_driver, "make_tensordesc_arg", encode)
    meta, other_meta = {"swizzle": 128}, {"swizzle": 64}
    x = torch.zeros(64, 32)
    desc = TensorDescriptor.from_tensor(x, [16, 32])
    full = ("q", desc, 5, desc)
    out = launcher._expand_descriptors(full, ((1, meta), (3, meta)))
    assert out == ("q", "map", 64, 32, 5, "map", 64, 32) and encoded == [id(desc)]
    assert launcher._expand_descriptors(full, ((1, meta), (3, meta))) == out and encoded == [id(desc)]
    launcher._expand_descriptors(("q", desc), ((1, other_meta),))
    other = TensorDescriptor.from_tensor(torch.ones(32, 32), [16, 32])
    assert launcher._expand_descriptors(("q", other), ((1, meta),)) == ("q", "map", 32, 32)
    assert encoded == [id(desc), id(desc), id(other)]
    ref = launcher._EXPANDED[id(other)][0]
    del other
    assert ref() is None  # held weakly
    plain = launcher._expand_descriptors(("q", desc), ((1, None),))
    assert plain == ("q", x, 64, 32) and plain[1] is x and len(encoded) == 4
    launcher._expand_descriptors(("q", desc), ((1, None),))
    assert len(encoded) == 5  # made again: never kept
