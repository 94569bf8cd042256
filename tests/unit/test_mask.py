"""forkrl.rl.mask: exact top-k forking-token mask (algorithms.md §2.3, §6 P1–P3)."""

from __future__ import annotations

import pytest
import torch

from forkrl.rl.mask import forking_token_mask, kept_count, kept_denominator, masks_for_step


@pytest.mark.parametrize(
    ("n", "rho", "k"),
    [
        (17, 0.2, 4),  # 3.4 -> 4
        (5, 0.2, 1),  # 1.0 -> 1
        (15, 0.2, 3),  # 0.2 * 15 rounds to exactly 3.0 in doubles
        (48, 0.2, 10),  # 9.6 -> 10
        (3, 0.1, 1),  # 0.3 -> max(1, 1)
        (1, 0.01, 1),  # max(1, ...)
        (10, 0.3, 3),  # 0.3 * 10 rounds to exactly 3.0 in doubles
        # The products below are 7.000000000000001 in doubles: a naive math.ceil(rho * n) gives 8. Only the
        # exact rational value of the decimal rho (7 exactly) gives the right k.
        (25, 0.28, 7),
        (50, 0.14, 7),
        (100, 0.07, 7),
        (7, 1.0, 7),
        (7, None, 7),
        (0, 0.2, 0),
    ],
)
def test_kept_count(n: int, rho: float | None, k: int):
    assert kept_count(n, rho) == k


