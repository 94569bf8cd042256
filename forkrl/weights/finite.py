"""Finite weights: the check every weight path runs before a model takes the weights.

One fused reduction per tensor (`torch.aminmax`: NaN propagates into both ends, ±inf lands in one), no copy and no
mask the size of the tensor, so a file in /dev/shm is checked through its memory map at the cost of one read.

"Finite" is judged in the dtype the model serves (`served`), not the one the tensor travels in: the model casts
what it loads, and 7e4 is finite in float32 but inf in float16. A value is refused when its magnitude exceeds
`torch.finfo(served).max` (a value just above it that the cast would round down to max is refused too: the bound
is the range, not the rounding).

    name = first_nonfinite(iter_safetensors(files), torch.float16)   # None: every tensor finite in float16
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def is_finite(t: torch.Tensor, served: torch.dtype | None = None) -> bool:
    """True when no element of `t` is NaN or ±inf, in `t`'s dtype and, when given, once cast to `served` (a
    floating dtype: every magnitude within its finfo.max). Integer and empty tensors are finite."""
    if t.numel() == 0 or not (t.is_floating_point() or t.is_complex()):
        return True
    if t.is_complex():
        t = torch.view_as_real(t)
    lo, hi = torch.aminmax(t.detach())
    lo, hi = float(lo), float(hi)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return False
    limit = served_max(served)
    return limit is None or max(-lo, hi) <= limit


def served_max(served: torch.dtype | None) -> float | None:
    """The largest finite magnitude of the served floating dtype (None: no dtype, or not a floating one)."""
    if served is None or not served.is_floating_point:
        return None
    return float(torch.finfo(served).max)


def first_nonfinite(items: Iterable[tuple[str, torch.Tensor]], served: torch.dtype | None = None) -> str | None:
    """The name of the first tensor holding a NaN or ±inf (also once cast to `served`), or None when all are
    finite."""
    for name, t in items:
        if not is_finite(t, served):
            return name
    return None
