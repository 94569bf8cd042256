"""The train step's guards on one rank (forkrl/rl/step.py): a non-finite loss or gradient skips the update (counted,
named, weights and optimizer state unchanged), and a stop takes effect before the next micro-batch (no forward
after it, no optimizer step of a half-accumulated gradient). The same on 2 ranks: tests/dist/."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from forkrl.rl.losses import LossConfig
from forkrl.rl.step import StepStopped, build_batch, train_step
from tests.numerics import FP32_EPS
from tests.unit.test_step import _model, _trajectories

N = 8  # 4 prompts x G = 2
KW = dict(temperature=1.0, micro_batch_size=2, max_grad_norm=1.0)


def _batch():
    prompts, comps, lps = _trajectories(N, seed=7)
    return build_batch(prompts, comps, lps, pad_id=0)


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_an_inf_gradient_skips_the_update_and_names_the_parameter() -> None:
    model = _model()
    before = _weights(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    hook = model.lm_head.weight.register_hook(lambda g: torch.full_like(g, math.inf))
    reasons: list[str] = []
    m = train_step(model, opt, _batch(), torch.linspace(-1, 1, N), LossConfig(name="dapo"), skipped_out=reasons,
                   **KW)
    hook.remove()
    assert (m["n_updates"], m["skipped_updates"]) == (0.0, 1.0)
    assert reasons == ["the gradient of lm_head.weight is non-finite (grad norm inf)"]
    assert _same(model, before) and not opt.state  # no optimizer step: weights and AdamW moments untouched
    assert all(p.grad is None for p in model.parameters())
    assert math.isfinite(m["loss"]) and m["grad_norm"] == math.inf  # the loss was fine, the gradient was not


def test_a_nan_loss_skips_the_update() -> None:
    model = _model()
    before = _weights(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    adv = torch.linspace(-1, 1, N)
    adv[3] = math.nan
    reasons: list[str] = []
    m = train_step(model, opt, _batch(), adv, LossConfig(name="grpo"), skipped_out=reasons,
                   **KW)
    assert (m["n_updates"], m["skipped_updates"]) == (0.0, 1.0)
    assert reasons and reasons[0].startswith("the loss is non-finite")
    assert _same(model, before)


def test_a_skipped_update_leaves_the_next_one_of_the_step_as_it_would_be_alone() -> None:
    """Mini-batch 1's gradient is inf: skipped. Mini-batch 2 then starts from the initial weights with π_old = the
    initial weights: exactly one update on mini-batch 2 alone."""
    batch, adv, cfg = _batch(), torch.linspace(-1, 1, N), LossConfig(name="dapo", entropy_top_frac=0.5)
    base = _model()
    ours, ref = copy.deepcopy(base), copy.deepcopy(base)
    calls = {"n": 0}

    def poison_first_update(g: torch.Tensor) -> torch.Tensor:  # 2 micro-batches per update
        calls["n"] += 1
        return torch.full_like(g, math.nan) if calls["n"] <= 2 else g

    hook = ours.model.embed_tokens.weight.register_hook(poison_first_update)
    reasons: list[str] = []
    m = train_step(ours, torch.optim.AdamW(ours.parameters(), lr=1e-2), batch, adv, cfg, mini_batch_size=4,
                   skipped_out=reasons, **KW)
    hook.remove()
    assert (m["n_updates"], m["skipped_updates"]) == (1.0, 1.0)
    assert reasons == ["the gradient of model.embed_tokens.weight is non-finite (grad norm nan)"]
    train_step(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), batch.slice(4, N), adv[4:], cfg, **KW)
    # π_old of mini-batch 2 comes from the no-grad pass in ours and from the update's own forward in ref: the
    # same float32 operations, equal up to rounding of weights of size <= ~1 (as tests/unit/test_updates.py)
    for (name, a), b in zip(ours.named_parameters(), ref.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=0, atol=8 * FP32_EPS * max(1.0, float(b.detach().abs().max()))), name


class _StopAfter:
    """stop() answers True from its `n`-th call on; counts the model's forwards after the first True."""

    def __init__(self, model: torch.nn.Module, n: int) -> None:
        self.n, self.calls, self.forwards_after = n, 0, 0
        model.register_forward_hook(self._forward)

    def __call__(self) -> bool:
        self.calls += 1
        return self.calls >= self.n

    def _forward(self, *_: object) -> None:
        if self.calls >= self.n:
            self.forwards_after += 1


@pytest.mark.parametrize("n", [1, 2, 3])  # before micro-batch 1, before micro-batch 2, before the optimizer step
def test_a_stop_inside_the_only_update_abandons_it(n: int) -> None:
    model = _model()
    before = _weights(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stop = _StopAfter(model, n)
    batch = _batch()
    with pytest.raises(StepStopped):
        train_step(model, opt, batch.slice(0, 4), torch.linspace(-1, 1, 4), LossConfig(name="dapo"), stop=stop, **KW)
    assert stop.calls == n and stop.forwards_after == 0  # nothing ran after the stop was seen
    assert _same(model, before) and not opt.state
    assert all(p.grad is None for p in model.parameters())  # the half-accumulated gradient is dropped


def test_a_stop_after_the_first_of_several_updates_keeps_it_and_reports_it() -> None:
    batch, adv, cfg = _batch(), torch.linspace(-1, 1, N), LossConfig(name="dapo", entropy_top_frac=0.5)
    base = _model()
    ours, ref = copy.deepcopy(base), copy.deepcopy(base)
    # checks: π_old pass 4 (one per micro-batch), update 1: 2 micro-batches + 1 before its step; stop at the 8th:
    # before the first micro-batch of update 2
    stop = _StopAfter(ours, 8)
    kept: list[torch.Tensor] = []
    m = train_step(ours, torch.optim.AdamW(ours.parameters(), lr=1e-2), batch, adv, cfg, mini_batch_size=4,
                   epochs=3, stop=stop, kept_out=kept, kl_pass=True, **KW)
    assert m["stopped"] == 1.0 and m["n_updates"] == 1.0 and m["skipped_updates"] == 0.0
    assert "approx_kl" not in m and kept == []  # telemetry of a complete step only
    assert stop.forwards_after == 0
    train_step(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), batch.slice(0, 4), adv[:4], cfg, **KW)
    for (name, a), b in zip(ours.named_parameters(), ref.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=0, atol=8 * FP32_EPS * max(1.0, float(b.detach().abs().max()))), name
