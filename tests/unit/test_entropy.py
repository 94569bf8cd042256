"""forkrl.rl.entropy: fp32 logp + entropy in one chunked pass (algorithms.md §1)."""

from __future__ import annotations

import math

import pytest
import torch

from forkrl.rl.entropy import response_logprobs_and_entropy, shift_for_causal_lm, token_logprobs_and_entropy
from tests.numerics import FP32_EPS, fp32_log_softmax_tol


def _naive_f64(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """Obviously-correct reference: float64, one row at a time, textbook softmax."""
    z = logits.double().reshape(-1, logits.shape[-1]) / temperature
    t = targets.reshape(-1)
    logps, ents = [], []
    for row, tok in zip(z, t, strict=True):
        p = torch.exp(row - row.max())
        p = p / p.sum()
        logps.append(math.log(p[tok]))
        ents.append(-sum(float(pv) * math.log(float(pv)) for pv in p if pv > 0))
    shape = targets.shape
    return (torch.tensor(logps, dtype=torch.float64).reshape(shape),
            torch.tensor(ents, dtype=torch.float64).reshape(shape))


def test_hand_computed_uniform_and_two_way():
    # Uniform over 4 tokens: logp = -ln 4 = -1.3862944, H = ln 4. Two equal logits + one -inf: H = ln 2.
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [3.0, 3.0, -math.inf, -math.inf]])
    logp, ent = token_logprobs_and_entropy(logits, torch.tensor([2, 0]))
    torch.testing.assert_close(logp, torch.tensor([-1.3862944, -0.6931472]))
    torch.testing.assert_close(ent, torch.tensor([1.3862944, 0.6931472]))  # -inf logits: no NaN


def test_matches_float64_reference_from_bf16_logits():
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 7, 257, generator=gen) * 4).to(torch.bfloat16)
    targets = torch.randint(0, 257, (6, 7), generator=gen)
    logp, ent = token_logprobs_and_entropy(logits, targets, chunk_size=5)
    ref_logp, ref_ent = _naive_f64(logits, targets)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32
    # float32 rounding of numbers as large as the logits (|logp| reaches ~23 here), not a fixed number
    assert ((logp.double() - ref_logp).abs() <= fp32_log_softmax_tol(logits, ref_logp)).all()
    assert ((ent.double() - ref_ent).abs() <= fp32_log_softmax_tol(logits, ref_ent)).all()
    # ... and far tighter than a bf16 computation, which is what the upcast is for
    lp16 = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0].double()
    assert (lp16 - ref_logp).abs().max() > 100 * fp32_log_softmax_tol(logits, ref_logp).max()


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_temperature_divides_logits(temperature: float):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 33, generator=gen) * 3
    targets = torch.randint(0, 33, (5,), generator=gen)
    logp, ent = token_logprobs_and_entropy(logits, targets, temperature=temperature)
    ref_logp, ref_ent = _naive_f64(logits, targets, temperature)
    scaled = logits / temperature
    assert ((logp.double() - ref_logp).abs() <= fp32_log_softmax_tol(scaled, ref_logp)).all()
    assert ((ent.double() - ref_ent).abs() <= fp32_log_softmax_tol(scaled, ref_ent)).all()
    # Not the same as dividing the log-probs by T (§6 P6).
    wrong = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1) / temperature
    assert (logp - wrong).abs().max() > 1e-2


def test_chunked_equals_unchunked_values_and_grads():
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(3, 11, 50, generator=gen)
    targets = torch.randint(0, 50, (3, 11), generator=gen)
    weights = torch.randn(3, 11, generator=gen)
    grads, outs = [], []
    for chunk in (1, 7, 1024):
        logits = base.clone().requires_grad_(True)
        logp, ent = token_logprobs_and_entropy(logits, targets, temperature=0.9, chunk_size=chunk)
        (logp * weights).sum().backward()
        outs.append((logp.detach(), ent))
        grads.append(logits.grad)
    # Rows are independent, so chunking changes nothing but float32 rounding (none on most CPUs; the bound
    # allows a few ulps where a kernel's vectorization follows the chunk's shape).
    lp_tol = fp32_log_softmax_tol(base / 0.9, outs[0][0]).max().item()
    ent_tol = fp32_log_softmax_tol(base / 0.9, outs[0][1]).max().item()
    # d logp / dz = w (onehot - p) / T: p carries logq's error (relative lp_tol), onehot - p one rounding.
    g_tol = weights.abs().max().item() / 0.9 * (lp_tol + FP32_EPS)
    for (lp, en), g in zip(outs[1:], grads[1:], strict=True):
        torch.testing.assert_close(lp, outs[0][0], rtol=0, atol=lp_tol)
        torch.testing.assert_close(en, outs[0][1], rtol=0, atol=ent_tol)
        torch.testing.assert_close(g, grads[0], rtol=0, atol=g_tol)
    # The analytic gradient of log_softmax(z/T)[o]: (onehot - softmax) / T.
    p = torch.softmax(base / 0.9, -1)
    onehot = torch.nn.functional.one_hot(targets, 50).float()
    torch.testing.assert_close(grads[0], (onehot - p) / 0.9 * weights[..., None], rtol=0, atol=2 * g_tol)


