"""Floating-point tolerances shared by the tests, each derived from the arithmetic, not from one machine.

Two computations of the same value in float32 agree only up to rounding, and how the rounding falls
depends on the CPU (SIMD width decides reduction order) and on the kernels (oneDNN, HF eager, vLLM). A
test that compares them therefore bounds the difference by the *size* of float32 rounding for the
numbers involved, never by a number measured on one machine:

- `FP32_EPS` = 2**-23, the spacing of float32 numbers in [1, 2); a correctly rounded operation on a value
  of magnitude x errs by at most eps * x / 2.
- `ATTN_FP32_RTOL`: HF's eager attention runs its softmax in float32 even for float64 models
  (`softmax(..., dtype=torch.float32)`), so two float64 forwards of the same tokens that differ in padding
  or sequence length (their attention rows have different lengths, summed in a different order) agree to
  float32 precision only. A few ulps per attention weight, carried through two layers into logits of
  magnitude <= ~10, stay below 2**-23 * 2**7 relative; an off-by-one position or a padding token that
  reaches a statistic differs by O(0.1).
- `logprob_parity_bound`: vLLM's float32 log-probs against the exact (float64) policy, bounded by HF's
  own float32 error on the very same tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

FP32_EPS = 2.0**-23
ATTN_FP32_RTOL = FP32_EPS * 2**7  # ~1.5e-5

# Two float32 implementations of one forward pass (HF eager, vLLM's CPU kernels) make the same operations
# on the same numbers in a different order: their errors from the exact value are of the same size, the
# size HF's float32 error shows on the same tokens (it grows with logit magnitude and sequence length).
# PARITY_FACTOR allows another kernel order 8x HF's error; PARITY_FLOOR_ULPS keeps a floor of 16 ulps of
# the largest logit for sequences so short that HF's float32 happens to be nearly exact.
PARITY_FACTOR = 8.0
PARITY_FLOOR_ULPS = 16.0


def reference_logprobs(
    model: torch.nn.Module, prompt_ids: Sequence[int], completion_ids: Sequence[int], temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log_softmax(logits / T) of the completion tokens, max |logit / T| per position), teacher-forced
    in the model's own dtype; both returned as float64."""
    p = len(prompt_ids)
    ids = torch.tensor([list(prompt_ids) + list(completion_ids)])
    with torch.no_grad():
        z = model(ids).logits[0, p - 1 : -1] / temperature
    logp = torch.log_softmax(z, -1).gather(-1, ids[0, p:, None])[:, 0]
    return logp.double(), z.abs().amax(-1).double()


def logprob_parity(
    served: Sequence[Sequence[float]],
    seqs: Sequence[tuple[Sequence[int], Sequence[int]]],
    model32: torch.nn.Module,
    model64: torch.nn.Module,
    temperature: float,
) -> tuple[float, float]:
    """(max |served - exact| over all tokens, the bound it must stay under).

    `served[i]` are the engine's log-probs of the completion of `seqs[i]` = (prompt_ids, completion_ids);
    the exact values come from `model64` (the same weights in float64), HF's float32 error from `model32`.
    """
    worst, hf_err, zmax = 0.0, 0.0, 0.0
    for lps, (prompt, completion) in zip(served, seqs, strict=True):
        exact, z = reference_logprobs(model64, prompt, completion, temperature)
        hf32, _ = reference_logprobs(model32, prompt, completion, temperature)
        worst = max(worst, float((torch.tensor(list(lps), dtype=torch.float64) - exact).abs().max()))
        hf_err = max(hf_err, float((hf32 - exact).abs().max()))
        zmax = max(zmax, float(z.max()))
    return worst, logprob_parity_bound(hf_err, zmax)


def float32_logprob_bound(
    seqs: Sequence[tuple[Sequence[int], Sequence[int]]],
    model32: torch.nn.Module,
    model64: torch.nn.Module,
    temperature: float,
) -> float:
    """`logprob_parity_bound` for these sequences, without an engine: how far any float32 implementation
    of this model may be from the exact log-probs of these tokens."""
    return logprob_parity(
        [reference_logprobs(model64, p, c, temperature)[0].tolist() for p, c in seqs], seqs, model32, model64,
        temperature,
    )[1]


def logprob_parity_bound(hf_fp32_error: float, max_abs_logit: float) -> float:
    """PARITY_FACTOR x max(HF's float32 error, PARITY_FLOOR_ULPS ulps of the largest logit)."""
    return PARITY_FACTOR * max(hf_fp32_error, PARITY_FLOOR_ULPS * FP32_EPS * max_abs_logit)


def fp32_log_softmax_tol(scaled_logits: torch.Tensor, reference: torch.Tensor, ulps: float = 4.0) -> torch.Tensor:
    """Per-row bound on the float32 error of a value derived from log_softmax(s) (a log-prob, an entropy).

    logq_v = (s_v - max s) - log sum_v exp(s_v - max s): each float32 operation rounds a number of
    magnitude at most 2 max|s| + ln V (the log of the sum is at most ln V), and the result, of magnitude
    |reference|, is rounded once more. `ulps` roundings of eps * (2 max|s| + ln V + |reference|) bound it:
    a careful implementation errs by a fraction of one (0.33 measured), a wrong one (bf16 arithmetic, the
    temperature applied to log-probs, a wrong row) by orders of magnitude more."""
    s = scaled_logits.double()
    scale = 2 * s.abs().amax(-1) + math.log(s.shape[-1]) + reference.double().abs()
    return ulps * FP32_EPS * scale
