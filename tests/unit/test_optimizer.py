"""The trainer's optimizer (forkrl/training/policy.py `load_policy`): torch's fused AdamW on CPU and CUDA, with the
run's hyper-parameters, and the same update as torch's per-tensor AdamW (its CPU default) up to fp32 rounding."""

from __future__ import annotations

import pytest
import torch

FP32_EPS = torch.finfo(torch.float32).eps


def test_fused_adamw_makes_the_per_tensor_update() -> None:
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (5,), (3, 4, 2), (1,)]
    start = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) * 10 ** k for s in shapes] for k in (-3, 0, 2)]  # three steps, scales apart
    lr = 1e-2
    out = {}
    for mode, kw in (("per_tensor", {"foreach": False}), ("fused", {"fused": True})):
        params = [torch.nn.Parameter(w.clone()) for w in start]
        opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), weight_decay=0.1, eps=1e-8, **kw)
        for step_grads in grads:
            for p, gr in zip(params, step_grads, strict=True):
                p.grad = gr.clone()
            opt.step()
        out[mode] = [p.detach() for p in params]
    for a, b, w0 in zip(out["per_tensor"], out["fused"], start, strict=True):
        moved = (a - w0).abs().max()
        assert moved > lr / 10  # the update happened (the first step alone moves each weight by ~lr)
        # Each step moves a weight by at most lr * (1 + |m/(sqrt(v)+eps)| <= ~1) plus decay; the two kernels round
        # the same fp32 expressions in a different order: a few ulps of |w| and of the step's size, per step.
        tol = 3 * 8 * FP32_EPS * (float(w0.abs().max()) + 4 * lr)
        assert float((a - b).abs().max()) <= tol


@pytest.mark.slow
def test_load_policy_builds_a_fused_adamw_with_the_run_s_settings(tiny_model_dir, tmp_path) -> None:
    from forkrl.training.config import RunConfig
    from forkrl.training.policy import load_policy

    cfg = RunConfig(model=str(tiny_model_dir), run_dir=str(tmp_path), lr=2e-4, weight_decay=0.05, adam_beta1=0.8,
                    adam_beta2=0.99)
    before = torch.get_num_threads()
    try:
        policy = load_policy(cfg, tmp_path, "cpu", 1)
    finally:
        torch._C.set_num_threads(before)
    d = policy.optimizer.defaults
    assert isinstance(policy.optimizer, torch.optim.AdamW)
    assert d["fused"] is True
    assert (d["lr"], d["betas"], d["weight_decay"], d["eps"]) == (2e-4, (0.8, 0.99), 0.05, 1e-8)
