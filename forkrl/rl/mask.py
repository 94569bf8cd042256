"""The forking-token mask: keep the top-rho fraction of response tokens by policy entropy (§2.3).

Wang et al., "Beyond the 80/20 Rule" (arXiv 2506.01939 v2, Eq. 6): the policy gradient flows only through
tokens with H >= tau, tau chosen so that a fraction rho of the response tokens is kept.

Spec choices (algorithms.md §2.3, §6):
- **Exact top-k**, k = max(1, ceil(rho * N)) over real tokens only (response_mask True). Never
  `torch.quantile` (ties keep more than rho; 2^24 limit, §6 P10). Padding is never a candidate, whatever
  its entropy (§6 P1).
- **Deterministic ties**: a stable descending sort, so among equal entropies the earlier position in
  row-major (flattened [B, T]) order wins; in step scope earlier micro-batches win.
- **Bool masks only** (§6 P3). The returned mask is a subset of response_mask.
- rho None or 1.0 means off: the mask equals response_mask.
- **rho is checked once per call**: each public function checks it at its entry with the one rule
  (`forkrl.rl.options.check_top_frac`: a float comparison, for callers that build their own value); the
  helpers below them take the checked value and do not check again.
- **Scope** `microbatch` (default; paper and official code): one top-k per micro-batch. `step`: one top-k
  over every micro-batch of the optimizer step, split back. With data parallelism pass the micro-batch's
  entropies/masks gathered from every rank (pad, gather, drop the sentinel, §6 P2) and slice your rows.
- **Denominator up front**: k depends only on token counts, so the global kept-token count
  (sum over micro-batches of ceil(rho N_micro), or ceil(rho N_step)) is known before any forward pass
  (`kept_denominator`); that keeps `token_mean` over kept tokens exact under gradient accumulation.

Usage (per micro-batch, microbatch scope):

    res = forking_token_mask(entropy, response_mask, top_frac=0.2)   # entropy [B, T] fp32, mask [B, T] bool
    token_mask = res.mask            # bool [B, T]; log res.kept_frac every step (§6 P3)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import torch
from torch import Tensor

from forkrl.rl.options import MASK_SCOPES, check_top_frac, mask_is_on

__all__ = [
    "MASK_SCOPES",
    "MaskResult",
    "check_top_frac",
    "forking_token_mask",
    "kept_count",
    "kept_denominator",
    "mask_is_on",
    "masks_for_step",
]


@dataclass(frozen=True)
class MaskResult:
    """Result of one top-k selection.

    mask: bool [B, T], True on kept tokens (subset of response_mask).
    threshold: entropy of the k-th (last) kept token, i.e. tau; NaN if this micro-batch has no tokens
        (possible only for an empty micro-batch in step scope). In step scope it is the step's threshold.
    kept: number of kept tokens in this tensor. total: number of real tokens in it.
    kept_frac: kept / total (0.0 if total == 0).
    """

    mask: Tensor
    threshold: float
    kept: int
    total: int
    kept_frac: float


def kept_count(n_tokens: int, top_frac: float | None) -> int:
    """k = max(1, ceil(rho * N)) for N >= 1; N if the mask is off; 0 for N = 0.

    The ceiling is taken on the exact rational value of the *decimal* rho (Fraction(str(rho))), so that
    0.28 * 25 = 7.000000000000001 in floating point still gives 7 while 0.2 * 17 gives 4.
    """
    check_top_frac(top_frac)
    return _kept_count(n_tokens, top_frac)


def _kept_count(n_tokens: int, top_frac: float | None) -> int:
    """kept_count of a checked top_frac."""
    if isinstance(n_tokens, bool) or int(n_tokens) != n_tokens or n_tokens < 0:
        raise ValueError(f"n_tokens must be a non-negative integer, got {n_tokens!r}")
    n = int(n_tokens)
    if n == 0:
        return 0
    if not mask_is_on(top_frac):
        return n
    return max(1, math.ceil(Fraction(str(top_frac)) * n))


def _check_pair(entropy: Tensor, response_mask: Tensor, where: str) -> None:
    if response_mask.dtype != torch.bool:
        raise ValueError(
            f"{where}response_mask must be a bool tensor, got dtype {response_mask.dtype} "
            "(a 0/1 integer mask used as an index selects elements 0 and 1, §6 P3)"
        )
    if tuple(entropy.shape) != tuple(response_mask.shape):
        raise ValueError(
            f"{where}entropy shape {tuple(entropy.shape)} does not match "
            f"response_mask shape {tuple(response_mask.shape)}"
        )
    if not entropy.is_floating_point():
        raise ValueError(f"{where}entropy must be a floating-point tensor, got dtype {entropy.dtype}")


def _top_k_flat(values: Tensor, k: int) -> tuple[Tensor, float]:
    """values [N] -> (keep [N] bool with exactly k True, threshold). Stable: earlier index wins ties."""
    if not bool(torch.isfinite(values).all()):
        raise ValueError("entropy has non-finite values on response tokens")
    order = torch.sort(values, descending=True, stable=True).indices[:k]
    keep = torch.zeros(values.shape[0], dtype=torch.bool, device=values.device)
    keep[order] = True
    return keep, float(values[order[-1]])


def _scatter_back(response_mask: Tensor, keep_flat: Tensor) -> Tensor:
    mask = torch.zeros_like(response_mask)
    mask[response_mask] = keep_flat  # same row-major order as entropy[response_mask]
    return mask


def forking_token_mask(entropy: Tensor, response_mask: Tensor, top_frac: float | None) -> MaskResult:
    """Keep the k = max(1, ceil(rho N)) highest-entropy real tokens of one micro-batch.

    Args:
        entropy: [B, T] float (fp32 from `forkrl.rl.entropy`); values at padding are ignored.
        response_mask: [B, T] bool, True on real response tokens.
        top_frac: rho in (0, 1], or None; None or 1.0 returns response_mask itself (a copy).
    """
    check_top_frac(top_frac)
    return _one_mask(entropy, response_mask, top_frac)


def _one_mask(entropy: Tensor, response_mask: Tensor, top_frac: float | None) -> MaskResult:
    """forking_token_mask of a checked top_frac."""
    _check_pair(entropy, response_mask, "")
    vals = entropy.detach()[response_mask].float()
    n = vals.shape[0]
    if n == 0:
        raise ValueError("response_mask has no real tokens: cannot select forking tokens from nothing")
    k = _kept_count(n, top_frac)
    if k == n:
        mask = response_mask.clone()
        return MaskResult(mask=mask, threshold=float(vals.min()), kept=n, total=n, kept_frac=1.0)
    keep, threshold = _top_k_flat(vals, k)
    return MaskResult(
        mask=_scatter_back(response_mask, keep), threshold=threshold, kept=k, total=n, kept_frac=k / n
    )


def masks_for_step(
    entropies: Sequence[Tensor],
    response_masks: Sequence[Tensor],
    top_frac: float | None,
    scope: str = "microbatch",
) -> list[MaskResult]:
    """Masks for every micro-batch of one optimizer step.

    scope="microbatch": one independent top-k per micro-batch (each keeps ceil(rho N_micro)).
    scope="step": one top-k over all real tokens of the step (ceil(rho N_step) kept in total, spread
    unevenly across micro-batches), split back; every result carries the step threshold.
    Micro-batches may have different [B_m, T_m] shapes.
    """
    check_top_frac(top_frac)
    if scope not in MASK_SCOPES:
        raise ValueError(f"mask_scope must be one of {MASK_SCOPES}, got {scope!r}")
    if len(entropies) != len(response_masks):
        raise ValueError(
            f"got {len(entropies)} entropies but {len(response_masks)} response_masks (one per micro-batch)"
        )
    if not entropies:
        raise ValueError("masks_for_step needs at least one micro-batch")
    if scope == "microbatch":
        return [_one_mask(e, m, top_frac) for e, m in zip(entropies, response_masks, strict=True)]
    for j, (e, m) in enumerate(zip(entropies, response_masks, strict=True)):
        _check_pair(e, m, f"micro-batch {j}: ")
    vals_per = [e.detach()[m].float() for e, m in zip(entropies, response_masks, strict=True)]
    counts = [v.shape[0] for v in vals_per]
    n = sum(counts)
    if n == 0:
        raise ValueError("response_masks have no real tokens: cannot select forking tokens from nothing")
    vals = torch.cat(vals_per)
    k = _kept_count(n, top_frac)
    if k == n:
        keep, threshold = torch.ones(n, dtype=torch.bool, device=vals.device), float(vals.min())
    else:
        keep, threshold = _top_k_flat(vals, k)
    results = []
    for m, part in zip(response_masks, torch.split(keep, counts), strict=True):
        kept, total = int(part.sum()), part.shape[0]
        results.append(
            MaskResult(
                mask=_scatter_back(m, part),
                threshold=threshold,
                kept=kept,
                total=total,
                kept_frac=kept / total if total else 0.0,
            )
        )
    return results


def kept_denominator(
    response_masks: Sequence[Tensor | int], top_frac: float | None, scope: str = "microbatch"
) -> int:
    """Number of kept tokens in the whole step, from token counts alone (before any forward pass).

    response_masks: per micro-batch, a bool [B, T] mask or its token count (int).
    microbatch scope: sum_m ceil(rho N_m); step scope: ceil(rho sum_m N_m). Mask off: sum_m N_m.
    With data parallelism pass the counts of every rank's micro-batch (the top-k is taken over the
    gathered micro-batch, §2.3).
    """
    check_top_frac(top_frac)
    if scope not in MASK_SCOPES:
        raise ValueError(f"mask_scope must be one of {MASK_SCOPES}, got {scope!r}")
    counts = []
    for j, m in enumerate(response_masks):
        if isinstance(m, Tensor):
            if m.dtype != torch.bool:
                raise ValueError(f"response_masks[{j}] must be a bool tensor, got dtype {m.dtype}")
            counts.append(int(m.sum()))
        else:
            counts.append(int(m))
    if scope == "step":
        return _kept_count(sum(counts), top_frac)
    return sum(_kept_count(c, top_frac) for c in counts)
