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


@pytest.mark.parametrize("value", [7e4, -7e4, 65520.0])
def test_a_value_finite_in_float32_but_not_in_the_served_float16_is_refused(value: float) -> None:
    t = torch.ones(4)
    t[2] = value
    assert is_finite(t) and not torch.isfinite(t.to(torch.float16)).all()  # what the model's cast would make
    assert not is_finite(t, torch.float16)
    assert is_finite(t, torch.float32) and is_finite(t, torch.bfloat16)
    assert first_nonfinite([("a", torch.ones(2)), ("w", t)], torch.float16) == "w"
    assert is_finite(torch.full((3,), torch.finfo(torch.float16).max), torch.float16)  # the largest one is fine
