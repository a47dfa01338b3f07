"""Launches of compiled Triton kernels with less host time a call: ``@cached_launch`` over ``@triton.jit``.

``kernel[grid](*args, **kw)`` through Triton's JIT binds the arguments into dictionaries, computes each one's
specialisation, builds a cache key that includes the text of every keyword argument, compares every global the
kernel reads with its value at compile time, builds the launch's metadata for the hooks, and then launches: host
time that grows with the arguments (our prefill launches have sixty and more), which a short prefill call pays for
every launch it makes outside a CUDA graph (docs/PERFORMANCE.md, where the time goes).

``CachedLaunch`` keeps the compiled kernel of each (device, per-parameter specialisation, keyword arguments) and
launches it directly. The specialisations are Triton's own (``native_specialize_impl`` with each parameter's
flags, what its binder computes), so a call reuses a compiled kernel exactly when Triton's cache would and compiles
where Triton would. A key's first call, and every call while launch hooks are set (a profiler) or under the
interpreter, goes through ``JITFunction.run``. What this skips, and so does not watch: the globals check (the
kernels' globals are constants) and changes of Triton's debug knobs after a kernel's first launch. A kept variant
launches through Triton's C launcher directly (``_direct``), each tensor descriptor's arguments encoded once per
descriptor object, where Triton's Python wrapper around it would walk every argument and encode every descriptor.

``CachedLaunch.bind`` goes one step further for launches that repeat with most of their arguments unchanged (the
layers of an engine step: the same step tensors, scratch and constexprs, each layer its own queries, cache and
output): a ``BoundLaunch`` keeps the trailing arguments and the keywords, and each call passes only the leading
ones (and any keywords of its own), which are all it specialises.
"""

from __future__ import annotations

import operator
import weakref
from itertools import repeat
from typing import Any, Dict, Tuple

import torch
import triton
from triton import knobs
from triton._C.libtriton import native_specialize_impl
from triton.backends.nvidia import driver as nvidia_driver

from .common import interpreting


class CachedLaunch:
    """A ``@triton.jit`` kernel launched as ``kernel[grid](*args, **kw)`` (grid: a tuple of 1 to 3 ints), each
    compiled variant kept here after its first launch. Runtime arguments go positionally; keywords are constexprs
    and launch options (hashable values: they are part of the key). Attributes other than ``[grid]`` are the
    kernel's."""

    def __init__(self, fn: triton.runtime.JITFunction) -> None:
        self.fn = fn
        self._compiled: Dict[Tuple, Any] = {}
        self._backends: Dict[int, Any] = {}
        self._interpreted = interpreting()  # triton.jit made an InterpretedFunction: every launch is its own
        if self._interpreted:
            return
        params = fn.params
        self._names = fn.arg_names
        self._defaults = [p.default for p in params]
        runtime = [p for p in params if not p.is_constexpr]
        # the arguments Triton specialises, and how (its binder's flags): C-level iteration over them below
        self._runtime_args = _getter([p.num for p in runtime])
        self._constexpr_args = _getter([p.num for p in params if p.is_constexpr])
        self._is_const = [p.is_const for p in runtime]
        self._specialize = [not p.do_not_specialize for p in runtime]
        self._align = [not p.do_not_specialize_on_alignment for p in runtime]
        self._leading_runtime = next((p.num for p in params if p.is_constexpr), len(params))  # what bind may keep

    def __getattr__(self, name: str):
        return getattr(self.fn, name)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def _through_triton(self) -> bool:
        """Whether a launch goes through ``JITFunction.run``: under the interpreter, or while launch hooks are set."""
        return self._interpreted or knobs.runtime.launch_enter_hook.calls or knobs.runtime.launch_exit_hook.calls

    def _full(self, args: tuple, kwargs: dict) -> tuple:
        """Every parameter's value, as the compiled kernel's ``run`` takes them: ``args``, then each later
        parameter's keyword value or default."""
        nargs = len(args)
        return args + tuple(map(kwargs.get, self._names[nargs:], self._defaults[nargs:]))

    def launch(self, grid, args: tuple, kwargs: dict):
        """Launch on the current device and stream; returns the compiled kernel (None under the interpreter)."""
        if self._through_triton():
            return self.fn[grid](*args, **kwargs)
        full = self._full(args, kwargs)
        device = torch.cuda.current_device()
        backend = self._backends.get(device)
        if backend is None:  # what Triton's binder specialises with on this device
            backend = self._backends[device] = self.fn.device_caches[device][3]
        spec = tuple(map(native_specialize_impl, repeat(backend), self._runtime_args(full), self._is_const,
                         self._specialize, self._align))
        key = (device, spec, self._constexpr_args(full), tuple(kwargs.items()))
        kernel = self._compiled.get(key)
        if kernel is None:  # Triton's path: compiles, or finds the variant in its own cache
            tensors = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
            if tensors:  # its identity would key the cache: a miss, and a kept variant, at every call
                raise TypeError(f"{self.fn.__name__}: pass tensors positionally, not as keywords {tensors}")
            kernel = self._compiled[key] = self.fn[grid](*args, **kwargs)
            return kernel
        _run(kernel, grid, device, full)
        return kernel

    def bind(self, grid, lead: int, tail: tuple, **options) -> "BoundLaunch":
        """``kernel[grid](*lead_args, *tail, **options)`` with ``tail`` and ``options`` kept: call the result with
        the ``lead`` leading runtime arguments (and keywords of their own, constexprs that follow from them)."""
        return BoundLaunch(self, grid, lead, tail, options)


