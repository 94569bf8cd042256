"""Cell statistics of probe gradients, in float64 (algorithms.md §4.3).

A cell is (checkpoint, entropy bin, correctness); for one target weight and row set it holds n row-gradient
blocks V3 of shape (n, R, in): v_{k,r} is the gradient of logp at position k w.r.t. row r. V (n x D,
D = R * in) is the flattened form.

- grad norm: a_{k,r} = |v_{k,r}|; median and geometric mean over k (norms are heavy-tailed), mean over r.
- row cosine: mean pairwise cosine of the n gradients of a row, (|sum_k u_k|^2 - n) / (n (n-1)) with
  u_k = v_k / |v_k| (O(nD)); mean over rows, plus the same on the flattened V, plus a sign-flip null
  (about 0 +- 1/sqrt(D)).
- projection energy fraction: |V_B U_A|^2 / |V_B|^2 with U_A the top-k right singular vectors of the other
  half of the trajectories, averaged over both directions (cross-fitted; the in-sample EF_k is optimistic).
- effective rank (Roy & Vetterli 2007): exp(entropy of sigma / sum sigma), tiny sigma dropped; also on the
  row-normalized V and at a common n (subsample, average over draws) since erank grows with n.

Vectors with a NaN/inf entry are dropped first and counted (`n_nonfinite`); vectors with
|v| <= 1e-12 * max |v| are dropped before any statistic, and counted.

Intervals: `forkrl.probe.bootstrap` (cluster bootstrap over trajectories). Effective rank at a common n
(`erank_at_n`) is computed by the job once every checkpoint is done, with one n per (target, row set) for the
whole job.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "DROP_REL",
    "erank_at_n",
    "finite_vectors",
    "cell_metrics",
    "drop_tiny",
    "effective_rank",
    "energy_fraction",
    "energy_fraction_crossfit",
    "grad_norm_stats",
    "mean_pairwise_cosine",
    "row_cosine",
    "singular_values",
    "top_right_singular_vectors",
]

DROP_REL = 1e-12
EPS = torch.finfo(torch.float64).eps


def finite_vectors(v3: Tensor) -> tuple[Tensor, int]:
    """bool mask (n,) of the vectors without a NaN/inf entry, and how many have one."""
    ok = torch.isfinite(v3.reshape(v3.shape[0], -1)).all(dim=1)
    return ok, int((~ok).sum())


def drop_tiny(v: Tensor, rel: float = DROP_REL) -> tuple[Tensor, Tensor]:
    """Rows of v (n x D) with norm > rel * max norm, and the bool keep mask."""
    v = v.double()
    norms = v.norm(dim=1)
    if v.shape[0] == 0:
        return v, norms.bool()
    keep = norms > rel * norms.max()
    return v[keep], keep


def mean_pairwise_cosine(v: Tensor) -> float | None:
    """(|sum u|^2 - n) / (n (n-1)) for unit u = v / |v|; v must already be free of zero rows. None if n < 2."""
    n = v.shape[0]
    if n < 2:
        return None
    u = v.double() / v.double().norm(dim=1, keepdim=True)
    return ((u.sum(0).pow(2).sum() - n) / (n * (n - 1))).item()


def singular_values(v: Tensor) -> Tensor:
    """Singular values of v (n x D), descending, float64, with numerically-zero ones removed.

    When n << D: eigenvalues of the n x n Gram matrix V V^T, clamped at 0; an eigenvalue below
    lambda_1 * max(n, D) * eps is noise (the Gram matrix squares the condition number), sigma = sqrt(lambda).
    Otherwise `svdvals`, dropping sigma < sigma_1 * max(n, D) * eps.
    """
    v = v.double()
    n, d = v.shape
    if n == 0 or d == 0:
        return v.new_zeros(0)
    tol = max(n, d) * EPS
    if 2 * n <= d:
        lam = torch.linalg.eigvalsh(v @ v.T).flip(0).clamp_min(0)
        if lam[0] <= 0:
            return v.new_zeros(0)
        return lam[lam > lam[0] * tol].sqrt()
    s = torch.linalg.svdvals(v)
    if s[0] <= 0:
        return v.new_zeros(0)
    return s[s > s[0] * tol]


def effective_rank(v: Tensor) -> float | None:
    """Roy & Vetterli: exp(-sum p log p), p = sigma / sum sigma. In [1, min(n, D)]; None if v is all zero."""
    s = singular_values(v)
    if s.numel() == 0:
        return None
    p = s / s.sum()
    return math.exp(-(p * p.log()).sum().item())


def top_right_singular_vectors(v: Tensor, k: int) -> Tensor:
    """D x k' orthonormal basis of the top-k right singular subspace of v (k' <= k: zero directions dropped)."""
    v = v.double()
    n, d = v.shape
    if 2 * n <= d:
        lam, q = torch.linalg.eigh(v @ v.T)
        lam, q = lam.flip(0), q.flip(1)
        good = lam > lam[0].clamp_min(0) * max(n, d) * EPS
        kk = min(k, int(good.sum()))
        if kk == 0:
            return v.new_zeros(d, 0)
        # right singular vectors: V^T q_j / sigma_j
        return (v.T @ q[:, :kk]) / lam[:kk].sqrt()
    _, s, vh = torch.linalg.svd(v, full_matrices=False)
    kk = min(k, int((s > s[0] * max(n, d) * EPS).sum())) if s.numel() and s[0] > 0 else 0
    return vh[:kk].T


def energy_fraction(v: Tensor, u: Tensor) -> float | None:
    """|V U|_F^2 / |V|_F^2 for an orthonormal D x k basis U (energy-weighted). None if V is zero."""
    v = v.double()
    total = v.pow(2).sum()
    if total <= 0:
        return None
    return ((v @ u.double()).pow(2).sum() / total).item()


def _half_a(groups: Sequence[int], seed: int) -> Tensor:
    """bool mask of the vectors whose group (trajectory) falls in the seeded half A."""
    uniq = sorted(set(int(g) for g in groups))
    gen = torch.Generator().manual_seed(seed)
    perm = [uniq[i] for i in torch.randperm(len(uniq), generator=gen).tolist()]
    half_a = set(perm[: len(perm) // 2])
    return torch.tensor([int(g) in half_a for g in groups], dtype=torch.bool)


def energy_fraction_crossfit(
    v: Tensor, groups: Sequence[int], ks: Sequence[int], seed: int = 0
) -> dict[int, float | None]:
    """Cross-fitted EF_k: split the *groups* (trajectories) into two seeded halves A and B, fit the top-k
    right singular subspace on one half and measure the other's energy in it; mean of both directions.

    A k gets None unless k < n and k < the size of each half (otherwise the subspace is the whole half).
    """
    out: dict[int, float | None] = {k: None for k in ks}
    n = v.shape[0]
    uniq = sorted(set(int(g) for g in groups))
    if n < 2 or len(uniq) < 2:
        return out
    in_a = _half_a(groups, seed)
    va, vb = v[in_a].double(), v[~in_a].double()
    for k in ks:
        if not (k < n and k < va.shape[0] and k < vb.shape[0]):
            continue
        ef_ab = energy_fraction(vb, top_right_singular_vectors(va, k))
        ef_ba = energy_fraction(va, top_right_singular_vectors(vb, k))
        if ef_ab is not None and ef_ba is not None:
            out[k] = 0.5 * (ef_ab + ef_ba)
    return out


def _row_keep(norms: Tensor) -> Tensor:
    """(n, R) bool: per row r, vectors above 1e-12 x that row's max norm (an all-zero row keeps none)."""
    top = norms.max(dim=0, keepdim=True).values if norms.shape[0] else norms
    return (norms > DROP_REL * top) & (top > 0)


