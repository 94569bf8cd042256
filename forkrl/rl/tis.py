"""Truncated importance sampling (TIS) on the behaviour policy: the rollout/trainer mismatch correction.

Three policies meet in one step (algorithms.md §3.8):
- π_behav: the weights that sampled the trajectory, as the rollout engine computed them (vLLM's log-probs at
  the sampling temperature T, recorded per token);
- π_old (π_prox): the trainer's own weights before the first update of the batch, fp32 (forkrl/rl/step.py);
- π_θ: the weights being updated.
The PPO ratio r = π_θ / π_old only measures how far the updates of this batch moved the policy. In sync mode
π_old and π_behav are the same weights, but the engine computes them with other kernels and dtypes (bf16 vs
fp32, fused sampling), so its probabilities differ (§6 P6): the samples are off-policy for π_old by that gap.
TIS (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training") reweights
every token by the truncated ratio of the two, detached:

    w_t = sg(min(π_old(o_t) / π_behav(o_t), C))      = min(exp(logp_old - logp_behav), C)
    ℓ_t = w_t · ℓ^PPO_t       (clip-based losses; the dual clip and the forking mask apply as before)
    ℓ_t = −w_t · A · logp_θ   (reinforce, rloo)

C = `tis_cap` (2.0 is the published choice; None = off, which is w_t = 1 and exactly the loss without TIS).
The weight is a constant per token: it rescales the token's gradient and never carries one. Truncation
bounds the variance a token with a tiny behaviour probability would add.
- GSPO-token: one weight per sequence, sg(min(exp(mean_t (logp_old − logp_behav)), C)), over all response
  tokens (the geometric-mean form of its sequence ratio, §3.8).
- CISPO is itself an IS weight (§3.6): with tis_cap its weight becomes sg(min(π_θ / π_behav, cispo_max_weight)),
  π_behav as its denominator directly, with no extra w_t (§3.8; forkrl/rl/losses.py). C then only sets the
  threshold of the logged statistics below, which still describe π_old / π_behav.

Logged per step (`tis_tally` per micro-batch, summed over updates and ranks, then `tis_from_tally`): the
weight's mean on kept tokens, the largest raw ratio and the fraction of tokens whose raw ratio exceeds C, on all
response tokens and on kept tokens (the trainer-vs-rollout mean |Δlogp| is logged by the step with or without
TIS).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["tis_from_tally", "tis_metrics", "tis_tally", "tis_weights"]

_LOG_RATIO_CLAMP = 20.0  # as the PPO ratio (forkrl/rl/losses.py)


def tis_weights(
    old_logp: Tensor, behav_logp: Tensor, response_mask: Tensor, cap: float, *, per_sequence: bool = False
) -> tuple[Tensor, Tensor]:
    """(w, raw): w = min(π_old / π_behav, cap) and the untruncated ratio, both detached [B, T], 1 off response.

    old_logp, behav_logp: [B, T] log-probs of the trajectory's tokens under π_old and π_behav (any values on
    non-response positions). per_sequence: one ratio per row, exp of the mean log-ratio over its response
    tokens (GSPO), broadcast to its tokens.
    """
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    if old_logp.shape != behav_logp.shape or old_logp.shape != response_mask.shape:
        raise ValueError(f"old_logp {tuple(old_logp.shape)}, behav_logp {tuple(behav_logp.shape)} and "
                         f"response_mask {tuple(response_mask.shape)} must have the same shape")
    with torch.no_grad():
        delta = torch.where(response_mask, old_logp.detach() - behav_logp.to(old_logp.dtype), 0.0)
        if per_sequence:
            n = response_mask.sum(dim=-1, keepdim=True).clamp_min(1)
            delta = (delta.sum(dim=-1, keepdim=True) / n).expand_as(delta)
            delta = torch.where(response_mask, delta, 0.0)
        raw = torch.exp(delta.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
        return raw.clamp(max=cap), raw


def tis_tally(raw: Tensor, kept: Tensor, cap: float) -> tuple[dict[str, float], dict[str, float]]:
    """One micro-batch's mismatch statistics as float64 sums and maxima (what ranks and updates add up):
    raw = the untruncated ratios of its response tokens (1-D), kept = their kept flags (bool, same shape)."""
    r = raw.detach().double()
    if r.numel() == 0:
        return {"tis_capped": 0.0, "tis_capped_kept": 0.0, "tis_weight_kept": 0.0}, {}
    ninf = torch.full((), -torch.inf, dtype=torch.float64, device=r.device)
    capped, capped_kept, w_kept, r_max, r_kept_max = torch.stack([  # one device sync
        (r > cap).sum().double(), ((r > cap) & kept).sum().double(), torch.where(kept, r.clamp(max=cap), 0.0).sum(),
        r.max(), torch.where(kept, r, ninf).max()]).tolist()
    sums = {"tis_capped": capped, "tis_capped_kept": capped_kept, "tis_weight_kept": w_kept}
    maxs = {"tis_ratio_max": r_max}
    if r_kept_max > -torch.inf:
        maxs["tis_ratio_kept_max"] = r_kept_max
    return sums, maxs


def tis_from_tally(sums: dict[str, float], maxs: dict[str, float], n_resp: float, n_kept: float) -> dict[str, float]:
    """The logged statistics from `tis_tally`'s sums and maxima over a step (n_resp / n_kept: its token counts):
    tis_weight_mean (kept tokens), tis_ratio_max / tis_ratio_kept_max, tis_capped_frac / tis_capped_kept_frac
    (fraction of tokens with raw ratio > cap)."""
    return {
        "tis_ratio_max": maxs.get("tis_ratio_max", 0.0),
        "tis_capped_frac": sums.get("tis_capped", 0.0) / n_resp if n_resp else 0.0,
        "tis_ratio_kept_max": maxs.get("tis_ratio_kept_max", 0.0),
        "tis_capped_kept_frac": sums.get("tis_capped_kept", 0.0) / n_kept if n_kept else 0.0,
        "tis_weight_mean": sums.get("tis_weight_kept", 0.0) / n_kept if n_kept else 0.0,
    }


def tis_metrics(parts: Sequence[tuple[Tensor, Tensor, Tensor]], cap: float) -> dict[str, float]:
    """Mismatch statistics over micro-batches: parts = (raw ratio, response mask, kept mask) per micro-batch
    (`tis_from_tally` of their `tis_tally`s)."""
    sums: dict[str, float] = {}
    maxs: dict[str, float] = {}
    n_resp = n_kept = 0
    for r, m, k in parts:
        s, mx = tis_tally(r[m], k[m], cap)
        for key, v in s.items():
            sums[key] = sums.get(key, 0.0) + v
        for key, v in mx.items():
            maxs[key] = max(maxs.get(key, v), v)
        n_resp, n_kept = n_resp + int(m.sum()), n_kept + int(k.sum())
    return tis_from_tally(sums, maxs, n_resp, n_kept)
