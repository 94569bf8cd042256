"""The probe's comparable statistics (issue 14) on hand-made arrays: frozen bin edges, cluster-bootstrap
intervals, effective rank at one n for a whole job, NaN/inf counted, ungradable samples excluded and counted,
the entropy-pattern overlap, and the seed's single-row grain."""

from __future__ import annotations

import math

import pytest
import torch

from forkrl.probe.bootstrap import _CellGrams, bootstrap_ci
from forkrl.probe.gradients import parse_row_spec, resolve_layers
from forkrl.probe.job import _common_erank, _overlap
from forkrl.probe.metrics import cell_metrics, effective_rank, erank_at_n
from forkrl.probe.outputs import count_nonfinite
from forkrl.probe.sampling import (
    TokenStats,
    Trajectory,
    bin_edges,
    edge_bins,
    rank_bins,
    seeded_generator,
    top_frac_mask,
)
from forkrl.probe.worker import CheckpointResult, _TokenTable

DT = torch.float64


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- frozen bin edges


def test_reference_edges_reproduce_its_rank_bins_and_apply_by_value():
    ref = torch.tensor([0.5, 0.1, 0.9, 0.3, 0.7, 0.2], dtype=DT)  # no ties
    bins = rank_bins(ref, 3, seeded_generator(0, "bins"))
    edges = bin_edges(ref, bins, 3)
    assert edges == [0.3, 0.7]  # the smallest entropy of bins 1 and 2
    assert edge_bins(ref, edges).tolist() == bins.tolist()
    other = torch.tensor([0.0, 0.29, 0.3, 0.69, 0.7, 5.0], dtype=DT)
    assert edge_bins(other, edges).tolist() == [0, 0, 1, 1, 2, 2]  # the same entropy ranges, not equal counts


def test_empty_reference_bin_gets_an_unreachable_edge():
    ref = torch.tensor([0.1, 0.2], dtype=DT)
    bins = torch.tensor([0, 2])
    edges = bin_edges(ref, bins, 3)
    assert edges[0] == math.inf and edges[1] == pytest.approx(0.2)
    assert edge_bins(torch.tensor([0.05, 0.3], dtype=DT), edges).tolist() == [0, 2]  # nothing lands in bin 1


# ---- cluster bootstrap


def _two_traj_cell():
    g = _gen(3)
    v3 = torch.randn(8, 2, 20, generator=g, dtype=DT)
    groups = [0, 0, 1, 1, 2, 2, 3, 3]
    return v3, groups


def test_identity_resample_gives_the_point_estimates():
    v3, groups = _two_traj_cell()
    m = cell_metrics(v3, groups, ks=(1, 2), seed=5)
    s = _CellGrams(v3).scalars(torch.arange(8), groups, (1, 2), 5)
    assert s["grad_norm.median"] == pytest.approx(m["grad_norm"]["median"], rel=1e-12)
    assert s["grad_norm.geomean"] == pytest.approx(m["grad_norm"]["geomean"], rel=1e-12)
    for k in ("grad_norm_flat_median", "row_cosine", "row_cosine_flat", "effective_rank", "effective_rank_normalized"):
        assert s[k] == pytest.approx(m[k], rel=1e-10, abs=1e-14), k
    for k in (1, 2):
        assert s[f"proj_energy_frac.{k}"] == pytest.approx(m["proj_energy_frac"][str(k)], rel=1e-10)
        assert s[f"proj_energy_frac_insample.{k}"] == pytest.approx(m["proj_energy_frac_insample"][str(k)], rel=1e-10)


def test_all_draws_at_once_equal_one_draw_at_a_time():
    """The batched draws (multiplicities, sqrt(w) G sqrt(w)) against explicit index vectors with repeats."""
    v3, groups = _two_traj_cell()
    cg = _CellGrams(v3)
    draws = [[0, 1, 0, 1, 6, 7], [2, 3, 2, 3, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6, 7], [6, 7]]
    w = torch.zeros(len(draws), 8, dtype=DT)
    for b, idx in enumerate(draws):
        for i in idx:
            w[b, i] += 1
    batched = cg.batched(w, (1, 2))
    for b, idx in enumerate(draws):
        one = cg.scalars(torch.tensor(idx), [groups[i] for i in idx], (1, 2), 0)
        cf = cg.crossfit(torch.tensor(idx), [groups[i] for i in idx], (1, 2), 0)
        for name, x in batched.items():
            want = one[name]
            got = x[b].item()
            assert (want is None and math.isnan(got)) or got == pytest.approx(want, rel=1e-9, abs=1e-12), (b, name)
        for name, x in cf.items():
            assert x == (None if one[name] is None else pytest.approx(one[name], rel=1e-12)), (b, name)


