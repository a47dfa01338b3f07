"""Static buffers and capture/replay helpers for CUDA-graph DASH decode (adapters and standalone users)."""

from .decode import CapturedDecode, DecodeGraphBuffers

__all__ = ["CapturedDecode", "DecodeGraphBuffers"]
