"""Several optimizer updates per rollout batch (forkrl/rl/step.py, algorithms.md §3.8): the default is exactly
the single-update arithmetic; with mini-batches π_old is the weights before the first update, so ratios move
away from 1 and the clip acts; gradient accumulation stays exact inside a mini-batch."""

from __future__ import annotations

import copy

import pytest
import torch

from forkrl.rl.losses import LossConfig, policy_loss, step_denominator
from forkrl.rl.mask import forking_token_mask, masks_for_step
from forkrl.rl.step import _forward, build_batch, train_step
from tests.numerics import FP32_EPS
from tests.unit.test_step import _model, _trajectories

N = 12  # 6 prompts x G = 2


def _batch(seed: int = 1):
    prompts, comps, lps = _trajectories(N, seed=seed)
    return build_batch(prompts, comps, lps, pad_id=0)


def _reference_single_update(model, opt, batch, adv, cfg, micro, max_grad_norm, temperature):
    """One update as the trainer made it before mini-batches existed: π_old = the update's own detached logp."""
    bounds = [(s, min(s + micro, len(batch))) for s in range(0, len(batch), micro)]
    mbs = [batch.slice(s, e) for s, e in bounds]
    denom = step_denominator(cfg, [mb.response_mask for mb in mbs])
    masks = None
    if cfg.mask_on and cfg.mask_scope == "step":
        with torch.no_grad():
            ents = [_forward(model, mb, temperature, True)[1] for mb in mbs]
        masks = masks_for_step(ents, [mb.response_mask for mb in mbs], cfg.entropy_top_frac, "step")
    model.train()
    opt.zero_grad(set_to_none=True)
    losses, clipped = [], 0.0
    for j, ((s, e), mb) in enumerate(zip(bounds, mbs, strict=True)):
        logp, ent = _forward(model, mb, temperature, True)
        tm = masks[j].mask if masks else forking_token_mask(ent, mb.response_mask, cfg.entropy_top_frac).mask
        loss, m = policy_loss(cfg, logp, logp.detach(), adv[s:e], mb.response_mask, tm, denom)
        loss.backward()
        losses.append(m["loss"])
        clipped += m.get("clip_frac_high", 0.0) * m["kept_tokens"]
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return sum(losses), float(norm), clipped


@pytest.mark.parametrize(("loss", "rho", "scope"), [("dapo", 0.3, "microbatch"), ("grpo", None, "microbatch"),
                                                     ("gspo", 0.5, "step"), ("rloo", 0.2, "microbatch")])
def test_default_settings_are_the_single_update_arithmetic_bit_for_bit(loss: str, rho, scope: str) -> None:
    batch, adv = _batch(), torch.linspace(-1, 1, N)
    cfg = LossConfig(name=loss, max_len=8, entropy_top_frac=rho, mask_scope=scope)
    base = _model()
    models = [copy.deepcopy(base) for _ in range(3)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in models]
    kw = dict(temperature=0.9, micro_batch_size=5, max_grad_norm=0.5)
    for _ in range(3):  # three steps: AdamW state carries over as in a run
        ref_loss, ref_norm, ref_clipped = _reference_single_update(models[0], opts[0], batch, adv, cfg, 5, 0.5, 0.9)
        default = train_step(models[1], opts[1], batch, adv, cfg, **kw)
        explicit = train_step(models[2], opts[2], batch, adv, cfg, mini_batch_size=N, epochs=1, **kw)
        assert default == explicit
        assert default["n_updates"] == 1.0 and default["micro_batches"] == 3.0
        assert default["loss"] == ref_loss and default["grad_norm"] == ref_norm == default["grad_norm_max"]
        if "clip_frac_high" in default:
            assert default["clip_frac_high"] * default["kept_tokens"] == pytest.approx(ref_clipped, abs=1e-9)
            assert default["ratio_min"] == default["ratio_max"] == 1.0  # π_old = the update's own logp
    for a, b, c in zip(*(m.parameters() for m in models), strict=True):
        assert torch.equal(a, b) and torch.equal(b, c)


def _manual_update(model, opt, mb, adv, cfg, old_logp, temperature=1.0):
    """One update on one micro-batch = mini-batch, with the given π_old (None: its own detached logp)."""
    model.train()
    opt.zero_grad(set_to_none=True)
    logp, ent = _forward(model, mb, temperature, True)
    tm = forking_token_mask(ent, mb.response_mask, cfg.entropy_top_frac).mask
    denom = step_denominator(cfg, [mb.response_mask])
    loss, m = policy_loss(cfg, logp, logp.detach() if old_logp is None else old_logp, adv, mb.response_mask, tm,
                          denom)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    opt.step()
    return m


