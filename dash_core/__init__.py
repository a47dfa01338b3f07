"""DASH sparse attention for serving: parameters, the float64 oracle, paged ops and kernels."""

from .params import DashParams
from .reference import dash_reference

__all__ = ["DashParams", "dash_reference"]
