"""Probe metrics (algorithms.md §4.3) on synthetic matrices whose answers are known by construction."""

from __future__ import annotations

import math

import pytest
import torch

from forkrl.probe.metrics import (
    cell_metrics,
    drop_tiny,
    effective_rank,
    energy_fraction,
    energy_fraction_crossfit,
    grad_norm_stats,
    mean_pairwise_cosine,
    row_cosine,
    singular_values,
    top_right_singular_vectors,
)

DT = torch.float64


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("n,d", [(9, 200), (9, 12)])  # Gram path (n << D) and svdvals path
def test_effective_rank_rank1_and_orthonormal(n, d):
    g = _gen()
    r1 = torch.outer(torch.randn(n, generator=g, dtype=DT), torch.randn(d, generator=g, dtype=DT))
    assert effective_rank(r1) == pytest.approx(1.0, abs=1e-9)
    q = torch.linalg.qr(torch.randn(d, n, generator=g, dtype=DT)).Q.T  # n orthonormal rows
    assert effective_rank(q) == pytest.approx(n, abs=1e-9)
    assert effective_rank(3.0 * q) == pytest.approx(n, abs=1e-9)  # scale-free
    # two orthogonal directions with singular values 3 and 1: p = (3/4, 1/4)
    v = torch.zeros(4, d, dtype=DT)
    v[0, 0], v[1, 1] = 3.0, 1.0
    assert effective_rank(v) == pytest.approx(math.exp(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25))))
    assert effective_rank(torch.zeros(3, d, dtype=DT)) is None


def test_gram_and_svd_agree():
    v = torch.randn(6, 300, generator=_gen(1), dtype=DT)
    torch.testing.assert_close(singular_values(v), torch.linalg.svdvals(v))


def test_row_cosine_identical_orthogonal_opposite():
    g = _gen(2)
    w = torch.randn(1, 3, 50, generator=g, dtype=DT)
    same = w.repeat(5, 1, 1) * torch.tensor([1.0, 2.0, 0.5, 7.0, 3.0], dtype=DT).view(5, 1, 1)
    cos, dropped = row_cosine(same)
    assert cos == pytest.approx(1.0) and dropped == 0
    assert mean_pairwise_cosine(same.reshape(5, -1)) == pytest.approx(1.0)
    eye = torch.eye(4, dtype=DT)
    assert mean_pairwise_cosine(eye) == pytest.approx(0.0, abs=1e-15)
    pair = torch.stack([eye[0], -eye[0]])
    assert mean_pairwise_cosine(pair) == pytest.approx(-1.0)
    # closed form == brute force
    v = torch.randn(7, 20, generator=g, dtype=DT) + 0.8 * torch.randn(1, 20, generator=g, dtype=DT)
    u = v / v.norm(dim=1, keepdim=True)
    c = u @ u.T
    assert mean_pairwise_cosine(v) == pytest.approx(((c.sum() - c.trace()) / 42).item())