def test_two_mini_batches_use_the_weights_before_the_first_update_as_pi_old() -> None:
    batch, adv = _batch(), torch.linspace(-1, 1, N)
    cfg = LossConfig(name="dapo", entropy_top_frac=0.5)
    base = _model()
    ours, ref = copy.deepcopy(base), copy.deepcopy(base)
    m = train_step(ours, torch.optim.SGD(ours.parameters(), lr=1.0), batch, adv, cfg, temperature=1.0,
                   micro_batch_size=6, max_grad_norm=1e9, mini_batch_size=6)
    assert m["n_updates"] == 2.0 and m["micro_batches"] == 2.0

    opt = torch.optim.SGD(ref.parameters(), lr=1.0)
    second = batch.slice(6, N)
    with torch.no_grad():
        ref.train()
        old_second = _forward(ref, second, 1.0, False)[0]  # π_old of mini-batch 2: the weights before update 1
    _manual_update(ref, opt, batch.slice(0, 6), adv[:6], cfg, None)
    m2 = _manual_update(ref, opt, second, adv[6:], cfg, old_second)
    # The same operations on the same numbers, except that π_old of mini-batch 1 comes from a no-grad pass in
    # ours and from the update's own forward here: equal up to float32 rounding of weights of size <= ~1.
    for (name, a), b in zip(ours.named_parameters(), ref.parameters(), strict=True):
        tol = 8 * FP32_EPS * max(1.0, float(a.detach().abs().max()))
        assert torch.allclose(a, b, rtol=0, atol=tol), name
    assert m2["ratio_max"] > 1.0 or m2["ratio_min"] < 1.0  # the second update sees the first one's change
    assert m["ratio_max"] == pytest.approx(max(1.0, m2["ratio_max"]), rel=1e-5)
    assert m["ratio_min"] == pytest.approx(min(1.0, m2["ratio_min"]), rel=1e-5)


