"""Micro-batches by tokens equal fixed micro-batches: the cases, and one rank of the 2-rank check
(tests/dist/test_token_budget_ranks.py launches it with torchrun; tests/unit/test_microbatch.py runs the same
cases on one process).

Every case trains the same tiny random-init Qwen2 model (tests/dist/dp_worker.py `build_model`) on the same
batch of long-tailed lengths: 2 mini-batches of 2 groups (G = 4) x 2 epochs = 4 SGD updates, rho = 0.2 in step
scope, TIS, for grpo, dapo (with the dual clip) and cispo, plus dapo with every entropy tied (lm_head zero: the
kept set is decided by the tie order alone, so it checks that the top-k reads the entropies in batch-row order
whatever the micro-batches). The reference is fixed micro-batches of FIXED rows on one rank; it is compared with
micro-batches of at most BUDGET padded tokens, and with packed sequences (one row of at most BUDGET tokens per
micro-batch, no padding), on one rank and on 2 ranks (a replicated model with a SUM all_reduce, and FSDP2).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/dist/budget_worker.py OUT.json
"""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dp_worker import VOCAB, build_model  # noqa: E402

from forkrl.rl.losses import LossConfig  # noqa: E402
from forkrl.rl.step import Batch, build_batch, train_step  # noqa: E402

N, MINI, FIXED, BUDGET, LR = 16, 8, 4, 30, 0.3  # BUDGET: the 51-token row alone, a rank with an empty slot
MAX_COMPLETION = 48  # the "recipe's cap" of this batch (the model has 64 positions)
KW = dict(temperature=0.9, max_grad_norm=1.0, mini_batch_size=MINI, epochs=2, kl_pass=True)
CASES = {
    "grpo": (LossConfig(name="grpo", entropy_top_frac=0.2, mask_scope="step", tis_cap=2.0), False),
    "dapo": (LossConfig(name="dapo", entropy_top_frac=0.2, mask_scope="step", tis_cap=2.0, dual_clip_c=2.0), False),
    "cispo": (LossConfig(name="cispo", entropy_top_frac=0.2, mask_scope="step", tis_cap=2.0), False),
    "dapo_ties": (LossConfig(name="dapo", entropy_top_frac=0.2, mask_scope="step"), True),
}
EXACT = ("kept_tokens", "response_tokens", "n_updates", "skipped_updates")
PLAN_ONLY = ("micro_batches",)  # describes the plan, not the update: differs by design


def long_tailed_lengths(n: int, cap: int, seed: int, median: float) -> list[int]:
    """Response lengths of an RL batch: log-normal (most responses short, a few long), sigma 1, capped at the
    recipe's max_new_tokens as the engine would truncate them, at least 1."""
    rng = random.Random(seed)
    return [max(1, min(cap, round(rng.lognormvariate(math.log(median), 1.0)))) for _ in range(n)]


def build_inputs() -> tuple[Batch, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    lens = long_tailed_lengths(N, MAX_COMPLETION, seed=3, median=8.0)
    prompts, comps, lps = [], [], []
    # a prompt per row: the samples of a real group share their prompt, so the entropies at their first response
    # token are equal in exact arithmetic and differ only by float32 rounding, which depends on which rows share a
    # forward; at the top-k boundary such a tie may then keep another (equally valid) sample's token with fixed
    # and with token-budget micro-batches (never another count). Distinct prompts keep the kept flags comparable
    # exactly; dapo_ties checks the tie order where ties are exact.
    for n_c in lens:
        prompts.append(torch.randint(3, VOCAB, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist())
        comps.append(torch.randint(3, VOCAB, (n_c,), generator=g).tolist())
        lps.append((-torch.rand(n_c, generator=g) * 3).tolist())
    return build_batch(prompts, comps, lps, pad_id=0), torch.randn(N, generator=g)


MODES = {"ddp": (False, False), "fsdp": (True, False), "ddp_packed": (False, True), "fsdp_packed": (True, True)}
"""The 2-rank arms: (FSDP2, packed sequences)."""


def run_case(name: str, budget: int, group: dist.ProcessGroup | None = None, sharded: bool = False,
             pack: bool = False) -> dict:
    """One train_step of the case: its metrics, the updated full weights and the kept flags."""
    from forkrl.training.distributed import full_state_dict, shard_model

    cfg, tied = CASES[name]
    batch, adv = build_inputs()
    model = build_model(tied)
    if sharded:
        model = shard_model(model, "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    kept: list[torch.Tensor] = []
    m = train_step(model, opt, batch, adv, cfg, micro_batch_size=FIXED, max_tokens_per_micro_batch=budget,
                   pack_sequences=pack, kept_out=kept, group=group, **KW)
    w = full_state_dict(model) if sharded else {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"metrics": m, "weights": w, "kept": kept}


def differences(got: dict, ref: dict) -> dict:
    """What tests compare: |got - ref| per metric, the largest weight difference and scale, kept flags equal."""
    m, m_ref = got["metrics"], ref["metrics"]
    assert set(m) == set(m_ref), sorted(set(m) ^ set(m_ref))
    dm = {k: abs(m[k] - v) if math.isfinite(v) else (0.0 if m[k] == v else 1e9) for k, v in m_ref.items()}
    want = ref["weights"]
    return {"metrics": m, "ref": m_ref, "metric_delta": dm,
            "weight_delta": max(float((got["weights"][k] - want[k]).abs().max()) for k in want),
            "weight_scale": max(float(v.abs().max()) for v in want.values()),
            "kept_equal": len(got["kept"]) == len(ref["kept"]) == N and all(
                torch.equal(a, b) for a, b in zip(got["kept"], ref["kept"], strict=True))}


def main(out_path: str) -> None:
    from forkrl.training.distributed import init_from_env

    info = init_from_env()
    assert info.world_size == 2, info
    solo = [dist.new_group([r]) for r in range(info.world_size)][info.rank]  # the 1-rank reference
    results = {}
    for name in CASES:
        ref = run_case(name, 0, group=solo)
        for mode, (sharded, pack) in MODES.items():
            got = run_case(name, BUDGET, sharded=sharded, pack=pack)
            if info.rank == 0:  # FSDP2's full weights are gathered on rank 0 only
                results.setdefault(name, {})[mode] = differences(got, ref)
        dist.barrier()
    if info.rank == 0:
        Path(out_path).write_text(json.dumps({"world_size": info.world_size, "cases": results}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
