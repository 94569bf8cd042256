"""forkrl.rl.entropy: fp32 logp + entropy in one chunked pass (algorithms.md §1), from logits and from the final hidden
states (the lm_head computed per chunk inside a custom autograd function, recomputed in the backward)."""

from __future__ import annotations

import math

import pytest
import torch

from forkrl.rl.entropy import hidden_logprobs_and_entropy, shift_for_causal_lm, token_logprobs_and_entropy
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
    with pytest.raises(ValueError, match=r"hidden must be \[n, h\] and weight \[V, h\]; got hidden \(2, 3\) and "
                                         r"weight \(5, 4\)"):
        hidden_logprobs_and_entropy(torch.randn(2, 3), torch.randn(5, 4), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"targets must be an integer tensor of shape \(2,\)"):
        hidden_logprobs_and_entropy(torch.randn(2, 3), torch.randn(5, 3), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature must be > 0, got -1.0"):
        hidden_logprobs_and_entropy(torch.randn(2, 3), torch.randn(5, 3), torch.zeros(2, dtype=torch.long), -1.0)


def test_dtypes_bf16_upcast_fp64_kept():
    logits = torch.randn(2, 3, 9, dtype=torch.float64)
    targets = torch.zeros(2, 3, dtype=torch.long)
    lp64, ent64 = token_logprobs_and_entropy(logits, targets)
    assert lp64.dtype == ent64.dtype == torch.float64  # exact float64 reference models stay exact
    ref_lp, ref_ent = _naive_f64(logits, targets)
    assert (lp64 - ref_lp).abs().max() < 1e-12 and (ent64 - ref_ent).abs().max() < 1e-12
    lp16, ent16 = token_logprobs_and_entropy(logits.bfloat16(), targets)
    assert lp16.dtype == ent16.dtype == torch.float32


# ---- the hidden-state path: logits h @ Wᵀ computed per chunk inside a custom autograd function ----


def _logits_path(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, temperature: float, g: torch.Tensor):
    """The logits path the trainer used before: the whole [n, V] logits, then `token_logprobs_and_entropy`."""
    h, w = h.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    logp, ent = token_logprobs_and_entropy(torch.nn.functional.linear(h, w), targets, temperature=temperature)
    (logp * g).sum().backward()
    return logp.detach(), ent, h.grad, w.grad


def _hidden_path(h, w, targets, temperature, g, chunk):
    h, w = h.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    logp, ent = hidden_logprobs_and_entropy(h, w, targets, temperature=temperature, chunk_size=chunk)
    assert logp.requires_grad and not ent.requires_grad
    (logp * g).sum().backward()
    return logp.detach(), ent, h.grad, w.grad


def _fp32_bounds(h, w, targets, temperature, g):
    """How far any float32 implementation of logp, H, d/dh and d/dW of sum(g logp) may be from the exact values,
    to first order, from the float32 rounding of each operation (eps = 2**-23), evaluated in float64:
    - z = h Wᵀ: a k-term dot product errs by at most (k + 1) eps (|h| |W|ᵀ) (gamma_k and the rounded result);
      s = z / T one rounding more; e_s = max over the row;
    - logp = s_o - lse(s) moves by at most 2 e_s, H = -sum p logq by sum_v p_v |logq_v + H| e_s; each then carries
      the log-softmax's own rounding (`fp32_log_softmax_tol`);
    - dz = g (onehot - p) / T: p = exp(logq) has the relative error of logq (2 e_s + its rounding), and two
      roundings more;
    - d/dh = dz W and d/dW = dzᵀ h: the error of dz carried through |W| or |h|, plus (terms + 1) eps of the
      products of magnitudes (V terms for d/dh, n for d/dW).
    Two implementations differ by at most twice these. A wrong row, a wrong temperature or a lost gradient term
    is off by O(0.1)."""
    h64, w64 = h.double(), w.double()
    k, n, v = h.shape[1], h.shape[0], w.shape[0]
    s = h64 @ w64.T / temperature
    e_s = ((k + 1) * FP32_EPS * (h64.abs() @ w64.abs().T) / temperature + FP32_EPS * s.abs()).amax(-1)
    logq = torch.log_softmax(s, -1)
    p = logq.exp()
    ent = -(p * logq).sum(-1)
    logp = logq.gather(-1, targets[:, None])[:, 0]
    lq_tol = fp32_log_softmax_tol(s, logq.abs().amax(-1))
    b_logp = 2 * e_s + fp32_log_softmax_tol(s, logp)
    b_ent = (p * (logq + ent[:, None]).abs()).sum(-1) * e_s + fp32_log_softmax_tol(s, ent)
    onehot = torch.nn.functional.one_hot(targets, v).double()
    g64 = g.double()[:, None].abs() / temperature
    dz = g64 * (onehot - p).abs()
    e_dz = g64 * (p * (2 * e_s + lq_tol)[:, None] + 2 * FP32_EPS * (onehot - p).abs())
    b_h = e_dz @ w64.abs() + (v + 1) * FP32_EPS * (dz @ w64.abs())
    b_w = e_dz.T @ h64.abs() + (n + 1) * FP32_EPS * (dz.T @ h64.abs())
    return 2 * b_logp, 2 * b_ent, 2 * b_h, 2 * b_w


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_hidden_path_equals_the_logits_path_values_and_gradients(temperature: float):
    gen = torch.Generator().manual_seed(4)
    n, k, v = 29, 24, 97
    h = torch.randn(n, k, generator=gen)
    w = torch.randn(v, k, generator=gen) * 0.5  # logits of a few units: H from ~0 to ~3
    targets = torch.randint(0, v, (n,), generator=gen)
    g = torch.randn(n, generator=gen)  # the loss's per-token weights (advantages x mask / denominator)
    ref_lp, ref_ent, ref_gh, ref_gw = _logits_path(h, w, targets, temperature, g)
    b_lp, b_ent, b_h, b_w = _fp32_bounds(h, w, targets, temperature, g)
    for chunk in (1, 7, 1024):  # one row per chunk, a partial last chunk, everything in one chunk
        lp, ent, gh, gw = _hidden_path(h, w, targets, temperature, g, chunk)
        assert lp.dtype == ent.dtype == gh.dtype == gw.dtype == torch.float32
        assert ((lp.double() - ref_lp.double()).abs() <= b_lp).all()
        assert ((ent.double() - ref_ent.double()).abs() <= b_ent).all()
        assert ((gh.double() - ref_gh.double()).abs() <= b_h).all()
        assert ((gw.double() - ref_gw.double()).abs() <= b_w).all()
    # the bounds are tight enough to mean something: a gradient with the temperature left out is far outside them
    lp_t1, _, gh_t1, _ = _hidden_path(h, w, targets, 1.0 if temperature != 1.0 else 0.7, g, 7)
    assert ((gh_t1.double() - ref_gh.double()).abs() > b_h).any()
    assert ((lp_t1.double() - ref_lp.double()).abs() > b_lp).any()


def test_hidden_path_in_float64_is_exact_and_passes_gradcheck():
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(11, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(13, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 13, (11,), generator=gen)
    lp, ent = hidden_logprobs_and_entropy(h, w, targets, temperature=0.8, chunk_size=4)
    ref_lp, ref_ent = _naive_f64((h @ w.T).detach(), targets, 0.8)
    assert lp.dtype == torch.float64 and (lp.detach() - ref_lp).abs().max() < 1e-12
    assert (ent - ref_ent).abs().max() < 1e-12
    assert torch.autograd.gradcheck(lambda a, b: hidden_logprobs_and_entropy(a, b, targets, 0.8, 4)[0], (h, w))


def test_hidden_path_in_bf16_rounds_the_logits_as_the_lm_head_does():
    # Under FSDP2's bf16 mixed precision the hidden states and W are bf16: z = h Wᵀ is computed in bf16, as the
    # model's lm_head (and the engine) compute it, and only then upcast: the same numbers as the logits path.
    gen = torch.Generator().manual_seed(6)
    h = torch.randn(9, 16, generator=gen).bfloat16()
    w = (torch.randn(40, 16, generator=gen) * 0.5).bfloat16()
    targets = torch.randint(0, 40, (9,), generator=gen)
    g = torch.randn(9, generator=gen)
    ref_lp, ref_ent, ref_gh, ref_gw = _logits_path(h, w, targets, 1.0, g)
    lp, ent, gh, gw = _hidden_path(h, w, targets, 1.0, g, 4)
    assert lp.dtype == ent.dtype == torch.float32 and gh.dtype == gw.dtype == torch.bfloat16
    z = torch.nn.functional.linear(h, w).float()
    # a bf16 matmul of a subset of rows may round an element of z one bf16 ulp (2**-8 relative) the other way
    e_z = 2.0**-8 * float(z.abs().max())
    assert (lp - ref_lp).abs().max() <= 2 * e_z + float(fp32_log_softmax_tol(z, ref_lp).max())
    assert (ent - ref_ent).abs().max() <= math.log(40) * 2 * e_z + float(fp32_log_softmax_tol(z, ref_ent).max())
    # gradients in bf16: each carries a few bf16 roundings (2**-8) of the products of magnitudes
    for got, want in ((gh, ref_gh), (gw, ref_gw)):
        assert (got.float() - want.float()).abs().max() <= 2.0**-5 * float(want.float().abs().max())


def test_hidden_path_without_rows_gives_zero_gradients():
    # a rank's empty share of a micro-batch: no row, but its backward still reaches W (zeros), so every rank
    # reduce-scatters the same tensors under FSDP2
    w = torch.randn(7, 5, requires_grad=True)
    h = torch.zeros(0, 5, requires_grad=True)
    lp, ent = hidden_logprobs_and_entropy(h, w, torch.zeros(0, dtype=torch.long))
    assert lp.shape == ent.shape == (0,)
    (lp.sum() * 0.0).backward()
    assert w.grad is not None and w.grad.shape == (7, 5) and not w.grad.any()
    lp2, ent2 = hidden_logprobs_and_entropy(torch.randn(3, 5), w, torch.zeros(3, dtype=torch.long),
                                            with_entropy=False)
    assert ent2 is None and lp2.shape == (3,)