def test_bootstrap_is_seeded_and_ordered():
    v3, groups = _two_traj_cell()
    a = bootstrap_ci(v3, groups, ks=(1,), seed=1, draws=50)
    assert a == bootstrap_ci(v3, groups, ks=(1,), seed=1, draws=50)
    assert a != bootstrap_ci(v3, groups, ks=(1,), seed=2, draws=50)
    for name, ci in a.items():
        assert ci is not None and ci[0] <= ci[1], name


def test_bootstrap_resamples_whole_trajectories():
    """Trajectory t has 3 copies of e_t (norm t + 1): resampling trajectories, every draw's vectors come in
    threes, so the row cosine is 1 within a trajectory-pure draw and the geomean of norms is a geometric mean of
    the drawn trajectories' norms; with one trajectory there is nothing to resample."""
    d = 4
    v3 = torch.zeros(6, 1, d, dtype=DT)
    for t in range(2):
        v3[3 * t : 3 * t + 3, 0, t] = t + 1.0
    groups = [0, 0, 0, 1, 1, 1]
    ci = bootstrap_ci(v3, groups, ks=(1,), seed=0, draws=400)
    # possible draws: {0,0} -> erank 1, {0,1} -> erank of (3 x e0, 3 x 2e1) = 2-point p=(1/3, 2/3), {1,1} -> 1
    assert ci["effective_rank"][0] == pytest.approx(1.0)
    mixed = math.exp(-(1 / 3 * math.log(1 / 3) + 2 / 3 * math.log(2 / 3)))
    assert ci["effective_rank"][1] == pytest.approx(mixed)
    assert ci["grad_norm.geomean"][0] == pytest.approx(1.0) and ci["grad_norm.geomean"][1] == pytest.approx(2.0)
    one = bootstrap_ci(v3[:3], groups[:3], ks=(1,), seed=0, draws=10)
    assert all(x is None for x in one.values())


def test_identical_vectors_give_a_degenerate_interval():
    w = torch.randn(1, 1, 30, generator=_gen(4), dtype=DT)
    v3 = w.repeat(6, 1, 1) * torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], dtype=DT).view(6, 1, 1)
    ci = bootstrap_ci(v3, [0, 0, 1, 1, 2, 2], ks=(1,), seed=0, draws=30)
    assert ci["row_cosine"] == pytest.approx([1.0, 1.0]) and ci["effective_rank"] == pytest.approx([1.0, 1.0])


# ---- NaN / inf


def test_nonfinite_vectors_are_counted_and_left_out():
    v3, groups = _two_traj_cell()
    bad = v3.clone()
    bad[2, 0, 0] = float("nan")
    bad[5, 1, 3] = float("inf")
    m_bad = cell_metrics(bad, groups, ks=(1,), seed=0)
    keep = [0, 1, 3, 4, 6, 7]
    m_ref = cell_metrics(v3[keep], [groups[i] for i in keep], ks=(1,), seed=0)
    assert m_bad["n_nonfinite"] == 2 and m_ref["n_nonfinite"] == 0 and m_bad["n"] == 6
    assert m_bad["effective_rank"] == pytest.approx(m_ref["effective_rank"], rel=1e-12)
    assert m_bad["row_cosine"] == pytest.approx(m_ref["row_cosine"], rel=1e-12)
    ci = bootstrap_ci(bad, groups, ks=(1,), seed=0, draws=20)
    assert all(x is None or all(math.isfinite(y) for y in x) for x in ci.values())


def test_count_nonfinite_counts_what_becomes_null():
    assert count_nonfinite({"a": [1.0, float("nan")], "b": {"c": float("inf"), "d": None, "e": 2}}) == 2


# ---- effective rank at one n for the whole job


def _result(label: str, n: int, v: torch.Tensor) -> tuple[dict, tuple]:
    g = v[:n] @ v[:n].T
    return {"checkpoint": label, "target": "t", "row_set": "start", "n": n}, (g, v.shape[1])


def test_common_n_is_the_smallest_cell_over_all_checkpoints():
    q = torch.linalg.qr(torch.randn(40, 9, generator=_gen(5), dtype=DT)).Q.T  # 9 orthonormal vectors
    cells_a = [_result("a", 9, q), _result("a", 6, q)]
    cells_b = [_result("b", 4, q), _result("b", 1, q)]  # n = 1 cannot set the common n
    done = [
        CheckpointResult({}, [r for r, _ in cells], [], {}, grams=[g for _, g in cells])
        for cells in (cells_a, cells_b)
    ]  # fmt: skip
    ns = _common_erank(done, draws=5, seed=0)
    assert ns == {"t|start": 4}
    for res in done:
        for r in res.results:
            assert r["n_common"] == 4
            # orthonormal vectors: any 4 of them have erank exactly 4; the n = 1 cell has fewer than 4
            assert r["effective_rank_common_n"] == (pytest.approx(4.0) if r["n"] >= 4 else None)