def grad_norm_stats(v3: Tensor) -> dict[str, float | None]:
    """Median and geometric mean of a_{k,r} = |v_{k,r}| over k, averaged over rows r.

    Per row, vectors at or below 1e-12 x that row's max are left out (log 0 would make the geomean 0).
    """
    return _norm_stats(v3.double().norm(dim=2))


def _norm_stats(norms: Tensor) -> dict[str, float | None]:
    """grad_norm_stats from the (n, R) row norms."""
    keep = _row_keep(norms)
    rows = keep.any(dim=0)
    if norms.numel() == 0 or not bool(rows.any()):
        return {"median": None, "geomean": None}
    masked = torch.where(keep, norms, torch.full_like(norms, float("nan")))
    med = masked.nanquantile(0.5, dim=0)[rows]  # the midpoint for even counts (torch.median takes the lower)
    logs = torch.where(keep, norms.clamp_min(1e-300).log(), torch.zeros_like(norms))
    geo = (logs.sum(0)[rows] / keep.sum(0)[rows]).exp()
    return {"median": med.mean().item(), "geomean": geo.mean().item()}


def row_cosine(v3: Tensor) -> tuple[float | None, int]:
    """Mean over rows of the within-row mean pairwise cosine; and how many row vectors were dropped.

    Vectorized over rows: C_r = (|sum_k u_{k,r}|^2 - n_r) / (n_r (n_r - 1)) with dropped vectors as u = 0.
    """
    v3 = v3.double()
    norms = v3.norm(dim=2)
    keep = _row_keep(norms)
    u = torch.where(keep.unsqueeze(-1), v3 / norms.clamp_min(1e-300).unsqueeze(-1), torch.zeros_like(v3))
    n_r = keep.sum(0).double()
    ok = n_r >= 2
    dropped = int((~keep).sum())
    if not bool(ok.any()):
        return None, dropped
    c = (u.sum(0).pow(2).sum(-1) - n_r) / (n_r * (n_r - 1)).clamp_min(1)
    return c[ok].mean().item(), dropped


