"""Per-token log-probabilities and policy entropy from logits, in one fp32 pass (algorithms.md §1).

For each row of logits z (any dtype, bf16 included) and its target token o:

    s    = z.float() / T          # T = the *sampling* temperature (§1.3), applied to logits, not logprobs
    logq = log_softmax(s)         # max-shifted, all <= 0
    logp = logq[o]                # differentiable
    H    = -sum_v exp(logq_v) * logq_v, clamped >= 0   # no grad: used for the mask, logs, probe (§1.2)

The `logq` form of H avoids cancelling two large numbers (`lse - sum p*s`) when H is near 0, which is
where half of CoT tokens sit (§1.1). Rows are processed in chunks (default 1024), so the peak extra memory
is chunk x V x 4 bytes instead of a full fp32 copy of the (B, L, V) logits.

Causal shift: the logits at position p predict the token at p + 1. With model outputs `logits[B, L, V]`
for `input_ids[B, L]`, use `shift_for_causal_lm` and slice any per-token mask the same way:

    logits_s, targets = shift_for_causal_lm(logits, input_ids)        # [B, L-1, V], [B, L-1]
    resp = response_mask[:, 1:]                                        # mask of the *target* tokens
    logp, ent = response_logprobs_and_entropy(logits_s, targets, resp, temperature=T)   # [B, L-1] each
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["response_logprobs_and_entropy", "shift_for_causal_lm", "token_logprobs_and_entropy"]


def _check_args(logits: Tensor, targets: Tensor, temperature: float, chunk_size: int) -> None:
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have shape [..., V] with V >= 1, got {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a floating-point tensor, got dtype {logits.dtype}")
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal logits shape without the vocab dim "
            f"{tuple(logits.shape[:-1])} (logits shape {tuple(logits.shape)})"
        )
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be an integer (long) tensor, got dtype {targets.dtype}")
    if not temperature > 0:  # also rejects NaN
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _rows_logprobs_and_entropy(
    rows: Tensor, targets: Tensor, temperature: float, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """rows [n, V] (any float dtype), targets [n] -> logp [n] (grad), entropy [n] (no grad), both fp32.

    fp64 logits stay fp64 (exact reference models in tests and the probe); everything narrower is upcast.
    """
    s = rows.to(_compute_dtype(rows.dtype))
    if temperature != 1.0:
        s = s / temperature  # divide the logits, never the logprobs (§6 P6)
    logq = torch.log_softmax(s, dim=-1)
    logp = logq.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return logp, None
    with torch.no_grad():
        lq = logq.detach()
        p = lq.exp()
        # p * logq is 0 * -inf = NaN where a logit is -inf (a banned token); its true contribution is 0.
        plogq = torch.where(p > 0, p * lq, torch.zeros((), dtype=lq.dtype, device=lq.device))
        ent = (-plogq.sum(-1)).clamp_min(0.0)
    return logp, ent


def token_logprobs_and_entropy(
    logits: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Log-probability of each target token and the entropy of each position's distribution.

    Args:
        logits: [..., V] raw logits (bf16/fp16/fp32/fp64). Already shifted: logits[..., j, :] scores
            targets[..., j] (see `shift_for_causal_lm`).
        targets: [...] integer token ids.
        temperature: the sampling temperature T; logits are divided by T before the softmax (§1.3).
        chunk_size: rows per chunk (§1.2).
        with_entropy: if False, skip the entropy (returns None) and save its exp/sum.

    Returns:
        logp: [...] fp32 (fp64 for fp64 logits), differentiable w.r.t. logits.
        entropy: [...] same dtype, detached, >= 0 (or None when with_entropy is False).
    """
    _check_args(logits, targets, temperature, chunk_size)
    out_shape = tuple(targets.shape)
    flat = logits.reshape(-1, logits.shape[-1])
    tflat = targets.reshape(-1)
    logps: list[Tensor] = []
    ents: list[Tensor] = []
    for start in range(0, flat.shape[0], chunk_size):
        lp, ent = _rows_logprobs_and_entropy(
            flat[start : start + chunk_size], tflat[start : start + chunk_size], temperature, with_entropy
        )
        logps.append(lp)
        if ent is not None:
            ents.append(ent)
    if not logps:  # zero rows
        empty = flat.new_zeros(out_shape, dtype=_compute_dtype(logits.dtype))
        return empty, (empty.detach() if with_entropy else None)
    logp = torch.cat(logps).reshape(out_shape)
    entropy = torch.cat(ents).reshape(out_shape) if with_entropy else None
    return logp, entropy


def response_logprobs_and_entropy(
    logits: Tensor,
    targets: Tensor,
    mask: Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Like `token_logprobs_and_entropy`, but only for positions where `mask` is True (§1.2).

    Prompt and padding rows are never pushed through the softmax. Positions outside the mask get
    logp = 0 and entropy = 0 (a real value, never a sentinel that could leak into metrics, §6 P5).

    Args:
        logits: [B, T, V] (already shifted), targets: [B, T] long, mask: [B, T] bool.
    Returns:
        logp [B, T] fp32 (fp64 for fp64 logits), differentiable; entropy [B, T] detached (or None).
    """
    _check_args(logits, targets, temperature, chunk_size)
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor, got dtype {mask.dtype}")
    if tuple(mask.shape) != tuple(targets.shape):
        raise ValueError(
            f"mask shape {tuple(mask.shape)} does not match targets shape {tuple(targets.shape)}"
        )
    flat = logits.reshape(-1, logits.shape[-1])
    tflat = targets.reshape(-1)
    idx = mask.reshape(-1).nonzero().squeeze(-1)
    n_all = tflat.shape[0]
    logps: list[Tensor] = []
    ents: list[Tensor] = []
    for start in range(0, idx.shape[0], chunk_size):
        sel = idx[start : start + chunk_size]
        # index_select copies only this chunk's rows, so no full-size copy of the masked logits exists.
        lp, ent = _rows_logprobs_and_entropy(
            flat.index_select(0, sel), tflat.index_select(0, sel), temperature, with_entropy
        )
        logps.append(lp)
        if ent is not None:
            ents.append(ent)
    zeros = torch.zeros(n_all, dtype=_compute_dtype(logits.dtype), device=logits.device)
    # Out-of-place index_put keeps autograd to the chunks. No masked position -> plain zeros, no graph.
    logp = zeros.index_put((idx,), torch.cat(logps)) if logps else zeros
    entropy = None
    if with_entropy:
        entropy = zeros.index_put((idx,), torch.cat(ents)) if ents else zeros.clone()
    shape = tuple(targets.shape)
    return logp.reshape(shape), (entropy.reshape(shape) if entropy is not None else None)


def shift_for_causal_lm(logits: Tensor, input_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Align a causal LM's outputs with the tokens they predict (§1.2: position p predicts p + 1).

    Args:
        logits: [B, L, V] model outputs for input_ids.
        input_ids: [B, L].
    Returns:
        (logits[:, :-1], input_ids[:, 1:]): [B, L-1, V] and [B, L-1]. Views, no copy. Slice any per-token
        mask over input_ids the same way (`response_mask[:, 1:]`) so it marks the scored target tokens.
    """
    if logits.dim() != 3 or input_ids.dim() != 2 or tuple(logits.shape[:2]) != tuple(input_ids.shape):
        raise ValueError(
            f"logits must be [B, L, V] and input_ids [B, L]; got logits {tuple(logits.shape)} "
            f"and input_ids {tuple(input_ids.shape)}"
        )
    return logits[:, :-1], input_ids[:, 1:]
