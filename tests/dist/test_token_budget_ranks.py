"""Micro-batches by tokens on 2 ranks (torchrun, gloo, CPU) equal fixed micro-batches on 1 rank: loss, metrics,
kept tokens and updated weights, for grpo, dapo and cispo with rho = 0.2 (step scope), 2 mini-batches x 2 epochs,
and dapo with every entropy tied; a replicated model and FSDP2, each with padded and with packed micro-batches
(pack_sequences: one row per micro-batch, position ids restarting per sequence, no padding). One torchrun launch
runs every case (tests/dist/budget_worker.py).

The 2 ranks deal the rows by tokens and pack each rank's rows by length, so each rank's micro-batches, their
number, and the padding widths differ from the 1-rank fixed micro-batches; the update does not depend on them
(denominators global to the update, the step-scope top-k over the entropies in batch-row order), so the bounds
are those of tests/dist/test_dp_equals_one_rank.py: float32 rounding of another summation order and padding
width, REL = 1e-5 per update on every metric, u lr REL max(1, |w|) on the weights after u SGD updates (lr, the
clip at 1); counts and the kept flags exactly. Only `micro_batches`, which describes the plan, differs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from forkrl.rl.microbatch import token_plan
from tests.dist.budget_worker import BUDGET, CASES, EXACT, LR, MINI, MODES, PLAN_ONLY, build_inputs

REPO = Path(__file__).resolve().parents[2]
REL = 1e-5

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("budget") / "result.json"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REPO / "tests/dist/budget_worker.py"), str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return json.loads(out.read_text())


def test_the_two_rank_plan_deals_micro_batches_by_tokens_with_uneven_counts() -> None:
    batch, _ = build_inputs()
    lengths, resp = batch.attention_mask.sum(1).tolist(), batch.response_mask.sum(1).tolist()
    plan = token_plan(lengths, resp, MINI, BUDGET, 2)
    # both ranks train rows of every mini-batch, not contiguous blocks, and some rank has fewer micro-batches than
    # the other in some mini-batch: it joins with an empty share
    for slots in plan:
        for r in range(2):
            rows = sorted(i for slot in slots for i in slot[r])
            assert rows and rows != list(range(rows[0], rows[-1] + 1)), rows
    assert any(not slot[r] for slots in plan for slot in slots for r in range(2))


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", list(CASES))
def test_token_budget_on_two_ranks_equals_fixed_micro_batches_on_one(result: dict, case: str, mode: str) -> None:
    assert result["world_size"] == 2
    d = result["cases"][case][mode]
    ref = d["ref"]
    u = int(ref["n_updates"])
    assert u == 4 and ref["kept_tokens"] < ref["response_tokens"] and ref["skipped_updates"] == 0
    for k, v in ref.items():
        if k in EXACT:
            assert d["metrics"][k] == v, k
        elif k not in PLAN_ONLY:
            assert d["metric_delta"][k] <= u * REL * max(1.0, abs(v)), (k, d["metric_delta"][k], v)
    assert d["weight_delta"] <= u * LR * REL * max(1.0, d["weight_scale"]), d["weight_delta"]
    assert d["kept_equal"]