# ---- everything below works from the n x n Gram matrix V V^T: one (n x D) matmul per cell instead of one per
# statistic. The public functions above compute the same quantities directly (the tests check both agree).


def _eig_desc(g: Tensor) -> tuple[Tensor, Tensor]:
    lam, q = torch.linalg.eigh(g)
    return lam.flip(0).clamp_min(0), q.flip(1)


def _erank_gram(g: Tensor, d: int, lam: Tensor | None = None) -> float | None:
    """erank from Gram eigenvalues; lambda below lambda_1 * max(n, D) * eps is noise (see singular_values).
    `lam`: g's eigenvalues, descending and clamped at 0, when already at hand."""
    if g.shape[0] == 0:
        return None
    if lam is None:
        lam = torch.linalg.eigvalsh(g).flip(0).clamp_min(0)
    if lam[0] <= 0:
        return None
    s = lam[lam > lam[0] * max(g.shape[0], d) * EPS].sqrt()
    p = s / s.sum()
    return math.exp(-(p * p.log()).sum().item())


def _cosine_gram(g: Tensor, signs: Tensor | None = None) -> float | None:
    n = g.shape[0]
    if n < 2:
        return None
    inv = g.diagonal().rsqrt()
    c = g * inv[:, None] * inv[None, :]
    if signs is not None:
        c = c * signs[:, None] * signs[None, :]
    return ((c.sum() - n) / (n * (n - 1))).item()