def test_entropy_is_detached_and_nonnegative_near_one_hot():
    logits = torch.zeros(4, 1000)
    logits[:, 3] = torch.tensor([100.0, 60.0, 30.0, 20.0])
    logits.requires_grad_(True)
    logp, ent = token_logprobs_and_entropy(logits, torch.full((4,), 3))
    assert logp.requires_grad and not ent.requires_grad
    assert (ent >= 0).all()
    # H ~ (V-1) e^{-m} (m + 1) for a peak of height m: ~0 for m = 100 and 60, 2.9e-9 for m = 30.
    assert ent[0] < 1e-30 and ent[1] < 1e-20
    assert abs(float(ent[2]) - 999 * math.exp(-30) * 31) < 1e-10
    assert ent[3] > ent[2] > ent[1] >= ent[0]


def test_with_entropy_false_returns_none():
    logp, ent = token_logprobs_and_entropy(torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long),
                                           with_entropy=False)
    assert ent is None and logp.shape == (2, 3)


def test_response_version_matches_full_and_zeros_padding():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 6, 20, generator=gen).requires_grad_(True)
    targets = torch.randint(0, 20, (3, 6), generator=gen)
    mask = torch.rand(3, 6, generator=gen) > 0.4
    logp, ent = response_logprobs_and_entropy(logits, targets, mask, temperature=0.8, chunk_size=4)
    full_lp, full_ent = token_logprobs_and_entropy(logits.detach(), targets, temperature=0.8)
    tol = fp32_log_softmax_tol(logits.detach() / 0.8, full_lp.abs() + full_ent).max().item()  # a few ulps
    torch.testing.assert_close(logp.detach(), torch.where(mask, full_lp, 0.0), rtol=0, atol=tol)
    torch.testing.assert_close(ent, torch.where(mask, full_ent, 0.0), rtol=0, atol=tol)
    assert (logp[~mask] == 0).all() and (ent[~mask] == 0).all()  # padding: exactly zero, not just small
    logp.sum().backward()
    # No gradient reaches rows outside the mask: they never entered the softmax.
    assert (logits.grad[~mask] == 0).all() and (logits.grad[mask].abs().sum(-1) > 0).all()


def test_shift_for_causal_lm():
    logits = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)
    ids = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23]])
    sl, st = shift_for_causal_lm(logits, ids)
    assert sl.shape == (2, 3, 3) and torch.equal(st, ids[:, 1:])
    assert torch.equal(sl[:, 0], logits[:, 0])  # position 0's logits score token 1
    with pytest.raises(ValueError, match=r"got logits \(2, 4, 3\) and input_ids \(2, 3\)"):
        shift_for_causal_lm(logits, ids[:, :3])


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"targets shape \(2, 4\) must equal .* \(2, 3\)"):
        token_logprobs_and_entropy(torch.randn(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature must be > 0, got 0.0"):
        token_logprobs_and_entropy(torch.randn(2, 5), torch.zeros(2, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size must be >= 1, got 0"):
        token_logprobs_and_entropy(torch.randn(2, 5), torch.zeros(2, dtype=torch.long), chunk_size=0)
    with pytest.raises(ValueError, match="targets must be an integer"):
        token_logprobs_and_entropy(torch.randn(2, 5), torch.zeros(2))
    with pytest.raises(ValueError, match="mask must be a bool tensor, got dtype torch.int64"):
        response_logprobs_and_entropy(torch.randn(1, 2, 5), torch.zeros(1, 2, dtype=torch.long),
                                      torch.ones(1, 2, dtype=torch.long))


def test_dtypes_bf16_upcast_fp64_kept():
    logits = torch.randn(2, 3, 9, dtype=torch.float64)
    targets = torch.zeros(2, 3, dtype=torch.long)
    lp64, ent64 = token_logprobs_and_entropy(logits, targets)
    assert lp64.dtype == ent64.dtype == torch.float64  # exact float64 reference models stay exact
    ref_lp, ref_ent = _naive_f64(logits, targets)
    assert (lp64 - ref_lp).abs().max() < 1e-12 and (ent64 - ref_ent).abs().max() < 1e-12
    resp = torch.ones(2, 3, dtype=torch.bool)
    lp16, ent16 = response_logprobs_and_entropy(logits.bfloat16(), targets, resp)
    assert lp16.dtype == ent16.dtype == torch.float32
