"""forkrl.rl.microbatch: micro-batches by tokens (padded size within the budget), ranks balanced by tokens, and a
train step on them equal to fixed micro-batches (one process; 2 ranks: tests/dist/test_token_budget_ranks.py)."""

from __future__ import annotations

import pytest
import torch

from forkrl.rl.losses import LossConfig
from forkrl.rl.microbatch import balance, fill, fixed_plan, pack, padded_size, token_plan
from forkrl.rl.options import check_budget_scope
from forkrl.rl.step import train_step
from forkrl.training.config import RunConfig
from tests.dist.budget_worker import (
    BUDGET,
    CASES,
    EXACT,
    LR,
    PLAN_ONLY,
    build_inputs,
    differences,
    long_tailed_lengths,
    run_case,
)

REL = 1e-5  # float32 rounding of another summation order and padding width (tests/dist/test_dp_equals_one_rank.py)
CAP, PROMPT = 20480, 300  # recipes/dapo_paper.toml: max_new_tokens; a math prompt of a few hundred tokens


def _recipe_batch(seed: int = 0) -> list[int]:
    """One mini-batch of the paper's recipe (32 prompts x 16 samples): prompt + a long-tailed response, log-normal
    with median 2000 tokens and sigma 1 (about 1% hit the 20480 cap), as reasoning RL responses are."""
    return [PROMPT + n for n in long_tailed_lengths(32 * 16, CAP, seed, median=2000.0)]


def _loads(parts: list[list[int]], lengths: list[int]) -> list[int]:
    return [sum(lengths[i] for i in p) for p in parts]


@pytest.mark.parametrize("world", [2, 4, 8])
def test_ranks_within_ten_percent_of_the_mean_on_a_long_tailed_batch(world: int) -> None:
    lengths = _recipe_batch()
    assert max(lengths) == PROMPT + CAP  # the tail reaches the cap
    parts = balance(lengths, world)  # rows
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))  # every row once
    loads = _loads(parts, lengths)
    mean = sum(loads) / world
    assert max(abs(x - mean) for x in loads) <= 0.1 * mean, (loads, mean)
    # the token plan: micro-batches of <= 32k padded tokens (a 20k response fits), dealt whole
    (slots,) = token_plan(lengths, [n - PROMPT for n in lengths], len(lengths), 32768, world)
    loads = [sum(lengths[i] for slot in slots for i in slot[r]) for r in range(world)]
    assert max(abs(x - mean) for x in loads) <= 0.1 * mean, (loads, mean)
    padded = sum(padded_size(part, lengths) for slot in slots for part in slot)
    assert padded <= 1.05 * sum(lengths), padded / sum(lengths)  # rows of similar length share a micro-batch


def test_one_row_longer_than_the_mean_per_rank_is_alone_and_the_rest_are_balanced() -> None:
    # balance within 10% is impossible: one 20k response among short ones on 4 ranks (mean ~6.3k); the best any
    # assignment of whole rows can do is the giant alone on one rank and the rest spread over the others
    lengths = [PROMPT + CAP] + [PROMPT + n for n in long_tailed_lengths(40, 400, 1, median=200.0)]
    parts = balance(lengths, 4)
    loads = _loads(parts, lengths)
    giant = next(r for r, p in enumerate(parts) if 0 in p)
    assert parts[giant] == [0] and max(loads) == lengths[0]
    rest = [x for r, x in enumerate(loads) if r != giant]
    assert max(abs(x - sum(rest) / 3) for x in rest) <= 0.1 * sum(rest) / 3, rest


def test_balance_deals_ties_deterministically_and_handles_fewer_rows_than_ranks() -> None:
    assert balance([5, 5, 5, 5], 2) == [[0, 2], [1, 3]]
    assert balance([7], 3) == [[0], [], []]
    with pytest.raises(ValueError, match="world must be >= 1"):
        balance([1], 0)


