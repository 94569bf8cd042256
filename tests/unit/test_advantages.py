"""forkrl.rl.advantages: group estimators and DAPO reward helpers (algorithms.md §3.1–§3.4)."""

from __future__ import annotations

import math

import pytest
import torch

from forkrl.rl.advantages import (
    DEFAULT_ESTIMATOR,
    compute_advantages,
    dr_grpo_advantages,
    dynamic_sampling_keep,
    grpo_advantages,
    reinforce_advantages,
    rloo_advantages,
    soft_overlong_penalty,
)
from forkrl.rl.losses import LOSS_NAMES

R = torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)


def test_grpo_hand_computed():
    # Row 0: mean 0.5, Bessel std sqrt(4 * 0.25 / 3) = 0.5773503 -> +-0.5 / 0.5773503 = +-0.8660254.
    # Row 1: mean 0.75, std sqrt((3 * 0.0625 + 0.5625) / 3) = 0.5 -> 0.25/0.5 = 0.5, -0.75/0.5 = -1.5.
    adv = grpo_advantages(R, eps=0.0)
    expected = [[0.8660254, -0.8660254, 0.8660254, -0.8660254], [0.5, 0.5, 0.5, -1.5]]
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-7)
    # eps is added to the std: 0.25 / (0.5 + 0.1)
    assert grpo_advantages(R, eps=0.1)[1, 0].item() == pytest.approx(0.25 / 0.6)


def test_grpo_degenerate_groups_are_zero():
    adv = grpo_advantages(torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    assert torch.equal(adv, torch.zeros(2, 3))
    assert torch.equal(grpo_advantages(torch.tensor([[3.0], [-1.0]])), torch.zeros(2, 1))  # G = 1


def test_dr_grpo_rloo_reinforce_hand_computed():
    expected_dr = torch.tensor([[0.5, -0.5, 0.5, -0.5], [0.25, 0.25, 0.25, -0.75]], dtype=R.dtype)
    torch.testing.assert_close(dr_grpo_advantages(R), expected_dr)
    # RLOO row 0, sample 0: 1 - mean(0, 1, 0) = 2/3; row 1, sample 3: 0 - mean(1, 1, 1) = -1.
    rloo = rloo_advantages(R)
    expected = [[2 / 3, -2 / 3, 2 / 3, -2 / 3], [1 / 3, 1 / 3, 1 / 3, -1.0]]
    torch.testing.assert_close(rloo, torch.tensor(expected, dtype=R.dtype))
    torch.testing.assert_close(reinforce_advantages(R, baseline=0.5), R - 0.5)
    assert torch.equal(reinforce_advantages(R), R)


def test_rloo_matches_leave_one_out_loop():
    gen = torch.Generator().manual_seed(0)
    r = torch.randn(5, 6, generator=gen, dtype=torch.float64)
    ref = torch.tensor(
        [[r[b, i].item() - (r[b].sum().item() - r[b, i].item()) / 5 for i in range(6)] for b in range(5)],
        dtype=torch.float64,
    )
    torch.testing.assert_close(rloo_advantages(r), ref)


def test_grpo_matches_loop_reference():
    gen = torch.Generator().manual_seed(1)
    r = torch.randint(0, 2, (8, 5), generator=gen).double()
    for b in range(8):
        row = r[b].tolist()
        m = sum(row) / 5
        sd = math.sqrt(sum((x - m) ** 2 for x in row) / 4)
        for i in range(5):
            assert grpo_advantages(r)[b, i].item() == pytest.approx((row[i] - m) / (sd + 1e-6), abs=1e-9)


def test_integer_rewards_become_float():
    adv = dr_grpo_advantages(torch.tensor([[1, 0]]))
    assert adv.dtype == torch.float32 and adv.tolist() == [[0.5, -0.5]]


def test_compute_advantages_dispatch():
    assert set(DEFAULT_ESTIMATOR) == set(LOSS_NAMES)
    for name in ("grpo", "dapo", "gspo", "cispo"):
        assert torch.equal(compute_advantages(name, R), grpo_advantages(R))
    assert torch.equal(compute_advantages("dr_grpo", R), dr_grpo_advantages(R))
    assert torch.equal(compute_advantages("rloo", R), rloo_advantages(R))
    assert torch.equal(compute_advantages("reinforce", R, baseline=0.25), R - 0.25)
    assert torch.equal(compute_advantages("grpo", R, estimator="rloo"), rloo_advantages(R))
    with pytest.raises(ValueError, match=r"unknown loss name 'ppo'; valid names: \['cispo', 'dapo'"):
        compute_advantages("ppo", R)
    with pytest.raises(ValueError, match="unknown advantage estimator 'gae'"):
        compute_advantages("grpo", R, estimator="gae")


def test_bad_rewards():
    with pytest.raises(ValueError, match=r"rloo_advantages needs group size G >= 2, got G = 1"):
        rloo_advantages(torch.ones(3, 1))
    with pytest.raises(ValueError, match=r"grpo_advantages: rewards must have shape \[B, G\].*got \(4,\)"):
        grpo_advantages(torch.ones(4))
    with pytest.raises(ValueError, match="NaN or inf"):
        dr_grpo_advantages(torch.tensor([[1.0, float("nan")]]))


def test_soft_overlong_penalty_hand_computed():
    # L_max = 20, L_cache = 4: soft zone (16, 20]; (16 - len) / 4 there, -1 beyond 20.
    lengths = torch.tensor([10, 16, 17, 18, 20, 21, 100])
    pen = soft_overlong_penalty(lengths, max_len=20, cache_len=4)
    assert pen.tolist() == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0]
    # Paper defaults: 20480 / 4096 -> soft zone starts at 16384.
    big = soft_overlong_penalty(torch.tensor([16384, 18432, 20480]), 20480, 4096)
    assert big.tolist() == [0.0, -0.5, -1.0]
    with pytest.raises(ValueError, match="need 0 < cache_len <= max_len, got cache_len=0"):
        soft_overlong_penalty(lengths, 20, 0)


def test_dynamic_sampling_keep_binary_and_signed():
    r01 = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    assert dynamic_sampling_keep(r01).tolist() == [False, False, True, True]
    rpm = torch.tensor([[1.0, 1.0], [-1.0, -1.0], [-1.0, 1.0]])
    assert dynamic_sampling_keep(rpm).tolist() == [False, False, True]
    assert dynamic_sampling_keep(torch.tensor([[1.0], [0.0]])).tolist() == [False, False]  # G = 1
    assert dynamic_sampling_keep(r01).dtype == torch.bool