class BoundLaunch:
    """A launch of a ``CachedLaunch`` kernel whose grid, trailing arguments and keywords are fixed
    (``CachedLaunch.bind``). A call passes the leading arguments, which must be the kernel's first parameters and
    runtime ones, and may add keywords (constexprs that follow from them). The kept arguments are specialised once,
    at the first call of each variant (through ``CachedLaunch.launch``, which compiles where Triton would), so a
    later call specialises its leading arguments only, and passes the kept CUDA tensors as the addresses the first
    call found (``_addresses``): their memory must not move in place (no ``set_`` or ``resize_``; a workspace's
    scratch and a step's tables never do)."""

    def __init__(self, kernel: CachedLaunch, grid, lead: int, tail: tuple, options: dict) -> None:
        self.kernel, self.grid, self.lead, self.tail, self.options = kernel, tuple(grid), lead, tuple(tail), options
        self._variants: Dict[Tuple, Tuple[Any, tuple]] = {}  # key -> (compiled kernel, the arguments after lead)
        if kernel._interpreted:
            return
        if lead + len(tail) > kernel._leading_runtime:
            raise TypeError(f"{kernel.fn.__name__}: bound arguments must be runtime parameters; pass constexprs as "
                            "keywords")
        # the leading arguments' specialisation flags (Triton's binder's, as CachedLaunch keeps them)
        self._flags = (kernel._is_const[:lead], kernel._specialize[:lead], kernel._align[:lead])

    def _key(self, device: int, backend, args: tuple, more: dict) -> tuple:
        return device, tuple(map(native_specialize_impl, repeat(backend), args, *self._flags)), tuple(more.items())

    def __call__(self, *args, **more) -> None:
        k = self.kernel
        if len(args) != self.lead:
            raise TypeError(f"{k.fn.__name__}: a bound launch takes its {self.lead} leading arguments, got {len(args)}")
        if k._through_triton():
            k.launch(self.grid, args + self.tail, {**self.options, **more})
            return
        device = torch.cuda.current_device()
        backend = k._backends.get(device)
        key = None if backend is None else self._key(device, backend, args, more)
        found = self._variants.get(key)
        if found is None:  # the first call of this variant: the whole launch specialised, kept by the lead's key
            kwargs = {**self.options, **more}
            compiled = k.launch(self.grid, args + self.tail, kwargs)
            if compiled is not None:  # None: Triton's JIT cache hook skipped the launch
                rest = _addresses(k._full(args + self.tail, kwargs)[self.lead:])
                self._variants[key or self._key(device, k._backends[device], args, more)] = (compiled, rest)
            return
        compiled, rest = found
        _run(compiled, self.grid, device, args + rest)


def _run(kernel, grid, device: int, full: tuple) -> None:
    """Launch the compiled ``kernel`` on ``grid`` (1 to 3 ints) on the current stream of ``device``, with every
    parameter's value ``full``: straight through its C launcher where ``_direct`` knows the launcher's form."""
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    stream = torch._C._cuda_getCurrentRawStream(device)
    direct = _DIRECT.get(kernel)
    if direct is None:
        direct = _DIRECT[kernel] = _direct(kernel)
    if direct is False:
        kernel.run(grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata, None, None, None, *full)
        return
    launch, options, descs = direct
    if descs:
        full = _expand_descriptors(full, descs)
    launch(grid[0], g1, g2, stream, kernel.function, *options, kernel.packed_metadata, None, None, None, *full)


_DIRECT: Dict[Any, Any] = {}  # compiled kernel -> _direct(kernel)
# grid (3), stream, function, cooperative, pdl, global and profile scratch, metadata, launch metadata, two hooks
_LAUNCH_FORMAT = "iiiKKppOOOOOO"
_EXPANDED: Dict[int, tuple] = {}  # id of a tensor descriptor -> (weak reference to it, its metadata, its arguments)


