"""forkrl.rl.dp without a process group: the row dealing, and world size 1 is train_step bit for bit.

The 2-rank equality with 1 rank (torchrun, gloo, FSDP2) is tests/dist/test_dp_equals_one_rank.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

from forkrl.rl.dp import dp_rank_world, dp_train_step, shard_rows
from forkrl.rl.losses import LossConfig
from forkrl.rl.step import build_batch, train_step
from tests.unit.test_step import _model, _trajectories


@pytest.mark.parametrize("n,micro,world", [(16, 8, 2), (13, 6, 2), (7, 7, 3), (5, 2, 4), (1, 4, 2)])
def test_shard_rows_deals_each_micro_batch_in_rank_order(n: int, micro: int, world: int) -> None:
    per_rank = [shard_rows(n, micro, world, r) for r in range(world)]
    n_micro = -(-n // micro)
    assert all(len(rows) == n_micro for rows in per_rank)  # every rank runs every micro-batch
    for j in range(n_micro):
        blocks = [per_rank[r][j] for r in range(world)]
        # rank r's block follows rank r-1's: together they are the 1-rank micro-batch j, in order
        assert blocks[0][0] == j * micro and blocks[-1][1] == min((j + 1) * micro, n)
        assert all(blocks[r][1] == blocks[r + 1][0] for r in range(world - 1))
        sizes = [e - s for s, e in blocks]
        assert max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError, match="rank"):
        shard_rows(4, 2, 2, 2)


def test_world_size_one_is_train_step_bit_for_bit() -> None:
    assert dp_rank_world() == (0, 1)
    model = _model()
    prompts, comps, lps = _trajectories(8)
    batch = build_batch(prompts, comps, lps, pad_id=0)
    adv = torch.linspace(-1, 1, 8)
    cfg = LossConfig(name="dapo", entropy_top_frac=0.2, mask_scope="step")
    runs = []
    for fn in (train_step, dp_train_step):
        m = copy.deepcopy(model)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        metrics = fn(m, opt, batch, adv, cfg, temperature=0.8, micro_batch_size=3, max_grad_norm=1.0)
        runs.append((m, metrics))
    (a, ma), (b, mb) = runs
    assert ma == mb
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_a_checkpoint_without_optimizer_state_is_not_resumed(tiny_model_dir, tmp_path) -> None:
    # What a multi-rank trainer wrote before sharded optimizer checkpoints (optimizer_saved: false): the full
    # model, no AdamW moments. Resuming it would restart AdamW silently, so load_policy refuses and says what
    # to do instead (today's multi-rank checkpoints hold the moments: tests/dist/test_resume_across_ranks.py).
    from transformers import AutoModelForCausalLM

    from forkrl.training.config import RunConfig
    from forkrl.training.policy import load_policy
    from forkrl.weights.checkpoint import save_checkpoint

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    run_dir = tmp_path / "run"
    save_checkpoint(run_dir, "step_000001", model, None, None,
                    {"step": 1, "data_cursor": 8, "optimizer_saved": False, "world_size": 2},
                    model_state={k: v.detach() for k, v in model.state_dict().items()})
    cfg = RunConfig(model=str(tiny_model_dir), run_dir=str(run_dir), resume=True)
    with pytest.raises(ValueError, match="holds no optimizer state"):
        load_policy(cfg, run_dir, "cpu")