def _basis_coeffs(g_aa: Tensor, k: int, d: int, eig: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Coefficients C (n_A x k') with U_A = V_A^T C: top right singular vectors of V_A from its Gram
    (`eig`: its `_eig_desc`, when already at hand)."""
    lam, q = eig if eig is not None else _eig_desc(g_aa)
    good = int((lam > lam[0] * max(g_aa.shape[0], d) * EPS).sum()) if lam.numel() and lam[0] > 0 else 0
    kk = min(k, good)
    return q[:, :kk] / lam[:kk].sqrt()


def _ef_gram(g_ba: Tensor, g_bb_trace: Tensor, coeffs: Tensor) -> float | None:
    """|V_B U_A|^2 / |V_B|^2 with V_B U_A = (V_B V_A^T) C."""
    if g_bb_trace <= 0:
        return None
    return ((g_ba @ coeffs).pow(2).sum() / g_bb_trace).item()


def cell_metrics(
    v3: Tensor,
    groups: Sequence[int],
    *,
    ks: Sequence[int] = (1, 4, 16),
    seed: int = 0,
    n_common: int | None = None,
    erank_draws: int = 20,
    keep_gram: bool = False,
) -> dict:
    """All §4.3 statistics of one cell for one target and row set. v3: (n, R, in); groups: trajectory ids.

    Scalars are None where undefined (too few vectors, k not < n or not < a half's size). With `keep_gram`
    the result also holds "_gram": (the kept vectors' Gram matrix, D), for `erank_at_n` later."""
    ok, n_nonfinite = finite_vectors(v3)
    if n_nonfinite:
        v3 = v3[ok]
        groups = [g for g, k in zip(groups, ok.tolist(), strict=True) if k]
    n_total = v3.shape[0]
    flat = v3.reshape(n_total, -1).double()
    v, keep = drop_tiny(flat)
    kept_groups = [g for g, k in zip(groups, keep.tolist(), strict=True) if k]
    n, d = v.shape
    v3k = v3[keep].double()
    cos_row, row_dropped = row_cosine(v3k)
    g = v @ v.T  # the one big matmul
    out: dict = {
        "n": n,
        "n_nonfinite": n_nonfinite,
        "n_dropped": n_total - n,
        "n_row_vectors_dropped": row_dropped,
        "n_trajectories": len(set(kept_groups)),
        "grad_norm": grad_norm_stats(v3k),
        "grad_norm_flat_median": g.diagonal().sqrt().quantile(0.5).item() if n else None,
        "row_cosine": cos_row,
        "row_cosine_flat": _cosine_gram(g),
        "row_cosine_flat_null": None,
        "proj_energy_frac": {str(k): None for k in ks},
        "proj_energy_frac_insample": {str(k): None for k in ks},
        "effective_rank": _erank_gram(g, d),
        "effective_rank_normalized": None,
        "effective_rank_common_n": None,
        "n_common": n_common,
    }
    if keep_gram:
        out["_gram"] = (g, d)
    if n == 0:
        return out
    if n >= 2:
        gen = torch.Generator().manual_seed(seed)
        signs = torch.randint(0, 2, (n,), generator=gen).double() * 2 - 1
        out["row_cosine_flat_null"] = _cosine_gram(g, signs)
    inv = g.diagonal().rsqrt()
    out["effective_rank_normalized"] = _erank_gram(g * inv[:, None] * inv[None, :], d)
    lam = torch.linalg.eigvalsh(g).flip(0).clamp_min(0)
    for k in ks:
        if 0 < k < n and lam.sum() > 0:
            out["proj_energy_frac_insample"][str(k)] = (lam[:k].sum() / lam.sum()).item()
    if len(set(kept_groups)) >= 2:
        in_a = _half_a(kept_groups, seed)
        a, b = in_a.nonzero().squeeze(-1), (~in_a).nonzero().squeeze(-1)
        g_aa, g_bb, g_ab = g[a][:, a], g[b][:, b], g[a][:, b]
        for k in ks:
            if k < n and k < a.numel() and k < b.numel():
                ef_ab = _ef_gram(g_ab.T, g_bb.trace(), _basis_coeffs(g_aa, k, d))
                ef_ba = _ef_gram(g_ab, g_aa.trace(), _basis_coeffs(g_bb, k, d))
                if ef_ab is not None and ef_ba is not None:
                    out["proj_energy_frac"][str(k)] = 0.5 * (ef_ab + ef_ba)
    if n_common is not None:
        out["effective_rank_common_n"] = erank_at_n(g, d, n_common, draws=erank_draws, seed=seed)
    return out


def erank_at_n(g: Tensor, d: int, n_common: int, *, draws: int = 20, seed: int = 0) -> float | None:
    """Effective rank of n_common of the n vectors whose Gram matrix is g (n x n, vectors of dimension d):
    the mean over `draws` seeded subsets (exact when n_common == n); None when n_common is not in [1, n]."""
    n = g.shape[0]
    if not 1 <= n_common <= n:
        return None
    if n_common == n:
        return _erank_gram(g, d)
    gen = torch.Generator().manual_seed(seed)
    vals = []
    for _ in range(draws):
        idx = torch.randperm(n, generator=gen)[:n_common]
        e = _erank_gram(g[idx][:, idx], d)
        if e is not None:
            vals.append(e)
    return sum(vals) / len(vals) if vals else None
