"""Where the kernel tests run: compiled on a CUDA machine and under the Triton interpreter elsewhere.

``TRITON_INTERPRET=1`` must be set before triton is imported, so ``conftest.py`` imports this
module first; it sets it only when no CUDA device is present. Four shims make the triton 3.6 interpreter compute
what the compiled kernels compute (they touch nothing when compiling):

- a loaded scalar is a one-element array that ``range`` bounds convert with ``int()``, which
  numpy >= 2.4 refuses (triton-lang/triton#9171, fixed upstream after 3.6): squeeze it first;
- bf16 is stored as raw uint16 and ``tl.dot`` multiplies those integers: widen bf16 operands to
  fp32 first (exact, as the tensor cores' bf16 products are; accumulation stays fp32);
- fp32 -> bf16 casts truncate instead of rounding to nearest even as the GPU does: round with
  torch instead;
- ``tl.reduce`` with a combine function of its own (a tuple of sums, say) runs the function once per element in
  Python and misplaces a negative axis: fold halves of the axis instead (a tree, as the GPU reduces; Triton's
  tensor shapes are powers of two).
"""

from __future__ import annotations

import os

import torch

import sys

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

try:
    import triton
except ImportError:  # the kernel suite is not collected (conftest.py)
    triton = None


def _interpreted_here() -> bool:
    """True when this process runs jit functions in the interpreter: triton's own helpers and ours
    were decorated after TRITON_INTERPRET was set. (``--doctest-modules dash_core`` imports the
    kernels, and triton, before this file runs: then only a fresh process can interpret them.)"""
    if triton is None or os.environ.get("TRITON_INTERPRET") != "1":
        return False
    import triton.language.standard as std
    from triton.runtime.interpreter import InterpretedFunction

    ours = sys.modules.get("dash_core.kernels.decode.route")
    return isinstance(std.max, InterpretedFunction) and (  # (our kernels: a CachedLaunch around each)
        ours is None or isinstance(ours._decode_select_kernel.fn, InterpretedFunction))


INTERPRET = _interpreted_here()
# no CUDA and the interpreter unusable in this process: the suite runs in a fresh one instead
NEEDS_FRESH_PROCESS = triton is not None and not CUDA and not INTERPRET

if INTERPRET:
    from triton.runtime import interpreter as _interp

    _orig_patch = _interp._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        _orig_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interp._patch_lang_tensor = _patch_lang_tensor

    import numpy as np
    import triton.language as tl

    _Builder = _interp.InterpreterBuilder
    _orig_dot = _Builder.create_dot
    _orig_cast = _Builder.cast_impl

    def _bf16_to_f32(h):
        return _interp.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16:
            a, b = _bf16_to_f32(a), _bf16_to_f32(b)
        return _orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            x = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            bits = x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return _interp.TensorHandle(bits.reshape(src.data.shape), dst_type.scalar)
        return _orig_cast(self, src, dst_type)

    _Builder.create_dot = create_dot
    _Builder.cast_impl = cast_impl

    _orig_reduce = _interp.ReduceOps.generic_reduce

    def generic_reduce(self, input):
        data = [a.handle.data for a in input]
        if self.axis is None or data[0].ndim == 0:
            return _orig_reduce(self, input)
        axis = self.axis % data[0].ndim
        size = data[0].shape[axis]
        if size & (size - 1):
            return _orig_reduce(self, input)
        dtypes = [a.dtype for a in input]
        while data[0].shape[axis] > 1:
            half = data[0].shape[axis] // 2
            lo = [self.to_tensor(np.take(d, np.arange(half), axis), t) for d, t in zip(data, dtypes)]
            hi = [self.to_tensor(np.take(d, np.arange(half, 2 * half), axis), t) for d, t in zip(data, dtypes)]
            ret = self.combine_fn.fn(*lo, *hi)
            ret = ret if isinstance(ret, tuple) else (ret,)
            data = [r.handle.data for r in ret]
        if not self.keep_dims:
            data = [np.squeeze(d, axis) for d in data]
        return [self.to_tensor(d, t) for d, t in zip(data, dtypes)]

    _interp.ReduceOps.generic_reduce = generic_reduce

# Where the kernels run: the interpreter on CPU tensors, or compiled on the GPU.
KERNEL_DEVICE = None if triton is None else ("cpu" if INTERPRET else ("cuda" if CUDA else None))
