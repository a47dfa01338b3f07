"""What each execution path supports: one table, read by ``DashParams``, the ops and both adapters.

The PyTorch paged path (CPU, fp32) runs every ``DashParams``; the Triton kernels (CUDA, fp16/bf16) run the subset
below. Nothing here imports triton.
"""

from __future__ import annotations

import importlib.util

import torch

# The Triton kernels need triton (a dependency on Linux); without it every call takes the PyTorch path.
HAVE_TRITON = importlib.util.find_spec("triton") is not None

# DashParams.block_size: a power of two in this range (the PyTorch path and the oracle take all of them).
BLOCK_SIZE_RANGE = (16, 256)
# The dtypes the ops take; the kernels take the half-precision ones, the PyTorch path all three.
OP_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
KERNEL_DTYPES = (torch.float16, torch.bfloat16)
KERNEL_HEAD_DIMS = (64, 128, 256)
KERNEL_BLOCK_SIZES = (16, 32, 64, 128)
KERNEL_MAX_GROUP = 16  # query heads per KV head
KERNEL_MAX_PAGE_SIZE = 256
KERNEL_MAX_INDEXER_HEADS = 8 * KERNEL_MAX_GROUP


def uses_kernels(device, dtype: torch.dtype) -> bool:
    """Whether the ops run tensors on ``device`` in ``dtype`` on the Triton kernels (CUDA with fp16/bf16); all others
    take the PyTorch paged path."""
    return HAVE_TRITON and torch.device(device).type == "cuda" and dtype in KERNEL_DTYPES


_CAPABILITY: dict = {}  # device (as given) -> (major, minor)


def nvidia_capability(device) -> tuple:
    """``(major, minor)`` of an NVIDIA CUDA ``device``, read once per device (the launches ask on every call);
    ``(0, 0)`` for any other device."""
    cap = _CAPABILITY.get(device)
    if cap is not None:
        return cap
    d = torch.device(device)
    if d.type != "cuda" or torch.version.hip is not None:
        cap = (0, 0)
    elif d.index is None:  # the current device, which may change: not kept
        return torch.cuda.get_device_capability(torch.cuda.current_device())
    else:
        cap = torch.cuda.get_device_capability(d.index)
    _CAPABILITY[device] = cap
    return cap


def kernel_block_size_error(block_size: int) -> str:
    """The message for a block size the kernels do not run, or '' where they do."""
    if block_size in KERNEL_BLOCK_SIZES:
        return ""
    return (f"block_size = {block_size} is not supported by the Triton kernels (GPU); use one of "
            f"{KERNEL_BLOCK_SIZES} (the PyTorch path on the CPU takes powers of two in {BLOCK_SIZE_RANGE[0]}.."
            f"{BLOCK_SIZE_RANGE[1]})")
