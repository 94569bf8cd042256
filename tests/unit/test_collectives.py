"""forkrl.rl.collectives without a process group (the trivial case every function reduces to), the row dealing of
the train step, and the finiteness check of the guards.

The 2-rank equality with 1 rank (torchrun, gloo, FSDP2) is tests/dist/test_dp_equals_one_rank.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from forkrl.rl.collectives import (
    deal,
    first_nonfinite,
    gather_segments,
    rank_world,
    reduce_floats,
    union_keys,
)


@pytest.mark.parametrize("n,micro,world", [(16, 8, 2), (13, 6, 2), (7, 7, 3), (5, 2, 4), (1, 4, 2)])
def test_deal_gives_each_rank_its_block_of_every_micro_batch_in_rank_order(n: int, micro: int, world: int) -> None:
    for s in range(0, n, micro):
        e = min(s + micro, n)
        blocks = [deal(s, e, world, r) for r in range(world)]
        # rank r's block follows rank r-1's: together they are the 1-rank micro-batch, in order
        assert blocks[0][0] == s and blocks[-1][1] == e
        assert all(blocks[r][1] == blocks[r + 1][0] for r in range(world - 1))
        sizes = [b - a for a, b in blocks]
        assert max(sizes) - min(sizes) <= 1
    assert deal(3, 9, 1, 0) == (3, 9)  # one rank: the whole micro-batch
    with pytest.raises(ValueError, match="rank"):
        deal(0, 4, 2, 2)


def test_one_process_is_the_trivial_case_of_every_collective() -> None:
    assert rank_world() == (0, 1)
    segs = [torch.tensor([1.0, 2.0]), torch.zeros(0), torch.tensor([[3.0]])]
    got = gather_segments(segs)
    assert [t.tolist() for t in got] == [[1.0, 2.0], [], [3.0]]  # 1-D, same order
    assert reduce_floats([1.5, -2.0], "sum", torch.device("cpu")) == [1.5, -2.0]
    assert union_keys(["b", "a", "b"]) == ["a", "b"]


def test_first_nonfinite_names_the_first_tensor_with_an_inf_or_a_nan() -> None:
    dev = torch.device("cpu")
    big = torch.full((3,), 3e38)  # finite, though its 2-norm overflows float32: not flagged
    named = [("a", torch.ones(2)), ("b", None), ("c", big), ("d", torch.tensor([1.0, math.nan])),
             ("e", torch.tensor([math.inf]))]
    assert first_nonfinite(named, dev) == "d"
    assert first_nonfinite(named[:3], dev) is None
    assert first_nonfinite([("x", torch.zeros(0)), ("y", torch.tensor([-math.inf]))], dev) == "y"
    assert first_nonfinite([], dev) is None


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