def test_naive_float_ceil_would_be_wrong():
    """The cases above that catch a naive ceil really are ones where float multiplication overshoots."""
    import math

    assert [math.ceil(rho * n) for n, rho in ((25, 0.28), (50, 0.14), (100, 0.07))] == [8, 8, 8]
    # and kept_count agrees with integer arithmetic on the decimal fraction for every n up to 1000
    for rho, (num, den) in ((0.2, (1, 5)), (0.28, (7, 25)), (0.14, (7, 50)), (0.3, (3, 10))):
        assert [kept_count(n, rho) for n in range(1, 1001)] == [max(1, -(-n * num // den)) for n in range(1, 1001)]


@pytest.mark.parametrize("rho", [1.5, 0.0, -0.1, float("nan")])
def test_top_frac_out_of_range(rho: float):
    with pytest.raises(ValueError, match=r"entropy_top_frac must be in \(0, 1\], got"):
        kept_count(10, rho)
    with pytest.raises(ValueError, match=r"entropy_top_frac must be in \(0, 1\], got"):
        forking_token_mask(torch.rand(2, 3), torch.ones(2, 3, dtype=torch.bool), rho)


@pytest.mark.parametrize("rho", [1.5, 0.0, float("nan")])
def test_every_public_mask_function_refuses_a_bad_fraction(rho: float):
    ent, resp = torch.rand(2, 3), torch.ones(2, 3, dtype=torch.bool)
    for call in (lambda: masks_for_step([ent, ent], [resp, resp], rho, "microbatch"),
                 lambda: masks_for_step([ent, ent], [resp, resp], rho, "step"),
                 lambda: kept_denominator([resp, 3], rho, "microbatch")):
        with pytest.raises(ValueError, match=r"entropy_top_frac must be in \(0, 1\], got"):
            call()


def test_the_fraction_is_checked_once_per_call(monkeypatch: pytest.MonkeyPatch):
    # one rule (forkrl/rl/options.check_top_frac), applied at each public function's entry; the helpers below it
    # (per micro-batch, per count) take the checked value (docs/architecture.md, the --entropy-top-frac walk)
    import forkrl.rl.mask as mask
    from forkrl.rl.options import check_top_frac

    calls: list[float | None] = []
    monkeypatch.setattr(mask, "check_top_frac", lambda rho: (calls.append(rho), check_top_frac(rho))[1])
    ents = [torch.rand(2, 5) for _ in range(4)]
    resps = [torch.ones(2, 5, dtype=torch.bool) for _ in range(4)]
    for scope in ("microbatch", "step"):
        calls.clear()
        kept = [r.kept for r in mask.masks_for_step(ents, resps, 0.2, scope)]
        assert sum(kept) == 8 and calls == [0.2], (scope, kept, calls)  # 4 x ceil(0.2 * 10), ceil(0.2 * 40)
    calls.clear()
    assert mask.kept_denominator(resps, 0.2, "microbatch") == 4 * 2 and calls == [0.2]
    calls.clear()
    assert mask.forking_token_mask(ents[0], resps[0], 0.2).kept == 2 and calls == [0.2]


def test_top_frac_message_exact():
    with pytest.raises(ValueError, match=r"^entropy_top_frac must be in \(0, 1\], got 1\.5$"):
        kept_count(10, 1.5)


def test_exact_k_on_17_tokens():
    gen = torch.Generator().manual_seed(0)
    ent = torch.rand(3, 8, generator=gen)
    resp = torch.zeros(3, 8, dtype=torch.bool)
    resp[0, :8] = True
    resp[1, :5] = True
    resp[2, :4] = True  # 17 real tokens
    res = forking_token_mask(ent, resp, 0.2)
    assert res.mask.dtype == torch.bool
    assert res.kept == 4 == int(res.mask.sum()) and res.total == 17
    assert res.kept_frac == pytest.approx(4 / 17)
    top4 = torch.sort(ent[resp], descending=True).values[:4]
    assert torch.equal(torch.sort(ent[res.mask], descending=True).values, top4)
    assert res.threshold == pytest.approx(float(top4[-1]))
    assert not (res.mask & ~resp).any()


def test_hand_example():
    # Real entropies (row-major): 0.5, 2.0, 0.1 | 1.5, 0.3 ; pad 9.9. rho = 0.4 -> k = ceil(2.0) = 2.
    ent = torch.tensor([[0.5, 2.0, 0.1], [1.5, 0.3, 9.9]])
    resp = torch.tensor([[True, True, True], [True, True, False]])
    res = forking_token_mask(ent, resp, 0.4)
    assert res.mask.tolist() == [[False, True, False], [True, False, False]]
    assert res.threshold == 1.5 and res.kept == 2 and res.total == 5


def test_padding_never_selected_even_with_highest_entropy():
    ent = torch.tensor([[0.1, 0.2, 50.0, 60.0], [0.3, 99.0, 98.0, 97.0]])
    resp = torch.tensor([[True, True, False, False], [True, False, False, False]])
    for rho in (0.2, 0.5, 0.9, 1.0):
        res = forking_token_mask(ent, resp, rho)
        assert not (res.mask & ~resp).any()
        assert res.kept == kept_count(3, rho)
    assert forking_token_mask(ent, resp, 0.2).mask.tolist() == [[False] * 4, [True, False, False, False]]
    # Non-finite entropy on padding is ignored too.
    ent2 = ent.clone()
    ent2[0, 3] = float("nan")
    assert forking_token_mask(ent2, resp, 0.2).kept == 1


def test_ties_are_deterministic_earlier_position_wins():
    ent = torch.full((2, 5), 0.7)
    resp = torch.ones(2, 5, dtype=torch.bool)
    res = forking_token_mask(ent, resp, 0.3)  # k = 3 among 10 equal values
    assert res.mask.tolist() == [[True, True, True, False, False], [False] * 5]
    ent2 = torch.tensor([[0.1, 0.5, 0.5, 0.9], [0.5, 0.5, 0.2, 0.5]])
    res2 = forking_token_mask(ent2, torch.ones(2, 4, dtype=torch.bool), 0.375)  # k = 3
    assert res2.mask.tolist() == [[False, True, True, True], [False, False, False, False]]
    all4 = torch.ones(2, 4, dtype=torch.bool)
    for _ in range(3):
        assert torch.equal(forking_token_mask(ent2, all4, 0.375).mask, res2.mask)


def test_rho_one_or_none_is_identity():
    gen = torch.Generator().manual_seed(1)
    ent = torch.rand(3, 6, generator=gen)
    resp = torch.rand(3, 6, generator=gen) > 0.3
    for rho in (None, 1.0):
        res = forking_token_mask(ent, resp, rho)
        assert torch.equal(res.mask, resp) and res.mask is not resp
        assert res.kept == res.total == int(resp.sum()) and res.kept_frac == 1.0


def test_scope_microbatch_vs_step():
    # Micro-batch A has all the high entropies. rho = 0.25.
    ea = torch.tensor([[9.0, 8.0, 7.0, 6.0]])
    eb = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.5, 0.4, 0.3, 0.2]])
    ra = torch.ones(1, 4, dtype=torch.bool)
    rb = torch.ones(2, 4, dtype=torch.bool)
    micro = masks_for_step([ea, eb], [ra, rb], 0.25, "microbatch")
    assert [m.kept for m in micro] == [1, 2]  # ceil(0.25*4)=1, ceil(0.25*8)=2
    assert micro[0].mask.tolist() == [[True, False, False, False]]
    assert micro[1].mask.tolist() == [[False, False, True, True], [False] * 4]
    step = masks_for_step([ea, eb], [ra, rb], 0.25, "step")
    assert [m.kept for m in step] == [3, 0]  # ceil(0.25*12) = 3, all from A
    assert step[0].mask.tolist() == [[True, True, True, False]] and not step[1].mask.any()
    assert step[0].threshold == step[1].threshold == 7.0
    assert kept_denominator([ra, rb], 0.25, "microbatch") == 3 == sum(m.kept for m in micro)
    assert kept_denominator([ra, rb], 0.25, "step") == 3 == sum(m.kept for m in step)
    # Step scope on concatenated micro-batches equals the full-batch mask.
    full = forking_token_mask(torch.cat([ea, eb]), torch.cat([ra, rb]), 0.25).mask
    assert torch.equal(torch.cat([m.mask for m in step]), full)


