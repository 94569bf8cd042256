"""Truncated importance sampling on the behaviour policy (forkrl/rl/tis.py, algorithms.md §3.8): the weights are
min(π_old / π_behav, C) by hand, they multiply the per-token loss without carrying a gradient, and off is the
loss without them."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from forkrl.rl.losses import LossConfig, policy_loss, step_denominator
from forkrl.rl.mask import forking_token_mask
from forkrl.rl.step import _forward, build_batch, train_step
from forkrl.rl.tis import tis_metrics, tis_weights
from tests.numerics import FP32_EPS
from tests.unit.test_step import _model, _trajectories


def test_weights_are_the_truncated_ratio_by_hand() -> None:
    old = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-0.1, -0.2, 0.0, 0.0]])
    behav = torch.tensor([[-1.5, -1.0, -3.0, 0.0], [-0.4, -0.2, 0.0, 0.0]])
    resp = torch.tensor([[True, True, True, False], [True, True, False, False]])
    w, raw = tis_weights(old, behav, resp, 2.0)
    want_raw = [[math.exp(0.5), math.exp(-1.0), math.exp(2.5), 1.0], [math.exp(0.3), 1.0, 1.0, 1.0]]
    assert torch.allclose(raw.double(), torch.tensor(want_raw, dtype=torch.float64), rtol=4 * FP32_EPS, atol=0)
    want_w = [[math.exp(0.5), math.exp(-1.0), 2.0, 1.0], [math.exp(0.3), 1.0, 1.0, 1.0]]
    assert torch.allclose(w.double(), torch.tensor(want_w, dtype=torch.float64), rtol=4 * FP32_EPS, atol=0)
    # GSPO: one weight per sequence, exp(mean log-ratio over its response tokens), then truncated
    ws, raws = tis_weights(old, behav, resp, 2.0, per_sequence=True)
    row0, row1 = math.exp((0.5 - 1.0 + 2.5) / 3), math.exp(0.3 / 2)
    assert torch.allclose(raws.double(), torch.tensor([[row0] * 3 + [1.0], [row1] * 2 + [1.0] * 2],
                                                      dtype=torch.float64), rtol=4 * FP32_EPS, atol=0)
    assert torch.allclose(ws[0, :3].double(), torch.full((3,), min(row0, 2.0), dtype=torch.float64),
                          rtol=4 * FP32_EPS, atol=0)

    kept = torch.tensor([[False, True, True, False], [True, False, False, False]])
    m = tis_metrics([(raw, resp, kept)], 2.0)
    assert m["tis_ratio_max"] == pytest.approx(math.exp(2.5), rel=1e-6)
    assert m["tis_capped_frac"] == pytest.approx(1 / 5)  # one of five response tokens above C
    assert m["tis_ratio_kept_max"] == pytest.approx(math.exp(2.5), rel=1e-6)
    assert m["tis_capped_kept_frac"] == pytest.approx(1 / 3)
    assert m["tis_weight_mean"] == pytest.approx((math.exp(-1.0) + 2.0 + math.exp(0.3)) / 3, rel=1e-6)
    with pytest.raises(ValueError, match="cap must be > 0"):
        tis_weights(old, behav, resp, 0.0)


@pytest.mark.parametrize("loss", ["dapo", "reinforce"])
def test_the_weight_multiplies_each_token_term_and_carries_no_gradient(loss: str) -> None:
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, 0.0]], requires_grad=True)
    resp = torch.tensor([[True, True, True], [True, True, False]])
    adv = torch.tensor([1.0, -0.5])
    w = torch.tensor([[0.5, 2.0, 1.5], [1.0, 0.25, 9.0]], requires_grad=True)  # 9.0 sits on padding
    cfg = LossConfig(name=loss, agg="token_mean")
    denom = step_denominator(cfg, [resp])
    loss_w, _ = policy_loss(cfg, logp, logp.detach(), adv, resp, None, denom, is_weight=w)
    loss_w.backward()
    # ratio 1 (π_old = the current logp): the PPO term is -A; reinforce's is -A logp. Token mean over 5 tokens.
    a = adv[:, None].expand(2, 3)
    term = -a if loss == "dapo" else -a * logp.detach()
    want = float((torch.where(resp, w.detach() * term, 0.0)).sum() / 5)
    assert float(loss_w.detach()) == pytest.approx(want, rel=1e-6)
    # d loss / d logp = w * (-A) / 5 for both (the ratio's derivative at r = 1 is 1), and none into w
    assert torch.allclose(logp.grad, torch.where(resp, -w.detach() * a / 5, 0.0), rtol=1e-6, atol=0)
    assert w.grad is None


def test_train_step_uses_pi_old_over_the_rollout_logprobs_and_off_is_the_plain_loss() -> None:
    prompts, comps, _ = _trajectories(8, seed=2)
    g = torch.Generator().manual_seed(0)
    lps = [(-1.0 - torch.rand(len(c), generator=g) * 5).tolist() for c in comps]  # far from ours (~ -ln 23)
    batch = build_batch(prompts, comps, lps, pad_id=0)
    adv = torch.linspace(-1, 1, 8)
    base = _model()
    cfg = LossConfig(name="dapo", entropy_top_frac=0.5, tis_cap=2.0)

    ours = copy.deepcopy(base)
    m = train_step(ours, torch.optim.SGD(ours.parameters(), lr=0.5), batch, adv, cfg, temperature=1.0,
                   micro_batch_size=8, max_grad_norm=1e9)

    # by hand: one micro-batch, π_old = the model's logp before the update, w = min(exp(old - behav), 2)
    ref = copy.deepcopy(base)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref.train()
    logp, ent = _forward(ref, batch, 1.0, True)
    resp = batch.response_mask
    tm = forking_token_mask(ent, resp, 0.5).mask
    raw = torch.where(resp, (logp.detach() - batch.rollout_logp).exp(), 1.0)
    w = raw.clamp(max=2.0)
    loss, _ = policy_loss(cfg, logp, logp.detach(), adv, resp, tm, step_denominator(cfg, [resp]), is_weight=w)
    loss.backward()
    opt.step()
    assert m["loss"] == pytest.approx(float(loss.detach()), rel=8 * FP32_EPS)
    for (name, a), b in zip(ours.named_parameters(), ref.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=0, atol=8 * FP32_EPS * max(1.0, float(b.detach().abs().max()))), name
    assert m["tis_ratio_max"] == pytest.approx(float(raw[resp].max()), rel=1e-6)
    assert m["tis_capped_frac"] == pytest.approx(float((raw[resp] > 2.0).double().mean()))
    assert m["tis_capped_kept_frac"] == pytest.approx(float((raw[tm] > 2.0).double().mean()))
    assert m["tis_weight_mean"] == pytest.approx(float(w[tm].double().mean()), rel=1e-6)
    assert 0 < m["tis_capped_frac"] < 1  # the case exercises the truncation

    # off (the default) is the loss without any weight: no tis_ metrics, a different update
    off = copy.deepcopy(base)
    m_off = train_step(off, torch.optim.SGD(off.parameters(), lr=0.5), batch, adv,
                       LossConfig(name="dapo", entropy_top_frac=0.5), temperature=1.0, micro_batch_size=8,
                       max_grad_norm=1e9)
    assert not any(k.startswith("tis_") for k in m_off) and m_off["loss"] != m["loss"]


def test_tis_cap_is_validated_by_the_loss_config() -> None:
    with pytest.raises(ValueError, match="tis_cap must be a finite number >= 1, got 0.5"):
        LossConfig(name="grpo", tis_cap=0.5)
    assert LossConfig(name="cispo", tis_cap=2.0).tis_cap == 2.0  # its behaviour correction (§3.8)
    assert LossConfig(name="gspo", tis_cap=2.0).tis_cap == 2.0


def test_cispo_behaviour_correction_by_hand() -> None:
    """§3.8: CISPO's IS weight takes π_behav as its denominator, truncated at its own cap, no extra w_t:
    ℓ_t = −sg(min(π_θ/π_behav, cap)) · A · logπ_θ, token mean. float64, numbers written out."""
    f64 = torch.float64
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, 0.0]], dtype=f64, requires_grad=True)
    old = torch.tensor([[-1.2, -2.0, -0.4], [-0.3, -0.9, 0.0]], dtype=f64)  # π_old: only the ratio metrics
    behav = torch.tensor([[-1.5, -1.0, -3.0], [-0.4, -0.2, 9.0]], dtype=f64)  # 9.0 sits on padding
    resp = torch.tensor([[True, True, True], [True, True, False]])
    adv = torch.tensor([1.0, -0.5], dtype=f64)
    cfg = LossConfig(name="cispo", cispo_max_weight=2.0, tis_cap=2.0)
    denom = step_denominator(cfg, [resp])
    loss, m = policy_loss(cfg, logp, old, adv, resp, None, denom, behav_logp=behav)
    loss.backward()
    # π_θ/π_behav = e^0.5, e^-1, e^2.5 -> 2 (capped) | e^0.1, e^-0.5
    w = [math.exp(0.5), math.exp(-1.0), 2.0, math.exp(0.1), math.exp(-0.5)]
    a = [1.0, 1.0, 1.0, -0.5, -0.5]
    lp = [-1.0, -2.0, -0.5, -0.3, -0.7]
    want = -sum(wi * ai * li for wi, ai, li in zip(w, a, lp, strict=True)) / 5
    assert float(loss.detach()) == pytest.approx(want, rel=1e-12)
    grad = logp.grad[resp].tolist()  # d/dlogp = −w·A/5: the weight carries no gradient
    assert grad == pytest.approx([-wi * ai / 5 for wi, ai in zip(w, a, strict=True)], rel=1e-12)
    assert m["clip_frac_high"] == pytest.approx(1 / 5)  # the one token whose weight was truncated
    # the ratio metrics stay π_θ / π_old
    assert m["ratio_max"] == pytest.approx(math.exp(0.2), rel=1e-12)
    assert m["ratio_min"] == pytest.approx(math.exp(-0.1), rel=1e-12)
    # without the correction the weight is π_θ/π_old: a different loss
    plain, _ = policy_loss(LossConfig(name="cispo", cispo_max_weight=2.0), logp, old, adv, resp, None, denom)
    assert float(plain.detach()) != pytest.approx(want, rel=1e-3)
    with pytest.raises(ValueError, match="loss 'cispo' with tis_cap needs behav_logp"):
        policy_loss(cfg, logp, old, adv, resp, None, denom)
    with pytest.raises(ValueError, match="behav_logp is only used by loss 'cispo' with tis_cap set"):
        policy_loss(LossConfig(name="dapo"), logp, old, adv, resp, None, denom, behav_logp=behav)


def test_train_step_cispo_uses_the_rollout_logprobs_as_its_denominator() -> None:
    """Through train_step: one update, π_θ = π_old at the forward, weight min(exp(logp − behav), cap), no w_t."""
    prompts, comps, _ = _trajectories(8, seed=2)
    g = torch.Generator().manual_seed(0)
    lps = [(-1.0 - torch.rand(len(c), generator=g) * 5).tolist() for c in comps]
    batch = build_batch(prompts, comps, lps, pad_id=0)
    adv = torch.linspace(-1, 1, 8)
    base = _model()
    cfg = LossConfig(name="cispo", cispo_max_weight=3.0, tis_cap=2.0)
    ours = copy.deepcopy(base)
    m = train_step(ours, torch.optim.SGD(ours.parameters(), lr=0.5), batch, adv, cfg, temperature=1.0,
                   micro_batch_size=8, max_grad_norm=1e9)

    ref = copy.deepcopy(base)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref.train()
    logp, _ = _forward(ref, batch, 1.0, False)
    resp = batch.response_mask
    w = torch.where(resp, (logp.detach() - batch.rollout_logp).exp(), 0.0).clamp(max=3.0)
    n = int(resp.sum())
    loss = -(w * adv[:, None] * torch.where(resp, logp, 0.0)).sum() / n  # token mean, mask off
    loss.backward()
    opt.step()
    assert m["loss"] == pytest.approx(float(loss.detach()), rel=8 * FP32_EPS)
    for (name, a), b in zip(ours.named_parameters(), ref.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=0, atol=8 * FP32_EPS * max(1.0, float(b.detach().abs().max()))), name
    raw = (logp.detach() - batch.rollout_logp).exp()[resp]
    assert m["clip_frac_high"] == pytest.approx(float((raw > 3.0).double().mean()))
    assert 0 < m["clip_frac_high"] < 1  # the case exercises the truncation
    assert m["tis_capped_frac"] == pytest.approx(float((raw > 2.0).double().mean()))  # stats at C = tis_cap