@pytest.mark.parametrize("budget", [1, 700, 4096, 32768])
def test_every_micro_batch_within_the_budget_except_a_single_longer_row(budget: int) -> None:
    lengths = _recipe_batch(seed=2)
    micro = pack(range(len(lengths)), lengths, budget)
    assert sorted(i for m in micro for i in m) == list(range(len(lengths)))
    for m in micro:
        assert padded_size(m, lengths) <= budget or (len(m) == 1 and lengths[m[0]] > budget), (m, budget)
    # rows of similar length share a micro-batch: with a budget of several rows, padding stays small
    if budget == 32768:
        pad = sum(padded_size(m, lengths) for m in micro) / sum(lengths) - 1
        assert pad < 0.05, pad
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch must be >= 1, got 0"):
        pack([0], lengths, 0)


@pytest.mark.parametrize("budget", [1, 700, 4096, 32768])
def test_packed_micro_batches_hold_at_most_the_budget_in_all_without_padding(budget: int) -> None:
    lengths = _recipe_batch(seed=2)
    micro = fill(range(len(lengths)), lengths, budget)
    assert sorted(i for m in micro for i in m) == list(range(len(lengths)))  # every row once
    for m in micro:
        assert sum(lengths[i] for i in m) <= budget or (len(m) == 1 and lengths[m[0]] > budget), (m, budget)
    # one packed row each: never more micro-batches than padded rows need, and at 32k nearly full ones
    assert len(micro) <= len(pack(range(len(lengths)), lengths, budget))
    if budget == 32768:
        assert sum(lengths) / (len(micro) * budget) > 0.95
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch must be >= 1, got 0"):
        fill([0], lengths, 0)
    assert fill([0, 1, 2, 3], [5, 3, 3, 2], 8) == [[0, 1], [2, 3]]  # first fit: 5+3, then 3+2
    assert fill([0, 1, 2], [9, 2, 6], 8) == [[0], [1, 2]]  # a longer row alone; the rest fill the next


@pytest.mark.parametrize("world", [2, 4, 8])
def test_packed_ranks_within_ten_percent_of_the_mean_on_a_long_tailed_batch(world: int) -> None:
    lengths = _recipe_batch()
    (slots,) = token_plan(lengths, [n - PROMPT for n in lengths], len(lengths), 32768, world, packed=True)
    loads = [sum(lengths[i] for slot in slots for i in slot[r]) for r in range(world)]
    mean = sum(loads) / world
    assert max(abs(x - mean) for x in loads) <= 0.1 * mean, (loads, mean)
    assert sorted(i for slot in slots for part in slot for i in part) == list(range(len(lengths)))


def test_token_plan_keeps_mini_batches_and_gives_every_rank_the_same_slots() -> None:
    lengths = _recipe_batch(seed=4)[:64]
    resp = [n - PROMPT for n in lengths]
    resp[5] = 0  # an empty completion (aborted sample): trains nothing, left out
    plan = token_plan(lengths, resp, mini=32, max_tokens=16384, world=3)
    assert len(plan) == 2
    for k, slots in enumerate(plan):
        assert all(len(slot) == 3 for slot in slots)  # every rank in every slot (an empty share joins)
        rows = sorted(i for slot in slots for part in slot for i in part)
        assert rows == [i for i in range(32 * k, 32 * (k + 1)) if i != 5]  # whole mini-batch, each row once
        for slot in slots:
            for part in slot:
                assert padded_size(part, lengths) <= 16384 or len(part) == 1
        per_rank = [sum(lengths[i] for slot in slots for i in slot[r]) for r in range(3)]
        # few micro-batches per rank: balanced only as finely as they are (list scheduling: mean + the largest)
        largest = max(sum(lengths[i] for i in part) for slot in slots for part in slot)
        assert max(per_rank) <= sum(per_rank) / 3 + largest