def test_later_mini_batches_clip_on_a_step_built_to_clip() -> None:
    batch, adv = _batch(), torch.tensor([1.0, -1.0] * (N // 2))  # 6 groups of 2: every group has +1 and -1
    cfg = LossConfig(name="dapo")  # clip 0.2 / 0.28
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)  # large steps: the ratio leaves [0.8, 1.28]
    m = train_step(model, opt, batch, adv, cfg, temperature=1.0, micro_batch_size=2, max_grad_norm=1e9,
                   mini_batch_size=4, epochs=2)
    assert m["n_updates"] == 6.0 and m["micro_batches"] == 6.0
    assert m["clip_frac_low"] > 0 and m["clip_frac_high"] > 0
    assert m["ratio_max"] > 1.28 and m["ratio_min"] < 0.8
    assert m["approx_kl_start"] > 0 and "approx_kl" not in m  # the extra pass only when asked for
    assert m["kept_tokens"] == m["response_tokens"] == 2 * int(batch.response_mask.sum())  # 2 epochs
    # one update (the default) never clips: its ratios are exactly 1
    one = train_step(_model(), torch.optim.AdamW(_model().parameters(), lr=0.05), batch, adv, cfg, temperature=1.0,
                     micro_batch_size=2, max_grad_norm=1e9)
    assert one["clip_frac_low"] == one["clip_frac_high"] == 0.0 and one["ratio_max"] == 1.0


@pytest.mark.parametrize(("loss", "rho"), [("dapo", 0.4), ("grpo", None), ("gspo", 0.4), ("rloo", None)])
def test_micro_batches_inside_a_mini_batch_equal_the_whole_mini_batch(loss: str, rho: float | None) -> None:
    batch, adv = _batch(seed=4), torch.linspace(-1, 1, N)
    # step scope: one top-k over the update's mini-batch, whatever its micro-batches (microbatch scope keeps
    # the top-k of each micro-batch, a different token set by design)
    cfg = LossConfig(name=loss, entropy_top_frac=rho, mask_scope="step", max_len=8)
    base = _model()
    runs = []
    for micro in (6, 2):  # 2 mini-batches of 6 sequences, as 1 or 3 micro-batches each
        model = copy.deepcopy(base)
        m = train_step(model, torch.optim.SGD(model.parameters(), lr=0.5), batch, adv, cfg, temperature=1.0,
                       micro_batch_size=micro, max_grad_norm=1e9, mini_batch_size=6)
        runs.append((model, m))
    (full, m_full), (accum, m_acc) = runs
    assert (m_full["micro_batches"], m_acc["micro_batches"]) == (2.0, 6.0)
    assert m_full["n_updates"] == m_acc["n_updates"] == 2.0
    assert m_acc["response_tokens"] == m_full["response_tokens"]
    # Same denominators per mini-batch: only the float32 order of summing micro-batch gradients differs, a few
    # ulps per update; the second update starts from weights that differ by that much, and its gradient at
    # them differs by as little again (SGD lr 0.5 on weights and gradients of size <= ~1). 16 ulps of
    # max(1, |w|) covers two updates; a denominator per micro-batch instead of per mini-batch is off by x3.
    assert m_acc["loss"] == pytest.approx(m_full["loss"], abs=16 * FP32_EPS * max(1.0, abs(m_full["loss"])))
    for (name, a), b in zip(full.named_parameters(), accum.parameters(), strict=True):
        tol = 16 * FP32_EPS * max(1.0, float(a.detach().abs().max()))
        assert torch.allclose(a, b, rtol=0, atol=tol), name


def test_approx_kl_start_is_the_k3_of_each_update_s_loss_pass_on_its_kept_tokens() -> None:
    batch, adv = _batch(), torch.linspace(-1, 1, N)
    cfg = LossConfig(name="dapo", entropy_top_frac=0.5)
    base = _model()
    ours, ref = copy.deepcopy(base), copy.deepcopy(base)
    m = train_step(ours, torch.optim.SGD(ours.parameters(), lr=1.0), batch, adv, cfg, temperature=1.0,
                   micro_batch_size=6, max_grad_norm=1e9, mini_batch_size=6)
    opt = torch.optim.SGD(ref.parameters(), lr=1.0)
    second = batch.slice(6, N)
    with torch.no_grad():
        ref.train()
        old_second = _forward(ref, second, 1.0, False)[0]  # π_old: the weights before update 1
    m1 = _manual_update(ref, opt, batch.slice(0, 6), adv[:6], cfg, None)  # its loss pass: π_θ = π_old, k3 = 0
    with torch.no_grad():
        logp, ent = _forward(ref, second, 1.0, True)  # update 2 starts from the weights after update 1
    kept = forking_token_mask(ent, second.response_mask, 0.5).mask
    d = (logp - old_second).double()[kept]
    expected = float((d.exp() - d - 1.0).sum()) / (m1["kept_tokens"] + int(kept.sum()))
    assert expected > 0
    # float64 sums of the same float32 log-ratios, which differ by float32 rounding of the weights (SGD lr 1 on
    # weights and gradients of size <= ~1): k3 ~ d^2/2, so a relative 1e-3 covers a few ulps of d
    assert m["approx_kl_start"] == pytest.approx(expected, rel=1e-3)


def test_approx_kl_after_the_update_only_with_kl_pass() -> None:
    batch, adv = _batch(), torch.linspace(-1, 1, N)
    cfg = LossConfig(name="grpo", entropy_top_frac=None)  # every response token kept
    base = _model()
    kw = dict(temperature=1.0, micro_batch_size=N, max_grad_norm=1e9)
    plain, with_pass = copy.deepcopy(base), copy.deepcopy(base)
    m = train_step(plain, torch.optim.SGD(plain.parameters(), lr=1.0), batch, adv, cfg, **kw)
    assert "approx_kl" not in m and "approx_kl_all" not in m
    assert m["approx_kl_start"] == 0.0  # one update: its loss pass is π_old itself, log-ratio exactly 0
    with torch.no_grad():
        base.train()
        before = _forward(base, batch, 1.0, False)[0]
    mk = train_step(with_pass, torch.optim.SGD(with_pass.parameters(), lr=1.0), batch, adv, cfg, kl_pass=True, **kw)
    with torch.no_grad():
        after = _forward(with_pass, batch, 1.0, False)[0]
    d = (after - before).double()[batch.response_mask]
    expected = float((d.exp() - d - 1.0).mean())
    assert expected > 0
    assert mk["approx_kl"] == pytest.approx(expected, rel=1e-3) and mk["approx_kl_all"] == mk["approx_kl"]
    assert {k: v for k, v in mk.items() if not k.startswith("approx_kl")} == \
        {k: v for k, v in m.items() if not k.startswith("approx_kl")}  # the pass changes no other number
    for a, b in zip(plain.parameters(), with_pass.parameters(), strict=True):
        assert torch.equal(a, b)


def test_bad_update_settings_are_refused() -> None:
    batch, adv, cfg = _batch(), torch.zeros(N), LossConfig(name="grpo")
    kw = dict(temperature=1.0, micro_batch_size=4, max_grad_norm=1.0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="mini_batch_size must be >= 1 or None, got 0"):
        train_step(model, opt, batch, adv, cfg, mini_batch_size=0, **kw)
    with pytest.raises(ValueError, match="epochs must be >= 1, got 0"):
        train_step(model, opt, batch, adv, cfg, epochs=0, **kw)
