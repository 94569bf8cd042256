"""Group advantage estimators and the DAPO reward helpers (algorithms.md §3.1–§3.4, §3.6).

All estimators take rewards [B, G] (B prompts x G samples each, one scalar reward per response) and
return advantages [B, G] of the same float dtype (integer rewards become float32). Flatten row-major
(`adv.reshape(-1)`) to get one advantage per sequence in the order prompt0/sample0, prompt0/sample1, ...

| estimator  | formula                                          | used by (default)          |
|------------|--------------------------------------------------|----------------------------|
| grpo       | (R - mean_G R) / (std_G R + eps), Bessel std     | grpo, dapo, gspo, cispo    |
| dr_grpo    | R - mean_G R                                     | dr_grpo                    |
| rloo       | R - mean_{j!=i} R_j = G/(G-1) (R - mean_G R)     | rloo                       |
| reinforce  | R - b (constant baseline, default 0)             | reinforce                  |

Group size 1: grpo and dr_grpo give 0 (a single sample carries no baseline, so no signal; note that verl
instead uses mean 0 / std 1 there, §3.1); rloo raises (no "others" to leave one out).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "DEFAULT_ESTIMATOR",
    "ESTIMATORS",
    "compute_advantages",
    "dr_grpo_advantages",
    "dynamic_sampling_keep",
    "grpo_advantages",
    "reinforce_advantages",
    "rloo_advantages",
    "soft_overlong_penalty",
]

ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce")

# Each loss's default advantage estimator (§3): DAPO, GSPO and CISPO all use the GRPO advantage.
DEFAULT_ESTIMATOR: dict[str, str] = {
    "grpo": "grpo",
    "dapo": "grpo",
    "gspo": "grpo",
    "cispo": "grpo",
    "dr_grpo": "dr_grpo",
    "rloo": "rloo",
    "reinforce": "reinforce",
}


def _check_rewards(rewards: Tensor, fn: str) -> Tensor:
    if not isinstance(rewards, Tensor):
        raise ValueError(f"{fn}: rewards must be a tensor of shape [B, G], got {type(rewards).__name__}")
    if rewards.dim() != 2 or rewards.shape[1] < 1:
        raise ValueError(f"{fn}: rewards must have shape [B, G] with G >= 1, got {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.float32)
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError(f"{fn}: rewards contain NaN or inf")
    return rewards


def grpo_advantages(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    """(R - mean) / (std + eps) per group, Bessel-corrected std (§3.1; eps 1e-6 as verl). G = 1 -> 0."""
    rewards = _check_rewards(rewards, "grpo_advantages")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if rewards.shape[1] == 1:
        return torch.zeros_like(rewards)
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    return centered / (rewards.std(dim=1, keepdim=True, correction=1) + eps)


def dr_grpo_advantages(rewards: Tensor) -> Tensor:
    """R - mean per group: no std scaling, no difficulty re-weighting (Dr. GRPO fix (i), §3.2)."""
    rewards = _check_rewards(rewards, "dr_grpo_advantages")
    return rewards - rewards.mean(dim=1, keepdim=True)


def rloo_advantages(rewards: Tensor) -> Tensor:
    """Leave-one-out baseline: R_i - mean_{j != i} R_j = G/(G-1) (R_i - mean R) (§3.4). Needs G >= 2."""
    rewards = _check_rewards(rewards, "rloo_advantages")
    g = rewards.shape[1]
    if g < 2:
        raise ValueError(f"rloo_advantages needs group size G >= 2, got G = {g}")
    return (rewards - rewards.mean(dim=1, keepdim=True)) * (g / (g - 1))


def reinforce_advantages(rewards: Tensor, baseline: float = 0.0) -> Tensor:
    """R - b with a constant baseline b (§3.4)."""
    rewards = _check_rewards(rewards, "reinforce_advantages")
    return rewards - baseline


def compute_advantages(
    loss_name: str,
    rewards: Tensor,
    *,
    eps: float = 1e-6,
    baseline: float = 0.0,
    estimator: str | None = None,
) -> Tensor:
    """Advantages [B, G] for `loss_name` with its default estimator (or `estimator` to override)."""
    if loss_name not in DEFAULT_ESTIMATOR:
        raise ValueError(f"unknown loss name {loss_name!r}; valid names: {sorted(DEFAULT_ESTIMATOR)}")
    est = DEFAULT_ESTIMATOR[loss_name] if estimator is None else estimator
    if est == "grpo":
        return grpo_advantages(rewards, eps=eps)
    if est == "dr_grpo":
        return dr_grpo_advantages(rewards)
    if est == "rloo":
        return rloo_advantages(rewards)
    if est == "reinforce":
        return reinforce_advantages(rewards, baseline=baseline)
    raise ValueError(f"unknown advantage estimator {est!r}; valid estimators: {list(ESTIMATORS)}")


def soft_overlong_penalty(lengths: Tensor, max_len: int, cache_len: int) -> Tensor:
    """DAPO soft overlong punishment (Eq. 13), added to the reward; lengths [...] -> float32 [...].

    0 if len <= max_len - cache_len; ((max_len - cache_len) - len) / cache_len in the soft zone (linear from
    0 to -1); -1 beyond max_len. Defaults in the paper: max_len 20480, cache_len 4096.
    """
    if not 0 < cache_len <= max_len:
        raise ValueError(f"need 0 < cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}")
    ell = lengths.to(torch.float32)
    soft_start = max_len - cache_len
    pen = (soft_start - ell) / cache_len
    pen = torch.where(ell <= soft_start, torch.zeros_like(ell), pen)
    return torch.where(ell > max_len, torch.full_like(ell, -1.0), pen)


def dynamic_sampling_keep(rewards: Tensor) -> Tensor:
    """DAPO dynamic sampling (§3.3): bool [B], True for groups whose rewards are not all equal.

    With 0/1 or +-1 correctness rewards this is 0 < #correct < G. Groups where every reward is equal have
    zero GRPO advantage and contribute no gradient. Exact equality: apply it to the correctness reward
    (before a length penalty makes otherwise-degenerate groups differ), if that is what you want.
    """
    rewards = _check_rewards(rewards, "dynamic_sampling_keep")
    return (rewards != rewards[:, :1]).any(dim=1)