def test_fixed_plan_is_contiguous_dealt_blocks_and_leaves_out_empty_micro_batches() -> None:
    plan = fixed_plan([1, 1, 1, 0, 0, 0, 1, 1], mini=8, micro=2, world=2)
    assert plan == [[[[0], [1]], [[2], [3]], [[6], [7]]]]  # rows 4-5 hold no token: left out
    assert fixed_plan([0, 0, 1, 1], mini=2, micro=2, world=1) == [[[[2, 3]]]]  # a mini-batch with none: left out


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("name", list(CASES))
def test_token_budget_equals_fixed_micro_batches(name: str, pack: bool) -> None:
    batch, _ = build_inputs()
    lengths, resp = batch.attention_mask.sum(1).tolist(), batch.response_mask.sum(1).tolist()
    plan = token_plan(lengths, resp, 8, BUDGET, 1, packed=pack)
    sizes = [len(slot[0]) for slots in plan for slot in slots]
    assert len(set(sizes)) > 1 and any(slot[0] != list(range(slot[0][0], slot[0][-1] + 1))
                                       for slots in plan for slot in slots)  # uneven, non-contiguous micro-batches
    if pack:  # several sequences share a packed row (its length the sum of theirs, within the budget)
        assert max(sizes) > 1 and all(sum(lengths[i] for i in slot[0]) <= BUDGET or len(slot[0]) == 1
                                      for slots in plan for slot in slots)
    ref, got = run_case(name, 0), run_case(name, BUDGET, pack=pack)
    d = differences(got, ref)
    u = int(d["ref"]["n_updates"])
    assert u == 4 and d["ref"]["kept_tokens"] < d["ref"]["response_tokens"]  # several updates, the mask on
    for k, v in d["ref"].items():
        if k in EXACT:
            assert d["metrics"][k] == v, k
        elif k not in PLAN_ONLY:
            assert d["metric_delta"][k] <= u * REL * max(1.0, abs(v)), (k, d["metric_delta"][k], v)
    assert d["metrics"]["micro_batches"] != d["ref"]["micro_batches"]
    assert d["weight_delta"] <= u * LR * REL * max(1.0, d["weight_scale"]), d["weight_delta"]
    assert d["kept_equal"]  # the very same tokens (with every entropy tied too: batch-row order decides)


def test_token_budget_refuses_the_micro_batch_scope_with_the_mask_on() -> None:
    batch, adv = build_inputs()
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    both = "max_tokens_per_micro_batch \\(64\\) needs mask_scope 'step'.*got mask_scope 'microbatch'"
    with pytest.raises(ValueError, match=both):
        train_step(model, opt, batch, adv, LossConfig(name="dapo", entropy_top_frac=0.2), temperature=1.0,
                   micro_batch_size=4, max_grad_norm=1.0, max_tokens_per_micro_batch=64)
    with pytest.raises(ValueError, match=both):  # the run's config says it before anything starts
        RunConfig(entropy_top_frac=0.2, max_tokens_per_micro_batch=64)
    # the step scope, or no mask (the scope selects nothing), is fine; so is the micro-batch scope without a budget
    check_budget_scope(64, True, "step")
    check_budget_scope(64, False, "microbatch")
    check_budget_scope(0, True, "microbatch")
    assert RunConfig(entropy_top_frac=0.2, mask_scope="step", max_tokens_per_micro_batch=64).max_tokens_per_micro_batch
    assert RunConfig(max_tokens_per_micro_batch=64).mask_scope == "microbatch"  # rho = 1
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch must be >= 0"):
        train_step(model, opt, batch, adv, LossConfig(name="dapo"), temperature=1.0, micro_batch_size=4,
                   max_grad_norm=1.0, max_tokens_per_micro_batch=-1)


def test_the_run_s_policy_update_passes_the_budget_to_the_step() -> None:
    from tests.unit.test_class_breakdown import _policy, _scored

    policy = _policy("countdown", 0.2)
    batch = _scored(policy, "countdown", [["2+3=5,5*1=5", "3*1=3,3+2=5"], ["8+2=10,10*9=90", "9*9=81"]])
    fixed = policy.update(batch, policy.cfg.loss_config())
    assert fixed["micro_batches"] == 1  # micro_batch_size 64: the 4 rows in one micro-batch
    policy.cfg = policy.cfg.model_copy(update={"max_tokens_per_micro_batch": 1, "mask_scope": "step"})
    budget = policy.update(batch, policy.cfg.loss_config())
    assert budget["micro_batches"] == 4  # a budget of 1 token: every row alone
    assert budget["kept_tokens"] == fixed["kept_tokens"]
