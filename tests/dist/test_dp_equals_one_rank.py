"""2 ranks (torchrun, gloo, CPU) train one step that equals 1 rank: loss, metrics and updated weights.

tests/dist/dp_worker.py runs on 2 ranks; per case it compares `dp_train_step` (a replicated model with a
SUM all_reduce, and an FSDP2 model, `fully_shard` per decoder layer) with `train_step` on one process, on
the same random-init Qwen2 model and the same batch. Cases: token_mean with no mask, the step-scope and the
micro-batch-scope top-k (rho 0.2), the same with every entropy tied (lm_head zero: the kept set is decided
by the tie order alone), a rank with an empty share of a micro-batch (Dr. GRPO's constant denominator),
and AdamW.

Tolerance, from the arithmetic: 2 ranks do the same float32 operations as 1 rank on the same numbers, but
sum the per-rank gradient and metric shares in another order and run each forward on a different set of
rows (another padding width). Both change a result of magnitude |v| by a few float32 roundings,
eps = 2**-23 ~ 1.2e-7 of |v| each; REL = 1e-5 (~84 ulps, the bound issue 13 sets) leaves room for sums
over the ~100 tokens of a step. A wrong denominator, a token kept on one side and not the other, or a
gradient averaged instead of summed changes the values by O(0.1) or more. Counts (kept, response tokens,
micro-batches) must be equal exactly. SGD with lr 1 and a gradient clip of 1 makes the weight update the
clipped gradient itself, so the weight check is a gradient check at |g| <= 1; the first AdamW step moves
each weight by lr * g / (|g| + eps_adam) <= lr, so there 2 ranks and 1 rank differ by at most 2 lr.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


REPO = Path(__file__).resolve().parents[2]
REL = 1e-5
EXACT = ("kept_tokens", "response_tokens", "micro_batches")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_rank_result(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    tmp = tmp_path_factory.mktemp("dp")
    out, ckpt = tmp / "result.json", tmp / "ckpt"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REPO / "tests/dist/dp_worker.py"), str(out), str(ckpt)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return json.loads(out.read_text()), ckpt


CASE_NAMES = ["token_mean", "step_top0.2", "micro_top0.2", "step_top0.2_ties", "micro_top0.3_ties",
              "dr_grpo_empty_share", "seq_mean_adamw"]


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("case", CASE_NAMES)
def test_two_ranks_equal_one_rank(two_rank_result: tuple[dict, Path], case: str, mode: str) -> None:
    res = two_rank_result[0]
    assert res["world_size"] == 2
    c = res["cases"][case]
    ref, got = c["ref"], c[mode]
    for k, v in ref.items():
        if k in EXACT:
            assert got["metrics"][k] == v, k
        else:
            assert got["metric_delta"][k] <= REL * max(1.0, abs(v)), (k, got["metric_delta"][k], v)
    lr = res["lr"]["adamw" if "adamw" in case else "sgd"]
    bound = 2 * lr if "adamw" in case else REL * max(1.0, got["weight_scale"])
    assert got["weight_delta"] <= bound, (got["weight_delta"], bound)
    assert ref["kept_tokens"] < ref["response_tokens"] or case == "token_mean"  # the mask was on


def test_the_masks_keep_what_one_rank_keeps(two_rank_result: tuple[dict, Path]) -> None:
    cases = two_rank_result[0]["cases"]
    # step scope keeps ceil(0.2 N) over the step; ties: every entropy is ln V, so only the order decides
    for name in ("step_top0.2", "step_top0.2_ties"):
        ref = cases[name]["ref"]
        assert ref["kept_tokens"] == -(-ref["response_tokens"] // 5)
    tied = cases["step_top0.2_ties"]["ref"]
    assert tied["entropy_p50"] == tied["entropy_p99"]  # all tied indeed
    for mode in ("ddp", "fsdp"):  # the kept tokens are the same tokens: their rollout |dlogp| agree
        got = cases["step_top0.2_ties"][mode]["metric_delta"]
        assert got["logp_delta_kept_mean"] <= REL * max(1.0, tied["logp_delta_kept_mean"])


def test_the_fsdp_checkpoint_gathered_on_rank_0_loads_in_transformers(two_rank_result: tuple[dict, Path]) -> None:
    from transformers import AutoModelForCausalLM

    ckpt = two_rank_result[1]
    ref = AutoModelForCausalLM.from_pretrained(ckpt / "ref", dtype=torch.float32).state_dict()
    got = AutoModelForCausalLM.from_pretrained(ckpt / "fsdp", dtype=torch.float32).state_dict()
    assert set(ref) == set(got)
    for k in ref:
        assert torch.allclose(ref[k], got[k], rtol=0, atol=REL * max(1.0, float(ref[k].abs().max()))), k


def test_fsdp_with_activation_checkpointing_equals_one_rank(two_rank_result: tuple[dict, Path]) -> None:
    c = two_rank_result[0]["cases"]["step_top0.2"]
    ref, got = c["ref"], c["fsdp_ac"]
    for k, v in ref.items():  # recomputing the layers' activations repeats the same float32 operations
        assert got["metric_delta"][k] <= REL * max(1.0, abs(v)), (k, got["metric_delta"][k], v)
    assert got["weight_delta"] <= REL * max(1.0, got["weight_scale"])


def test_fsdp_bf16_compute_keeps_fp32_master_weights_and_stays_close(two_rank_result: tuple[dict, Path]) -> None:
    # MixedPrecisionPolicy(bf16 params in compute, fp32 reduce), the GPU default, run on CPU. bf16 has an
    # 8-bit significand (unit roundoff 2**-8 ~ 3.9e-3); the logits and gradients of a 2-layer model carry a
    # few such roundings, so BF16_REL = 2**-5 (8 roundings) bounds them relative to the O(1) clipped update;
    # summing instead of averaging the 2 ranks' gradients (or the reverse) would be off by 1/2.
    bf16_rel = 2.0**-5
    c = two_rank_result[0]["cases"]["step_top0.2"]
    ref, got = c["ref"], c["fsdp_bf16"]
    assert got["dtypes"] == ["torch.float32"]  # the gathered (master) weights stay fp32
    for k in EXACT:
        assert got["metrics"][k] == ref[k], k
    assert abs(got["metrics"]["grad_norm"] - ref["grad_norm"]) <= bf16_rel * ref["grad_norm"]
    assert got["weight_delta"] <= bf16_rel * max(1.0, got["weight_scale"])