def _direct(kernel):
    """``(C launch, (cooperative, pdl, None, None), ((position, metadata) of each tensor-descriptor parameter))``
    for a compiled kernel whose launcher is Triton's ``CudaLauncher`` without scratch memory, else False.

    Triton's ``CudaLauncher.__call__`` allocates no scratch for such a kernel, and where the kernel takes tensor
    descriptors its wrapper walks every argument in Python and encodes each descriptor's TMA map at every launch:
    host time a short prefill layer pays at each of its launches. Calling the C launch with the descriptors'
    arguments encoded once per descriptor object (``_expand_descriptors``) launches the same kernel."""
    launcher = kernel.run
    if (type(launcher).__name__ != "CudaLauncher" or launcher.global_scratch_size or launcher.profile_scratch_size
            or getattr(nvidia_driver, "_BASE_ARGS_FORMAT", None) != _LAUNCH_FORMAT  # the C launch's first arguments
            or not hasattr(nvidia_driver, "make_tensordesc_arg")):  # (other Triton versions: Triton's own path)
        return False
    launch = launcher.launch
    descs: tuple = ()
    if getattr(launch, "__name__", "") == "inner":  # driver.wrap_handle_tensordesc's wrapper
        names = launch.__code__.co_freevars
        cells = dict(zip(names, (c.cell_contents for c in launch.__closure__ or ())))
        if not {"launcher", "tensordesc_indices", "tensordesc_meta"} <= cells.keys():
            return False
        meta = list(cells["tensordesc_meta"] or [None] * len(cells["tensordesc_indices"]))
        descs = tuple(zip(sorted(cells["tensordesc_indices"]), meta))
        launch = cells["launcher"]
    elif not callable(launch) or hasattr(launch, "__code__"):  # a Python wrapper of a form not known here
        return False
    return launch, (launcher.launch_cooperative_grid, launcher.launch_pdl, None, None), descs


def _expand_descriptors(full: tuple, descs: tuple) -> tuple:
    """``full`` with each tensor descriptor at the positions ``descs`` names replaced by its launch arguments
    (``nvidia_driver.make_tensordesc_arg``). A TMA map (metadata given) is encoded once per live descriptor object
    and metadata: the descriptor keeps its base tensor, whose memory a kept descriptor's owner never moves, and is
    held weakly here, so that a cache freed by its engine is freed. Without metadata the arguments hold the base
    tensor itself and cost no encoding: made at each launch, never kept."""
    parts, start = [], 0
    for pos, meta in descs:
        desc = full[pos]
        if meta is None:
            args = tuple(nvidia_driver.make_tensordesc_arg(desc, None))
        else:
            kept = _EXPANDED.get(id(desc))
            if kept is None or kept[0]() is not desc or kept[1] is not meta:
                if len(_EXPANDED) >= 4096:
                    _EXPANDED.clear()
                kept = _EXPANDED[id(desc)] = (weakref.ref(desc), meta,
                                              tuple(nvidia_driver.make_tensordesc_arg(desc, meta)))
            args = kept[2]
        parts.append(full[start:pos])
        parts.append(args)
        start = pos + 1
    parts.append(full[start:])
    return sum(parts, ())


def _addresses(args: tuple) -> tuple:
    """``args`` with each CUDA tensor replaced by its address. Triton's C launcher takes an int as the address
    itself; given a tensor, it calls ``data_ptr()`` and asks the driver to translate the address
    (``cuPointerGetAttribute``) at every launch, which for kept arguments only repeats the first launch's answer."""
    return tuple(a.data_ptr() if isinstance(a, torch.Tensor) and a.is_cuda else a for a in args)


def _getter(indices: list):
    """``x -> tuple(x[i] for i in indices)``, iterating in C."""
    if len(indices) == 0:
        return lambda x: ()
    if len(indices) == 1:
        i = indices[0]
        return lambda x: (x[i],)
    return operator.itemgetter(*indices)


def bind_launch(kernel, grid, lead: int, tail: tuple, **options):
    """``kernel.bind(grid, lead, tail, **options)`` for a ``CachedLaunch``; for any other launchable (a recording
    stand-in in the compile checks), a call of ``kernel[grid]`` with the kept arguments appended."""
    if isinstance(kernel, CachedLaunch):
        return kernel.bind(grid, lead, tail, **options)
    return lambda *args, **more: kernel[grid](*args, *tail, **options, **more)


def cached_launch(fn: triton.runtime.JITFunction) -> CachedLaunch:
    """Decorator: ``@cached_launch`` above ``@triton.jit`` (or ``@gluon.jit``) on a kernel the host launches (not
    on functions other kernels call)."""
    return CachedLaunch(fn)