def test_kept_denominator_differs_by_scope():
    masks = [torch.ones(1, 17, dtype=torch.bool), torch.ones(1, 17, dtype=torch.bool)]
    assert kept_denominator(masks, 0.2, "microbatch") == 8  # 4 + 4
    assert kept_denominator(masks, 0.2, "step") == 7  # ceil(6.8)
    assert kept_denominator([17, 17], 0.2, "microbatch") == 8  # counts work too
    assert kept_denominator(masks, None, "step") == 34


def test_step_scope_different_widths_and_empty_micro():
    e1 = torch.tensor([[0.1, 5.0, 0.2]])
    e2 = torch.tensor([[3.0, 0.4], [0.6, 4.0]])
    e3 = torch.tensor([[7.0]])
    r3 = torch.zeros(1, 1, dtype=torch.bool)  # an empty micro-batch is fine in step scope
    r1, r2 = torch.ones(1, 3, dtype=torch.bool), torch.ones(2, 2, dtype=torch.bool)
    res = masks_for_step([e1, e2, e3], [r1, r2, r3], 0.4, "step")  # k = ceil(2.8) = 3
    assert [m.kept for m in res] == [1, 2, 0] and res[2].kept_frac == 0.0
    assert res[0].mask.tolist() == [[False, True, False]]
    assert res[1].mask.tolist() == [[True, False], [False, True]]


def test_bad_inputs():
    ent = torch.rand(2, 3)
    with pytest.raises(ValueError, match="response_mask must be a bool tensor, got dtype torch.int64"):
        forking_token_mask(ent, torch.ones(2, 3, dtype=torch.long), 0.2)
    with pytest.raises(ValueError, match=r"entropy shape \(2, 3\) does not match response_mask shape \(2, 4"):
        forking_token_mask(ent, torch.ones(2, 4, dtype=torch.bool), 0.2)
    with pytest.raises(ValueError, match="no real tokens"):
        forking_token_mask(ent, torch.zeros(2, 3, dtype=torch.bool), 0.2)
    with pytest.raises(ValueError, match="no real tokens"):
        masks_for_step([ent], [torch.zeros(2, 3, dtype=torch.bool)], 0.2, "step")
    with pytest.raises(ValueError, match="mask_scope must be one of .*got 'global'"):
        masks_for_step([ent], [torch.ones(2, 3, dtype=torch.bool)], 0.2, "global")
    with pytest.raises(ValueError, match="micro-batch 1: entropy shape"):
        masks_for_step([ent, ent], [torch.ones(2, 3, dtype=torch.bool), torch.ones(3, 3, dtype=torch.bool)],
                       0.2, "step")
    with pytest.raises(ValueError, match=r"response_masks\[0\] must be a bool tensor"):
        kept_denominator([torch.ones(2, 3)], 0.2)
    bad = ent.clone()
    bad[0, 0] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        forking_token_mask(bad, torch.ones(2, 3, dtype=torch.bool), 0.5)
    with pytest.raises(ValueError, match="n_tokens must be a non-negative integer, got -1"):
        kept_count(-1, 0.2)
