"""Checkpoints from shards (issue 13 item 2): a 2-rank run's checkpoint (HF weights gathered on rank 0, AdamW
state sharded with torch.distributed.checkpoint) resumes on 2 ranks exactly and on 1 rank; a 1-rank
checkpoint resumes on 2 ranks.

tests/dist/resume_worker.py drives load_policy / Policy.update / Policy.save (the trainer's own code) on the
embedded tiny model with three fixed batches (dapo, step-scope top-k rho 0.2, AdamW lr 1e-3, weight decay
0.01, clip 1). Three launches, each a fresh process group:

    torchrun 2 ranks: train steps 1-3, checkpoint after step 2                    -> t2, run2/step_000002
    python, 1 rank:   the same                                                     -> t1, run1/step_000002
                      then resume run2 (2 -> 1) and train step 3                   -> r21
    torchrun 2 ranks: resume run2 (2 -> 2), train step 3                          -> r22
                      resume run1 (1 -> 2), train step 3                          -> r12

Tolerances, from the arithmetic:
- N -> N: the resumed ranks hold bit for bit the weights (the gathered fp32 state, written and read as
  float32, resharded the same way) and AdamW state (each rank's shards written and read back) they held at
  the checkpoint, and run the same float32 operations on the same batch: every weight, moment and metric of
  step 3 is **equal** to the uninterrupted run's.
- N -> M: the loaded weights and AdamW state are again equal bit for bit (DCP reshards by copying
  slices; the 1-rank file is cut into shards by copying). Step 3 then runs on another number of ranks: its
  metrics equal the uninterrupted run's within REL = 1e-5 (the bound of tests/dist/test_dp_equals_one_rank.py:
  same weights, same batch, another reduction order), counts exactly. The weights after step 3 differ only
  through the gradient g (clipped to norm 1, so |g_i| <= 1 and, by that test, |dg_i| <= REL). AdamW moves
  w_i by lr * u_i, u = m_hat / (sqrt(v_hat) + eps); to first order |du_i| <= C |dg_i| / (sqrt(v_hat_i) + eps)
  with C = (1 - b1) / bc1 + U sqrt((1 - b2) / bc2) (the second term from d sqrt(v_hat) / dg, since
  sqrt(v_hat) >= |g| sqrt((1 - b2) / bc2)), bc_k = 1 - b_k^t, and U >= |u| the Adam bound at step t
  (Cauchy-Schwarz: U = sqrt(sum_k a_k^2 / c_k) sqrt(bc2) / bc1, a_k = (1 - b1) b1^k, c_k = (1 - b2) b2^k).
  Per element: |dw_i| <= 2 lr C REL / (sqrt(v_hat_i) + eps) + 2 ulp(w_i) (a factor 2 over the first-order
  term; each run rounds its own w_i once more). A resume that dropped the AdamW state is caught by the exact
  state comparison, not by this bound.
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
WORKER = str(REPO / "tests/dist/resume_worker.py")
REL = 1e-5
EXACT = ("kept_tokens", "response_tokens", "micro_batches", "n_updates")
B1, B2, EPS = 0.9, 0.999, 1e-8  # RunConfig's adam_beta1 / adam_beta2, the trainer's AdamW eps

pytestmark = [pytest.mark.slow, pytest.mark.isolated]  # it launches its own processes, shares nothing


def _launch(out: Path, ranks: int, *jobs: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    launcher = [sys.executable, "-m", "forkrl.launch", "--nproc-per-node", str(ranks)] \
        if ranks > 1 else [sys.executable]
    proc = subprocess.run([*launcher, WORKER, str(out), *jobs], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("resume")
    _launch(out, 2, "train:run2:t2")
    _launch(out, 1, "train:run1:t1", "resume:run2:r21")
    _launch(out, 2, "resume:run2:r22", "resume:run1:r12")
    return out


def _load(out: Path, tag: str) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return json.loads((out / f"{tag}.json").read_text()), load_file(str(out / f"{tag}.safetensors"))


def _part(t: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in t.items() if k.startswith(prefix)}


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a and set(a) == set(b), sorted(set(a) ^ set(b))
    for k in a:
        assert torch.equal(a[k], b[k]), (k, float((a[k].float() - b[k].float()).abs().max()))


def test_the_two_rank_checkpoint_holds_hf_weights_and_dcp_optimizer_shards(runs: Path) -> None:
    from transformers import AutoModelForCausalLM

    from forkrl.weights.checkpoint import read_state
    from forkrl.weights.safetensors import checkpoint_files

    ckpt = runs / "run2" / "checkpoints" / "step_000002"
    state = read_state(ckpt)
    assert state["world_size"] == 2 and state["optimizer_saved"] is True and state["step"] == 2
    assert state["optimizer"] == {"format": "dcp", "dir": "trainer_state/optimizer_dcp", "world_size": 2}
    dcp_dir = ckpt / "trainer_state" / "optimizer_dcp"
    assert sorted(p.name for p in dcp_dir.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert [p.name for p in checkpoint_files(ckpt)] == ["model.safetensors"]  # engines see the weights only
    assert not list((runs / "run2" / "checkpoints").glob(".tmp-*"))
    step0 = runs / "run2" / "checkpoints" / "step_000000"  # saved before any optimizer step: no moments
    assert read_state(step0)["optimizer"] == {} and not (step0 / "trainer_state" / "optimizer_dcp").exists()
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)  # what vLLM and the probe load
    _assert_equal({k: v for k, v in model.state_dict().items()}, _part(_load(runs, "t2")[1], "w2."))


def test_the_one_rank_checkpoint_keeps_its_format(runs: Path) -> None:
    from safetensors.torch import load_file

    from forkrl.weights.checkpoint import read_state

    ckpt = runs / "run1" / "checkpoints" / "step_000002"
    state = read_state(ckpt)
    assert "world_size" not in state and "optimizer_saved" not in state and set(state["optimizer"]) == {"steps"}
    assert not (ckpt / "trainer_state" / "optimizer_dcp").exists()
    moments = load_file(str(ckpt / "trainer_state" / "optimizer.safetensors"))
    saved = _part(_load(runs, "t1")[1], "o2.")
    for k, v in moments.items():
        if k != "__torch_rng_state__":
            assert torch.equal(v, saved[k]), k


def test_two_ranks_resume_on_two_ranks_bit_for_bit(runs: Path) -> None:
    (ref_m, ref), (got_m, got) = _load(runs, "t2"), _load(runs, "r22")
    assert got_m["world_size"] == 2
    for prefix in ("w2.", "o2.", "w3.", "o3."):  # loaded = saved; step 3 = the uninterrupted step 3
        _assert_equal(_part(got, prefix), _part(ref, prefix))
    assert got_m["metrics"]["3"] == ref_m["metrics"]["3"]


def _adam_bound(t: int) -> float:
    """U >= |m_hat / (sqrt(v_hat) + eps)| after t AdamW steps, any gradients (Cauchy-Schwarz)."""
    s = sum(((1 - B1) * B1**k) ** 2 / ((1 - B2) * B2**k) for k in range(t))
    return math.sqrt(s) * math.sqrt(1 - B2**t) / (1 - B1**t)


@pytest.mark.parametrize(("ref_tag", "tag", "world"), [("t2", "r21", 1), ("t1", "r12", 2)])
def test_resume_onto_another_number_of_ranks(runs: Path, ref_tag: str, tag: str, world: int) -> None:
    (ref_m, ref), (got_m, got) = _load(runs, ref_tag), _load(runs, tag)
    assert got_m["world_size"] == world
    # the state as loaded (resharded) is the state as saved
    _assert_equal(_part(got, "w2."), _part(ref, "w2."))
    _assert_equal(_part(got, "o2."), _part(ref, "o2."))
    # step 3 on another number of ranks: same weights and batch, another reduction order
    a, b = ref_m["metrics"]["3"], got_m["metrics"]["3"]
    assert set(a) == set(b)
    for k, v in a.items():
        if k in EXACT:
            assert b[k] == v, k
        else:
            assert abs(b[k] - v) <= REL * max(1.0, abs(v)), (k, v, b[k])
    t, lr = 3, ref_m["lr"]
    bc1, bc2 = 1 - B1**t, 1 - B2**t
    c = (1 - B1) / bc1 + _adam_bound(t) * math.sqrt((1 - B2) / bc2)
    w_ref, w_got, o_ref = _part(ref, "w3."), _part(got, "w3."), _part(ref, "o3.")
    assert set(w_ref) == set(w_got)
    for k, w in w_ref.items():
        v_hat = o_ref[f"{k}.exp_avg_sq"] / bc2
        ulp = 2 * torch.finfo(torch.float32).eps * w.abs().clamp_min(torch.finfo(torch.float32).tiny)  # >= 1 ulp
        tol = 2 * lr * c * REL / (v_hat.sqrt() + EPS) + 2 * ulp
        d = (w_got[k] - w).abs()
        assert bool((d <= tol).all()), (k, float(d.max()), float((d / tol).max()))
