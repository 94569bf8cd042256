"""forkrl/weights/finite.py: one reduction per tensor finds any NaN or inf, in every float dtype, anywhere."""

from __future__ import annotations

import pytest
import torch

from forkrl.weights.finite import first_nonfinite, is_finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [0, 517, -1])
def test_any_nan_or_inf_anywhere_is_found(dtype: torch.dtype, bad: float, where: int) -> None:
    t = torch.randn(33, 31).to(dtype)
    assert is_finite(t)
    t.view(-1)[where] = bad
    assert not is_finite(t)
    assert not is_finite(t[:, :].t())  # a non-contiguous view too


def test_integers_empty_and_extremes_are_finite() -> None:
    assert is_finite(torch.arange(10))
    assert is_finite(torch.empty(0, 5))
    big = torch.full((4,), torch.finfo(torch.float32).max)
    assert is_finite(big) and is_finite(-big)  # the largest finite values are finite (no sum that overflows)


def test_first_nonfinite_names_the_first_bad_tensor() -> None:
    a, b, c = torch.ones(3), torch.ones(3), torch.ones(3)
    assert first_nonfinite([("a", a), ("b", b)]) is None
    b[1], c[0] = float("nan"), float("inf")
    assert first_nonfinite([("a", a), ("b", b), ("c", c)]) == "b"