def test_energy_fraction_of_planted_subspace():
    g = _gen(3)
    d, k = 100, 4
    basis = torch.linalg.qr(torch.randn(d, k, generator=g, dtype=DT)).Q  # D x k orthonormal
    v = torch.randn(40, k, generator=g, dtype=DT) @ basis.T  # every row inside span(basis)
    assert energy_fraction(v, basis) == pytest.approx(1.0)
    # add orthogonal noise with exactly 1/3 of the energy: EF = 3/4 ... built to be exact
    noise_dir = torch.linalg.qr(torch.cat([basis, torch.randn(d, 1, generator=g, dtype=DT)], 1)).Q[:, k]
    sig = v.norm(dim=1, keepdim=True)
    v2 = v + (sig / math.sqrt(3.0)) * noise_dir  # per row: |noise|^2 = |signal|^2 / 3
    assert energy_fraction(v2, basis) == pytest.approx(0.75)
    # a random k-dim subspace of D dims captures ~k/D of isotropic noise energy
    iso = torch.randn(400, d, generator=g, dtype=DT)
    assert energy_fraction(iso, basis) == pytest.approx(k / d, rel=0.25)
    # cross-fit: trajectories in halves; planted subspace recovered from either half -> EF ~ 1
    groups = [i // 4 for i in range(40)]  # 10 trajectories, 4 positions each
    ef = energy_fraction_crossfit(v, groups, ks=(1, 4, 16), seed=0)
    assert ef[4] == pytest.approx(1.0) and ef[1] < 0.9
    assert ef[16] == pytest.approx(1.0)  # k beyond the planted rank still spans it
    assert energy_fraction_crossfit(v[:8], groups[:8], ks=(4,), seed=0)[4] is None  # k >= half size
    # top-k right singular vectors are orthonormal and reproduce the in-sample EF_k (Eckart-Young)
    u = top_right_singular_vectors(v2, 2)
    torch.testing.assert_close(u.T @ u, torch.eye(2, dtype=DT))
    s = torch.linalg.svdvals(v2)
    assert energy_fraction(v2, u) == pytest.approx(((s[:2] ** 2).sum() / (s**2).sum()).item())


def test_zero_vectors_dropped_and_counted():
    g = _gen(4)
    v3 = torch.randn(6, 2, 30, generator=g, dtype=DT)
    v3[2] = 0.0
    v3[4] = 1e-14 * v3[4] / v3[4].norm() * v3[0].norm()  # below 1e-12 x max
    flat = v3.reshape(6, -1)
    kept, keep = drop_tiny(flat)
    assert kept.shape[0] == 4 and keep.tolist() == [True, True, False, True, False, True]
    m = cell_metrics(v3, groups=[0, 0, 1, 1, 2, 2], ks=(1, 4))
    assert m["n"] == 4 and m["n_dropped"] == 2 and m["n_trajectories"] == 3
    assert m["proj_energy_frac"]["4"] is None  # k < n but not < half size
    assert all(not math.isnan(x) for x in [m["row_cosine"], m["effective_rank"], m["grad_norm"]["median"]])


def test_grad_norm_median_and_geomean():
    v3 = torch.zeros(3, 2, 4, dtype=DT)
    v3[:, 0, 0] = torch.tensor([1.0, 4.0, 16.0])  # row 0: median 4, geomean 4
    v3[:, 1, 1] = torch.tensor([2.0, 2.0, 8.0])  # row 1: median 2, geomean (32)^(1/3)
    s = grad_norm_stats(v3)
    assert s["median"] == pytest.approx(3.0)
    assert s["geomean"] == pytest.approx((4.0 + 32 ** (1 / 3)) / 2)
    even = torch.zeros(4, 1, 2, dtype=DT)
    even[:, 0, 0] = torch.tensor([1.0, 2.0, 4.0, 100.0])
    assert grad_norm_stats(even)["median"] == pytest.approx(3.0)  # midpoint, not the lower middle


def test_cell_metrics_common_n_subsampling():
    q = torch.linalg.qr(torch.randn(64, 10, generator=_gen(5), dtype=DT)).Q.T  # 10 orthonormal
    m = cell_metrics(q.reshape(10, 2, 32), groups=list(range(10)), n_common=4, erank_draws=5)
    assert m["effective_rank"] == pytest.approx(10.0)
    assert m["effective_rank_common_n"] == pytest.approx(4.0)
    assert m["row_cosine_flat"] == pytest.approx(0.0, abs=1e-12)


def test_cell_metrics_from_gram_equal_direct_functions():
    """cell_metrics works from one Gram matrix; every value must equal the direct (SVD/projection) one."""
    g = _gen(6)
    v3 = torch.randn(24, 3, 40, generator=g, dtype=DT) + 0.7 * torch.randn(1, 3, 40, generator=g, dtype=DT)
    groups = [i // 3 for i in range(24)]  # 8 trajectories
    m = cell_metrics(v3, groups, ks=(1, 4, 16), seed=5, n_common=10, erank_draws=4)
    v = v3.reshape(24, -1)
    assert m["effective_rank"] == pytest.approx(effective_rank(v), rel=1e-9)
    assert m["effective_rank_normalized"] == pytest.approx(effective_rank(v / v.norm(dim=1, keepdim=True)), rel=1e-9)
    assert m["row_cosine_flat"] == pytest.approx(mean_pairwise_cosine(v), rel=1e-9)
    signs = torch.randint(0, 2, (24,), generator=torch.Generator().manual_seed(5)).double() * 2 - 1
    assert m["row_cosine_flat_null"] == pytest.approx(mean_pairwise_cosine(v * signs[:, None]), rel=1e-9)
    direct = energy_fraction_crossfit(v, groups, (1, 4, 16), seed=5)
    for k in (1, 4):
        assert m["proj_energy_frac"][str(k)] == pytest.approx(direct[k], rel=1e-9)
        u = top_right_singular_vectors(v, k)
        assert m["proj_energy_frac_insample"][str(k)] == pytest.approx(energy_fraction(v, u), rel=1e-9)
    assert m["proj_energy_frac"]["16"] is None and direct[16] is None  # 16 >= half size (12)
    gen = torch.Generator().manual_seed(5)
    draws = [effective_rank(v[torch.randperm(24, generator=gen)[:10]]) for _ in range(4)]
    assert m["effective_rank_common_n"] == pytest.approx(sum(draws) / 4, rel=1e-9)


def test_row_cosine_drops_zero_row_vectors_per_row():
    g = _gen(7)
    v3 = torch.randn(5, 2, 8, generator=g, dtype=DT)
    v3[1, 0] = 0.0  # position 1 has no gradient on row 0 only
    cos, dropped = row_cosine(v3)
    want = [mean_pairwise_cosine(v3[[0, 2, 3, 4], 0]), mean_pairwise_cosine(v3[:, 1])]
    assert dropped == 1 and cos == pytest.approx(sum(want) / 2)
    norms = grad_norm_stats(v3)
    a0, a1 = v3[[0, 2, 3, 4], 0].norm(dim=1), v3[:, 1].norm(dim=1)
    assert norms["geomean"] == pytest.approx((a0.log().mean().exp() + a1.log().mean().exp()).item() / 2)
