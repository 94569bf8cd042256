"""2 ranks (torchrun, gloo, CPU) train one step that equals 1 rank: loss, metrics, kept tokens and updated weights;
and the guards decide the same on every rank.

tests/dist/dp_worker.py runs on 2 ranks; per case it compares `train_step` over both ranks (a replicated model
with a SUM all_reduce, and an FSDP2 model, `fully_shard` per decoder layer) with `train_step` over a group of
one rank, on the same random-init Qwen2 model and the same batch. Cases: token_mean with no mask, the
step-scope and the micro-batch-scope top-k (rho 0.2), the same with every entropy tied (lm_head zero: the kept
set is decided by the tie order alone), a rank with an empty share of a micro-batch (Dr. GRPO's constant
denominator), AdamW, and the recipe's mechanics: 2 mini-batches of whole groups x 2 epochs (4 updates, pi_old
from the no-grad pass), rho 0.2, TIS, dual clip, with SGD steps large enough that both clips act (micro-batch
scope; step scope with the KL term; AdamW with a rank holding an empty share; tied embeddings, where the lm_head
weight, read by the chunked loss after the forward, is the embedding in FSDP2's root unit). FSDP2 reduce-scatters
every micro-batch's gradient (the default); some cases also run with grad_sync="last" (once per update) and with
activation checkpointing, and the gradients between micro-batches are checked to be sharded (every) or not yet
reduced (last).

Tolerance, from the arithmetic: 2 ranks do the same float32 operations as 1 rank on the same numbers, but
sum the per-rank gradient and metric shares in another order and run each forward on a different set of
rows (another padding width). Both change a result of magnitude |v| by a few float32 roundings,
eps = 2**-23 ~ 1.2e-7 of |v| each; REL = 1e-5 (~84 ulps, the bound issue 13 sets) leaves room for sums
over the ~100 tokens of a step. A wrong denominator, a token kept on one side and not the other, or a
gradient averaged instead of summed changes the values by O(0.1) or more. Counts (kept, response tokens,
micro-batches) must be equal exactly. SGD with lr 1 and a gradient clip of 1 makes the weight update the
clipped gradient itself, so the weight check is a gradient check at |g| <= 1; the first AdamW step moves
each weight by lr * g / (|g| + eps_adam) <= lr, so there 2 ranks and 1 rank differ by at most 2 lr.

Several updates (u of them): each update is the one-update arithmetic above, at weights that differ between the
runs by what the earlier updates' rounding left. SGD with lr eta and the clip at 1 moves each weight by eta g,
|g_i| <= 1, and g differs by at most REL between the runs, so after u updates the weights differ by at most
u eta REL max(1, |w|) (to first order: the change of g caused by weights that differ by eta REL is of the same
order, times eta); a metric, a smooth function of weights and tokens, differs by at most REL per update:
u REL max(1, |v|). AdamW moves each weight by at most lr U_t at update t (U_t: the Adam bound of
tests/dist/test_resume_across_ranks.py), so 2 ranks and 1 rank differ by at most 2 lr sum_t U_t.
The kept tokens (`kept_out`) and every count must be equal exactly.

Guards, each rank's own answer: an inf gradient injected on rank 1 only skips every update on both ranks with
the same sentence and no optimizer state; rank 0's stop (the other rank has none) stops both ranks at the same
check point as one rank with the same stop (before any update: StepStopped everywhere; after 2 updates: both
return those 2, `stopped`), with the weights of one rank within the bound above; an inf in rank 1's shard of a
weight is named on both ranks.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
REL = 1e-5
EXACT = ("kept_tokens", "response_tokens", "micro_batches", "n_updates", "skipped_updates")
B1, B2 = 0.9, 0.999  # torch's AdamW defaults (the worker's optimizer)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_rank_result(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    tmp = tmp_path_factory.mktemp("dp")
    out, ckpt = tmp / "result.json", tmp / "ckpt"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "forkrl.launch", "--nproc-per-node", "2",
           str(REPO / "tests/dist/dp_worker.py"), str(out), str(ckpt)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return json.loads(out.read_text()), ckpt


CASE_NAMES = ["token_mean", "step_top0.2", "micro_top0.2", "step_top0.2_ties", "micro_top0.3_ties",
              "dr_grpo_empty_share", "seq_mean_adamw", "recipe", "recipe_step_kl", "recipe_adamw_empty_share",
              "recipe_tied_embeddings"]
# FSDP2 with gradients reduce-scattered on an update's last micro-batch only (the default is every micro-batch),
# and with activation checkpointing, on the cases the worker runs them for (dp_worker.py MODES)
MORE_MODES = [("micro_top0.2", "fsdp_last"), ("recipe", "fsdp_last"), ("recipe_adamw_empty_share", "fsdp_last"),
              ("recipe_tied_embeddings", "fsdp_last"), ("recipe_tied_embeddings", "fsdp_ac")]


def _adam_bound(t: int) -> float:
    """U_t >= |m_hat / (sqrt(v_hat) + eps)| after t AdamW steps, any gradients (Cauchy-Schwarz)."""
    s = sum(((1 - B1) * B1**k) ** 2 / ((1 - B2) * B2**k) for k in range(t))
    return math.sqrt(s) * math.sqrt(1 - B2**t) / (1 - B1**t)


def _weight_bound(lrs: dict, case: str, updates: int, scale: float) -> float:
    if "adamw" in case:
        return 2 * lrs["adamw"] * sum(_adam_bound(t) for t in range(1, updates + 1))
    return updates * lrs["sgd_recipe" if "recipe" in case else "sgd"] * REL * max(1.0, scale)


def _check_equal(res: dict, case: str, mode: str) -> None:
    assert res["world_size"] == 2
    c = res["cases"][case]
    ref, got = c["ref"], c[mode]
    u = int(ref["n_updates"])
    for k, v in ref.items():
        if k in EXACT:
            assert got["metrics"][k] == v, k
        else:
            assert got["metric_delta"][k] <= u * REL * max(1.0, abs(v)), (k, got["metric_delta"][k], v)
    bound = _weight_bound(res["lr"], case, u, got["weight_scale"])
    assert got["weight_delta"] <= bound, (got["weight_delta"], bound)
    assert got["kept_equal"]  # the breakdown's kept flags: the same tokens of the same sequences
    assert ref["kept_tokens"] < ref["response_tokens"] or case == "token_mean"  # the mask was on
    assert ref["skipped_updates"] == 0


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("case", CASE_NAMES)
def test_two_ranks_equal_one_rank(two_rank_result: tuple[dict, Path], case: str, mode: str) -> None:
    _check_equal(two_rank_result[0], case, mode)


@pytest.mark.parametrize(("case", "mode"), MORE_MODES)
def test_grad_sync_last_and_checkpointing_equal_one_rank(two_rank_result: tuple[dict, Path], case: str,
                                                         mode: str) -> None:
    # the same arithmetic in another order of summation: the same bounds. With tied embeddings the lm_head
    # weight is the embedding (FSDP2's root unit): a lost or doubled lm_head term of its gradient would move it by
    # O(lr |g|), far outside the bound.
    _check_equal(two_rank_result[0], case, mode)


def test_grad_sync_every_keeps_only_sharded_gradients_between_micro_batches(
        two_rank_result: tuple[dict, Path]) -> None:
    c = two_rank_result[0]["cases"]["recipe"]  # 4 updates of 2 micro-batches: 8 forwards with grad
    every, last = c["fsdp"], c["fsdp_last"]
    # every: micro-batch 1's gradient is already reduce-scattered into each parameter's shard when micro-batch 2
    # starts; last: FSDP2 holds it unsharded, so no parameter (shard) has a gradient before the update's end
    assert every["grads_at_forward"] == [0, every["n_params"]] * 4
    assert last["grads_at_forward"] == [0] * 8


def test_the_recipe_runs_every_mechanism_on_two_ranks(two_rank_result: tuple[dict, Path]) -> None:
    cases = two_rank_result[0]["cases"]
    for name in ("recipe", "recipe_step_kl", "recipe_adamw_empty_share", "recipe_tied_embeddings"):
        ref = cases[name]["ref"]
        assert ref["n_updates"] == 4 and ref["micro_batches"] == (4 if name != "recipe_adamw_empty_share" else 5)
        assert ref["tis_capped_frac"] > 0  # some engine log-probs are far from the trainer's: truncated
    for name in ("recipe", "recipe_step_kl"):  # pi_old from before the first update: the later ratios move
        ref = cases[name]["ref"]
        assert ref["clip_frac_low"] > 0 and ref["clip_frac_high"] > 0 and ref["approx_kl"] > 0
    assert cases["recipe"]["ref"]["dual_clip_frac"] > 0
    assert cases["recipe_step_kl"]["ref"]["kl_mean"] > 0


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_an_inf_gradient_on_one_rank_skips_the_update_on_every_rank(two_rank_result: tuple[dict, Path],
                                                                    mode: str) -> None:
    ranks = [r[mode]["inf_grad"] for r in two_rank_result[0]["guards"]["per_rank"]]
    for r in ranks:
        assert (r["metrics"]["n_updates"], r["metrics"]["skipped_updates"]) == (0.0, 4.0)
        assert r["optimizer_state"] == 0 and r["unchanged"]  # no AdamW step, the weights as before
        assert len(r["reasons"]) == 4 and r["reasons"][0].startswith("the gradient of model.")
    assert ranks[0]["reasons"] == ranks[1]["reasons"]  # the same tensor named on both ranks


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("at", [6, 12])
def test_rank_0s_stop_stops_every_rank_where_one_rank_stops(two_rank_result: tuple[dict, Path], mode: str,
                                                             at: int) -> None:
    res = two_rank_result[0]
    ranks = [r[mode][f"stop_{at}"] for r in res["guards"]["per_rank"]]
    ref = ranks[0]["ref"]
    for r in ranks:
        assert r["stopped_before_any_update"] == ref["stopped_before_any_update"] == (at == 6)
    if at == 12:  # two updates applied, then stopped before the third: both ranks return them
        for r in ranks:
            assert r["metrics"]["stopped"] == 1.0 and r["metrics"]["n_updates"] == ref["metrics"]["n_updates"] == 2
        assert ranks[0]["metrics"]["kept_tokens"] == ref["metrics"]["kept_tokens"]
    assert ranks[0]["weight_delta"] <= _weight_bound(res["lr"], "recipe", 2, 2.0)  # as one rank stopped there


def test_an_inf_in_one_ranks_shard_is_named_on_every_rank(two_rank_result: tuple[dict, Path]) -> None:
    for r in two_rank_result[0]["guards"]["per_rank"]:
        assert r["fsdp"]["inf_weight"]["found"] == r["fsdp"]["inf_weight"]["expected"]


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