def test_erank_at_n():
    v = torch.randn(7, 50, generator=_gen(6), dtype=DT)
    g = v @ v.T
    assert erank_at_n(g, 50, 7) == pytest.approx(effective_rank(v))
    assert erank_at_n(g, 50, 8) is None and erank_at_n(g, 50, 0) is None
    assert erank_at_n(g, 50, 3, draws=4, seed=1) == erank_at_n(g, 50, 3, draws=4, seed=1)


# ---- ungradable samples


def _trajs(rewards: list[float | None]) -> list[Trajectory]:
    return [Trajectory(i, i // 2, [1, 2], [3, 4, 2], True, reward=r, correct=r is not None and r > 0)
            for i, r in enumerate(rewards)]  # fmt: skip


def test_ungradable_samples_are_excluded_not_incorrect():
    trajs = _trajs([1.0, None, 0.0, 0.0])  # prompt 0: one correct + one ungradable; prompt 1: both wrong
    stats = [TokenStats(torch.tensor([0.1, 0.2, 0.3], dtype=DT), torch.full((3,), -0.5, dtype=DT)) for _ in trajs]
    tab = _TokenTable(trajs, stats)
    assert tab.gradable_of.tolist() == [True] * 3 + [False] * 3 + [True] * 6
    # prompt 0's only gradable sample is correct: degenerate over gradable samples (all correct)
    assert tab.degenerate_t.tolist() == [True, True, True, True]
    trajs = _trajs([1.0, 0.0, None, None])  # prompt 1 is wholly ungradable
    tab = _TokenTable(trajs, stats)
    # a wholly ungradable prompt is left out (its samples are counted as ungradable), not counted as degenerate
    assert tab.degenerate_t.tolist() == [False, False, True, True] and tab.n_degenerate_groups == 0


def test_nonfinite_tokens_are_flagged():
    trajs = _trajs([1.0, 0.0])
    stats = [TokenStats(torch.tensor([0.1, float("nan"), 0.3], dtype=DT), torch.full((3,), -0.5, dtype=DT)),
             TokenStats(torch.tensor([0.1, 0.2, 0.3], dtype=DT), torch.tensor([-0.1, float("-inf"), -0.2], dtype=DT))]
    tab = _TokenTable(trajs, stats)
    assert tab.finite.tolist() == [True, False, True, True, False, True]


# ---- the entropy-pattern overlap


def test_top_frac_mask_and_overlap():
    h = torch.tensor([0.9, 0.1, 0.5, 0.8, 0.2, 0.3, 0.0, 0.7, 0.4, 0.6], dtype=DT)
    assert top_frac_mask(h, 0.2).nonzero().squeeze(-1).tolist() == [0, 3]
    same = CheckpointResult({"label": "ref"}, [], [], {}, overlap_entropy=h)
    half = CheckpointResult({"label": "b"}, [], [], {}, overlap_entropy=torch.tensor(
        [0.9, 0.1, 0.5, 0.0, 0.2, 0.3, 0.0, 0.95, 0.4, 0.6], dtype=DT))  # fmt: skip
    out = _overlap([same, half])
    assert out["overlap"] == {"ref": 1.0, "b": 0.5} and out["n_tokens"] == 10 and out["reference"] == "ref"


# ---- the seed's grain


def test_start_mid_last_are_single_rows_in_row_mode():
    assert [parse_row_spec(s, 64, single=True) for s in ("start", "mid", "last")] == [(0,), (32,), (63,)]
    # k_proj with whole KV heads stays a block only in block mode
    assert parse_row_spec("last", 64, head_dim=32) == tuple(range(32, 64))
    assert len(parse_row_spec("mid", 512)) == 32


def test_layers_past_the_depth_clamp_with_a_note_or_fail():
    notes: list[str] = []
    assert resolve_layers([0, 14, 27], 2, clamp=True, notes=notes) == [0, 1]
    assert len(notes) == 2 and "layer 14" in notes[0]
    with pytest.raises(ValueError, match="layer 14 out of range"):
        resolve_layers([0, 14], 2)
    assert resolve_layers([0, -1, 1], 2) == [0, 1]
