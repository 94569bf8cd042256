"""Cluster-bootstrap 95% intervals of a cell's statistics (issue 14).

Positions of one trajectory are not independent, so a draw resamples the cell's *trajectories* with
replacement and takes all their vectors; every scalar is recomputed and the interval is the 2.5% and 97.5%
percentiles over the draws (`bootstrap_ci`). A draw is a multiplicity w_k per vector, and for duplicated rows
everything follows from the n x n matrices of the original vectors: the nonzero eigenvalues of the Gram
matrix of the resampled vectors are those of diag(sqrt w) G diag(sqrt w), a cosine sum is w^T C w, a median
is a weighted median. So all draws are computed at once (batched eigvalsh), except the cross-fitted energy
fraction, which splits each draw's trajectories into halves (one small loop). `_CellGrams.scalars` computes
one draw from an explicit index vector, the obviously correct reference the tests compare against.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from forkrl.probe.metrics import (
    EPS,
    _basis_coeffs,
    _cosine_gram,
    _ef_gram,
    _eig_desc,
    _erank_gram,
    _half_a,
    _norm_stats,
    _row_keep,
    drop_tiny,
    finite_vectors,
)

__all__ = ["CI_METRICS", "bootstrap_ci"]

# the scalars that get a 95% interval ("proj_energy_frac.4" is proj_energy_frac["4"])
CI_METRICS = (
    "grad_norm.median", "grad_norm.geomean", "grad_norm_flat_median", "row_cosine", "row_cosine_flat",
    "effective_rank", "effective_rank_normalized", "proj_energy_frac", "proj_energy_frac_insample",
)  # fmt: skip


class _CellGrams:
    """Everything a cell's scalars need, from which any resample (an index vector, repeats allowed) is cheap:
    the flat Gram (n x n), the per-row cosine Grams (R x n x n) and the row norms (n x R)."""

    def __init__(self, v3: Tensor):
        v3 = v3.double()
        self.n, self.d = v3.shape[0], v3.shape[1] * v3.shape[2]
        flat = v3.reshape(self.n, -1)
        self.g = flat @ flat.T
        self.norms = v3.norm(dim=2)  # (n, R)
        self.row_keep = _row_keep(self.norms)
        u = torch.where(
            self.row_keep.unsqueeze(-1), v3 / self.norms.clamp_min(1e-300).unsqueeze(-1), torch.zeros_like(v3)
        )
        self.cos_rows = torch.einsum("kri,lri->rkl", u, u)  # (R, n, n)

    def scalars(self, idx: Tensor, groups: Sequence[int], ks: Sequence[int], seed: int) -> dict[str, float | None]:
        n = idx.numel()
        g = self.g[idx][:, idx]
        out: dict[str, float | None] = {}
        ns = _norm_stats(self.norms[idx])
        out["grad_norm.median"], out["grad_norm.geomean"] = ns["median"], ns["geomean"]
        out["grad_norm_flat_median"] = g.diagonal().sqrt().quantile(0.5).item() if n else None
        keep = self.row_keep[idx]  # (m, R)
        n_r = keep.sum(0).double()
        ok = n_r >= 2
        tot = self.cos_rows[:, idx][:, :, idx].sum((1, 2))
        c = (tot - n_r) / (n_r * (n_r - 1)).clamp_min(1)
        out["row_cosine"] = c[ok].mean().item() if bool(ok.any()) else None
        out["row_cosine_flat"] = _cosine_gram(g)
        # one eigendecomposition per matrix, shared by every statistic that needs it
        lam = torch.linalg.eigvalsh(g).flip(0).clamp_min(0) if n else g.new_zeros(0)
        out["effective_rank"] = _erank_gram(g, self.d, lam)
        inv = g.diagonal().rsqrt()
        out["effective_rank_normalized"] = _erank_gram(g * inv[:, None] * inv[None, :], self.d) if n else None
        uniq = set(groups)
        if len(uniq) >= 2:
            in_a = _half_a(groups, seed)
            a, b = in_a.nonzero().squeeze(-1), (~in_a).nonzero().squeeze(-1)
            g_aa, g_bb, g_ab = g[a][:, a], g[b][:, b], g[a][:, b]
            eig_a, eig_b = _eig_desc(g_aa), _eig_desc(g_bb)
        for k in ks:
            out[f"proj_energy_frac_insample.{k}"] = (
                (lam[:k].sum() / lam.sum()).item() if 0 < k < n and lam.sum() > 0 else None
            )
            out[f"proj_energy_frac.{k}"] = None
            if len(uniq) >= 2 and k < n and k < a.numel() and k < b.numel():
                ef_ab = _ef_gram(g_ab.T, g_bb.trace(), _basis_coeffs(g_aa, k, self.d, eig_a))
                ef_ba = _ef_gram(g_ab, g_aa.trace(), _basis_coeffs(g_bb, k, self.d, eig_b))
                if ef_ab is not None and ef_ba is not None:
                    out[f"proj_energy_frac.{k}"] = 0.5 * (ef_ab + ef_ba)
        return out

    def batched(self, w: Tensor, ks: Sequence[int]) -> dict[str, Tensor]:
        """Every scalar except the cross-fitted energy fraction for B draws at once; w (B, n) are the draws'
        multiplicities. Returns (B,) tensors, NaN where a draw leaves the scalar undefined."""
        w = w.double()
        nan = torch.full((w.shape[0],), float("nan"), dtype=torch.float64)
        m = w.sum(1)
        out: dict[str, Tensor] = {}
        # row norms: weighted median and geomean per row over the kept vectors, then the mean over rows
        meds, geos = [], []
        for r in range(self.norms.shape[1]):
            wr = w * self.row_keep[:, r]
            meds.append(_weighted_median(self.norms[:, r], wr))
            logs = self.norms[:, r].clamp_min(1e-300).log()
            geos.append(((wr * logs).sum(1) / wr.sum(1)).exp().where(wr.sum(1) > 0, nan))
        out["grad_norm.median"] = torch.stack(meds, 1).nanmean(1)
        out["grad_norm.geomean"] = torch.stack(geos, 1).nanmean(1)
        out["grad_norm_flat_median"] = _weighted_median(self.g.diagonal().sqrt(), w)
        # cosines: (w^T C w - m) / (m (m - 1)) per row, and on the flattened vectors
        wr = w.unsqueeze(1) * self.row_keep.T.unsqueeze(0)  # (B, R, n)
        n_r = wr.sum(-1)
        tot = torch.einsum("brk,rkl,brl->br", wr, self.cos_rows, wr)
        c = ((tot - n_r) / (n_r * (n_r - 1)).clamp_min(1)).where(n_r >= 2, torch.full_like(n_r, float("nan")))
        out["row_cosine"] = c.nanmean(1)
        inv = self.g.diagonal().rsqrt()
        cos = self.g * inv[:, None] * inv[None, :]
        flat = (torch.einsum("bk,kl,bl->b", w, cos, w) - m) / (m * (m - 1)).clamp_min(1)
        out["row_cosine_flat"] = flat.where(m >= 2, nan)
        # effective ranks and in-sample energy fractions from the eigenvalues of sqrt(w) G sqrt(w)
        sw = w.sqrt()
        lam = torch.linalg.eigvalsh(sw[:, :, None] * self.g * sw[:, None, :]).flip(-1).clamp_min(0)
        out["effective_rank"] = _erank_batched(lam, m, self.d)
        lam_n = torch.linalg.eigvalsh(sw[:, :, None] * cos * sw[:, None, :]).flip(-1).clamp_min(0)
        out["effective_rank_normalized"] = _erank_batched(lam_n, m, self.d)
        total = lam.sum(1)
        for k in ks:
            ef = lam[:, :k].sum(1) / total
            out[f"proj_energy_frac_insample.{k}"] = ef.where((m > k) & (total > 0) & (k > 0), nan)
        return out

    def crossfit(self, idx: Tensor, groups: Sequence[int], ks: Sequence[int], seed: int) -> dict[str, float | None]:
        """The cross-fitted energy fractions of one draw (an index vector, repeats allowed)."""
        out: dict[str, float | None] = {f"proj_energy_frac.{k}": None for k in ks}
        if len(set(groups)) < 2:
            return out
        g = self.g[idx][:, idx]
        in_a = _half_a(groups, seed)
        a, b = in_a.nonzero().squeeze(-1), (~in_a).nonzero().squeeze(-1)
        g_aa, g_bb, g_ab = g[a][:, a], g[b][:, b], g[a][:, b]
        eig_a, eig_b = _eig_desc(g_aa), _eig_desc(g_bb)
        for k in ks:
            if k < idx.numel() and k < a.numel() and k < b.numel():
                ef_ab = _ef_gram(g_ab.T, g_bb.trace(), _basis_coeffs(g_aa, k, self.d, eig_a))
                ef_ba = _ef_gram(g_ab, g_aa.trace(), _basis_coeffs(g_bb, k, self.d, eig_b))
                if ef_ab is not None and ef_ba is not None:
                    out[f"proj_energy_frac.{k}"] = 0.5 * (ef_ab + ef_ba)
        return out


def _weighted_median(x: Tensor, w: Tensor) -> Tensor:
    """Median of x (n,) repeated w[b, k] times, per draw b (B,): the mean of the two middle order statistics
    for an even count, as torch.quantile(0.5); NaN for an empty draw."""
    order = torch.argsort(x)
    xs, cw = x[order], w[:, order].cumsum(1)
    m = cw[:, -1]
    lo = torch.floor((m + 1) / 2).clamp_min(1)
    hi = torch.floor(m / 2) + 1
    i_lo = torch.searchsorted(cw, lo.unsqueeze(1)).squeeze(1).clamp_max(x.numel() - 1)
    i_hi = torch.searchsorted(cw, hi.unsqueeze(1)).squeeze(1).clamp_max(x.numel() - 1)
    med = 0.5 * (xs[i_lo] + xs[i_hi])
    return med.where(m > 0, torch.full_like(med, float("nan")))


def _erank_batched(lam: Tensor, m: Tensor, d: int) -> Tensor:
    """Roy-Vetterli erank per row of descending eigenvalues lam (B, n) of draws with m vectors each; the noise
    floor lambda_1 * max(m, D) * eps as in `_erank_gram`; NaN where lambda_1 <= 0."""
    tol = lam[:, :1] * torch.clamp(m, min=d).unsqueeze(1) * EPS
    s = torch.where(lam > tol, lam, torch.zeros_like(lam)).sqrt()
    p = s / s.sum(1, keepdim=True)
    h = -(torch.where(p > 0, p * p.log(), torch.zeros_like(p))).sum(1)
    return h.exp().where(lam[:, 0] > 0, torch.full_like(h, float("nan")))


def bootstrap_ci(
    v3: Tensor, groups: Sequence[int], *, ks: Sequence[int] = (1, 4, 16), seed: int = 0, draws: int = 200
) -> dict[str, list[float] | None]:
    """Cluster-bootstrap 95% intervals [2.5%, 97.5%] of every scalar in CI_METRICS (with `.k` suffixes for the
    energy fractions). Each draw resamples the cell's trajectories with replacement and takes all their
    vectors; vectors with NaN/inf or |v| <= 1e-12 max |v| are dropped first, as in `cell_metrics`. A metric
    gets None when fewer than half of the draws define it, or with fewer than 2 trajectories."""
    ok, _ = finite_vectors(v3)
    v3 = v3[ok].double()
    groups = [int(g) for g, k in zip(groups, ok.tolist(), strict=True) if k]
    _, keep = drop_tiny(v3.reshape(v3.shape[0], -1))
    v3 = v3[keep]
    groups = [g for g, k in zip(groups, keep.tolist(), strict=True) if k]
    names = [m for m in CI_METRICS if not m.startswith("proj_")]
    names += [f"{m}.{k}" for m in ("proj_energy_frac", "proj_energy_frac_insample") for k in ks]
    out: dict[str, list[float] | None] = {m: None for m in names}
    uniq = sorted(set(groups))
    if len(uniq) < 2 or draws < 1:
        return out
    cg = _CellGrams(v3)
    slot = torch.tensor([uniq.index(g) for g in groups])  # each vector's trajectory, 0..T-1
    members = [slot.eq(t).nonzero().squeeze(-1) for t in range(len(uniq))]
    picks = torch.randint(0, len(uniq), (draws, len(uniq)), generator=torch.Generator().manual_seed(seed))
    counts = torch.zeros(draws, len(uniq), dtype=torch.float64).scatter_add_(
        1, picks, torch.ones(picks.shape, dtype=torch.float64)
    )
    vals = cg.batched(counts[:, slot], ks)
    for k in ks:  # the cross-fitted energy fraction splits each draw's trajectories: one draw at a time
        vals[f"proj_energy_frac.{k}"] = torch.full((draws,), float("nan"), dtype=torch.float64)
    if any(k < len(groups) for k in ks):
        for b in range(draws):
            idx = torch.cat([members[p] for p in picks[b].tolist()])
            for name, x in cg.crossfit(idx, [uniq[p] for p in slot[idx].tolist()], ks, seed).items():
                if x is not None:
                    vals[name][b] = x
    for name in names:
        x = vals[name]
        x = x[torch.isfinite(x)]
        if x.numel() * 2 >= draws:
            out[name] = [x.quantile(0.025).item(), x.quantile(0.975).item()]
    return out
