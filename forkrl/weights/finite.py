"""Finite weights: the check every weight path runs before a model takes the weights.

One fused reduction per tensor (`torch.aminmax`: NaN propagates into both ends, ±inf lands in one), no copy and no
mask the size of the tensor, so a file in /dev/shm is checked through its memory map at the cost of one read.

    name = first_nonfinite(iter_safetensors(files))   # None: every tensor finite
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def is_finite(t: torch.Tensor) -> bool:
    """True when no element of `t` is NaN or ±inf (integer and empty tensors are)."""
    if t.numel() == 0 or not (t.is_floating_point() or t.is_complex()):
        return True
    if t.is_complex():
        t = torch.view_as_real(t)
    lo, hi = torch.aminmax(t.detach())
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def first_nonfinite(items: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first tensor holding a NaN or ±inf, or None when all are finite."""
    for name, t in items:
        if not is_finite(t):
            return name
    return None
